"""Compile-only (no GPU): the fast-sm120 forward traces and assembles for sm_120a and sm_80.

Checks, per compiled config: the PTX uses warp-level mma.sync (m16n8k16, which ptxas turns into
HMMA; the SASS is not read here: tests/test_sm90_sass.py does that for fast-sm90 with the
cuobjdump Triton ships), 16-byte cp.async and ldmatrix,
no wgmma/tcgen05; a cubin for the target SM was produced; shared memory <= 99 KB (sm_120's
per-block limit).

Which configs: compiling all 2 dtypes x 8 head dims x 16 flag combinations per arch takes far
longer than CI allows, so this compiles a representative set (below) that covers every head dim,
both dtypes and every flag (varlen, left/right window bound, softcap, key ranges, block-sparse CSR)
at least once for sm_120a,
and the two extreme head dims for sm_80. The flags only add code to the same skeleton; the tile
config, which decides smem and registers, depends on the head dim alone, and every head dim's
smem budget is also checked without compiling (test_smem_budget_all_head_dims).
"""
from __future__ import annotations

import os
import re
import struct
import tempfile

import pytest
import torch

pytest.importorskip("cutlass")

from dualattn.spec import AttentionSpec  # noqa: E402

SMEM_LIMIT = 99 * 1024

# (arch, dtype, head_dim, varlen, causal, window, softcap[, num_key_ranges, block_size])
CONFIGS = [
    (120, torch.bfloat16, 128, False, True, (-1, -1), 0.0, 2, (128, 128)),
    (120, torch.float16, 64, True, False, (-1, -1), 0.0, 1, None),
    (120, torch.bfloat16, 32, False, False, (-1, -1), 0.0),
    (120, torch.bfloat16, 64, False, True, (-1, -1), 0.0),
    (120, torch.float16, 96, True, False, (-1, -1), 0.0),
    (120, torch.bfloat16, 128, False, False, (-1, -1), 0.0),
    (120, torch.float16, 128, True, True, (64, -1), 30.0),
    (120, torch.bfloat16, 160, False, False, (32, 16), 0.0),
    (120, torch.float16, 192, False, True, (-1, -1), 0.0),
    (120, torch.bfloat16, 224, True, False, (-1, -1), 10.0),
    (120, torch.bfloat16, 256, False, True, (-1, -1), 0.0),
    (80, torch.float16, 64, False, False, (-1, -1), 0.0),
    (80, torch.bfloat16, 256, True, True, (128, -1), 5.0),
]


def _spec(dtype, d, varlen, causal, window, softcap, num_key_ranges=0, block_size=None):
    return AttentionSpec("varlen" if varlen else "batched", 2, 300, 300, 8, 2, d, d, dtype, "cuda",
                         causal=causal, window=window, softcap=softcap, num_key_ranges=num_key_ranges,
                         block_size=block_size)


def _id(c):
    return (f"sm{c[0]}-{str(c[1])[6:]}-d{c[2]}{'-varlen' if c[3] else ''}{'-causal' if c[4] else ''}"
            f"{'-win' if c[5] != (-1, -1) else ''}{'-softcap' if c[6] else ''}"
            f"{'-keyranges' if len(c) > 7 and c[7] else ''}{'-blocksparse' if len(c) > 8 and c[8] else ''}")


@pytest.mark.compile_only
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg", CONFIGS, ids=[_id(c) for c in CONFIGS])
def test_compiles(cfg):
    arch, dtype, d, varlen, causal, window, softcap = cfg[:7]
    from dualattn.fast.sm120.impl import FastSm120Forward, compile_key, compile_uncached

    spec = _spec(dtype, d, varlen, causal, window, softcap, *cfg[7:])
    # the dispatcher would pick this kernel for the spec (everything but the live-GPU checks)
    reason = FastSm120Forward().can_implement(spec)
    assert reason is None or reason.startswith("no CUDA GPU") or "sm_" in reason, reason
    with tempfile.TemporaryDirectory() as tmp:
        fn, kern = compile_uncached(compile_key(spec, arch), arch, f"--keep-ptx --keep-cubin --dump-dir {tmp}")
        ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
    assert isinstance(ptx, str) and isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    # the cubin's SM: ELF e_flags holds it in bits 0-7 (older CUDA ELF ABI) or 8-15 (newer)
    e_flags = struct.unpack_from("<I", cubin, 0x30)[0]
    assert arch in (e_flags & 0xFF, (e_flags >> 8) & 0xFF), hex(e_flags)
    target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    assert re.search(rf"\.target\s+{target}\b", ptx), "PTX not built for " + target
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)", ptx)) > 0
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 16", ptx), "no 16-byte cp.async"
    assert "ldmatrix.sync.aligned" in ptx
    assert "wgmma" not in ptx and "tcgen05" not in ptx  # sm_120 has neither
    static_smem = sum(int(n) for n in re.findall(r"\.shared\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx))
    assert kern.smem_bytes + static_smem <= SMEM_LIMIT, (kern.smem_bytes, static_smem)


@pytest.mark.parametrize("d", list(range(32, 257, 32)))
def test_smem_budget_all_head_dims(d):
    from dualattn.fast.sm120.fwd import SMEM_LIMIT_SM120, tile_config

    cfg = tile_config(d)
    assert SMEM_LIMIT_SM120 == SMEM_LIMIT
    assert cfg.smem_bytes(d, d) <= SMEM_LIMIT
    assert cfg.tile_m % (16 * (cfg.num_threads // 32)) == 0


@pytest.mark.compile_only
@pytest.mark.timeout(120)
def test_smem_formula_matches_compiled():
    from dualattn.fast.sm120.fwd import tile_config
    from dualattn.fast.sm120.impl import compile_key, compile_uncached

    spec = _spec(torch.bfloat16, 256, False, False, (-1, -1), 0.0)
    _, kern = compile_uncached(compile_key(spec, 120), 120)
    assert kern.smem_bytes == tile_config(256).smem_bytes(256, 256)


# ---------------------------------------------------------------------------- backward (fast-sm120-train)
# (arch, dtype, head_dim, varlen, causal, window, deterministic[, softcap, num_key_ranges, block_size]): both head
# dims (their tile configs
# decide smem, registers and the pipeline schedule: hd64 double-buffers Q/dO, hd128 writes dS^T over
# dO), both dtypes, every flag of the backward compile key at least once, sm_80 (scalar dQ atomics)
# and sm_120 (vector dQ atomics)
BWD_CONFIGS = [
    (120, torch.bfloat16, 64, False, True, (-1, -1), True),
    (120, torch.float16, 128, True, False, (64, 16), False, 30.0, 0),
    (120, torch.bfloat16, 128, False, True, (-1, -1), True),
    (120, torch.bfloat16, 64, True, True, (-1, -1), True, 0.0, 2),
    (120, torch.float16, 128, False, False, (-1, -1), False, 10.0, 1),
    (120, torch.bfloat16, 128, False, True, (-1, -1), True, 0.0, 0, (128, 128)),
    (120, torch.float16, 64, True, False, (64, 0), True, 0.0, 1, (128, 128)),
    (80, torch.float16, 64, True, False, (-1, -1), False),
    (80, torch.bfloat16, 128, False, True, (32, -1), True),
    (120, torch.bfloat16, 32, False, True, (-1, -1), True),
    (120, torch.float16, 96, True, False, (-1, -1), False, 0.0, 1, (128, 128)),
    (80, torch.bfloat16, 96, False, True, (-1, -1), True),
    (120, torch.bfloat16, 256, False, True, (-1, -1), True),
    (120, torch.float16, 192, True, False, (64, 16), False, 30.0, 0, (128, 128)),
]


def _bwd_id(c):
    return (f"sm{c[0]}-{str(c[1])[6:]}-d{c[2]}{'-varlen' if c[3] else ''}{'-causal' if c[4] else ''}"
            f"{'-win' if c[5] != (-1, -1) else ''}{'-det' if c[6] else ''}"
            f"{'-softcap' if len(c) > 7 and c[7] else ''}{'-keyranges' if len(c) > 8 and c[8] else ''}"
            f"{'-blocksparse' if len(c) > 9 and c[9] else ''}")


def _check_cubin(fn, arch):
    ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    e_flags = struct.unpack_from("<I", cubin, 0x30)[0]
    assert arch in (e_flags & 0xFF, (e_flags >> 8) & 0xFF), hex(e_flags)
    target = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    assert re.search(rf"\.target\s+{target}\b", ptx), "PTX not built for " + target
    assert "wgmma" not in ptx and "tcgen05" not in ptx
    return ptx


@pytest.mark.compile_only
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg", BWD_CONFIGS, ids=_bwd_id)
def test_bwd_compiles(cfg):
    arch, dtype, d, varlen, causal, window, det = cfg[:7]
    softcap, num_kr, block_size = (tuple(cfg[7:]) + (0.0, 0, None)[len(cfg) - 7:])[:3]
    from dataclasses import replace

    from dualattn.fast.sm120.bwd_impl import backward_reason, compile_key, compile_uncached, tile_for

    spec = replace(_spec(dtype, d, varlen, causal, window, softcap, num_kr, block_size), deterministic=det,
                   needs_grad=True)
    assert backward_reason(spec) is None
    with tempfile.TemporaryDirectory() as tmp:
        fn, kern = compile_uncached(compile_key(spec, arch), arch, f"--keep-ptx --keep-cubin --dump-dir {tmp}")
        ptx = _check_cubin(fn, arch)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)", ptx)) > 0
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 16", ptx), "no 16-byte cp.async"
    assert "ldmatrix.sync.aligned" in ptx and ".trans" in ptx  # transposed operands (Q^T, dO^T, K^T, dS)
    # dQ by fp32 atomics: 8-byte vector reductions from sm_90 on, scalar ones on sm_80
    vec = re.search(r"red\.(relaxed\.)?(gpu\.)?global\.(add\.)?v2\.f32(\.add)?", ptx)
    scalar = re.search(r"red\.(relaxed\.)?(gpu\.)?global\.add\.f32", ptx)
    assert (vec if arch >= 90 else scalar), "dQ is not accumulated by fp32 atomics"
    if det:  # the semaphore: acquire load to wait, release add to signal
        assert re.search(r"ld\.acquire\.gpu", ptx) and re.search(r"red\.release\.gpu", ptx)
    # early_s (one stage, dS^T over dO): a step first waits with dO's cp.async group still in flight
    assert bool(re.search(r"cp\.async\.wait_group\s+1;", ptx)) == kern.early_s, kern.early_s
    static_smem = sum(int(n) for n in re.findall(r"\.shared\s+\.align\s+\d+\s+\.b8\s+\w+\[(\d+)\]", ptx))
    assert kern.smem_bytes + static_smem <= SMEM_LIMIT, (kern.smem_bytes, static_smem)
    # the formula that can_implement uses is the compiled struct (plus alignment padding only)
    assert 0 <= kern.smem_bytes - tile_for(spec).smem_bytes(d) < 2048


@pytest.mark.parametrize("d", [32, 64, 96, 128, 192, 256])
def test_bwd_smem_budget(d):
    from dualattn.fast.sm120.bwd import SMEM_LIMIT_SM120, bwd_tile_config

    cfg = bwd_tile_config(d)
    # + 1 KB: the struct's alignment padding (checked against the compiled size above)
    assert cfg.smem_bytes(d) + 1024 <= SMEM_LIMIT_SM120
    # dS^T over dO: the same stage stride with two stages, or just fitting in one
    assert not cfg.ds_in_do or cfg.tile_n == d or (cfg.stages == 1 and cfg.tile_n <= d)
    assert d % cfg.d_split == 0 and (cfg.d_split == 1 or (d // cfg.d_split) % 64 == 0)


@pytest.mark.compile_only
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d", [192, 256])
def test_bwd_every_d_slice_compiles(d):
    # past D = 128 the backward launches one kernel per D-slice of dK / dV / dQ: each must build
    from dataclasses import replace

    from dualattn.fast.sm120.bwd_impl import compile_key, compile_uncached, tile_for

    spec = replace(_spec(torch.bfloat16, d, False, True, (-1, -1), 0.0), needs_grad=True)
    cfg = tile_for(spec)
    assert cfg.d_split > 1
    keys = {compile_key(spec, 120, s) for s in range(cfg.d_split)}
    assert len(keys) == cfg.d_split  # the slice is in the key
    for s in range(cfg.d_split):
        with tempfile.TemporaryDirectory() as tmp:
            fn, kern = compile_uncached(compile_key(spec, 120, s), 120, f"--keep-ptx --keep-cubin --dump-dir {tmp}")
            ptx = _check_cubin(fn, 120)
        assert kern.d_out == d // cfg.d_split and kern.d_slice == s
        assert re.search(r"mma\.sync\.aligned\.m16n8k16", ptx)
        assert kern.smem_bytes <= SMEM_LIMIT


@pytest.mark.compile_only
@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch,dtype,d", [(120, torch.bfloat16, 128), (120, torch.float16, 64),
                                          (80, torch.bfloat16, 64), (120, torch.bfloat16, 96)])
def test_bwd_preprocess_compiles(arch, dtype, d):
    from dataclasses import replace

    from dualattn.fast.sm120.bwd_impl import compile_preprocess_uncached, preprocess_key

    spec = replace(_spec(dtype, d, False, False, (-1, -1), 0.0), needs_grad=True)
    with tempfile.TemporaryDirectory() as tmp:
        fn, _ = compile_preprocess_uncached(preprocess_key(spec, arch), arch,
                                            f"--keep-ptx --keep-cubin --dump-dir {tmp}")
        ptx = _check_cubin(fn, arch)
    assert re.search(r"ld\.global(\.nc)?\.v4", ptx), "O / dO rows are not read with 16-byte loads"
    assert "shfl.sync.bfly" in ptx
