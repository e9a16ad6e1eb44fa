"""A second, deliberately separate statement of the semantics, in numpy / fp64 torch.

The oracle (reference/torch_ref.py) and the CSR builders share dualattn.masks.element_visible;
the metamorphic and empty-row properties compare against this file instead, which restates the
rules from DESIGN.md row by row: causal and windows bottom-right aligned, key ranges a union of
half-open intervals, block-sparse states FULL (visible) / MASK (predicate) / ABSENT (invisible).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from dualattn.sparse import FULL, MASK


def seq_bounds(case, b: int) -> Tuple[int, int, int, int]:
    """(query offset, Sq, key offset, Sk) of sequence ``b`` in the call's layout."""
    if case.mode == "varlen":
        oq = sum(case.seqlens_q[:b])
        ok = sum(case.seqlens_k[:b])
        return oq, case.seqlens_q[b], ok, case.seqlens_k[b]
    return 0, case.seqlens_q[b], 0, case.seqlens_k[b]


def element_mask(case, key_ranges: Optional[torch.Tensor], b: int, with_blocks=None) -> np.ndarray:
    """Visibility (Hq or 1, Sq_b, Sk_b) of sequence ``b``; ``with_blocks`` a BlockSparse or None."""
    _, sq, _, sk = seq_bounds(case, b)
    oq = seq_bounds(case, b)[0]
    hq = case.heads_q
    vis = np.ones((hq, sq, sk), dtype=bool)
    for i in range(sq):
        diag = i + sk - sq
        j = np.arange(sk)
        row = np.ones(sk, dtype=bool)
        if case.causal:
            row &= j <= diag
        left, right = case.window
        if left != -1:
            row &= j >= diag - left
        if right != -1:
            row &= j <= diag + right
        vis[:, i] = row
    if key_ranges is not None:
        kr = key_ranges.cpu().numpy()
        for h in range(hq):
            if case.mode == "varlen":
                rows = kr[0, min(h, kr.shape[1] - 1), oq:oq + sq]
            else:
                rows = kr[min(b, kr.shape[0] - 1), min(h, kr.shape[1] - 1)]
            for i in range(sq):
                inside = np.zeros(sk, dtype=bool)
                for lo, hi in rows[i]:
                    inside[lo:hi] = True  # intervals beyond Sk_b simply clip
                vis[h, i] &= inside
    if with_blocks is not None:
        states = with_blocks.block_states().cpu().numpy()
        st = states[min(b, states.shape[0] - 1)]
        bm, bn = with_blocks.block_m, with_blocks.block_n
        for h in range(hq):
            sh = st[min(h, st.shape[0] - 1)]
            blk = sh[np.arange(sq)[:, None] // bm, np.arange(sk)[None, :] // bn] if sq and sk else np.zeros((sq, sk))
            vis[h] = (blk == FULL) | ((blk == MASK) & vis[h])
    return vis


def masks(inp) -> List[np.ndarray]:
    """Per sequence, the (Hq, Sq_b, Sk_b) visibility of the whole call (key ranges and CSR applied)."""
    c = inp.case
    if c.mode == "kvcache":
        return [element_mask(c, None, b) for b in range(c.batch)]
    return [element_mask(c, inp.key_ranges, b, inp.block_sparse) for b in range(c.batch)]


def attention(inp) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """fp64 attention per sequence from the masks above: out (Sq_b, Hq, Dv), lse (Hq, Sq_b)."""
    c = inp.case
    scale = c.scale if c.scale is not None else 1.0 / np.sqrt(c.head_dim)
    g = c.heads_q // c.heads_kv
    outs, lses = [], []
    for b, vis in enumerate(masks(inp)):
        q, k, v = sequence_tensors(inp, b)
        q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if c.softcap > 0:
            s = c.softcap * torch.tanh(s / c.softcap)
        m = torch.from_numpy(np.broadcast_to(vis, s.shape).copy())
        s = s.masked_fill(~m, float("-inf"))
        lse = torch.logsumexp(s, -1) if s.shape[-1] else torch.full(s.shape[:2], float("-inf"), dtype=s.dtype)
        p = torch.where(m, torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]),
                        torch.zeros_like(s))
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        lses.append(lse)
    return outs, lses


def sequence_tensors(inp, b: int):
    """q (Sq_b, Hq, D), k (Sk_b, Hkv, D), v (Sk_b, Hkv, Dv) of sequence ``b`` (kv-cache: cache ++ new)."""
    c = inp.case
    if c.mode == "varlen":
        oq, sq, ok, sk = seq_bounds(c, b)
        return inp.q[oq:oq + sq], inp.k[ok:ok + sk], inp.v[ok:ok + sk]
    if c.mode == "kvcache":
        n = c.cache.cache_seqlens[b]
        if c.cache.paged:
            ps = c.cache.page_size
            pos = torch.arange(n, device=inp.q.device)
            pages = inp.page_table[b][(pos // ps).long()].long()
            kb, vb = inp.k[pages, pos % ps], inp.v[pages, pos % ps]
        else:
            kb, vb = inp.k[b, :n], inp.v[b, :n]
        if inp.k_new is not None:
            kb, vb = torch.cat([kb, inp.k_new[b]]), torch.cat([vb, inp.v_new[b]])
        return inp.q[b], kb, vb
    return inp.q[b], inp.k[b], inp.v[b]


def split_rows(case, t: torch.Tensor, b: int, what: str = "q") -> torch.Tensor:
    """Rows of sequence ``b`` of an output laid out like q (what="q") or k (what="k"); LSE via split_lse."""
    if case.mode == "varlen":
        oq, sq, ok, sk = seq_bounds(case, b)
        return t[oq:oq + sq] if what == "q" else t[ok:ok + sk]
    return t[b]


def split_lse(case, lse: torch.Tensor, b: int) -> torch.Tensor:
    """(Hq, Sq_b) LSE of sequence ``b``."""
    if case.mode == "varlen":
        oq, sq, _, _ = seq_bounds(case, b)
        return lse[:, oq:oq + sq]
    return lse[b]
