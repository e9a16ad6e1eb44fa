"""dualattn as ``torch.library`` custom ops, for ``torch.compile`` and CUDA graphs.

Three ops, each with a fake (meta) implementation so that the compiler can trace shapes without
running a kernel, and one backward op with its own fake implementation:

* ``dualattn::fwd``  dense or varlen attention -> (out, lse), with a registered autograd formula
  that calls ``dualattn::bwd`` -> (dq, dk, dv);
* ``dualattn::kvcache``  decode against a KV cache (no append, mutates nothing);
* ``dualattn::kvcache_append``  the same with ``k_new``/``v_new`` written into the cache
  (declares the caches as mutated, so functionalization sees the write).

The real implementation of each op builds the :class:`~dualattn.spec.AttentionCall` (which is
where the input is validated), honours reference / check mode and dispatches exactly as the eager
API does. The ops take only tensors and plain scalars: a ``BlockSparse`` travels as its four q->k
CSR tensors plus (block_m, block_n, seqlen_q, seqlen_k); ``scale=0.0`` means the default
``1/sqrt(D)``, computed from the real head dim inside the op (so tracing never specialises on it).

Use the wrappers :func:`attention`, :func:`attention_varlen` and :func:`attention_with_kvcache`
(same signatures as ``dualattn.attention`` ...). ``dualattn.attention`` itself switches to them
while ``torch.compile`` traces, so model code needs no change.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import debug, dispatch, spec as spec_mod

_LIB = "dualattn"


# --------------------------------------------------------------------------------------------
# helpers shared by the real implementations
# --------------------------------------------------------------------------------------------

def _window(window) -> Tuple[int, int]:
    if window is None:
        return -1, -1
    left, right = window
    return (-1 if left is None else left), (-1 if right is None else right)


def _block_sparse_from(full_rowptr, full_col, mask_rowptr, mask_col, bs_meta):
    if full_rowptr is None:
        return None
    from .sparse import BlockCSR, BlockSparse

    bm, bn, sq, sk = bs_meta
    return BlockSparse(BlockCSR(full_rowptr, full_col), BlockCSR(mask_rowptr, mask_col), bm, bn, sq, sk)


def _build(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_ranges, bs, causal,
           window_left, window_right, softcap, scale, deterministic, needs_grad):
    kw = dict(causal=causal, window=(window_left, window_right), softcap=softcap,
              scale=None if scale == 0.0 else scale, key_ranges=key_ranges, block_sparse=bs,
              deterministic=deterministic, return_lse=True)
    if cu_seqlens_q is None:
        call = spec_mod.build_dense(q, k, v, **kw)
    else:
        call = spec_mod.build_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw)
    call.spec = replace(call.spec, needs_grad=needs_grad)
    return call


def _select(call, impl: str):
    mode = debug.current_mode()
    return mode, dispatch.select(call.spec, "torch" if mode == "reference" else impl)


@contextlib.contextmanager
def _autograd_inside_op():
    """The body of a custom op runs below autograd (autograd keys excluded). The torch family's
    backward *is* autograd over the oracle, so give it the autograd keys back for its duration."""
    C = torch._C
    ex = C._dispatch_tls_local_exclude_set()
    for name in dir(C.DispatchKey):
        if name.startswith("Autograd"):
            ex = ex.remove(getattr(C.DispatchKey, name))
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), ex):
        yield


def _fresh(t: Tensor, *inputs: Tensor) -> Tensor:
    """Custom-op outputs may not alias inputs; copy in the (rare) case an impl returned one."""
    for x in inputs:
        if x is not None and t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and t.numel():
            return t.clone()
    return t


# --------------------------------------------------------------------------------------------
# dense / varlen forward and backward
# --------------------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
         max_seqlen_q: int, max_seqlen_k: int, key_ranges: Optional[Tensor], bs_full_rowptr: Optional[Tensor],
         bs_full_col: Optional[Tensor], bs_mask_rowptr: Optional[Tensor], bs_mask_col: Optional[Tensor],
         bs_meta: List[int], causal: bool, window_left: int, window_right: int, softcap: float, scale: float,
         deterministic: bool, needs_grad: bool, impl: str) -> Tuple[Tensor, Tensor]:
    bs = _block_sparse_from(bs_full_rowptr, bs_full_col, bs_mask_rowptr, bs_mask_col, bs_meta)
    call = _build(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_ranges, bs, causal,
                  window_left, window_right, softcap, scale, deterministic, needs_grad)
    mode, chosen = _select(call, impl)
    out, lse = chosen.forward(call)
    if mode == "check" and chosen.family != "torch":
        debug.check_against_reference(call, chosen, out, lse)
    return _fresh(out, q, k, v), _fresh(lse.float(), q, k, v)


@_fwd.register_fake
def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_ranges, bs_full_rowptr,
              bs_full_col, bs_mask_rowptr, bs_mask_col, bs_meta, causal, window_left, window_right, softcap,
              scale, deterministic, needs_grad, impl):
    dv = v.shape[-1]
    if cu_seqlens_q is None:
        B, Sq, Hq, _ = q.shape
        return q.new_empty((B, Sq, Hq, dv)), q.new_empty((B, Hq, Sq), dtype=torch.float32)
    T, Hq, _ = q.shape
    return q.new_empty((T, Hq, dv)), q.new_empty((Hq, T), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::bwd", mutates_args=())
def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Optional[Tensor],
         cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, key_ranges: Optional[Tensor],
         bs_full_rowptr: Optional[Tensor], bs_full_col: Optional[Tensor], bs_mask_rowptr: Optional[Tensor],
         bs_mask_col: Optional[Tensor], bs_meta: List[int], causal: bool, window_left: int, window_right: int,
         softcap: float, scale: float, deterministic: bool, impl: str) -> Tuple[Tensor, Tensor, Tensor]:
    bs = _block_sparse_from(bs_full_rowptr, bs_full_col, bs_mask_rowptr, bs_mask_col, bs_meta)
    call = _build(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_ranges, bs, causal,
                  window_left, window_right, softcap, scale, deterministic, True)
    # the same selection the forward made (its spec also had needs_grad=True)
    _, chosen = _select(call, impl)
    with _autograd_inside_op():
        dq, dk, dv = chosen.backward(call, out, lse, dout.contiguous())
    ins = (dout, q, k, v, out, lse)
    # contiguous, whatever each implementation's layout (the oracle's autograd and fast-sm120 give
    # contiguous gradients, Triton empty_like's): the fake below must describe the real strides
    return tuple(_fresh(g.contiguous(), *ins) for g in (dq, dk, dv))


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, *rest):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


_TENSOR_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "key_ranges", "bs_full_rowptr", "bs_full_col",
                "bs_mask_rowptr", "bs_mask_col")


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, kr, f_rp, f_col, m_rp, m_col, bs_meta, causal, wl, wr, softcap, scale,
     det, needs_grad, impl) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, kr, f_rp, f_col, m_rp, m_col)
    ctx.static = (max_q, max_k, bs_meta, causal, wl, wr, softcap, scale, det, impl)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k, kr, f_rp, f_col, m_rp, m_col = ctx.saved_tensors
    max_q, max_k, bs_meta, causal, wl, wr, softcap, scale, det, impl = ctx.static
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, kr, f_rp, f_col, m_rp, m_col, bs_meta,
                      causal, wl, wr, softcap, scale, det, impl)
    return (dq, dk, dv) + (None,) * 18


_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# kv-cache
# --------------------------------------------------------------------------------------------

def _kvcache_impl(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, causal, window_left,
                  window_right, softcap, scale, num_splits, impl):
    call = spec_mod.build_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                                  k_new=k_new, v_new=v_new, causal=causal, window=(window_left, window_right),
                                  softcap=softcap, scale=None if scale == 0.0 else scale, num_splits=num_splits,
                                  return_lse=True)
    mode, chosen = _select(call, impl)
    if mode == "check" and chosen.family != "torch" and k_new is not None:
        # the reference must see the cache as it was before the append
        before = call.with_tensors(k=k_cache.clone(), v=v_cache.clone())
    else:
        before = call
    out, lse = chosen.forward(call)
    if mode == "check" and chosen.family != "torch":
        debug.check_against_reference(before, chosen, out, lse)
    ins = (q, k_cache, v_cache)
    return _fresh(out, *ins), _fresh(lse.float(), *ins)


def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, page_table, *rest):
    B, Sq, Hq, _ = q.shape
    return q.new_empty((B, Sq, Hq, v_cache.shape[-1])), q.new_empty((B, Hq, Sq), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::kvcache", mutates_args=())
def _kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, page_table: Optional[Tensor],
             causal: bool, window_left: int, window_right: int, softcap: float, scale: float, num_splits: int,
             impl: str) -> Tuple[Tensor, Tensor]:
    return _kvcache_impl(q, k_cache, v_cache, cache_seqlens, page_table, None, None, causal, window_left,
                         window_right, softcap, scale, num_splits, impl)


@_kvcache.register_fake
def _kvcache_fake_noappend(q, k_cache, v_cache, cache_seqlens, page_table, *rest):
    return _kvcache_fake(q, k_cache, v_cache, cache_seqlens, page_table)


@torch.library.custom_op(f"{_LIB}::kvcache_append", mutates_args=("k_cache", "v_cache"))
def _kvcache_append(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                    page_table: Optional[Tensor], k_new: Tensor, v_new: Tensor, causal: bool, window_left: int,
                    window_right: int, softcap: float, scale: float, num_splits: int,
                    impl: str) -> Tuple[Tensor, Tensor]:
    return _kvcache_impl(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, causal, window_left,
                         window_right, softcap, scale, num_splits, impl)


@_kvcache_append.register_fake
def _kvcache_append_fake(q, k_cache, v_cache, cache_seqlens, page_table, *rest):
    return _kvcache_fake(q, k_cache, v_cache, cache_seqlens, page_table)


# --------------------------------------------------------------------------------------------
# public wrappers (traceable by dynamo: only attribute reads and the op calls)
# --------------------------------------------------------------------------------------------

def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _bs_parts(block_sparse):
    if block_sparse is None:
        return None, None, None, None, [0, 0, 0, 0]
    b = block_sparse
    return (b.q2k_full.rowptr, b.q2k_full.col, b.q2k_mask.rowptr, b.q2k_mask.col,
            [b.block_m, b.block_n, b.seqlen_q, b.seqlen_k])


def _scale(scale) -> float:
    """The op's encoding of ``scale``: 0.0 stands for the default 1/sqrt(D), so a caller's 0 (or
    any other invalid value) is refused here as the eager entry points refuse it, instead of
    silently becoming the default."""
    if scale is None:
        return 0.0
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale: must be a positive finite number, got {value}")
    return value


def attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, key_ranges=None,
              block_sparse=None, deterministic=False, return_lse=False, impl="auto"):
    """``dualattn.attention`` through the ``dualattn::fwd`` custom op."""
    wl, wr = _window(window)
    f_rp, f_col, m_rp, m_col, meta = _bs_parts(block_sparse)
    out, lse = _fwd(q, k, v, None, None, 0, 0, key_ranges, f_rp, f_col, m_rp, m_col, meta, causal, wl, wr,
                    float(softcap or 0.0), _scale(scale), bool(deterministic), _needs_grad(q, k, v), impl)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     window=(-1, -1), softcap=0.0, scale=None, key_ranges=None, block_sparse=None,
                     deterministic=False, return_lse=False, impl="auto"):
    """``dualattn.attention_varlen`` through the ``dualattn::fwd`` custom op."""
    wl, wr = _window(window)
    f_rp, f_col, m_rp, m_col, meta = _bs_parts(block_sparse)
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_ranges, f_rp, f_col, m_rp,
                    m_col, meta, causal, wl, wr, float(softcap or 0.0), _scale(scale), bool(deterministic),
                    _needs_grad(q, k, v), impl)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table=None, k_new=None, v_new=None,
                           causal=False, window=(-1, -1), softcap=0.0, scale=None, num_splits=0,
                           return_lse=False, impl="auto"):
    """``dualattn.attention_with_kvcache`` through the ``dualattn::kvcache[_append]`` custom ops."""
    wl, wr = _window(window)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new: k_new and v_new must be given together")
    with torch.no_grad():
        if k_new is None:
            out, lse = _kvcache(q, k_cache, v_cache, cache_seqlens, page_table, causal, wl, wr,
                                float(softcap or 0.0), _scale(scale), num_splits, impl)
        else:
            out, lse = _kvcache_append(q, k_cache, v_cache, cache_seqlens, page_table, k_new, v_new, causal, wl,
                                       wr, float(softcap or 0.0), _scale(scale), num_splits, impl)
    return (out, lse) if return_lse else out
