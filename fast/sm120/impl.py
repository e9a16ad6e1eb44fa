"""The "fast-sm120" implementation: FA2 forward on mma.sync for SM80..SM90 and SM120.

Host side only: refuse what the kernel does not do (with the reason), pick the tile config,
compile once per static configuration (explicit key), launch with runtime lengths.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from dualattn import dispatch
from dualattn.fast.common.compile_cache import CompileCache, arch_string, target_arch
from dualattn.fast.common.launch_args import PackedLaunch, empty_f32, empty_output, schema_like

from .fwd import SMEM_LIMIT_SM120, FlashFwdSm80, tile_config

# compute capabilities this kernel runs on: it needs only mma.sync, ldmatrix and cp.async (SM80+)
SUPPORTED_ARCHS = tuple(range(80, 90)) + (90, 120, 121)
_I32_MAX = 2 ** 31 - 1
# One switch for the backward: False leaves training calls to the other families again
# (the "fast-sm120-train" implementation of bwd_impl.py is then not registered).
BACKWARD_ENABLED = True
MAX_KEY_RANGES = 4

_cache = CompileCache()


def window_bounds(spec) -> Tuple[bool, bool, int, int]:
    """(has_left, has_right, left, right) of the combined causal/window predicate."""
    wl, wr = spec.window
    if spec.causal:
        wr = 0 if wr < 0 else min(wr, 0)
    return wl >= 0, wr >= 0, max(wl, 0), max(wr, 0)


def _cutlass_dtype(dt):
    """The DSL type of a torch dtype, or of its str() as compile keys hold it."""
    import cutlass
    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16,
            "torch.float16": cutlass.Float16, "torch.bfloat16": cutlass.BFloat16}[dt]


def compile_key(spec, arch: int) -> tuple:
    """Everything the generated code depends on; lengths, heads, batch, window sizes, scale are runtime."""
    has_left, has_right, _, _ = window_bounds(spec)
    cfg = tile_config(spec.head_dim)
    return ("fwd", str(spec.dtype), spec.head_dim, spec.head_dim_v, cfg, spec.mode == "varlen",
            has_left, has_right, spec.softcap > 0, spec.has_block_sparse, spec.num_key_ranges, arch)


def build_kernel(key: tuple) -> FlashFwdSm80:
    _, dt, d, _dv, cfg, varlen, has_left, has_right, has_softcap, block_sparse, num_kr, _arch = key
    return FlashFwdSm80(_cutlass_dtype(dt), d, cfg, varlen=varlen, has_left=has_left,
                        has_right=has_right, has_softcap=has_softcap, block_sparse=block_sparse,
                        num_key_ranges=num_kr)


def compile_prototypes(kernel_dtype) -> list:
    """Compile-time stand-ins of FlashFwdSm80.__call__'s arguments before the stream, in order:
    q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k pointers; 11 Int32 (total_q, total_k, seqlen_q,
    seqlen_k, batch, heads_q, heads_kv, lse strides, window); 3 Float32 (scale_log2, softcap scale,
    softcap); 4 CSR pointers and 10 Int32 (ratios, strides); the key-range pointer and 2 Int32."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    def ptr(dt, align):
        return cute.runtime.make_ptr(dt, 1 << 20, cute.AddressSpace.gmem, assumed_align=align)

    return ([ptr(kernel_dtype, 16)] * 4 + [ptr(Float32, 4)] + [ptr(Int32, 4)] * 2 + [Int32(1)] * 11
            + [Float32(1.0)] * 3 + [ptr(Int32, 4)] * 4 + [Int32(1)] * 10 + [ptr(Int32, 8)] + [Int32(1)] * 2)


def compile_uncached(key: tuple, arch: int, extra_options: str = ""):
    """Compile the kernel's packed-argument entry for ``key``.

    Returns (compiled function, kernel object); the kernel object records ``smem_bytes``.
    """
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    kern = build_kernel(key)
    schema = schema_like(compile_prototypes(kern.dtype))
    fn = cute.compile(kern.from_packed, schema.fake(), cuda.CUstream(0),
                      options=f"--gpu-arch {arch_string(arch)} {extra_options}".strip())
    return fn, kern


_launches = {}


def compile_kernel(key: tuple, arch: int) -> PackedLaunch:
    """Compile once per key (see ``compile_key``), then reuse; returns the launcher."""
    hit = _launches.get(key)
    if hit is None:
        fn = _cache.get(key, lambda: compile_uncached(key, arch)[0])
        hit = _launches[key] = PackedLaunch(fn, schema_like(compile_prototypes(build_kernel(key).dtype)))
    return hit


class FastSm120Forward:
    name = "fast-sm120"
    family = "fast"

    def __init__(self):
        self._entries = {}  # (spec, device index) -> launcher and runtime scalars (see _entry)

    def auto_skip(self, spec) -> Optional[str]:
        # On Hopper this portable mma.sync kernel is slower than the Triton reference in most
        # cells (H100, bf16, against FA2 in the same runs: forward 1.00-1.18x vs Triton's
        # 1.16-1.97x; backward hd128 0.85-1.00x vs 0.82-1.27x, hd64 0.92-1.11x vs 1.24-1.50x),
        # and fast-sm90 is the Hopper kernel. impl="fast" still uses it; impl="auto" prefers
        # Triton there.
        if dispatch.device_arch() == 90:
            return "on sm_90 the Triton kernels are measured faster than this portable kernel"
        return None

    def can_implement(self, spec) -> Optional[str]:
        if spec.needs_grad:
            return "inference only: training calls (backward) are served by fast-sm120-train"
        if spec.mode not in ("batched", "varlen"):
            return f"mode {spec.mode!r} not supported (batched and varlen only; no kv-cache/decode kernel)"
        if spec.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {spec.dtype} not supported (float16, bfloat16)"
        if spec.head_dim != spec.head_dim_v:
            return "head_dim_v must equal head_dim"
        if spec.head_dim % 32 != 0 or spec.head_dim > 256:
            return f"head dim {spec.head_dim} not supported (multiples of 32 up to 256)"
        if spec.num_key_ranges > MAX_KEY_RANGES:
            return f"at most {MAX_KEY_RANGES} key ranges per row (intervals are held in registers), got {spec.num_key_ranges}"
        cfg = tile_config(spec.head_dim)
        if spec.has_block_sparse:
            bm, bn = spec.block_size
            if bm % cfg.tile_m or bn % cfg.tile_n:
                return (f"block-sparse block size {spec.block_size} must be a multiple of the kernel tile "
                        f"({cfg.tile_m}, {cfg.tile_n}) at head dim {spec.head_dim}")
        rows = spec.batch * max(spec.seqlen_q, spec.seqlen_k)
        if rows * max(spec.num_heads_q, spec.num_heads_kv) * spec.head_dim > _I32_MAX:
            return "tensors over 2**31 elements (32-bit indexing)"
        if spec.wide_index_tensors:
            return "key_ranges or CSR column arrays of 2**31 elements or more (32-bit indexing)"
        if max(spec.batch, spec.num_heads_q) > 65535:  # grid y and z
            return "grid limit: batch and query heads must each be <= 65535"
        if cfg.smem_bytes(spec.head_dim, spec.head_dim_v) > SMEM_LIMIT_SM120:
            return "tile does not fit 99 KB of shared memory"
        if spec.device_type != "cuda":
            return f"needs CUDA tensors, got {spec.device_type}"
        arch = dispatch.device_arch()
        if arch is None:
            return "no CUDA GPU"
        if arch not in SUPPORTED_ARCHS:
            return f"runs on SM80-SM90 and SM120, not sm_{arch}"
        return None

    def _entry(self, spec, device):
        """(launcher, window bounds, scale_log2, softcap scale, softcap), memoised per (spec, device)
        so a repeated call builds no key and queries no device."""
        ek = (spec, device.index)
        hit = self._entries.get(ek)
        if hit is None:
            arch = target_arch(dispatch.device_arch(device.index or 0))
            launch = compile_kernel(compile_key(spec, arch), arch)
            _, _, wl, wr = window_bounds(spec)
            softcap_scale = spec.scale / spec.softcap if spec.softcap > 0 else 0.0
            hit = (launch, wl, wr, spec.scale * math.log2(math.e), softcap_scale, float(spec.softcap))
            if len(self._entries) > 4096:  # specs carry shapes: keep the memo bounded
                self._entries.clear()
            self._entries[ek] = hit
        return hit

    def forward(self, call):
        spec = call.spec
        varlen = spec.mode == "varlen"
        q, k, v = (_aligned(t) for t in (call.q, call.k, call.v))
        Hq, Hkv = spec.num_heads_q, spec.num_heads_kv
        if varlen:
            total_q, total_k = q.shape[0], k.shape[0]
            lse = empty_f32(q, (Hq, total_q))
            lse_sh, lse_sb = total_q, 0
        else:
            B, Sq, Sk = spec.batch, spec.seqlen_q, spec.seqlen_k
            total_q, total_k = B * Sq, B * Sk
            lse = empty_f32(q, (B, Hq, Sq))
            lse_sh, lse_sb = Sq, Hq * Sq
        out = empty_output(q, spec.head_dim_v)
        if total_q == 0 or spec.batch == 0 or spec.seqlen_q == 0:
            return out, lse

        launch, wl, wr, scale_log2, softcap_scale, softcap = self._entry(spec, q.device)
        # (total, heads, D) views: the kernel indexes rows of q/k/v by token
        qa = q.data_ptr()
        cu_q = call.cu_seqlens_q.data_ptr() if varlen else qa
        cu_k = call.cu_seqlens_k.data_ptr() if varlen else qa
        if spec.has_block_sparse or spec.has_key_ranges:
            q3 = q
            bs_ptrs, bs_ints = _block_sparse_args(call, q3)
            kr_ptr, kr_ints = _key_range_args(call, q3)
        else:
            bs_ptrs, bs_ints, kr_ptr, kr_ints = (qa,) * 4, _NO_CSR, qa, (0, 0)
        launch(q.device, qa, k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), cu_q, cu_k,
               total_q, max(total_k, 1), spec.seqlen_q, spec.seqlen_k, spec.batch, Hq, Hkv, lse_sh, lse_sb,
               wl, wr, scale_log2, softcap_scale, softcap, *bs_ptrs, *bs_ints, kr_ptr, *kr_ints)
        return out, lse

    def backward(self, call, out, lse, dout):
        raise NotImplementedError("fast-sm120 has no backward kernel (can_implement refuses needs_grad)")


def bh_strides(t: torch.Tensor):
    """(batch, head) strides of a (B'|1, H'|1, ...) index array; a size-1 dimension broadcasts (0)."""
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0)


_NO_CSR = (1,) * 10  # ratios and strides of the absent CSR (ratio 1 keeps the divisions defined)


def _block_sparse_args(call, dummy: torch.Tensor):
    """Pointers and (ratio_m, ratio_n, strides...) of the q->k CSR arrays; placeholders without one."""
    bs = call.block_sparse
    if bs is None:
        return (dummy.data_ptr(),) * 4, _NO_CSR
    cfg = tile_config(call.spec.head_dim)
    full, mask = bs.q2k_full, bs.q2k_mask
    arrays, strides = [], []
    keep = []
    for csr in (full, mask):
        rp, col = csr.rowptr.contiguous(), csr.col.contiguous()
        keep += [rp, col]
        arrays += [rp.data_ptr(), col.data_ptr()]
        strides += [*bh_strides(rp), *bh_strides(col)]
    call.extra["_sm120_keepalive"] = keep  # the launch is asynchronous: keep copies alive with the call
    return tuple(arrays), (bs.block_m // cfg.tile_m, bs.block_n // cfg.tile_n, *strides)


def _key_range_args(call, dummy: torch.Tensor):
    """Pointer and (batch stride, head stride) of key_ranges (B'|1, H'|1, rows, R, 2); 0 broadcasts."""
    kr = call.key_ranges
    if kr is None:
        return dummy.data_ptr(), (0, 0)
    kr = kr.contiguous()
    call.extra["_sm120_kr"] = kr  # keep alive for the asynchronous launch
    return kr.data_ptr(), bh_strides(kr)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned, as the 16-byte cp.async loads need."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.data_ptr() % 16 != 0:
        t = t.clone()
    return t


def compile_cache() -> CompileCache:
    return _cache
