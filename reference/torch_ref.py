"""The oracle: attention with materialized scores, in fp32 (or fp64, or the input dtype).

Every variant of the public API goes through one routine, ``_attend_rows``, which computes a
chunk of query rows of one sequence against all of its keys with the element predicate and the
block-sparse states applied. Chunks are wrapped in activation checkpointing, so the scores of a
16k x 16k, 16-head problem never exist at once, in the forward or in the backward.

``attention_ref(call, compute_dtype, dout)`` returns outputs in ``compute_dtype`` and, when
``dout`` is given, dQ, dK, dV by autograd. With ``compute_dtype`` equal to the input dtype it is
the "low precision" reference of the accuracy rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from dualattn.masks import element_visible
from dualattn.sparse import FULL, MASK

# query rows per chunk: bounds the materialized scores to chunk x Sk x heads
CHUNK_ELEMENTS = 1 << 26


@dataclass
class RefResult:
    out: torch.Tensor
    lse: torch.Tensor
    dq: Optional[torch.Tensor] = None
    dk: Optional[torch.Tensor] = None
    dv: Optional[torch.Tensor] = None


def _attend_rows(q, k, v, rows, *, seqlen_q, seqlen_k, spec, key_ranges, states, compute_dtype):
    """q: (M, Hq, D) for query rows ``rows``; k, v: (Sk, Hkv, *). Returns out (M, Hq, Dv), lse (Hq, M)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    g = Hq // Hkv
    qh = q.to(compute_dtype).permute(1, 0, 2)                      # (Hq, M, D)
    kh = k.to(compute_dtype).repeat_interleave(g, dim=1).permute(1, 0, 2)  # (Hq, Sk, D)
    vh = v.to(compute_dtype).repeat_interleave(g, dim=1).permute(1, 0, 2)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * spec.scale
    if spec.softcap > 0:
        s = torch.tanh(s / spec.softcap) * spec.softcap
    cols = torch.arange(seqlen_k, device=q.device)
    vis = element_visible(rows, cols, seqlen_q, seqlen_k, causal=spec.causal, window=spec.window,
                          key_ranges=key_ranges)  # (M, Sk) or (Hq|1, M, Sk)
    if states is not None:  # (Hq|1, nQ, nK) block states for this sequence
        bm, bn = spec.block_size
        st = states[:, (rows // bm).long()][:, :, (cols // bn).long()]
        vis = (st == FULL) | ((st == MASK) & vis)
    if vis.dim() == 2:
        vis = vis.unsqueeze(0)
    vis = vis.expand(Hq, rows.numel(), seqlen_k)
    s = s.masked_fill(~vis, float("-inf"))
    # the max is only a shift; detaching it keeps the gradient exact and NaN-free on empty rows
    if seqlen_k == 0:
        m = s.new_zeros(s.shape[:-1] + (1,))
    else:
        m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    has = l > 0
    l_safe = torch.where(has, l, torch.ones_like(l))
    o = torch.matmul(p, vh) / l_safe
    lse = torch.where(has, m + torch.log(l_safe), torch.full_like(l, float("-inf"))).squeeze(-1)
    return o.permute(1, 0, 2), lse


def _attend_sequence(q, k, v, *, seqlen_q, seqlen_k, spec, key_ranges, states, compute_dtype, row_offset=0):
    """All query rows of one sequence, in checkpointed chunks. q: (Sq, Hq, D)."""
    Hq = q.shape[1]
    chunk = max(1, CHUNK_ELEMENTS // max(1, seqlen_k * Hq))
    outs, lses = [], []
    for r0 in range(0, seqlen_q, chunk):
        r1 = min(seqlen_q, r0 + chunk)
        rows = torch.arange(r0, r1, device=q.device)
        kr = key_ranges[:, r0:r1] if key_ranges is not None else None

        def fn(qc, kk, vv, rows=rows, kr=kr):
            return _attend_rows(qc, kk, vv, rows, seqlen_q=seqlen_q, seqlen_k=seqlen_k, spec=spec,
                                key_ranges=kr, states=states, compute_dtype=compute_dtype)

        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            o, lse = checkpoint(fn, q[r0:r1], k, v, use_reentrant=False)
        else:
            o, lse = fn(q[r0:r1], k, v)
        outs.append(o)
        lses.append(lse)
    if not outs:
        return (q.new_zeros((0, Hq, v.shape[-1]), dtype=compute_dtype),
                torch.zeros(Hq, 0, dtype=compute_dtype, device=q.device))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def _states_for(call, b):
    bs = call.block_sparse
    if bs is None:
        return None
    st = bs.block_states().to(call.q.device)
    return st[min(b, st.shape[0] - 1)]  # (H'|1, nQ, nK)


def _kr_for(call, b, s0=None, s1=None):
    kr = call.key_ranges
    if kr is None:
        return None
    if s0 is not None:  # varlen: (1, H|1, total_q, R, 2)
        return kr[0, :, s0:s1]
    return kr[min(b, kr.shape[0] - 1)]  # (H|1, Sq, R, 2)


def _forward(call, q, k, v, compute_dtype):
    """Forward over the whole call; q/k/v may be leaf tensors requiring grad."""
    spec = call.spec
    if spec.mode == "batched":
        outs, lses = [], []
        for b in range(spec.batch):
            o, l = _attend_sequence(q[b], k[b], v[b], seqlen_q=spec.seqlen_q, seqlen_k=k.shape[1], spec=spec,
                                    key_ranges=_kr_for(call, b), states=_states_for(call, b),
                                    compute_dtype=compute_dtype)
            outs.append(o)
            lses.append(l)
        if spec.batch == 0:
            return (q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=compute_dtype),
                    torch.zeros(0, spec.num_heads_q, spec.seqlen_q, dtype=compute_dtype, device=q.device))
        return torch.stack(outs), torch.stack(lses)
    if spec.mode == "varlen":
        cq, ck = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        outs, lses = [], []
        for b in range(spec.batch):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            o, l = _attend_sequence(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], seqlen_q=sq,
                                    seqlen_k=sk, spec=spec, key_ranges=_kr_for(call, b, cq[b], cq[b + 1]),
                                    states=_states_for(call, b), compute_dtype=compute_dtype)
            outs.append(o)
            lses.append(l)
        return torch.cat(outs, 0), torch.cat(lses, 1)
    raise ValueError(f"unknown mode {spec.mode}")


def gather_kvcache(call):
    """Materialise each batch's visible keys/values of a kv-cache call, with k_new/v_new appended.

    Returns lists of (Sk_b, Hkv, D) tensors; the caches themselves are not modified here.
    """
    spec = call.spec
    ks, vs = [], []
    lens = call.cache_seqlens.tolist()
    for b in range(spec.batch):
        n = lens[b]
        if spec.paged:
            ps = spec.page_size
            pages = call.page_table[b, : (n + ps - 1) // ps].long()
            kb = call.k[pages].reshape(-1, *call.k.shape[2:])[:n]
            vb = call.v[pages].reshape(-1, *call.v.shape[2:])[:n]
        else:
            kb, vb = call.k[b, :n], call.v[b, :n]
        if call.k_new is not None:
            kb = torch.cat([kb, call.k_new[b]], 0)
            vb = torch.cat([vb, call.v_new[b]], 0)
        ks.append(kb)
        vs.append(vb)
    return ks, vs


def attention_ref(call, compute_dtype=torch.float32, dout: Optional[torch.Tensor] = None) -> RefResult:
    """Run the oracle on ``call``; gradients (dq, dk, dv) when ``dout`` is given."""
    spec = call.spec
    if spec.mode == "kvcache":
        ks, vs = gather_kvcache(call)
        outs, lses = [], []
        for b in range(spec.batch):
            o, l = _attend_sequence(call.q[b], ks[b], vs[b], seqlen_q=spec.seqlen_q, seqlen_k=ks[b].shape[0],
                                    spec=spec, key_ranges=None, states=None, compute_dtype=compute_dtype)
            outs.append(o)
            lses.append(l)
        if spec.batch == 0:  # torch.stack refuses an empty list
            return RefResult(call.q.new_zeros(call.q.shape[:3] + (spec.head_dim_v,), dtype=compute_dtype),
                             torch.zeros(0, spec.num_heads_q, spec.seqlen_q, dtype=torch.float32,
                                         device=call.q.device))
        return RefResult(torch.stack(outs), torch.stack(lses).float())
    if dout is None:
        with torch.no_grad():
            o, l = _forward(call, call.q, call.k, call.v, compute_dtype)
        return RefResult(o, l.float() if compute_dtype != torch.float64 else l)
    q = call.q.detach().requires_grad_(True)
    k = call.k.detach().requires_grad_(True)
    v = call.v.detach().requires_grad_(True)
    with torch.enable_grad():
        o, l = _forward(call, q, k, v, compute_dtype)
        if o.requires_grad:
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), dout.to(compute_dtype), allow_unused=True)
        else:  # no query token at all (e.g. an empty varlen batch): nothing depends on q, k, v
            dq = dk = dv = None
    z = lambda g, t: torch.zeros_like(t) if g is None else g
    return RefResult(o.detach(), (l.float() if compute_dtype != torch.float64 else l).detach(),
                     z(dq, q).to(compute_dtype) if dq is not None else torch.zeros_like(q, dtype=compute_dtype),
                     z(dk, k).to(compute_dtype) if dk is not None else torch.zeros_like(k, dtype=compute_dtype),
                     z(dv, v).to(compute_dtype) if dv is not None else torch.zeros_like(v, dtype=compute_dtype))
