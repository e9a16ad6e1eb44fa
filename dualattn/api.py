"""Public entry points: attention, attention_varlen, attention_with_kvcache, explain."""
from __future__ import annotations

import torch

from . import debug, dispatch, spec as spec_mod


class _Attention(torch.autograd.Function):
    """Runs one implementation's forward; its backward when autograd asks."""

    @staticmethod
    def forward(ctx, impl, call, q, k, v):
        out, lse = impl.forward(call)
        ctx.impl, ctx.call = impl, call
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call.with_tensors(q=q, k=k, v=v)
        dq, dk, dv = ctx.impl.backward(call, out, lse, dout.contiguous())
        return None, None, dq, dk, dv


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - old torch
        return False


def _needs_grad(q, k, v) -> bool:
    if not torch.is_grad_enabled():
        return False
    try:
        return bool(q.requires_grad or k.requires_grad or v.requires_grad)
    except AttributeError:  # not tensors: build_dense/build_varlen raise the TypeError that says so
        return False


def run_call(call, impl: str):
    """Dispatch a validated call (honouring reference / check mode) and return (out, lse)."""
    mode = debug.current_mode()
    requested = "torch" if mode == "reference" else impl
    chosen = dispatch.select(call.spec, requested)
    if call.spec.needs_grad:
        out, lse = _Attention.apply(chosen, call, call.q, call.k, call.v)
    else:
        out, lse = chosen.forward(call)
    if mode == "check" and chosen.family != "torch":
        debug.check_against_reference(call, chosen, out, lse)
    return out, lse


def attention(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, key_ranges=None,
              block_sparse=None, deterministic=False, return_lse=False, impl="auto"):
    """Attention over q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> (B, Sq, Hq, Dv).

    With ``return_lse`` also returns the natural-log LSE, fp32 (B, Hq, Sq).
    """
    if _compiling():  # torch.compile traces the custom op (dualattn.ops), not the Python checks
        from . import ops
        return ops.attention(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale,
                             key_ranges=key_ranges, block_sparse=block_sparse, deterministic=deterministic,
                             return_lse=return_lse, impl=impl)
    needs_grad = _needs_grad(q, k, v)
    launch_key = hit = None
    if not needs_grad and key_ranges is None and block_sparse is None and debug.current_mode() is None:
        # a repeated inference call: the launcher remembered for exactly these arguments (shapes,
        # strides, dtypes, devices, flags) skips the checks, the dispatch and the output / argument
        # set-up that depend on nothing else (the host-time target); first calls, and
        # implementations without one, take the path below
        launch_key = spec_mod.dense_memo_key(q, k, v, causal, window, softcap, scale, deterministic, return_lse,
                                             False)
        if launch_key is not None:
            launch_key = (launch_key, q.stride(), k.stride(), v.stride(), impl)
            try:
                hit = dispatch.LAUNCH_MEMO.get(launch_key)
            except TypeError:  # an unhashable argument: the checks below say what is wrong with it
                hit, launch_key = None, None
            if hit is not None:
                if not dispatch.registry_unchanged(hit[0]):
                    hit = None  # a family list was swapped (tests): decide and remember anew
                elif hit[1] is not None:
                    res = hit[1](q, k, v)
                    if res is not None:  # None: these tensors need what the full path does (a copy)
                        return res if return_lse else res[0]
    call = spec_mod.build_dense(q, k, v, causal=causal, window=window, softcap=softcap, scale=scale,
                                key_ranges=key_ranges, block_sparse=block_sparse, deterministic=deterministic,
                                return_lse=return_lse, needs_grad=needs_grad)
    out, lse = run_call(call, impl)
    # (a launch planned inside a CUDA graph capture may differ from an eager one: fast-sm90's
    # split tail cannot copy its table to the GPU there, so the next eager call remembers)
    if launch_key is not None and hit is None and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        _remember_launcher(launch_key, call, impl)
    return (out, lse) if return_lse else out


def _remember_launcher(launch_key, call, impl: str) -> None:
    """Keep the chosen implementation's launcher for these arguments (None: it offers none)."""
    make = getattr(dispatch.select(call.spec, impl), "direct_launcher", None)
    memo = dispatch.LAUNCH_MEMO
    if len(memo) >= 1024:  # keys hold shapes: keep it bounded
        memo.clear()
    memo[launch_key] = (dispatch.registry_snapshot(), make(call) if make is not None else None)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     window=(-1, -1), softcap=0.0, scale=None, key_ranges=None, block_sparse=None,
                     deterministic=False, return_lse=False, impl="auto"):
    """Packed sequences: q (total_q, Hq, D), k/v (total_k, Hkv, D/Dv), int32 cu_seqlens of length B+1.

    LSE (with ``return_lse``) is fp32 (Hq, total_q).
    """
    if _compiling():
        from . import ops
        return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    window=window, softcap=softcap, scale=scale, key_ranges=key_ranges,
                                    block_sparse=block_sparse, deterministic=deterministic, return_lse=return_lse,
                                    impl=impl)
    call = spec_mod.build_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                 window=window, softcap=softcap, scale=scale, key_ranges=key_ranges,
                                 block_sparse=block_sparse, deterministic=deterministic, return_lse=return_lse,
                                 needs_grad=_needs_grad(q, k, v))
    out, lse = run_call(call, impl)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, page_table=None, k_new=None, v_new=None,
                           causal=False, window=(-1, -1), softcap=0.0, scale=None, num_splits=0,
                           return_lse=False, impl="auto"):
    """Decode / chunked prefill against a KV cache (no autograd).

    k_cache/v_cache: (B, capacity, Hkv, D) or, with ``page_table`` (B, max_pages) int32, paged
    (num_pages, page_size, Hkv, D). ``k_new``/``v_new`` (B, S_new, Hkv, D) are written into the cache
    at ``cache_seqlens`` (which is not advanced) and attended to, as in FlashAttention.
    """
    if _compiling():
        from . import ops
        return ops.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                                          k_new=k_new, v_new=v_new, causal=causal, window=window, softcap=softcap,
                                          scale=scale, num_splits=num_splits, return_lse=return_lse, impl=impl)
    call = spec_mod.build_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table,
                                  k_new=k_new, v_new=v_new, causal=causal, window=window, softcap=softcap,
                                  scale=scale, num_splits=num_splits, return_lse=return_lse)
    with torch.no_grad():
        out, lse = run_call(call, impl)
    return (out, lse) if return_lse else out


def _with_grad(spec, q, k, v):
    from dataclasses import replace
    return replace(spec, needs_grad=_needs_grad(q, k, v))


def explain(q, k, v, *, varlen=None, kvcache=None, **kw) -> str:
    """Say which implementation impl="auto" picks for this call and why the others cannot serve it.

    Takes the same arguments as ``attention`` (or pass ``varlen=dict(cu_seqlens_q=..., ...)`` /
    ``kvcache=dict(cache_seqlens=..., ...)`` for the other entry points).
    """
    kw.pop("impl", None)
    if kvcache is not None:
        call = spec_mod.build_kvcache(q, k, v, **kvcache, **kw)
    elif varlen is not None:
        call = spec_mod.build_varlen(q, k, v, **varlen, **kw)
        call.spec = _with_grad(call.spec, q, k, v)
    else:
        call = spec_mod.build_dense(q, k, v, **kw)
        call.spec = _with_grad(call.spec, q, k, v)
    return dispatch.explain_spec(call.spec)
