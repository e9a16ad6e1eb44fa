"""The "fast-sm120-decode" implementation: kv-cache attention (decode) on mma.sync, SM80..SM90 and SM120.

Per call, in stream order, with nothing read back to the host:

1. append (only with k_new/v_new): the reference's Triton ``_append_kv`` writes the new tokens
   into the cache at cache_seqlens[b] .. (paged or not); cache_seqlens itself is not advanced
   (FlashAttention's semantics, as the oracle and the Triton decode);
2. one call of the compiled CuTe DSL function (decode.FlashDecodeSm80.from_packed, one packed
   argument) that launches the split kernel (flash-decoding over ``num_splits`` chunks of the key
   blocks, normalised fp32 partial outputs and LSEs into a workspace) and the combine kernel
   (out = sum_s exp(lse_s - lse) out_s, LSE).

The only allocations are the outputs and a workspace whose size follows from the spec, so a call
can be captured in a CUDA graph. The number of splits is chosen from the spec (capacity, not the
live lengths) and the GPU's size, never from device values.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from dualattn import dispatch
from dualattn.fast.common.compile_cache import CompileCache, arch_string, target_arch
from dualattn.fast.common.launch_args import DirectLauncher, current_device_index, current_stream_handle

from .decode import DecodeConfig, FlashDecodeSm80, decode_config
from .impl import SUPPORTED_ARCHS, _cutlass_dtype, window_bounds

_I32_MAX = 2 ** 31 - 1
MAX_AUTO_SPLITS = 64

_cache = CompileCache()


def compile_key(spec, arch: int) -> tuple:
    return FlashDecodeSm80.compile_key(spec, arch)


def build_kernel(key: tuple) -> FlashDecodeSm80:
    _, dt, d, _dv, cfg, paged, has_left, has_right, has_softcap, _arch = key
    return FlashDecodeSm80(_cutlass_dtype(dt), d, cfg, paged=paged, has_left=has_left,
                           has_right=has_right, has_softcap=has_softcap)


def compile_uncached(key: tuple, arch: int, extra_options: str = ""):
    """Compile the kernel for ``key`` (placeholders for every runtime value). Returns
    (compiled function, kernel object); the kernel object records ``smem_bytes``."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute

    kern = build_kernel(key)
    schema = FlashDecodeSm80.arg_schema(kern.dtype)
    fn = cute.compile(kern.from_packed, schema.fake(), cuda.CUstream(0),
                      options=f"--gpu-arch {arch_string(arch)} {extra_options}".strip())
    return fn, kern


_DEVICE_INFO = {}


def _device_info(device) -> tuple:
    """(SMs, shared memory per SM in bytes), cached per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    hit = _DEVICE_INFO.get(idx)
    if hit is None:
        p = torch.cuda.get_device_properties(idx)
        smem = getattr(p, "shared_memory_per_multiprocessor", 0) or (228 if p.major == 9 else 100) * 1024
        hit = _DEVICE_INFO[idx] = (p.multi_processor_count, int(smem))
    return hit


def num_m_tiles(spec, cfg: DecodeConfig) -> int:
    return -(-spec.seqlen_q * spec.gqa_ratio // cfg.tile_m)


def choose_num_splits(spec, cfg: DecodeConfig, sms: int, smem_per_sm: int) -> int:
    """Static choice (from the capacity, so it needs no sync); ``spec.num_splits`` wins.

    The fewest splits, at least 2 where the cache has 8 key blocks or more, that fill
    ``sms x per_sm`` CTA slots in whole waves to >= 90%, with at least 4 key blocks per split.
    per_sm is what shared memory allows, at most 2: on an H100 (3 CTAs fit) 2 per SM with longer
    splits read faster than 3 (GQA 32/8 hd128 bf16, CUDA graph, TB/s by splits: b8 32k
    2: 2.91, 3: 3.03, 4: 3.05, 6: 2.96, 8: 2.87; b8 8k 3: 2.71, 4: 2.68, 6: 2.61; b64 8k
    2-4: 3.04, 6: 3.01, 16: 2.90). On sm_120 (99 KB per SM) one CTA fits."""
    if spec.num_splits > 0:
        return spec.num_splits
    per_sm = max(1, min(smem_per_sm // (cfg.smem_bytes(spec.head_dim) + 1024), 2))
    slots = sms * per_sm
    work = max(1, spec.batch * spec.num_heads_kv * num_m_tiles(spec, cfg))
    blocks = -(-spec.seqlen_k // cfg.tile_n)
    max_s = max(1, min(MAX_AUTO_SPLITS, blocks // 4))
    best, best_eff = 1, 0.0
    for s in range(min(2, max_s), max_s + 1):
        total = work * s
        eff = total / (-(-total // slots) * slots)
        if eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best



def q_needs_copy(q) -> bool:
    """The kernel gathers q rows with a unit last stride and 32-bit element offsets: a view such
    as ``q_full[:, -1:]`` of a long prompt spans more than 2**31 elements although q itself is
    small, and its offsets would wrap. Such a q is copied (it is tiny next to the cache)."""
    extent = sum((n - 1) * st for n, st in zip(q.shape, q.stride()) if n > 1)
    return q.stride(-1) != 1 or extent >= 2 ** 31


class FastSm120Decode:
    name = "fast-sm120-decode"
    family = "fast"

    def __init__(self) -> None:
        self._entries = {}

    def auto_skip(self, spec) -> Optional[str]:
        # the same rule as fast-sm120 (impl.py): on Hopper impl="auto" keeps the Triton kernels;
        # impl="fast" still uses this one
        if dispatch.device_arch() == 90:
            return "on sm_90 the Triton kernels are measured faster than this portable kernel"
        return None

    def can_implement(self, spec) -> Optional[str]:
        why = FlashDecodeSm80.can_implement(spec)
        if why is not None:
            return why
        cfg = decode_config(spec.head_dim, spec.seqlen_q * spec.gqa_ratio)
        splits = spec.num_splits if spec.num_splits > 0 else MAX_AUTO_SPLITS
        if splits * spec.batch * spec.num_heads_q * spec.seqlen_q * spec.head_dim_v > _I32_MAX:
            return "split workspace over 2**31 elements (32-bit indexing)"
        if spec.batch * spec.seqlen_q * spec.num_heads_q * spec.head_dim > _I32_MAX:
            return "q over 2**31 elements (32-bit indexing)"
        if spec.batch * spec.num_heads_kv > _I32_MAX or num_m_tiles(spec, cfg) > 65535 or splits > 65535:
            return "grid limit: too many packed query rows per KV head or splits"
        if num_m_tiles(spec, cfg) > 1:
            # the kernel has the path (tests/test_fast_sm120_decode.py drives it directly), but it
            # has not run on a GPU yet: until it has, such calls go to Triton
            return (f"{spec.seqlen_q * spec.gqa_ratio} packed query rows per KV head (Sq x Hq/Hkv) need "
                    f"more than one {cfg.tile_m}-row tile, not GPU-verified yet")
        if spec.device_type != "cuda":
            return f"needs CUDA tensors, got {spec.device_type}"
        arch = dispatch.device_arch()
        if arch is None:
            return "no CUDA GPU"
        if arch not in SUPPORTED_ARCHS:
            return f"runs on SM80-SM90 and SM120, not sm_{arch}"
        return None

    def _entry(self, spec, device):
        """(compiled fn, schema.pack, cfg, splits, scalars), memoised per (spec, device)."""
        ek = (spec, device.index)
        hit = self._entries.get(ek)
        if hit is not None:
            return hit
        arch = target_arch(dispatch.device_arch(device.index or 0))
        key = compile_key(spec, arch)
        fn = _cache.get(key, lambda: compile_uncached(key, arch)[0])
        cfg = key[4]
        splits = choose_num_splits(spec, cfg, *_device_info(device))
        _, _, wl, wr = window_bounds(spec)
        if spec.softcap > 0:  # s' = cap * tanh(s * scale / cap), then exp2 with log2(e) only
            scalars = (wl, wr, math.log2(math.e), spec.scale / spec.softcap, spec.softcap)
        else:
            scalars = (wl, wr, spec.scale * math.log2(math.e), 0.0, 0.0)
        hit = (DirectLauncher(fn), FlashDecodeSm80.arg_schema(_cutlass_dtype(spec.dtype)).pack, cfg, splits, scalars)
        if len(self._entries) > 4096:  # specs carry shapes: keep the memo bounded
            self._entries.clear()
        self._entries[ek] = hit
        return hit

    def forward(self, call):
        spec = call.spec
        q, k, v = call.q, call.k, call.v
        B, Sq, Hq, Hkv, D = spec.batch, spec.seqlen_q, spec.num_heads_q, spec.num_heads_kv, spec.head_dim
        # the cache is read with 16-byte cp.async and written in place: it cannot be copied
        for name, t in (("k_cache", k), ("v_cache", v)):
            if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
                raise NotImplementedError(f"fast-sm120-decode: {name} needs a unit-stride last dimension, "
                                          "other strides a multiple of 8 elements and a 16-byte aligned base")
        out = call.extra.get("out")  # tests may pass preallocated (poisoned) outputs
        if out is None:
            out = torch.empty(B, Sq, Hq, spec.head_dim_v, dtype=q.dtype, device=q.device)
        lse = call.extra.get("lse")
        if lse is None:
            lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
        # the combine derives O's and LSE's offsets from the shapes
        assert out.is_contiguous() and lse.is_contiguous() and out.data_ptr() % 16 == 0
        page_table = call.page_table if spec.paged else call.cache_seqlens
        pt_stride = call.page_table.stride(0) if spec.paged else 0
        page_size = max(spec.page_size, 1)
        if spec.num_new_kv:  # appended even when there is no output to compute (as the oracle does)
            _append(call, k, v, page_table, pt_stride, page_size)
        if out.numel() == 0:
            return out, lse.fill_(-math.inf)
        if q_needs_copy(q):
            q = q.contiguous()

        fn, pack, cfg, splits, (wl, wr, scale_log2, softcap_scale, softcap) = self._entry(spec, q.device)
        # one workspace: o_part (splits, B, Hq, Sq, D) then l_part (splits, B, Hq, Sq), fp32
        n_rows = splits * B * Hq * Sq
        ws = torch.empty(n_rows * (D + 1), dtype=torch.float32, device=q.device)
        args = pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), ws.data_ptr(),
                    ws.data_ptr() + 4 * n_rows * D, call.cache_seqlens.data_ptr(), page_table.data_ptr(),
                    B, Sq, Hq, Hkv, spec.num_new_kv, splits, page_size, pt_stride, *q.stride()[:3], wl, wr,
                    *k.stride()[:3], *v.stride()[:3], scale_log2, softcap_scale, softcap)
        if q.device.index in (None, current_device_index()):
            fn(args, current_stream_handle(q.device))
        else:
            with torch.cuda.device(q.device):  # the launch goes to the current device's context
                fn(args, current_stream_handle(q.device))
        return out, lse

    def backward(self, call, out, lse, dout):
        raise NotImplementedError("fast-sm120-decode has no backward (can_implement refuses needs_grad)")


def _append(call, k, v, page_table, pt_stride: int, page_size: int) -> None:
    """k_new/v_new into the cache at cache_seqlens[b] ..: the reference's Triton append kernel."""
    from dualattn.reference.triton.common import next_pow2
    from dualattn.reference.triton.decode import _append_kv

    spec = call.spec
    D = spec.head_dim
    kn, vn = (t if t.stride(-1) == 1 else t.contiguous() for t in (call.k_new, call.v_new))
    _append_kv[(spec.batch * spec.num_new_kv, spec.num_heads_kv)](
        kn, vn, k, v, call.cache_seqlens, page_table, *kn.stride()[:3], *vn.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], pt_stride, spec.num_new_kv, page_size,
        BLOCK_D=next_pow2(D), BLOCK_DV=next_pow2(D), HEAD_D=D, HEAD_DV=D, PAGED=spec.paged)


def compile_cache() -> CompileCache:
    return _cache
