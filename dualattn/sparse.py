"""Block sparsity: CSR per (batch, head), split into full and mask blocks.

Layout of one CSR (``BlockCSR``): ``rowptr`` int32 ``(B', H', rows + 1)`` and ``col`` int32
``(B', H', nnz_max)``, where B' is the batch or 1 and H' the number of query heads or 1 (a size-1
dimension broadcasts). Row r of (b, h) lists ``col[b, h, rowptr[b, h, r]:rowptr[b, h, r + 1]]``
in strictly increasing order; entries past ``rowptr[b, h, -1]`` are padding.

``BlockSparse`` holds four of them:

* ``q2k_full`` / ``q2k_mask``: for each query block, the key blocks to visit (forward, dQ);
* ``k2q_full`` / ``k2q_mask``: the transpose, for each key block the query blocks (dK/dV);

and the deterministic lock values ``k2q_full_lock`` / ``k2q_mask_lock`` aligned with the k2q
``col`` arrays: for entry (key block kb, query block qb) the rank of kb among all key blocks (full
and mask) that visit qb. A dQ accumulation ordered by a per-query-block counter waits for that
rank, never for kb itself (which deadlocks as soon as a pattern skips a key block).

Semantics: element (i, j) is visible iff its block is listed as full, or listed as mask and the
element predicate (causal AND window AND key ranges) holds; unlisted blocks are invisible.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .masks import element_visible, segments_to_key_ranges

ABSENT, MASK, FULL = 0, 1, 2


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_block_size(block_m: int, block_n: int) -> None:
    if int(block_m) <= 0 or int(block_n) <= 0:
        raise ValueError(f"block_sparse: block size must be positive, got ({block_m}, {block_n})")


@dataclass
class BlockCSR:
    rowptr: torch.Tensor  # (B', H', rows + 1) int32
    col: torch.Tensor     # (B', H', nnz_max) int32

    @property
    def rows(self) -> int:
        return self.rowptr.shape[-1] - 1

    def to(self, device) -> "BlockCSR":
        return BlockCSR(self.rowptr.to(device), self.col.to(device))

    def row(self, b: int, h: int, r: int) -> List[int]:
        bb, hh = min(b, self.rowptr.shape[0] - 1), min(h, self.rowptr.shape[1] - 1)
        s, e = int(self.rowptr[bb, hh, r]), int(self.rowptr[bb, hh, r + 1])
        return [int(x) for x in self.col[bb, hh, s:e]]


def _dense_to_csr(is_set: torch.Tensor, nnz_max: Optional[int] = None) -> BlockCSR:
    """(B', H', R, C) bool -> CSR over rows R with column indices in increasing order.

    ``nnz_max`` (the padded length of ``col``) is read from the data unless given; giving it
    avoids a host synchronisation (the transpose of a CSR has the same number of entries)."""
    Bp, Hp, R, C = is_set.shape
    counts = is_set.sum(-1, dtype=torch.int32)
    rowptr = torch.zeros(Bp, Hp, R + 1, dtype=torch.int32, device=is_set.device)
    rowptr[..., 1:] = torch.cumsum(counts, -1, dtype=torch.int32)
    if nnz_max is None:
        nnz_max = max(int(rowptr[..., -1].max()) if rowptr.numel() else 0, 1)
    nnz_max = min(max(nnz_max, 1), max(R * C, 1))
    # stable sort puts the set entries first, in column order, row after row
    flat = is_set.reshape(Bp, Hp, R * C)
    order = torch.sort((~flat).to(torch.int8), dim=-1, stable=True).indices[..., :nnz_max]
    col = (order % C).to(torch.int32)
    pos = torch.arange(nnz_max, device=is_set.device)
    col = torch.where(pos < rowptr[..., -1:], col, torch.zeros_like(col))
    return BlockCSR(rowptr, col.contiguous())


def _csr_to_dense(csr: BlockCSR, cols: int) -> torch.Tensor:
    Bp, Hp, R1 = csr.rowptr.shape
    R = R1 - 1
    nnz = csr.col.shape[-1]
    pos = torch.arange(nnz, device=csr.col.device).expand(Bp, Hp, nnz)
    row = torch.searchsorted(csr.rowptr[..., 1:].contiguous().to(torch.int64), pos.contiguous(), right=True)
    valid = pos < csr.rowptr[..., -1:].to(torch.int64)
    out = torch.zeros(Bp, Hp, R * cols + 1, dtype=torch.bool, device=csr.col.device)
    flat_idx = torch.where(valid, row * cols + csr.col.to(torch.int64), torch.full_like(row, R * cols))
    out.scatter_(-1, flat_idx, torch.ones_like(flat_idx, dtype=torch.bool))
    return out[..., :R * cols].reshape(Bp, Hp, R, cols)


def _row_of_entry(csr: BlockCSR) -> Tuple[torch.Tensor, torch.Tensor]:
    nnz = csr.col.shape[-1]
    Bp, Hp, _ = csr.rowptr.shape
    pos = torch.arange(nnz, device=csr.col.device).expand(Bp, Hp, nnz).contiguous()
    row = torch.searchsorted(csr.rowptr[..., 1:].contiguous().to(torch.int64), pos, right=True)
    valid = pos < csr.rowptr[..., -1:].to(torch.int64)
    return row, valid


def compute_lock_values(q2k_full: BlockCSR, q2k_mask: BlockCSR, k2q_full: BlockCSR, k2q_mask: BlockCSR,
                        n_qblocks: int, n_kblocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank of each k2q entry's key block among the key blocks visiting its query block.

    On the device, no host synchronisation, O(nnz log nnz): every visit (b, h, qb, kb) becomes one
    int64 key; the sorted keys of the q->k lists give, by binary search, the position of a visit
    and the start of its query block's row, whose difference is the rank.
    """
    Bp, Hp, _ = q2k_full.rowptr.shape
    dev = q2k_full.col.device
    big = torch.iinfo(torch.int64).max
    bh = torch.arange(Bp * Hp, device=dev, dtype=torch.int64).reshape(Bp, Hp, 1)

    def visit_keys(csr: BlockCSR, transposed: bool) -> torch.Tensor:
        row, valid = _row_of_entry(csr)
        colv = csr.col.to(torch.int64)
        qb, kb = (colv, row) if transposed else (row, colv)
        key = (bh * n_qblocks + qb) * n_kblocks + kb
        return torch.where(valid, key, torch.full_like(key, big)), qb

    kf, _ = visit_keys(q2k_full, False)
    km, _ = visit_keys(q2k_mask, False)
    sorted_keys = torch.sort(torch.cat([kf.flatten(), km.flatten()])).values

    def ranks(csr: BlockCSR) -> torch.Tensor:
        key, qb = visit_keys(csr, True)
        row_start = (bh * n_qblocks + qb) * n_kblocks
        r = torch.searchsorted(sorted_keys, key.flatten()) - torch.searchsorted(sorted_keys, row_start.flatten())
        r = r.reshape(key.shape)
        return torch.where(key != big, r, torch.zeros_like(r)).to(torch.int32)

    return ranks(k2q_full), ranks(k2q_mask)


class BlockSparse:
    """Block-sparse attention pattern; see the module docstring for the layout and semantics."""

    def __init__(self, q2k_full: BlockCSR, q2k_mask: BlockCSR, block_m: int, block_n: int,
                 seqlen_q: int, seqlen_k: int):
        _check_block_size(block_m, block_n)
        self.block_m, self.block_n = int(block_m), int(block_n)
        self.seqlen_q, self.seqlen_k = int(seqlen_q), int(seqlen_k)
        self.q2k_full, self.q2k_mask = q2k_full, q2k_mask
        self._k2q = None
        self._k2q_versions = None

    # ---- derived structures (built lazily, on the CSR's device) ----
    @property
    def n_qblocks(self) -> int:
        return _cdiv(self.seqlen_q, self.block_m)

    @property
    def n_kblocks(self) -> int:
        return _cdiv(self.seqlen_k, self.block_n)

    @property
    def device(self):
        return self.q2k_full.rowptr.device

    @property
    def broadcast_shape(self) -> Tuple[int, int]:
        return tuple(self.q2k_full.rowptr.shape[:2])

    def _q2k_versions(self):
        from .spec import version_counters
        versions = version_counters((self.q2k_full.rowptr, self.q2k_full.col,
                                     self.q2k_mask.rowptr, self.q2k_mask.col))
        return versions if versions is not None else object()  # inference tensors: always rebuilt

    def _transpose(self):
        # rebuilt when the q->k tensors were changed in place since (their version counters
        # moved): every call validates the q->k lists as they are now, and the backward's k->q
        # lists and lock values must describe the same pattern. (A CUDA graph replays the k->q
        # tensors it captured: after an in-place update, capture again.)
        versions = self._q2k_versions()
        if self._k2q is not None and versions != self._k2q_versions:
            self._k2q = None
        if self._k2q is None:
            self._k2q_versions = versions
            full = _csr_to_dense(self.q2k_full, self.n_kblocks).transpose(-1, -2)
            mask = _csr_to_dense(self.q2k_mask, self.n_kblocks).transpose(-1, -2)
            # same entry counts as the q->k lists: no need to read them back from the device
            k2q_full = _dense_to_csr(full, self.q2k_full.col.shape[-1])
            k2q_mask = _dense_to_csr(mask, self.q2k_mask.col.shape[-1])
            locks = compute_lock_values(self.q2k_full, self.q2k_mask, k2q_full, k2q_mask,
                                        self.n_qblocks, self.n_kblocks)
            self._k2q = (k2q_full, k2q_mask, locks[0], locks[1])
        return self._k2q

    @property
    def k2q_full(self) -> BlockCSR:
        return self._transpose()[0]

    @property
    def k2q_mask(self) -> BlockCSR:
        return self._transpose()[1]

    @property
    def k2q_full_lock(self) -> torch.Tensor:
        return self._transpose()[2]

    @property
    def k2q_mask_lock(self) -> torch.Tensor:
        return self._transpose()[3]

    def block_states(self) -> torch.Tensor:
        """Dense ``(B', H', n_qblocks, n_kblocks)`` int8: 0 absent, 1 mask, 2 full."""
        f = _csr_to_dense(self.q2k_full, self.n_kblocks)
        m = _csr_to_dense(self.q2k_mask, self.n_kblocks)
        return (f.to(torch.int8) * FULL) + (m & ~f).to(torch.int8) * MASK

    def to(self, device) -> "BlockSparse":
        return BlockSparse(self.q2k_full.to(device), self.q2k_mask.to(device), self.block_m, self.block_n,
                           self.seqlen_q, self.seqlen_k)

    def __repr__(self) -> str:
        return (f"BlockSparse(block=({self.block_m}, {self.block_n}), seqlen=({self.seqlen_q}, {self.seqlen_k}), "
                f"broadcast={self.broadcast_shape}, nnz_full<={self.q2k_full.col.shape[-1]}, "
                f"nnz_mask<={self.q2k_mask.col.shape[-1]})")

    # ---- builders ----
    @classmethod
    def from_block_states(cls, states: torch.Tensor, block_m: int, block_n: int, seqlen_q: int,
                          seqlen_k: int) -> "BlockSparse":
        """From a dense ``(B', H', n_qblocks, n_kblocks)`` tensor of ABSENT / MASK / FULL."""
        if states.dim() != 4:
            raise ValueError(f"states: expected (B', H', n_qblocks, n_kblocks), got {tuple(states.shape)}")
        _check_block_size(block_m, block_n)
        want = (_cdiv(seqlen_q, block_m), _cdiv(seqlen_k, block_n))
        if tuple(states.shape[2:]) != want:
            raise ValueError(f"states: last dims {tuple(states.shape[2:])} must be (ceil(Sq/block_m), ceil(Sk/block_n)) = {want}")
        return cls(_dense_to_csr(states == FULL), _dense_to_csr(states == MASK), block_m, block_n, seqlen_q, seqlen_k)

    @classmethod
    def from_csr(cls, full_rowptr, full_col, mask_rowptr, mask_col, block_m: int, block_n: int,
                 seqlen_q: int, seqlen_k: int, validate: bool = True) -> "BlockSparse":
        """From user-given q->k CSR arrays (shapes as in the module docstring; 1-D/2-D broadcast)."""
        def norm(name, t):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor")
            if t.dtype != torch.int32:
                raise TypeError(f"{name}: must be int32, got {t.dtype}")
            while t.dim() < 3:
                t = t.unsqueeze(0)
            if t.dim() != 3:
                raise ValueError(f"{name}: expected at most 3 dims (B', H', n), got {tuple(t.shape)}")
            return t
        bs = cls(BlockCSR(norm("full_rowptr", full_rowptr), norm("full_col", full_col)),
                 BlockCSR(norm("mask_rowptr", mask_rowptr), norm("mask_col", mask_col)),
                 block_m, block_n, seqlen_q, seqlen_k)
        if validate:
            bs.validate()
        return bs

    @classmethod
    def from_dense_mask(cls, mask: torch.Tensor, block_m: int, block_n: int) -> "BlockSparse":
        """From a boolean ``(B', H', Sq, Sk)`` element mask: full where all in-range elements are
        set, mask where some are, absent where none are. The result reproduces the mask exactly
        only together with an element predicate equal to it; see ``from_key_ranges``."""
        if mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError(f"mask: expected a 4-D bool tensor (B', H', Sq, Sk), got {mask.dtype} {tuple(mask.shape)}")
        Bp, Hp, Sq, Sk = mask.shape
        _check_block_size(block_m, block_n)
        nq, nk = _cdiv(Sq, block_m), _cdiv(Sk, block_n)
        pad = torch.zeros(Bp, Hp, nq * block_m, nk * block_n, dtype=torch.int8, device=mask.device)
        inr = torch.zeros_like(pad)
        pad[..., :Sq, :Sk] = mask.to(torch.int8)
        inr[..., :Sq, :Sk] = 1
        cnt = pad.reshape(Bp, Hp, nq, block_m, nk, block_n).sum((3, 5), dtype=torch.int32)
        tot = inr.reshape(Bp, Hp, nq, block_m, nk, block_n).sum((3, 5), dtype=torch.int32)
        states = torch.where(cnt == 0, ABSENT, torch.where(cnt == tot, FULL, MASK)).to(torch.int8)
        return cls.from_block_states(states, block_m, block_n, Sq, Sk)

    @classmethod
    def from_key_ranges(cls, key_ranges: Optional[torch.Tensor], seqlen_q: int, seqlen_k: int, block_m: int,
                        block_n: int, *, causal: bool = False, window=(-1, -1),
                        rows_per_chunk: int = 1024) -> "BlockSparse":
        """Exact CSR of the predicate causal AND window AND key ranges (key_ranges may be None).

        A block is full iff every element of it (inside the sequence) is visible and absent iff
        none is, so attention with or without this CSR gives the same result.
        """
        _check_block_size(block_m, block_n)
        if key_ranges is None:
            dev = torch.device("cpu")
            Bp = Hp = 1
        else:
            dev = key_ranges.device
            Bp, Hp = key_ranges.shape[:2]
        nq, nk = _cdiv(seqlen_q, block_m), _cdiv(seqlen_k, block_n)
        cols = torch.arange(seqlen_k, device=dev)
        cnt = torch.zeros(Bp, Hp, nq, nk, dtype=torch.int32, device=dev)
        step = max(block_m, (rows_per_chunk // block_m) * block_m)
        for r0 in range(0, seqlen_q, step):
            r1 = min(seqlen_q, r0 + step)
            rows = torch.arange(r0, r1, device=dev)
            kr = key_ranges[:, :, r0:r1] if key_ranges is not None else None
            vis = element_visible(rows, cols, seqlen_q, seqlen_k, causal=causal, window=window, key_ranges=kr)
            vis = vis.expand(Bp, Hp, r1 - r0, seqlen_k).to(torch.int32)
            padded = torch.zeros(Bp, Hp, _cdiv(r1 - r0, block_m) * block_m, nk * block_n, dtype=torch.int32, device=dev)
            padded[..., : r1 - r0, :seqlen_k] = vis
            c = padded.reshape(Bp, Hp, -1, block_m, nk, block_n).sum((3, 5))
            cnt[:, :, r0 // block_m: r0 // block_m + c.shape[2]] += c
        # elements per block that lie inside the sequence
        rq = torch.clamp(seqlen_q - torch.arange(nq, device=dev) * block_m, max=block_m)
        rk = torch.clamp(seqlen_k - torch.arange(nk, device=dev) * block_n, max=block_n)
        tot = (rq[:, None] * rk[None, :]).to(torch.int32)
        states = torch.where(cnt == 0, ABSENT, torch.where(cnt == tot, FULL, MASK)).to(torch.int8)
        return cls.from_block_states(states, block_m, block_n, seqlen_q, seqlen_k)

    @classmethod
    def from_segments(cls, segment_lengths: Sequence[Sequence[int]], seqlen: int, block_m: int, block_n: int, *,
                      causal: bool = False, device=None) -> "BlockSparse":
        """Documents packed in one sequence (per batch, a list of lengths): block-diagonal,
        optionally causal inside each document. Use with ``key_ranges=segments_to_key_ranges(...)``."""
        kr = segments_to_key_ranges(segment_lengths, seqlen, causal=causal, device=device)
        return cls.from_key_ranges(kr, seqlen, seqlen, block_m, block_n)

    # ---- validation ----
    def validate(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Raise ValueError naming the array and the rule when the CSR is malformed; return the
        full and mask row pointers as read to the host (int64), for callers that keep them."""
        _check_block_size(self.block_m, self.block_n)
        nq, nk = self.n_qblocks, self.n_kblocks
        f, m = self.q2k_full, self.q2k_mask
        host_rowptrs = []
        if f.rowptr.shape[:2] != m.rowptr.shape[:2] or f.col.shape[:2] != f.rowptr.shape[:2] \
                or m.col.shape[:2] != m.rowptr.shape[:2]:
            raise ValueError("block_sparse: full and mask CSR arrays must share their (B', H') dims")
        for name, csr in (("full", f), ("mask", m)):
            rp, col = csr.rowptr.cpu().to(torch.int64), csr.col.cpu().to(torch.int64)
            host_rowptrs.append(rp)
            if rp.shape[-1] != nq + 1:
                raise ValueError(f"block_sparse {name}_rowptr: length {rp.shape[-1]} must be n_qblocks + 1 = {nq + 1}")
            if bool((rp[..., 0] != 0).any()):
                raise ValueError(f"block_sparse {name}_rowptr: must start at 0")
            if bool((rp[..., 1:] < rp[..., :-1]).any()):
                raise ValueError(f"block_sparse {name}_rowptr: counts inconsistent (row pointers decrease)")
            if bool((rp[..., -1] > col.shape[-1]).any()):
                raise ValueError(f"block_sparse {name}_rowptr: last entry exceeds the number of column entries {col.shape[-1]}")
            row, valid = _row_of_entry(BlockCSR(rp.to(torch.int32), col.to(torch.int32)))
            if bool(((col < 0) | (col >= nk))[valid].any()):
                raise ValueError(f"block_sparse {name}_col: key block index out of range [0, {nk})")
            same_row = (row[..., 1:] == row[..., :-1]) & valid[..., 1:]
            if bool((same_row & (col[..., 1:] <= col[..., :-1])).any()):
                raise ValueError(f"block_sparse {name}_col: indices in a row must be sorted and without duplicates")
        both = _csr_to_dense(BlockCSR(f.rowptr.cpu(), f.col.cpu()), nk) & _csr_to_dense(BlockCSR(m.rowptr.cpu(), m.col.cpu()), nk)
        if bool(both.any()):
            raise ValueError("block_sparse: a block is listed both as full and as mask")
        return host_rowptrs[0], host_rowptrs[1]

    def check_compatible(self, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, validate_values: bool = True,
                         exact_lengths: bool = False):
        """Raise ValueError unless this pattern fits a call. ``exact_lengths`` (batched calls): the
        pattern must have been built for exactly these lengths, since which blocks are full under
        bottom-right causal or windows depends on them; varlen calls need only the block counts
        of max_seqlen (their sequences are shorter and indexed locally)."""
        for name, t in (("full_rowptr", self.q2k_full.rowptr), ("full_col", self.q2k_full.col),
                        ("mask_rowptr", self.q2k_mask.rowptr), ("mask_col", self.q2k_mask.col)):
            if t.device != self.device:
                raise ValueError(f"block_sparse {name}: on device {t.device}, but full_rowptr is on {self.device}")
        Bp, Hp = self.broadcast_shape
        if Bp not in (1, batch):
            raise ValueError(f"block_sparse: batch dim {Bp} must be 1 or the batch {batch}")
        if Hp not in (1, heads_q):
            raise ValueError(f"block_sparse: head dim {Hp} must be 1 or the number of query heads {heads_q}")
        if (exact_lengths and (seqlen_q, seqlen_k) != (self.seqlen_q, self.seqlen_k)) or \
                _cdiv(seqlen_q, self.block_m) != self.n_qblocks or _cdiv(seqlen_k, self.block_n) != self.n_kblocks:
            raise ValueError(f"block_sparse: built for seqlen ({self.seqlen_q}, {self.seqlen_k}) with blocks "
                             f"({self.block_m}, {self.block_n}); the call has ({seqlen_q}, {seqlen_k})")
        if validate_values:
            # the value checks synchronise (about 1.3 ms per call on the H100 host for an 8k
            # pattern): a pattern reused across calls is read back once, and after any change
            from .spec import VALUE_CHECK_MEMO
            what = ("block_sparse", self.n_qblocks, self.n_kblocks)
            tensors = (self.q2k_full.rowptr, self.q2k_full.col, self.q2k_mask.rowptr, self.q2k_mask.col)
            if not VALUE_CHECK_MEMO.passed(what, *tensors):
                host_rowptrs = self.validate()
                VALUE_CHECK_MEMO.remember(what, *tensors)
                # the row pointers' host copies, for launches that plan by them
                # (fast-sm90's block-sparse unit table): read by the checks, kept by the same rule
                for rowptr, host in zip((self.q2k_full.rowptr, self.q2k_mask.rowptr), host_rowptrs):
                    VALUE_CHECK_MEMO.remember_values(rowptr, tuple(host.flatten().tolist()))
