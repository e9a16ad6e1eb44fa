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


def _cutlass_dtype(dt: torch.dtype):
    import cutlass
    return {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}[dt]


def compile_key(spec, arch: int) -> tuple:
    """Everything the generated code depends on; lengths, heads, batch, window sizes, scale are runtime."""
    has_left, has_right, _, _ = window_bounds(spec)
    cfg = tile_config(spec.head_dim)
    return ("fwd", str(spec.dtype), spec.head_dim, spec.head_dim_v, cfg, spec.mode == "varlen",
            has_left, has_right, spec.softcap > 0, spec.has_block_sparse, spec.num_key_ranges, arch)


def build_kernel(key: tuple) -> FlashFwdSm80:
    _, dt, d, _dv, cfg, varlen, has_left, has_right, has_softcap, block_sparse, num_kr, _arch = key
    torch_dt = {"torch.float16": torch.float16, "torch.bfloat16": torch.bfloat16}[dt]
    return FlashFwdSm80(_cutlass_dtype(torch_dt), d, cfg, varlen=varlen, has_left=has_left,
                        has_right=has_right, has_softcap=has_softcap, block_sparse=block_sparse,
                        num_key_ranges=num_kr)


def compile_args(kernel_dtype, ptrs=None, stream=None):
    """Argument list of the kernel's __call__ (placeholders when ``ptrs`` is None: compile only)."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    def ptr(dt, addr, align):
        return cute.runtime.make_ptr(dt, addr, cute.AddressSpace.gmem, assumed_align=align)

    if ptrs is None:
        ptrs = (1 << 20,) * 12
    q, k, v, o, lse, cuq, cuk, fr, fc, mr, mc, kr = ptrs
    p = [ptr(kernel_dtype, q, 16), ptr(kernel_dtype, k, 16), ptr(kernel_dtype, v, 16),
         ptr(kernel_dtype, o, 16), ptr(Float32, lse, 4), ptr(Int32, cuq, 4), ptr(Int32, cuk, 4),
         ptr(Int32, fr, 4), ptr(Int32, fc, 4), ptr(Int32, mr, 4), ptr(Int32, mc, 4), ptr(Int32, kr, 8)]
    return p, (stream if stream is not None else cuda.CUstream(0))


def compile_uncached(key: tuple, arch: int, extra_options: str = ""):
    """Compile the kernel for ``key``; placeholders stand in for every runtime value.

    Returns (compiled function, kernel object); the kernel object records ``smem_bytes``.
    """
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    kern = build_kernel(key)
    p, stream = compile_args(kern.dtype)
    args = p[:7] + [Int32(1)] * 11 + [Float32(1.0)] * 3 + p[7:11] + [Int32(1)] * 10 + p[11:] + [Int32(1)] * 2
    fn = cute.compile(kern, *args, stream, options=f"--gpu-arch {arch_string(arch)} {extra_options}".strip())
    return fn, kern


def compile_kernel(key: tuple, arch: int):
    """Compile once per key (see ``compile_key``), then reuse."""
    return _cache.get(key, lambda: compile_uncached(key, arch)[0])


class FastSm120Forward:
    name = "fast-sm120"
    family = "fast"

    def auto_skip(self, spec) -> Optional[str]:
        # On Hopper this portable mma.sync kernel is slower than the Triton reference in most
        # cells (H200, bf16, bench --quick: fwd hd128 8k 369 vs 483 TFLOP/s, window 228 vs 379;
        # backward 0.74-0.99x FA2 on an H100 vs Triton's 1.16x on the H200), and fast-sm90 is the
        # Hopper kernel.
        # impl="fast" still uses it; impl="auto" prefers Triton there.
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

    def forward(self, call):
        import cuda.bindings.driver as cuda

        spec = call.spec
        varlen = spec.mode == "varlen"
        q, k, v = (_aligned(t) for t in (call.q, call.k, call.v))
        Hq, Hkv, D = spec.num_heads_q, spec.num_heads_kv, spec.head_dim
        if varlen:
            q3, k3, v3 = q, k, v
            total_q, total_k = q.shape[0], k.shape[0]
            lse = torch.empty((Hq, total_q), dtype=torch.float32, device=q.device)
            lse_sh, lse_sb = total_q, 0
        else:
            B, Sq, Sk = spec.batch, spec.seqlen_q, spec.seqlen_k
            q3, k3, v3 = q.view(B * Sq, Hq, D), k.view(B * Sk, Hkv, D), v.view(B * Sk, Hkv, D)
            total_q, total_k = B * Sq, B * Sk
            lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
            lse_sh, lse_sb = Sq, Hq * Sq
        out = torch.empty(q.shape[:-1] + (spec.head_dim_v,), dtype=q.dtype, device=q.device)
        if total_q == 0 or spec.batch == 0 or spec.seqlen_q == 0:
            return out, lse

        arch = target_arch(dispatch.device_arch(q.device.index or 0))
        key = compile_key(spec, arch)
        fn = compile_kernel(key, arch)
        has_left, has_right, wl, wr = window_bounds(spec)
        scale_log2 = spec.scale * math.log2(math.e)
        softcap_scale = spec.scale / spec.softcap if spec.softcap > 0 else 0.0
        cu_q = call.cu_seqlens_q if varlen else None
        cu_k = call.cu_seqlens_k if varlen else None
        bs_ptrs, bs_ints = _block_sparse_args(call, q3)
        kr_ptr, kr_ints = _key_range_args(call, q3)
        ptrs = (q3.data_ptr(), k3.data_ptr(), v3.data_ptr(), out.data_ptr(), lse.data_ptr(),
                (cu_q if varlen else q3).data_ptr(), (cu_k if varlen else q3).data_ptr()) + bs_ptrs + (kr_ptr,)
        stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        p, stream = compile_args(_cutlass_dtype(spec.dtype), ptrs, stream)
        with torch.cuda.device(q.device):  # the launch goes to the current device's context
            fn(*p[:7], total_q, max(total_k, 1), spec.seqlen_q, spec.seqlen_k, spec.batch, Hq, Hkv,
               lse_sh, lse_sb, wl, wr, scale_log2, softcap_scale, float(spec.softcap), *p[7:11], *bs_ints,
               p[11], *kr_ints, stream)
        return out, lse

    def backward(self, call, out, lse, dout):
        raise NotImplementedError("fast-sm120 has no backward kernel (can_implement refuses needs_grad)")


def bh_strides(t: torch.Tensor):
    """(batch, head) strides of a (B'|1, H'|1, ...) index array; a size-1 dimension broadcasts (0)."""
    return (t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0)


def _block_sparse_args(call, dummy: torch.Tensor):
    """Pointers and (ratio_m, ratio_n, strides...) of the q->k CSR arrays; placeholders without one."""
    bs = call.block_sparse
    if bs is None:
        return (dummy.data_ptr(),) * 4, (1,) * 10
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
