"""FlashAttention-compatible entry points.

Replace ``from flash_attn import flash_attn_func`` (FlashAttention 2), ``from flash_attn_interface
import ...`` (FA3) or ``from flash_attn.cute import ...`` (FA4) with ``from dualattn.compat import
...``: the argument names, defaults, layouts and semantics are FlashAttention's, and every call goes
through dualattn's spec (validation) and dispatch. One addition: ``impl=`` ("auto", "fast",
"triton", "torch").

Conventions (as FlashAttention >= 2.1):

* q ``(B, Sq, Hq, D)``, k/v ``(B, Sk, Hkv, D)``; varlen ``(total, H, D)`` with int32 cu_seqlens;
* ``causal`` is bottom-right aligned; ``window_size=(left, right)`` from the same diagonal, with
  -1 or None for unbounded (FA2/FA3 use -1, FA4 None);
* ``softmax_scale`` defaults to ``1/sqrt(D)``; ``softcap=0`` disables capping;
* return values: ``out``; with ``return_attn_probs=True`` (FA2/FA3) ``(out, softmax_lse, None)``
  -- dualattn never materialises attention probabilities, which FlashAttention also only returns
  with dropout; with ``return_lse=True`` (FA4) ``(out, softmax_lse)``; with
  ``return_softmax_lse=True`` (kv-cache) ``(out, softmax_lse)``. LSE is natural-log fp32,
  ``(B, Hq, Sq)`` or ``(Hq, total_q)`` for varlen.

What dualattn does not do raises ``NotImplementedError`` naming the argument: dropout
(``dropout_p > 0``), ALiBi (``alibi_slopes``), FP8 descaling, ``qv``, learnable sinks,
score/mask mods (use dualattn's key ranges / BlockSparse), chunked attention, rotary embedding
in the kv-cache call, ``cache_batch_idx`` and ``cache_leftpad``. Performance hints
(``num_splits`` where it is only a hint, ``pack_gqa``, ``sm_margin``) are accepted and ignored.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import api
from .spec import value_checks_enabled

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_qkvpacked_func",
           "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]


# --------------------------------------------------------------------------------------------
# argument conversion
# --------------------------------------------------------------------------------------------

def _window(window_size):
    if window_size is None:
        return (-1, -1)
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise TypeError(f"window_size: expected a pair (left, right), got {window_size!r}")
    w = tuple(-1 if x is None else x for x in window_size)
    if any(isinstance(x, bool) or not isinstance(x, int) or x < -1 for x in w):
        raise ValueError(f"window_size: entries must be -1 or None (unbounded) or ints >= 0, got {tuple(window_size)}")
    return w


def _unsupported(**kw) -> None:
    """Raise for the first FlashAttention feature given a non-default value that dualattn lacks."""
    reasons = {
        "dropout_p": "attention dropout is not implemented (pass dropout_p=0.0)",
        "alibi_slopes": "ALiBi biases are not implemented",
        "qv": "the extra Qv operand (MLA) is not implemented",
        "q_descale": "FP8 descaling is not implemented", "k_descale": "FP8 descaling is not implemented",
        "v_descale": "FP8 descaling is not implemented",
        "learnable_sink": "learnable attention sinks are not implemented",
        "score_mod": "score_mod is not supported; dualattn has softcap and key ranges",
        "mask_mod": "mask_mod is not supported; express the mask as dualattn key ranges or a BlockSparse",
        "attention_chunk": "chunked attention (attention_chunk) is not implemented; use key ranges",
        "rotary_cos": "rotary embedding inside the kv-cache call is not implemented; apply it before",
        "rotary_sin": "rotary embedding inside the kv-cache call is not implemented; apply it before",
        "cache_batch_idx": "cache_batch_idx is not implemented; index the cache before the call",
        "cache_leftpad": "cache_leftpad is not implemented",
        "block_sparse_tensors": "FA4 block-sparse tensors are not accepted; use dualattn.BlockSparse",
    }
    for name, value in kw.items():
        if value is None or (name in ("dropout_p", "attention_chunk") and value == 0):
            continue
        raise NotImplementedError(f"{name}: {reasons[name]}")


def _finish(out_lse, return_attn_probs: bool, return_lse: bool):
    out, lse = out_lse
    if return_attn_probs:
        return out, lse, None
    if return_lse:
        return out, lse
    return out


# --------------------------------------------------------------------------------------------
# dense
# --------------------------------------------------------------------------------------------

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_lse=False,
                    qv=None, q_descale=None, k_descale=None, v_descale=None, attention_chunk=0, learnable_sink=None,
                    score_mod=None, mask_mod=None, block_sparse_tensors=None, num_splits=1, pack_gqa=None,
                    sm_margin=0, impl="auto"):
    """FlashAttention's ``flash_attn_func``: q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D) -> out (B, Sq, Hq, Dv)."""
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes, qv=qv, q_descale=q_descale, k_descale=k_descale,
                 v_descale=v_descale, attention_chunk=attention_chunk, learnable_sink=learnable_sink,
                 score_mod=score_mod, mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors)
    res = api.attention(q, k, v, causal=causal, window=_window(window_size), softcap=softcap or 0.0,
                        scale=softmax_scale, deterministic=deterministic, return_lse=True, impl=impl)
    return _finish(res, return_attn_probs, return_lse)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              impl="auto"):
    """qkv (B, S, 3, H, D)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, impl=impl)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             impl="auto"):
    """q (B, Sq, Hq, D), kv (B, Sk, 2, Hkv, D)."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, impl=impl)


# --------------------------------------------------------------------------------------------
# varlen
# --------------------------------------------------------------------------------------------

def _gather_paged(cache, block_table, cu_seqlens_k, total_k: int):
    """FA2's paged varlen KV: cache (num_pages, page_size, H, D) + block_table (B, max_pages) -> (total_k, H, D)."""
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise TypeError(f"block_table: must be a 2-D int32 tensor (batch, max_pages), got {block_table.dtype} "
                        f"{tuple(block_table.shape)}")
    if block_table.shape[0] != cu_seqlens_k.numel() - 1:
        raise ValueError(f"block_table: first dim {block_table.shape[0]} must equal the batch "
                         f"{cu_seqlens_k.numel() - 1} (len(cu_seqlens_k) - 1)")
    ps = cache.shape[1]
    t = torch.arange(total_k, device=cache.device)
    b = torch.searchsorted(cu_seqlens_k[1:].long(), t, right=True)
    j = t - cu_seqlens_k.long()[b]
    if value_checks_enabled() and total_k:  # as build_kvcache checks page_table (reads the device)
        longest = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
        if -(-longest // ps) > block_table.shape[1]:
            raise ValueError(f"block_table: {block_table.shape[1]} pages per sequence cannot hold a sequence of "
                             f"{longest} keys with page size {ps}")
    page = block_table.long()[b, j // ps]
    if value_checks_enabled() and page.numel() and (int(page.min()) < 0 or int(page.max()) >= cache.shape[0]):
        raise ValueError(f"block_table: entries must lie in [0, num_pages={cache.shape[0]})")
    return cache[page, j % ps]


def _seqused_key_ranges(cu_q, cu_k, total_q, seqused_q, seqused_k, causal, window, device):
    """Key ranges (1, 1, total_q, 1, 2) for varlen with seqused_q/seqused_k (FA3 semantics: the
    used lengths are the sequences' lengths for masking; rows past seqused_q see nothing)."""
    t = torch.arange(total_q, device=device)
    b = torch.searchsorted(cu_q[1:].long(), t, right=True)
    i = t - cu_q.long()[b]
    sq = (cu_q[1:] - cu_q[:-1]).long()[b] if seqused_q is None else seqused_q.long()[b]
    sk = (cu_k[1:] - cu_k[:-1]).long()[b] if seqused_k is None else seqused_k.long()[b]
    diag = i + sk - sq
    lo = torch.zeros_like(diag)
    hi = sk.clone()
    left, right = window
    if causal:
        hi = torch.minimum(hi, diag + 1)
    if left >= 0:
        lo = torch.maximum(lo, diag - left)
    if right >= 0:
        hi = torch.minimum(hi, diag + right + 1)
    lo = torch.minimum(lo.clamp(min=0), sk)
    hi = torch.maximum(torch.minimum(hi, sk), lo)  # hi < lo means empty
    dead = i >= sq  # rows past seqused_q see nothing
    lo = torch.where(dead, torch.zeros_like(lo), lo)
    hi = torch.where(dead, torch.zeros_like(hi), hi)
    return torch.stack([lo, hi], -1).to(torch.int32).view(1, 1, total_q, 1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, page_table=None,
                           seqused_q=None, seqused_k=None, return_lse=False, qv=None, q_descale=None,
                           k_descale=None, v_descale=None, attention_chunk=0, learnable_sink=None, score_mod=None,
                           mask_mod=None, block_sparse_tensors=None, num_splits=1, pack_gqa=None, sm_margin=0,
                           impl="auto"):
    """FlashAttention's ``flash_attn_varlen_func``: packed q (total_q, Hq, D), k/v (total_k, Hkv, D).

    ``block_table`` / ``page_table`` (B, max_pages) int32: k/v are paged ``(num_pages, page_size,
    Hkv, D)`` (gathered into a packed copy before the call). ``seqused_q`` / ``seqused_k`` (B,)
    int32: the number of tokens actually used per sequence (FA3), applied as key ranges.
    """
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes, qv=qv, q_descale=q_descale, k_descale=k_descale,
                 v_descale=v_descale, attention_chunk=attention_chunk, learnable_sink=learnable_sink,
                 score_mod=score_mod, mask_mod=mask_mod, block_sparse_tensors=block_sparse_tensors)
    if block_table is not None and page_table is not None:
        raise ValueError("block_table: give block_table (FA2) or page_table (FA3/FA4), not both")
    table = block_table if block_table is not None else page_table
    window = _window(window_size)
    if table is not None:
        if not (isinstance(cu_seqlens_k, torch.Tensor) and cu_seqlens_k.dtype == torch.int32):
            raise TypeError("cu_seqlens_k: must be an int32 tensor")
        total_k = int(cu_seqlens_k[-1])
        k = _gather_paged(k, table, cu_seqlens_k, total_k)
        v = _gather_paged(v, table, cu_seqlens_k, total_k)
    key_ranges = None
    if seqused_q is not None or seqused_k is not None:
        for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.int32
                                  or tuple(t.shape) != (cu_seqlens_q.numel() - 1,)):
                raise TypeError(f"{name}: expected an int32 tensor of shape (batch,) = "
                                f"({cu_seqlens_q.numel() - 1},)")
        key_ranges = _seqused_key_ranges(cu_seqlens_q, cu_seqlens_k, q.shape[0], seqused_q, seqused_k, causal,
                                         window, q.device)
        causal, window = False, (-1, -1)  # encoded in the key ranges, relative to the used lengths
    res = api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               window=window, softcap=softcap or 0.0, scale=softmax_scale, key_ranges=key_ranges,
                               deterministic=deterministic, return_lse=True, impl=impl)
    return _finish(res, return_attn_probs, return_lse)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, impl="auto"):
    """qkv (total, 3, H, D)."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  impl=impl)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, impl="auto"):
    """q (total_q, Hq, D), kv (total_k, 2, Hkv, D)."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, impl=impl)


# --------------------------------------------------------------------------------------------
# kv-cache
# --------------------------------------------------------------------------------------------

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            page_table=None, q_descale=None, k_descale=None, v_descale=None, attention_chunk=0,
                            pack_gqa=None, sm_margin=0, impl="auto"):
    """FlashAttention's ``flash_attn_with_kvcache`` (decode / chunked prefill against a cache).

    k_cache/v_cache (B, capacity, Hkv, D), or paged (num_pages, page_size, Hkv, D) with
    ``block_table`` (FA2) / ``page_table`` (FA3) (B, max_pages) int32. ``cache_seqlens``: int or
    (B,) int32 tensor (None: the whole cache). ``k``/``v`` (B, S_new, Hkv, D) are written into the
    cache at ``cache_seqlens`` (in place) and attended to.
    """
    _unsupported(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                 cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes, q_descale=q_descale, k_descale=k_descale,
                 v_descale=v_descale, attention_chunk=attention_chunk)
    if block_table is not None and page_table is not None:
        raise ValueError("block_table: give block_table (FA2) or page_table (FA3), not both")
    table = block_table if block_table is not None else page_table
    B = q.shape[0]
    if cache_seqlens is None:  # FlashAttention: the whole cache is valid
        cap = table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1]
        cache_seqlens = torch.full((B,), cap - (0 if k is None else k.shape[1]), dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    res = api.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=table, k_new=k,
                                     v_new=v, causal=causal, window=_window(window_size), softcap=softcap or 0.0,
                                     scale=softmax_scale, num_splits=int(num_splits or 0), return_lse=True, impl=impl)
    return _finish(res, False, return_softmax_lse)
