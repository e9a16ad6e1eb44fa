"""A pure-Python model of the deterministic dQ accumulation protocol of the fast backward kernels.

One CTA per key block kb walks the query blocks it touches (the k->q CSR row of kb, full and mask
entries). At each query block qb it spins until the per-qb semaphore equals its lock value,
accumulates its dQ contribution (recorded here as appending kb to qb's order), then releases by
incrementing the semaphore. The scheduler chooses which enabled CTA moves next; the properties let
Hypothesis play that scheduler adversarially.

The lock values are read from a BlockSparse (``k2q_full_lock`` / ``k2q_mask_lock``, i.e. what the
kernels read), or replaced by the key-block index, the known-bad choice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

Visits = Dict[int, List[Tuple[int, int]]]  # key block -> [(query block, lock value)] in walk order


def visits_from(bs, b: int, h: int, lock: str = "rank") -> Visits:
    """Per key block, its (query block, lock) entries for (batch b, head h) of a BlockSparse.

    Full entries first, then mask entries, as a kernel with two loops walks them; ``lock="index"``
    substitutes the key-block index for the lock value."""
    out: Visits = {}
    for csr, locks in ((bs.k2q_full, bs.k2q_full_lock), (bs.k2q_mask, bs.k2q_mask_lock)):
        bb, hh = min(b, csr.rowptr.shape[0] - 1), min(h, csr.rowptr.shape[1] - 1)
        rp = csr.rowptr[bb, hh].tolist()
        col = csr.col[bb, hh].tolist()
        lk = locks[bb, hh].tolist()
        for kb in range(len(rp) - 1):
            for e in range(rp[kb], rp[kb + 1]):
                out.setdefault(kb, []).append((col[e], kb if lock == "index" else lk[e]))
    return out


def visitors(v: Visits) -> Dict[int, List[int]]:
    """Query block -> sorted key blocks that visit it."""
    res: Dict[int, List[int]] = {}
    for kb, entries in v.items():
        for qb, _ in entries:
            res.setdefault(qb, []).append(kb)
    return {qb: sorted(x) for qb, x in res.items()}


@dataclass
class Outcome:
    completed: bool
    order: Dict[int, List[int]] = field(default_factory=dict)  # qb -> key blocks in accumulation order
    counters: Dict[int, int] = field(default_factory=dict)
    stuck: Dict[int, Tuple[int, int, int]] = field(default_factory=dict)  # kb -> (qb, lock, counter)
    overlap: List[Tuple[int, int, int]] = field(default_factory=list)    # (qb, kb, kb2) accumulating at once
    steps: int = 0


def simulate(v: Visits, choose: Callable[[int], int]) -> Outcome:
    """Run the protocol; ``choose(n)`` picks which of the n enabled moves happens next.

    A move is either "acquire" (semaphore == lock: start accumulating) or "release" (finish
    accumulating, increment). Returns when every CTA is done, or when none can move (deadlock).
    """
    pos = {kb: 0 for kb in v}
    holding = {kb: False for kb in v}
    counter: Dict[int, int] = {}
    order: Dict[int, List[int]] = {}
    busy: Dict[int, int] = {}  # qb -> kb accumulating into it
    out = Outcome(False)
    while True:
        moves = []
        for kb in sorted(v):
            if pos[kb] >= len(v[kb]):
                continue
            qb, lock = v[kb][pos[kb]]
            if holding[kb] or counter.get(qb, 0) == lock:
                moves.append(kb)
        if not moves:
            break
        kb = moves[choose(len(moves))]
        qb, lock = v[kb][pos[kb]]
        if not holding[kb]:
            if qb in busy:
                out.overlap.append((qb, busy[qb], kb))
            busy[qb] = kb
            holding[kb] = True
            order.setdefault(qb, []).append(kb)
        else:
            busy.pop(qb, None)
            holding[kb] = False
            counter[qb] = counter.get(qb, 0) + 1
            pos[kb] += 1
        out.steps += 1
    out.completed = all(pos[kb] >= len(v[kb]) for kb in v)
    out.order, out.counters = order, counter
    out.stuck = {kb: (v[kb][pos[kb]][0], v[kb][pos[kb]][1], counter.get(v[kb][pos[kb]][0], 0))
                 for kb in v if pos[kb] < len(v[kb])}
    return out


def index_lock_deadlocks(v: Visits) -> bool:
    """The precise condition under which lock = key-block index deadlocks: some query block's set
    of visiting key blocks V is not {0, 1, ..., |V| - 1}. (The semaphore of qb counts up from 0 one
    visitor at a time, so it only ever reaches the length of the prefix 0, 1, 2, ... present in V;
    the first visitor missing from that prefix waits forever. "The first visitor is not key block
    0" is the common case; {0, 2} deadlocks too.) Otherwise index == rank and nothing blocks."""
    return any(vs != list(range(len(vs))) for vs in visitors(v).values())
