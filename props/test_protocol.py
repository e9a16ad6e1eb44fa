"""Property 6 (the deterministic dQ semaphore protocol, as a pure-Python model) and the CSR
structure it relies on: k->q is the transpose of q->k, and the lock values are ranks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

from dualattn.sparse import ABSENT, FULL, MASK, BlockSparse
from props import profiles, protocol
from props import strategies as S

pytestmark = pytest.mark.device_free  # the model and the CSR builders run on CPU in every profile


@st.composite
def patterns(draw):
    """A BlockSparse drawn block by block (broadcast or per batch/head)."""
    lim = profiles.current()
    bm, bn = draw(st.sampled_from([(16, 16), (64, 128), (128, 128)]))
    nq, nk = draw(st.integers(1, lim.max_blocks)), draw(st.integers(1, lim.max_blocks))
    sq = (nq - 1) * bm + draw(st.integers(1, bm))  # lengths off the block edge
    sk = (nk - 1) * bn + draw(st.integers(1, bn))
    bp, hp = draw(st.sampled_from([(1, 1), (2, 1), (1, 3)]))
    states = draw(S.block_states(bp, hp, nq, nk))
    t = torch.tensor(states, dtype=torch.int8).reshape(bp, hp, nq, nk)
    note(f"block states (b, h, query block, key block; 0 absent 1 mask 2 full):\n{t.tolist()}")
    return BlockSparse.from_block_states(t, bm, bn, sq, sk)


@st.composite
def walk_orders(draw, v: protocol.Visits):
    """How each CTA walks its query blocks: as listed (full, then mask), sorted, reversed, or any
    permutation. The rank protocol must not depend on it."""
    how = draw(st.sampled_from(["listed", "sorted", "reversed", "shuffled"]))
    out = {}
    for kb, entries in v.items():
        if how == "sorted":
            entries = sorted(entries)
        elif how == "reversed":
            entries = sorted(entries, reverse=True)
        elif how == "shuffled":
            entries = draw(st.permutations(entries))
        out[kb] = list(entries)
    return out


def adversary(data):
    return lambda n: data.draw(st.integers(0, n - 1)) if n > 1 else 0


@profiles.examples(6.0)
@given(bs=patterns(), data=st.data())
def test_rank_locks_complete_in_one_fixed_order(bs, data):
    bp, hp = bs.broadcast_shape
    for b in range(bp):
        for h in range(hp):
            v = data.draw(walk_orders(protocol.visits_from(bs, b, h, "rank")))
            res = protocol.simulate(v, adversary(data))
            assert res.completed, f"(b={b}, h={h}) deadlock with rank locks: stuck (qb, lock, counter) {res.stuck}"
            assert not res.overlap, f"(b={b}, h={h}) two key blocks accumulated into one query block at once: {res.overlap}"
            want = protocol.visitors(v)
            assert res.order == want, (f"(b={b}, h={h}) accumulation order {res.order} is not the fixed order "
                                       f"(ascending key block) {want}")


@profiles.examples(6.0)
@given(bs=patterns(), data=st.data())
def test_index_locks_deadlock_exactly_when_visitors_are_not_a_prefix(bs, data):
    bp, hp = bs.broadcast_shape
    for b in range(bp):
        for h in range(hp):
            v = data.draw(walk_orders(protocol.visits_from(bs, b, h, "index")))
            res = protocol.simulate(v, adversary(data))
            expect_deadlock = protocol.index_lock_deadlocks(v)
            event(f"index locks: {'deadlock' if expect_deadlock else 'completes'}")
            assert res.completed == (not expect_deadlock), (
                f"(b={b}, h={h}) lock = key-block index: completed={res.completed}, but the visitor sets "
                f"{protocol.visitors(v)} predict {'a deadlock' if expect_deadlock else 'completion'}")
            if res.completed:
                assert res.order == protocol.visitors(v)


def test_index_locks_deadlock_examples():
    """The two shapes of the deadlock, by hand: first visitor not block 0, and a gap after 0."""
    for row in ([ABSENT, MASK, FULL], [FULL, ABSENT, MASK]):
        bs = BlockSparse.from_block_states(torch.tensor([[[row]]], dtype=torch.int8), 16, 16, 16, 48)
        v = protocol.visits_from(bs, 0, 0, "index")
        assert protocol.index_lock_deadlocks(v)
        assert not protocol.simulate(v, lambda n: 0).completed
        assert protocol.simulate(protocol.visits_from(bs, 0, 0, "rank"), lambda n: 0).completed


@profiles.examples(4.0)
@given(bs=patterns())
def test_k2q_is_transpose_and_locks_are_ranks(bs):
    bp, hp = bs.broadcast_shape
    for b in range(bp):
        for h in range(hp):
            q2k = {}
            for kind, csr in (("full", bs.q2k_full), ("mask", bs.q2k_mask)):
                for qb in range(bs.n_qblocks):
                    for kb in csr.row(b, h, qb):
                        q2k[(qb, kb)] = kind
            k2q = {}
            for kind, csr in (("full", bs.k2q_full), ("mask", bs.k2q_mask)):
                for kb in range(bs.n_kblocks):
                    row = csr.row(b, h, kb)
                    assert row == sorted(set(row)), f"k2q {kind} row {kb} not sorted/unique: {row}"
                    for qb in row:
                        k2q[(qb, kb)] = kind
            assert k2q == q2k, "k2q is not the transpose of q2k (full and mask kept apart)"
            # the lock of entry (kb, qb) is the number of key blocks < kb that visit qb
            for csr, locks in ((bs.k2q_full, bs.k2q_full_lock), (bs.k2q_mask, bs.k2q_mask_lock)):
                bb, hh = min(b, csr.rowptr.shape[0] - 1), min(h, csr.rowptr.shape[1] - 1)
                rp = csr.rowptr[bb, hh].tolist()
                for kb in range(bs.n_kblocks):
                    for e in range(rp[kb], rp[kb + 1]):
                        qb = int(csr.col[bb, hh, e])
                        rank = sum(1 for (q, k) in q2k if q == qb and k < kb)
                        got = int(locks[bb, hh, e])
                        assert got == rank, f"lock of (key block {kb}, query block {qb}) is {got}, its rank is {rank}"


@profiles.examples(2.0)
@given(case=st.one_of(S.batched_cases(key_ranges=True, blocks=True, block_kinds=("exact",)),
                      S.batched_cases(blocks=True, block_kinds=("exact",))))
def test_exact_csr_matches_the_element_predicate(case):
    """from_key_ranges: a block is FULL iff every element in the sequence is visible, ABSENT iff none."""
    from props import independent
    inp = S.materialize(case, "cpu")
    bs = inp.block_sparse
    states = bs.block_states()
    for b in range(case.batch):
        vis = independent.element_mask(case, inp.key_ranges, b)
        for h in range(case.heads_q):
            st_ = states[min(b, states.shape[0] - 1), min(h, states.shape[1] - 1)]
            for qb in range(bs.n_qblocks):
                for kb in range(bs.n_kblocks):
                    blk = vis[h, qb * bs.block_m:(qb + 1) * bs.block_m, kb * bs.block_n:(kb + 1) * bs.block_n]
                    want = FULL if blk.all() else (ABSENT if not blk.any() else MASK)
                    assert int(st_[qb, kb]) == want, (f"batch {b} head {h} block ({qb}, {kb}): state "
                                                      f"{int(st_[qb, kb])}, element predicate says {want}")
