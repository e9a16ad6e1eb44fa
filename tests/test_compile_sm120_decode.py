"""Compile-only (no GPU): the fast-sm120-decode kernel traces and assembles for sm_120a and sm_80.

Per compiled config (one host function that launches the split kernel and the combine kernel):
the PTX has both kernels and uses warp-level mma.sync m16n8k16 (ptxas turns it into HMMA; no
disassembler is available in CI to grep the SASS itself), 16-byte cp.async and ldmatrix, no
wgmma/tcgen05, no local-memory spills; a cubin for the target SM was produced; shared memory
<= 99 KB (sm_120's per-block limit).

Which configs: every entry of the decode tile table the dispatcher can pick (head dims 64 and 128
with 16 and 32 packed rows, 192, 256) for sm_120a, each flag (paged, left/right window bound,
softcap) at least once and both dtypes, plus two for sm_80. The flags add code to the same
skeleton; the tile config (smem, registers) depends on the head dim and the packed row count only,
and every config's smem budget is also checked without compiling.
"""
from __future__ import annotations

import re
import struct
import tempfile

import pytest
import torch

pytest.importorskip("cutlass")

from dualattn.spec import AttentionSpec  # noqa: E402

SMEM_LIMIT = 99 * 1024

# (arch, dtype, head_dim, seqlen_q, heads_q, heads_kv, page_size, causal, window, softcap)
CONFIGS = [
    (120, torch.bfloat16, 128, 1, 32, 8, 0, False, (-1, -1), 0.0),     # hd128, 16 rows
    (120, torch.float16, 128, 1, 40, 2, 64, True, (-1, -1), 0.0),      # hd128, 32 rows, paged
    (120, torch.bfloat16, 64, 1, 8, 2, 16, True, (100, -1), 0.0),      # hd64, 16 rows, window
    (120, torch.float16, 64, 3, 16, 2, 0, False, (16, 4), 30.0),       # hd64, 32 rows (24), softcap
    (120, torch.bfloat16, 192, 2, 8, 1, 32, True, (-1, -1), 0.0),      # hd192 (2 warps, 3 stages)
    (120, torch.float16, 256, 1, 16, 1, 0, True, (64, -1), 10.0),      # hd256 (2 warps, 2 stages)
    (80, torch.bfloat16, 128, 1, 32, 8, 256, True, (-1, -1), 0.0),
    (80, torch.float16, 256, 1, 8, 8, 0, False, (-1, -1), 0.0),
]


def _spec(dtype, d, sq, hq, hkv, page_size, causal, window, softcap):
    return AttentionSpec("kvcache", 2, sq, 4096, hq, hkv, d, d, dtype, "cuda", causal=causal, window=window,
                         softcap=softcap, paged=page_size > 0, page_size=page_size)


def _id(c):
    return (f"sm{c[0]}-{str(c[1])[6:]}-d{c[2]}-rows{c[3] * c[4] // c[5]}{'-paged' if c[6] else ''}"
            f"{'-causal' if c[7] else ''}{'-win' if c[8] != (-1, -1) else ''}{'-softcap' if c[9] else ''}")


@pytest.mark.compile_only
@pytest.mark.timeout(180)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_compiles(cfg):
    arch = cfg[0]
    from dualattn.fast.sm120.decode import FlashDecodeSm80, decode_config
    from dualattn.fast.sm120.decode_impl import compile_key, compile_uncached

    spec = _spec(*cfg[1:])
    assert FlashDecodeSm80.can_implement(spec) is None  # the dispatcher would pick it (on a GPU)
    key = compile_key(spec, arch)
    with tempfile.TemporaryDirectory() as tmp:
        fn, kern = compile_uncached(key, arch, f"--keep-ptx --keep-cubin --dump-dir {tmp}")
        ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
    assert isinstance(ptx, str) and isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    # the cubin's SM: ELF e_flags holds it in bits 0-7 (older CUDA ELF ABI) or 8-15 (newer)
    e_flags = struct.unpack_from("<I", cubin, 0x30)[0]
    assert arch in (e_flags & 0xFF, (e_flags >> 8) & 0xFF), hex(e_flags)
    target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    assert re.search(rf"\.target\s+{target}\b", ptx), "PTX not built for " + target
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)", ptx)) > 0
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 16", ptx), "no 16-byte cp.async"
    assert "ldmatrix.sync.aligned" in ptx and ".trans" in ptx  # V^T for P V
    assert "wgmma" not in ptx and "tcgen05" not in ptx  # sm_120 has neither
    assert len(re.findall(r"\.entry\s", ptx)) == 2, "the split kernel and the combine kernel"
    assert ".local" not in ptx, "register spills to local memory"
    static_smem = sum(int(n) for n in re.findall(r"\.shared\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx))
    assert kern.smem_bytes + static_smem <= SMEM_LIMIT, (kern.smem_bytes, static_smem)
    # the formula can_implement and the split choice use is the compiled struct (+ alignment)
    cfg_ = decode_config(spec.head_dim, spec.seqlen_q * spec.gqa_ratio)
    assert key[4] == cfg_ and 0 <= kern.smem_bytes - cfg_.smem_bytes(spec.head_dim) < 2048


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("rows", [1, 4, 16, 17, 32, 64])
def test_smem_budget_every_config(d, rows):
    from dualattn.fast.sm120.decode import decode_config

    cfg = decode_config(d, rows)
    assert cfg.smem_bytes(d) + 2048 <= SMEM_LIMIT
    assert cfg.merge_fits(d)
    assert cfg.tile_m in (16, 32) and cfg.stages >= 2
    assert d <= 128 or cfg.tile_m == 16  # O at <= 128 fp32 registers per thread


def test_compile_key_ignores_runtime_values():
    from dualattn.fast.sm120.decode import FlashDecodeSm80

    a = _spec(torch.bfloat16, 128, 1, 32, 8, 64, True, (-1, -1), 0.0)
    b = AttentionSpec("kvcache", 7, 1, 999, 16, 4, 128, 128, torch.bfloat16, "cuda", causal=True,
                      paged=True, page_size=256, scale=0.3, num_splits=5)
    assert FlashDecodeSm80.compile_key(a, 120) == FlashDecodeSm80.compile_key(b, 120)
    c = AttentionSpec("kvcache", 2, 1, 4096, 32, 8, 128, 128, torch.bfloat16, "cuda", causal=True, window=(50, -1),
                      paged=True, page_size=64)
    assert FlashDecodeSm80.compile_key(a, 120) != FlashDecodeSm80.compile_key(c, 120)
