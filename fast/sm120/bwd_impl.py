"""Host side of the fast-sm120 backward: what it serves, compile key, preprocess, launch, postprocess.

Preprocess (bwd.FlashBwdPreprocess, one pass over O and dO): delta = rowsum(dO * O) in fp32 and
the LSE in log2 units with -inf (rows that see no key) turned into +inf, so exp2(s - lse2) is 0
there instead of NaN; both in the LSE layout. dQ is accumulated in an fp32 buffer by atomics
(zeroed first by torch) and converted to the output dtype afterwards (a torch cast).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from dualattn import dispatch
from dualattn.fast.common.compile_cache import CompileCache, arch_string
from dualattn.fast.common.launch_args import PackedLaunch, schema_like

from .bwd import SMEM_LIMIT_SM120, SUPPORTED_HEAD_DIMS, FlashBwdPreprocess, FlashBwdSm80, bwd_tile_config
from .impl import _cutlass_dtype

_cache = CompileCache()
LOG2_E = math.log2(math.e)


def _window_bounds(spec):
    wl, wr = spec.window
    if spec.causal:
        wr = 0 if wr < 0 else min(wr, 0)
    return wl >= 0, wr >= 0, max(wl, 0), max(wr, 0)


# Causal calls up to this many keys launch key blocks fastest, like unmasked ones: the CTAs running
# together then belong to few (batch, head)s and share their Q / dO in L2, where key-blocks-slowest
# has every running CTA on another (batch, head) and streams all of Q / dO from HBM once per key
# block. Past it, longest-first wins. H100, hd128 causal, ms, key blocks fastest / slowest (FA2):
# 2k 1.62-1.66 / 1.80-1.82 (1.56-1.64); 4k 2.94-2.96 / 2.79-2.81 (2.73-2.75); 16k 9.78-9.82 /
# 9.66-9.70 (8.85-9.08).
CAUSAL_KEYS_FASTEST_MAX_SEQLEN = 2048


def tile_for(spec):
    """The backward tile of a call: by head dim, and dividing the CSR's key blocks if it has one."""
    banded = spec.window != (-1, -1) or (spec.causal and spec.seqlen_k > CAUSAL_KEYS_FASTEST_MAX_SEQLEN)
    return bwd_tile_config(spec.head_dim, spec.block_size[1] if spec.has_block_sparse else 0, banded=banded)


def backward_reason(spec) -> Optional[str]:
    """None when the backward kernel serves ``spec`` (forward checks already passed), else why not."""
    if spec.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"backward: head dim {spec.head_dim} not supported (head dims {SUPPORTED_HEAD_DIMS})"
    cfg = tile_for(spec)
    if spec.has_block_sparse:
        bm, bn = spec.block_size
        if bm % cfg.tile_m or bn % cfg.tile_n:
            return (f"backward: block-sparse block size {bm}x{bn} must be a multiple of the backward tile "
                    f"{cfg.tile_m}x{cfg.tile_n} (head dim {spec.head_dim})")
    if cfg.smem_bytes(spec.head_dim) > SMEM_LIMIT_SM120:
        return "backward: tile does not fit 99 KB of shared memory"
    if spec.batch > 65535 or (cfg.n_slowest and -(-spec.seqlen_k // cfg.tile_n) > 65535) or (
            not cfg.n_slowest and spec.num_heads_kv > 65535):
        return "backward: grid limit (batch, KV heads or key blocks over 65535)"
    if spec.batch * spec.num_heads_q * -(-max(spec.seqlen_q, 1) // 32) > 2 ** 31 - 1:
        return "backward: too many (batch, head, query block) semaphores for 32-bit indexing"
    return None


def compile_key(spec, arch: int, d_slice: int = 0) -> tuple:
    """Key of the kernel computing D-slice ``d_slice`` of the tile's ``d_split`` (see bwd.py)."""
    has_left, has_right, _, _ = _window_bounds(spec)
    return ("bwd", str(spec.dtype), spec.head_dim, tile_for(spec), spec.mode == "varlen",
            has_left, has_right, bool(spec.deterministic), spec.softcap > 0, spec.num_key_ranges,
            spec.has_block_sparse, _vector_reductions(arch), d_slice, _rotate_m(spec), _defer_dq(spec), _early_s(), arch)


def _rotate_m(spec) -> bool:
    """Key blocks start their walk over the query tiles at staggered offsets (FlashBwdSm80.rotate_m)
    when no causal/window band bounds their query range. H100, bf16, 16k tokens, one lease, TFLOP/s
    2k / 4k / 8k / 16k, rotated against not: hd64 241 / 261 / 277 / 270 against 234 / 256 / 267 / 265,
    hd128 246 / 250 / 261 / 263 against 232 / 249 / 261 / 264; causal lost (hd128 196-252 against
    206-270: its key-blocks-slowest grid already spreads the running CTAs over heads).
    DUALATTN_SM120_BWD_ROTATE=0 turns it off, =1 forces it (comparisons)."""
    env = os.environ.get("DUALATTN_SM120_BWD_ROTATE", "")
    banded = spec.causal or spec.window != (-1, -1)
    return (env == "1" or (env == "" and not banded)) and not spec.deterministic and not spec.has_block_sparse


def _defer_dq(spec) -> bool:
    """The dQ atomics of a step go out between the next step's S^T MMAs (FlashBwdSm80.defer_dq).
    DUALATTN_SM120_BWD_DEFER_DQ=0|1 overrides (comparisons)."""
    env = os.environ.get("DUALATTN_SM120_BWD_DEFER_DQ", "")
    return (env != "0") and not spec.deterministic


def _early_s() -> bool:
    """S^T before waiting for dO (FlashBwdSm80.early_s). DUALATTN_SM120_BWD_EARLY_S=0|1 overrides."""
    return os.environ.get("DUALATTN_SM120_BWD_EARLY_S", "") != "0"


def _vector_reductions(arch: int) -> bool:
    """dQ by red.global.add.v2.f32 (sm_90+) rather than scalar reductions; DUALATTN_SM120_VEC_RED=0|1
    overrides (tuning)."""
    env = os.environ.get("DUALATTN_SM120_VEC_RED")
    return arch >= 90 if env is None else env == "1"


def build_kernel(key: tuple) -> FlashBwdSm80:
    (_, dt, d, cfg, varlen, has_left, has_right, det, has_softcap, num_kr, block_sparse, vec_red, d_slice, rot,
     defer, early_s, _) = key
    cdt = _cutlass_dtype(dt)
    return FlashBwdSm80(cdt, d, cfg, varlen=varlen, has_left=has_left, has_right=has_right, deterministic=det,
                        vec_red=vec_red, has_softcap=has_softcap, num_key_ranges=num_kr,
                        block_sparse=block_sparse, d_slice=d_slice, rotate_m=rot, defer_dq=defer,
                        early_s=early_s)


def _ptr(dt, align):
    import cutlass.cute as cute
    return cute.runtime.make_ptr(dt, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)


def compile_prototypes(kernel_dtype) -> list:
    """Stand-ins of FlashBwdSm80.__call__'s arguments before the stream, in order: q, k, v, dO,
    dK, dV pointers; dQ accumulator, LSE2, delta, semaphores, cu_seqlens_q/k, key ranges; 6 k->q
    CSR pointers; 14 Int32 (lengths, heads, LSE strides, window, query blocks, key-range strides);
    4 Float32 (scale_log2, scale, softcap scale, softcap); 10 Int32 (CSR ratios and strides)."""
    from cutlass import Float32, Int32
    return ([_ptr(kernel_dtype, 16)] * 6 + [_ptr(Float32, 16), _ptr(Float32, 4), _ptr(Float32, 4)]
            + [_ptr(Int32, 4)] * 10 + [Int32(1)] * 14 + [Float32(1.0)] * 4 + [Int32(1)] * 10)


def preprocess_prototypes(kernel_dtype) -> list:
    """Stand-ins of FlashBwdPreprocess.__call__'s arguments: O, dO, LSE, LSE2, delta, dQ accumulator
    pointers, then n_rows, heads, seqlen_q, LSE strides."""
    from cutlass import Float32, Int32
    return [_ptr(kernel_dtype, 16)] * 2 + [_ptr(Float32, 4)] * 3 + [_ptr(Float32, 16)] + [Int32(1)] * 5


def _compile_packed(kern, prototypes, arch: int, extra_options: str):
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    return cute.compile(kern.from_packed, schema_like(prototypes).fake(), cuda.CUstream(0),
                        options=f"--gpu-arch {arch_string(arch)} {extra_options}".strip())


def compile_uncached(key: tuple, arch: int, extra_options: str = ""):
    """Compile the packed-argument entry for ``key``; returns (fn, kernel object)."""
    kern = build_kernel(key)
    return _compile_packed(kern, compile_prototypes(kern.dtype), arch, extra_options), kern


_launches = {}


def _launcher(key: tuple, arch: int, compile_fn, prototypes) -> PackedLaunch:
    hit = _launches.get(key)
    if hit is None:
        fn = _cache.get(key, lambda: compile_fn(key, arch)[0])
        hit = _launches[key] = PackedLaunch(fn, schema_like(prototypes(_cutlass_dtype(key[1]))))
    return hit


def compile_kernel(key: tuple, arch: int) -> PackedLaunch:
    return _launcher(key, arch, compile_uncached, compile_prototypes)


def preprocess_key(spec, arch: int) -> tuple:
    return ("bwd_pre", str(spec.dtype), spec.head_dim, arch)


def compile_preprocess_uncached(key: tuple, arch: int, extra_options: str = ""):
    """Compile the delta / LSE2 preprocess kernel for ``key``; returns (fn, kernel object)."""
    _, dt, d, _arch = key
    kern = FlashBwdPreprocess(_cutlass_dtype(dt), d)
    return _compile_packed(kern, preprocess_prototypes(kern.dtype), arch, extra_options), kern


def compile_cache() -> CompileCache:
    return _cache


def _k2q_args(call, dummy: torch.Tensor, cfg):
    """Pointers of the k->q CSR (full rowptr, col, mask rowptr, col, full locks, mask locks) and
    (ratio_m, ratio_n, rowptr/col (batch, head) strides of full then mask); placeholders without one.
    A size-1 batch or head dimension broadcasts (stride 0); the lock arrays are laid out like the cols."""
    bs = call.block_sparse
    if bs is None:
        return (dummy.data_ptr(),) * 6, (1, 1) + (0,) * 8
    arrays = [t.contiguous() for t in (bs.k2q_full.rowptr, bs.k2q_full.col, bs.k2q_mask.rowptr, bs.k2q_mask.col,
                                       bs.k2q_full_lock, bs.k2q_mask_lock)]
    from .impl import bh_strides
    fr, fc, mr, mc, fl, ml = arrays
    assert fl.shape == fc.shape and ml.shape == mc.shape
    call.extra["_sm120_bwd_csr"] = arrays  # keep alive for the asynchronous launch
    return tuple(a.data_ptr() for a in arrays), (bs.block_m // cfg.tile_m, bs.block_n // cfg.tile_n,
                                                 *bh_strides(fr), *bh_strides(fc), *bh_strides(mr), *bh_strides(mc))


class _Plan:
    """What a backward call of one spec needs besides its tensors, built once per (spec, arch): the
    tile, the launchers (preprocess, one kernel per D-slice) and the scalar arguments."""
    __slots__ = ("cfg", "pre", "kernels", "n_mblocks", "n_sem", "scalars", "scalars_f")

    def __init__(self, spec, arch: int):
        self.cfg = cfg = tile_for(spec)
        self.pre = _launcher(preprocess_key(spec, arch), arch, compile_preprocess_uncached, preprocess_prototypes)
        self.kernels = [compile_kernel(compile_key(spec, arch, s), arch) for s in range(cfg.d_split)]
        self.n_mblocks = -(-spec.seqlen_q // cfg.tile_m)
        # deterministic: one semaphore per (batch, head, query block), for each D-slice's kernel
        self.n_sem = spec.batch * spec.num_heads_q * self.n_mblocks if spec.deterministic else 0
        _, _, wl, wr = _window_bounds(spec)
        softcap_scale = spec.scale / spec.softcap if spec.softcap > 0 else 0.0
        self.scalars = (wl, wr, self.n_mblocks)
        self.scalars_f = (spec.scale * LOG2_E, spec.scale, softcap_scale, float(spec.softcap))


_plans = {}


def _plan(spec, arch: int) -> _Plan:
    hit = _plans.get((spec, arch))
    if hit is None:
        if len(_plans) > 4096:  # specs carry shapes: keep the memo bounded
            _plans.clear()
        hit = _plans[(spec, arch)] = _Plan(spec, arch)
    return hit


def run_backward(call, out, lse, dout, arch: int, aligned):
    """(dq, dk, dv) for a call whose forward produced (out, lse)."""
    spec = call.spec
    varlen = spec.mode == "varlen"
    q, k, v, do = (aligned(t) for t in (call.q, call.k, call.v, dout))
    out = aligned(out)
    Hq, Hkv, D = spec.num_heads_q, spec.num_heads_kv, spec.head_dim
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if varlen:
        total_q, total_k = q.shape[0], k.shape[0]
        lse_sh, lse_sb, rows_per_b = total_q, 0, max(total_q, 1)
    else:
        B, Sq, Sk = spec.batch, spec.seqlen_q, spec.seqlen_k
        total_q, total_k = B * Sq, B * Sk
        lse_sh, lse_sb, rows_per_b = Sq, Hq * Sq, max(Sq, 1)
    if total_q == 0 or total_k == 0 or spec.batch == 0:
        dk.zero_()
        dv.zero_()
        return torch.zeros_like(q), dk, dv
    plan = _plan(spec, arch)
    cfg = plan.cfg
    lse = lse.contiguous()
    # LSE2 and delta in one buffer (one allocation); the preprocess zeroes the dQ accumulator
    lse2_delta = torch.empty((2,) + lse.shape, dtype=torch.float32, device=q.device)
    lse2, delta = lse2_delta[0], lse2_delta[1]
    dq_acc = torch.empty((total_q, Hq, D), dtype=torch.float32, device=q.device)
    dev = q.device
    plan.pre(dev, out.data_ptr(), do.data_ptr(), lse.data_ptr(), lse2.data_ptr(), delta.data_ptr(),
             dq_acc.data_ptr(), total_q * Hq, Hq, rows_per_b, lse_sh, lse_sb)
    n_sem = plan.n_sem
    # the semaphores (deterministic only); otherwise a placeholder pointer the kernel never reads,
    # like those of the features a call does not have
    sem = torch.zeros((n_sem * cfg.d_split,), dtype=torch.int32, device=q.device) if n_sem else None
    dummy = sem if n_sem else lse2_delta
    cu_q = call.cu_seqlens_q.data_ptr() if varlen else dummy.data_ptr()
    cu_k = call.cu_seqlens_k.data_ptr() if varlen else dummy.data_ptr()
    from .impl import _key_range_args
    kr_ptr, (kr_sb, kr_sh) = _key_range_args(call, dummy)
    csr_ptrs, csr_ints = _k2q_args(call, dummy, cfg)
    wl, wr, n_mblocks = plan.scalars
    for d_slice, fn in enumerate(plan.kernels):
        sem_ptr = sem.data_ptr() + 4 * n_sem * d_slice if n_sem else dummy.data_ptr()
        fn(dev, q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), dk.data_ptr(), dv.data_ptr(),
           dq_acc.data_ptr(), lse2.data_ptr(), delta.data_ptr(), sem_ptr, cu_q, cu_k,
           kr_ptr, *csr_ptrs, total_q, total_k, spec.seqlen_q, spec.seqlen_k, spec.batch, Hq, Hkv, lse_sh, lse_sb,
           wl, wr, n_mblocks, kr_sb, kr_sh, *plan.scalars_f, *csr_ints)
    # keep the buffers of the asynchronous launch alive until the caller's stream moves on
    call.extra["_sm120_bwd_keepalive"] = (lse2_delta, sem, q, k, v, do, out, lse, dq_acc)
    dq = dq_acc.to(spec.dtype).view(q.shape)
    return dq, dk, dv


class FastSm120Train:
    """Training calls (spec.needs_grad): the fast-sm120 forward kernel plus the backward kernel above.

    A sibling of ``FastSm120Forward`` (which serves inference and refuses needs_grad): the dispatcher
    reaches this one for training calls of the "fast" family.
    """
    name = "fast-sm120-train"
    family = "fast"

    def __init__(self, forward_impl):
        self._fwd = forward_impl

    def auto_skip(self, spec) -> Optional[str]:
        return self._fwd.auto_skip(spec)  # the same measurements decide (impl.py)

    def can_implement(self, spec) -> Optional[str]:
        from dataclasses import replace
        if not spec.needs_grad:
            return "serves training calls only (inference goes to fast-sm120)"
        # the backward's own limits first: they hold on any machine, the forward ends with the GPU checks
        return backward_reason(spec) or self._fwd.can_implement(replace(spec, needs_grad=False))

    def forward(self, call):
        return self._fwd.forward(call)

    def backward(self, call, out, lse, dout):
        from dualattn import dispatch
        from dualattn.fast.common.compile_cache import target_arch
        from .impl import _aligned
        arch = target_arch(dispatch.device_arch(call.q.device.index or 0))
        return run_backward(call, out, lse, dout, arch, _aligned)
