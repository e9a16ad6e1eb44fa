"""The Triton kernels compiled for sm_90 without a GPU (Triton's own ptxas), in the CPU CI.

The interpreter runs the kernels' Python, not their compiled form; this proves the GPU build:
the forward, dK/dV and dQ kernels assemble for Hopper with every feature flag on (varlen, window,
key ranges, block-sparse CSR, softcap), and the fp32 backward build keeps the
compensated (Kahan) sums of reference/triton/common._accumulate (the compiler must not fold
``(t - acc) - y`` away), while the 16-bit build carries none of them (its only per-block
accumulation stays fused into the dot).
"""
from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")

try:
    from triton.backends import backends as _BACKENDS
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older Triton layouts
    GPUTarget = ASTSource = None
    _BACKENDS = {}
# a Triton build without its CUDA backend has nothing to compile with; any error past this point
# (ptxas included) is a failure of the kernels
_NO_AOT = GPUTarget is None or "nvidia" not in _BACKENDS
# a Triton without its CUDA backend (macOS, ROCm builds) cannot build for sm_90; CI (.ci/run)
# sets DUALATTN_REQUIRE_TRITON_AOT, so there a missing backend fails instead of skipping
if _NO_AOT and os.environ.get("DUALATTN_REQUIRE_TRITON_AOT"):
    raise RuntimeError("DUALATTN_REQUIRE_TRITON_AOT is set but this Triton has no ahead-of-time "
                       "compile API or no CUDA backend")
pytestmark = pytest.mark.skipif(_NO_AOT, reason="this Triton has no ahead-of-time compile API or no CUDA backend")

from dualattn.reference.triton import backward as B
from dualattn.reference.triton import forward as F

INT_POINTERS = {"CuQ", "CuK", "KR", "FullPtr", "FullCol", "MaskPtr", "MaskCol"}
FP32_POINTERS = {"Lse2", "Delta", "Lse"}
FLOAT_SCALARS = {"qk_scale", "softcap", "sm_scale"}
NUM_WARPS = 8


def _signature(fn, dtype: str):
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name[0].isupper():  # tensors are the capitalised parameters
            sig[p.name] = "*" + ("i32" if p.name in INT_POINTERS else "fp32" if p.name in FP32_POINTERS else dtype)
        else:
            sig[p.name] = "fp32" if p.name in FLOAT_SCALARS else "i32"
    return sig


def _ptx(fn, dtype: str, **flags) -> str:
    consts = dict(HEAD_D=128, HEAD_DV=128, BLOCK_D=128, BLOCK_DV=128, IS_VARLEN=False, HAS_LEFT=False,
                  HAS_RIGHT=True, NUM_KR=0, HAS_BS=False, BS_M=128, BS_N=128, SOFTCAP=False, DOT_FP32=False,
                  IEEE=dtype == "fp32")
    if any(p.name == "WIDE_ROWS" for p in fn.params):  # the backward's 64-bit row offsets switch
        consts["WIDE_ROWS"] = False
    consts.update(flags)
    k = triton.compile(ASTSource(fn=fn, signature=_signature(fn, dtype), constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS, "num_stages": 2})
    ptx = re.sub(r"//[^\n]*", "", k.asm["ptx"])
    assert ".target sm_90" in ptx
    return ptx


def _f32_add_sub(fn, dtype: str, **tiles) -> int:
    return len(re.findall(r"\b(?:add|sub)(?:\.rn)?\.f32\b", _ptx(fn, dtype, **tiles)))


# (head dims, flags): the tiles are the configs' shapes for those head dims (reference/triton/configs)
FEATURES = {
    "causal": dict(BLOCK_M=128, BLOCK_N=64),
    "varlen-window-kr2-softcap": dict(BLOCK_M=64, BLOCK_N=64, IS_VARLEN=True, HAS_LEFT=True, NUM_KR=2,
                                      SOFTCAP=True),
    "bs-d192-dv128": dict(BLOCK_M=64, BLOCK_N=64, HEAD_D=192, HEAD_DV=128, BLOCK_D=256, HAS_BS=True),
    "wide-rows": dict(BLOCK_M=64, BLOCK_N=64, WIDE_ROWS=True),  # 64-bit row offsets (backward only)
}


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_kernels_build_for_sm90_with_every_feature(kernel, feature):
    fn = {"forward": F._attn_fwd, "dkdv": B._attn_bwd_dkdv, "dq": B._attn_bwd_dq}[kernel]
    flags = dict(FEATURES[feature])
    if kernel == "forward":
        flags.pop("WIDE_ROWS", None)  # the forward's row offsets are 64-bit always
    ptx = _ptx(fn, "bf16", **flags)
    # bf16 tensor-core products on Hopper: wgmma (or mma.sync where Triton picks it for the tile)
    assert "wgmma.mma_async" in ptx or "mma.sync" in ptx


@pytest.mark.parametrize("kernel, tiles, accumulators, acc_rows, acc_cols", [
    ("_attn_bwd_dkdv", dict(BLOCK_M=64, BLOCK_N=128), 2, 128, 128),
    ("_attn_bwd_dq", dict(BLOCK_M=128, BLOCK_N=64), 1, 128, 128),
])
def test_backward_builds_for_sm90_with_compensated_fp32_sums(kernel, tiles, accumulators, acc_rows, acc_cols):
    fn = getattr(B, kernel)
    plain = _f32_add_sub(fn, "bf16", **tiles)
    compensated = _f32_add_sub(fn, "fp32", **tiles)
    # Kahan: 4 adds/subs per accumulator element per inlined block visit (the full-block and the
    # masked-block loops each inline one), per thread
    per_thread = accumulators * acc_rows * acc_cols // (32 * NUM_WARPS)
    assert compensated - plain >= 4 * per_thread, (plain, compensated)


# ---- shared memory of the tile table (reference/triton/configs), as Triton itself counts it ----
from dualattn.reference.triton import configs as C
from dualattn.reference.triton import decode as D

CONSUMER_SHARED = 99 * 1024  # sm_86 / sm_89 / sm_120: opt-in shared memory per block


def _shared_bytes(kernel: str, head_dim: int, tile, arch: int, dtype: str = "bf16") -> int:
    fn = {"fwd": F._attn_fwd, "dkdv": B._attn_bwd_dkdv, "dq": B._attn_bwd_dq, "decode": D._decode_split}[kernel]
    consts = dict(HEAD_D=head_dim, HEAD_DV=head_dim, BLOCK_D=head_dim, BLOCK_DV=head_dim, HAS_LEFT=False,
                  HAS_RIGHT=True, SOFTCAP=False, DOT_FP32=False, IEEE=dtype == "fp32",
                  BLOCK_M=tile.block_m, BLOCK_N=tile.block_n)
    if kernel == "decode":
        sig = {p.name: "constexpr" if p.is_constexpr else
               "*" + dtype if p.name in ("Q", "K", "V") else "*fp32" if p.name in ("OPart", "LPart") else
               "*i32" if p.name in ("CacheSeqlens", "PageTable") else
               "fp32" if p.name in FLOAT_SCALARS else "i32" for p in fn.params}
        consts.update(PAGED=True)
    else:
        sig = _signature(fn, dtype)
        consts.update(IS_VARLEN=True, NUM_KR=0, HAS_BS=True, BS_M=128, BS_N=128)
        if kernel != "fwd":
            consts["WIDE_ROWS"] = False
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})
    return k.metadata.shared


def _table_cases():
    for kernel, by_bucket in C._TABLE.items():
        for bucket in by_bucket:
            yield kernel, bucket


@pytest.mark.parametrize("kernel, bucket", list(_table_cases()))
def test_tile_table_fits_its_gpus_shared_memory(kernel, bucket):
    """Each bf16 entry fits SHARED_FOR_TABLE where the table applies (sm_80: Triton's largest
    figure of the archs that get it), and the entry a consumer GPU gets fits 99 KB on sm_120."""
    tile = C.tile_for(kernel, bucket, C.torch.bfloat16)
    assert _shared_bytes(kernel, bucket, tile, 80) <= C.SHARED_FOR_TABLE
    small = C.tile_for(kernel, bucket, C.torch.bfloat16, max_shared=CONSUMER_SHARED)
    assert _shared_bytes(kernel, bucket, small, 120) <= CONSUMER_SHARED, small


@pytest.mark.parametrize("kernel", list(C._TABLE_FP32))
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp32_tiles_fit_their_gpus_shared_memory(kernel, head_dim):
    tile = C.tile_for(kernel, head_dim, C.torch.float32)
    assert _shared_bytes(kernel, head_dim, tile, 80, dtype="fp32") <= C.SHARED_FOR_TABLE, tile
    small = C.tile_for(kernel, head_dim, C.torch.float32, max_shared=CONSUMER_SHARED)
    assert _shared_bytes(kernel, head_dim, small, 120, dtype="fp32") <= CONSUMER_SHARED, small
