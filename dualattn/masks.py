"""The element predicate of a call, in torch: causal AND window AND key ranges.

Shared by the oracle, the CSR builders and the debug reports, so there is one definition of
"query i sees key j" in Python. (Kernels implement the same rule in their own language.)
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def element_visible(rows: torch.Tensor, cols: torch.Tensor, seqlen_q: int, seqlen_k: int, *,
                    causal: bool = False, window: Tuple[int, int] = (-1, -1),
                    key_ranges: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Boolean ``(..., M, N)`` visibility of keys ``cols`` (N,) for queries ``rows`` (M,).

    ``key_ranges``: ``(..., M, R, 2)`` half-open intervals for these rows, or None.
    Causal and windows are bottom-right aligned: the diagonal of row i is key ``i + Sk - Sq``.
    Keys at or beyond ``seqlen_k`` are never visible.
    """
    r = rows.to(torch.int64)[:, None]
    c = cols.to(torch.int64)[None, :]
    diag = r + (seqlen_k - seqlen_q)
    vis = c < seqlen_k
    if causal:
        vis = vis & (c <= diag)
    left, right = window
    if left >= 0:
        vis = vis & (c >= diag - left)
    if right >= 0:
        vis = vis & (c <= diag + right)
    if key_ranges is not None:
        kr = key_ranges.to(torch.int64)
        lo = kr[..., 0].unsqueeze(-1)  # (..., M, R, 1)
        hi = kr[..., 1].unsqueeze(-1)
        inside = (c.unsqueeze(-2) >= lo) & (c.unsqueeze(-2) < hi)  # (..., M, R, N)
        vis = vis & inside.any(dim=-2)
    return vis


def segments_to_key_ranges(segment_lengths, seqlen: int, *, causal: bool = False,
                           device=None) -> torch.Tensor:
    """Key ranges ``(B, 1, S, 1, 2)`` for documents packed into one sequence.

    ``segment_lengths``: per batch, a list of document lengths summing to at most ``seqlen``
    (tokens after the last document see nothing). Each query sees the keys of its own document,
    up to and including itself when ``causal``.
    """
    out = torch.zeros(len(segment_lengths), 1, seqlen, 1, 2, dtype=torch.int32)
    for b, lengths in enumerate(segment_lengths):
        start = 0
        for n in lengths:
            n = int(n)
            if n < 0 or start + n > seqlen:
                raise ValueError(f"segment_lengths: batch {b} segments exceed the sequence length {seqlen}")
            idx = torch.arange(start, start + n)
            out[b, 0, start:start + n, 0, 0] = start
            out[b, 0, start:start + n, 0, 1] = (idx + 1) if causal else start + n
            start += n
    return out.to(device) if device is not None else out
