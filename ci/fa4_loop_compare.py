"""FlashAttention-4's SM90 forward loop beside fast-sm90's, from the SASS, on a machine without a
GPU (docs/bench-h100-20261124.md section 32):

    pip download --no-deps flash-attn-4==4.0.0b36 quack-kernels==0.6.5 -d .fa4   # once
    pip install --no-deps --target .fa4/site .fa4/flash_attn_4-*.whl .fa4/quack_kernels-*.whl
    python ci/fa4_loop_compare.py [--site .fa4/site] [--hdim 128,64]

FA4's kernel (FlashAttentionForwardSm90) is built for sm_90a with the tile configuration its
interface picks for non-causal bf16 calls (hd64: 192 x 128, hd128: 128 x 128; P V from registers,
intra-warpgroup overlap, 2 stages), ours for the same spec; both are assembled with Triton's ptxas
(fast/sm90/sass.py). For each steady key-block loop: instructions by class, where the P V wait
sits after the S wait, how many exponentials come after it, and the registers the loop holds for
later (sass.registers_live_through). The flash_attn and quack packages are imported as bare
namespaces, so neither their __init__ nor apache-tvm-ffi is needed.
"""
import argparse
import math
import os
import re
import sys
import tempfile
import types
import warnings
from collections import Counter

CLASSES = [("HGMMA", r"HGMMA"), ("MUFU", r"MUFU"), ("FFMA", r"FFMA"), ("FMUL", r"FMUL"),
           ("FADD", r"FADD"), ("FMNMX", r"FMNMX"), ("F2FP", r"F2FP"), ("SHFL", r"SHFL"),
           ("barriers", r"(BAR|SYNCS|WARPGROUP)"), ("uniform", r"U"), ("integer / move", r"(I|LOP|SHF|LEA|MOV|PRMT|SEL|VIADD)"),
           ("branch", r"BRA"), ("other", r"")]


def import_fa4(site: str):
    """FlashAttentionForwardSm90 and its AuxData from an unpacked flash-attn-4 / quack install."""
    for name, path in (("flash_attn", "flash_attn"), ("flash_attn.cute", "flash_attn/cute"), ("quack", "quack")):
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(site, path)]
        sys.modules[name] = mod
    # quack patches the DSL's TVM-FFI argument converter at import; nothing here compiles with it
    stub = types.ModuleType("cutlass.cute._tvm_ffi_args_spec_converter")
    stub._convert_single_arg = lambda *a, **k: None
    sys.modules["cutlass.cute._tvm_ffi_args_spec_converter"] = stub
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.utils import AuxData
    return FlashAttentionForwardSm90, AuxData


def fa4_ptx(site: str, head_dim: int, seqlen: int = 8192, batch: int = 2, heads: int = 8) -> str:
    import torch
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import from_dlpack
    Fwd, AuxData = import_fa4(site)
    tile_m, tile_n = (192, 128) if head_dim <= 64 else (128, 128)  # FA4's non-causal SM90 tiles

    def dyn(t, align=16):
        return from_dlpack(t, assumed_align=align, enable_tvm_ffi=False).mark_layout_dynamic(leading_dim=t.ndim - 1)

    q = torch.empty(batch, seqlen, heads, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, seqlen, dtype=torch.float32)
    kernel = Fwd(cutlass.BFloat16, head_dim, head_dim, 1, is_causal=False, is_local=False,
                 pack_gqa=False, tile_m=tile_m, tile_n=tile_n, num_stages=2, num_threads=384,
                 Q_in_regs=False, intra_wg_overlap=True, mma_pv_is_rs=True, mask_mod=None,
                 score_mod=None, has_aux_tensors=False, q_subtile_factor=1, paged_kv_non_tma=False)
    args = [kernel, dyn(q), dyn(torch.empty_like(q)), dyn(torch.empty_like(q)), dyn(torch.empty_like(q)),
            dyn(lse, 4), 1.0 / math.sqrt(head_dim), *([None] * 9), AuxData(None, None), None, None,
            cuda.CUstream(0)]
    with tempfile.TemporaryDirectory() as dump:  # --keep-ptx: the compiled object keeps its PTX
        return cute.compile(*args, options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {dump}").__ptx__


def our_ptx(head_dim: int, seqlen: int = 8192) -> str:
    import torch
    from dualattn.fast.sm90 import FastSm90Forward
    from dualattn.spec import AttentionSpec
    spec = AttentionSpec("batched", 2, seqlen, seqlen, 8, 8, head_dim, head_dim, torch.bfloat16,
                         "cuda", causal=False, return_lse=True)
    return FastSm90Forward().compile_only(spec, arch=90).__ptx__


def describe(ptx: str) -> dict:
    from dualattn.fast.sm90.sass import assemble, opcode, registers_live_through, steady_loop
    with tempfile.TemporaryDirectory() as tmp:
        log, sass = assemble(ptx, tmp)
    lo, hi = steady_loop(sass)
    loop = sass[lo:hi + 1]
    classes = Counter()
    for line in loop:
        op = opcode(line)
        classes[next(name for name, pat in CLASSES if re.match(pat, op))] += 1
    s_wait = next(i for i, ln in enumerate(loop) if "DEPBAR.LE gsb0, 0x1" in ln)
    pv_wait = next(i for i, ln in enumerate(loop) if "DEPBAR.LE gsb0, 0x0" in ln)
    exps = [i for i, ln in enumerate(loop) if "MUFU.EX2" in ln]
    return {"instructions": len(loop), **classes, "S wait -> P V wait": pv_wait - s_wait,
            "exponentials after the P V wait": f"{sum(i > pv_wait for i in exps)} / {len(exps)}",
            "registers held for after the loop": len(registers_live_through(sass, lo, hi)),
            "registers (ptxas)": re.findall(r"Used (\d+) registers", log)[-1]}


def main():
    # FA4's kernel checks the DSL's target arch when built (there is no GPU to detect it from)
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", default=".fa4/site", help="directory holding flash_attn/ and quack/")
    ap.add_argument("--hdim", default="128,64")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    for hd in (int(h) for h in a.hdim.split(",")):
        ours, fa4 = describe(our_ptx(hd)), describe(fa4_ptx(a.site, hd))
        print(f"hd{hd} non-causal, steady loop per key block and consumer warp: fast-sm90 / FA4")
        for key in dict.fromkeys([*ours, *fa4]):
            print(f"  {key:36s} {str(ours.get(key, 0)):>8s} {str(fa4.get(key, 0)):>8s}")


if __name__ == "__main__":
    main()
