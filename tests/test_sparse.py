"""BlockSparse builders, transposition and lock values on hand-checked patterns."""
import pytest
import torch

import dualattn
from dualattn.sparse import ABSENT, FULL, MASK, BlockSparse, compute_lock_values
from dualattn.masks import element_visible, segments_to_key_ranges

A, M, F = ABSENT, MASK, FULL


def states(bs):
    return bs.block_states()[0, 0].tolist()


def test_causal_square():
    bs = BlockSparse.from_key_ranges(None, 8, 8, 4, 4, causal=True)
    assert states(bs) == [[M, A], [F, M]]


def test_causal_bottom_right_sq_lt_sk():
    # Sq=4, Sk=8: query i sees keys j <= i + 4 -> key block 0 is full for every row, block 1 is mask
    bs = BlockSparse.from_key_ranges(None, 4, 8, 4, 4, causal=True)
    assert states(bs) == [[F, M]]


def test_tails_count_only_in_range_elements():
    # Sq=Sk=6, block 4: second key block holds keys 4,5 only; without a mask everything is full
    bs = BlockSparse.from_key_ranges(None, 6, 6, 4, 4)
    assert states(bs) == [[F, F], [F, F]]


def test_sliding_window():
    # window (4, 0) on 12x12 with blocks of 4: row block r sees key blocks r-1 (mask) and r (mask)
    bs = BlockSparse.from_key_ranges(None, 12, 12, 4, 4, window=(4, 0))
    assert states(bs) == [[M, A, A], [M, M, A], [A, M, M]]


def test_documents_off_tile_edges():
    # documents of length 5 and 7 in a 12-token sequence, blocks of 4, no causal:
    # rows 0-3 (doc 0) see keys 0-4: block 0 full, block 1 mask (key 4 only)
    # rows 4-7 (row 4 doc 0, rows 5-7 doc 1): all mask where touched
    # rows 8-11 (doc 1: keys 5-11): block 1 mask (5-7), block 2 full
    kr = segments_to_key_ranges([[5, 7]], 12)
    bs = BlockSparse.from_key_ranges(kr, 12, 12, 4, 4)
    assert states(bs) == [[F, M, A], [M, M, M], [A, M, F]]


def test_rows_and_columns_without_blocks():
    # queries 0..3 see nothing; key block 2 is seen by nobody
    kr = torch.zeros(1, 1, 8, 1, 2, dtype=torch.int32)
    kr[0, 0, 4:, 0, 1] = 4
    bs = BlockSparse.from_key_ranges(kr, 8, 12, 4, 4)
    assert states(bs) == [[A, A, A], [F, A, A]]
    assert bs.q2k_full.row(0, 0, 0) == [] and bs.q2k_mask.row(0, 0, 0) == []
    assert bs.k2q_full.row(0, 0, 2) == [] and bs.k2q_mask.row(0, 0, 2) == []
    assert bs.k2q_full.row(0, 0, 0) == [1]


def test_from_dense_mask_matches_key_ranges():
    g = torch.Generator().manual_seed(0)
    lo = torch.randint(0, 30, (2, 3, 37, 2, 1), generator=g)
    kr = torch.cat([lo, torch.clamp(lo + torch.randint(0, 15, lo.shape, generator=g), max=41)], -1).to(torch.int32)
    vis = element_visible(torch.arange(37), torch.arange(41), 37, 41, causal=True, key_ranges=kr)
    a = BlockSparse.from_key_ranges(kr, 37, 41, 8, 16, causal=True)
    b = BlockSparse.from_dense_mask(vis, 8, 16)
    assert torch.equal(a.block_states(), b.block_states())


def test_transpose_roundtrip():
    g = torch.Generator().manual_seed(1)
    st = torch.randint(0, 3, (2, 3, 5, 7), generator=g).to(torch.int8)
    bs = BlockSparse.from_block_states(st, 16, 16, 80, 112)
    assert torch.equal(bs.block_states(), st)
    for b in range(2):
        for h in range(3):
            for kb in range(7):
                assert bs.k2q_full.row(b, h, kb) == [qb for qb in range(5) if st[b, h, qb, kb] == FULL]
                assert bs.k2q_mask.row(b, h, kb) == [qb for qb in range(5) if st[b, h, qb, kb] == MASK]


def test_lock_values_are_ranks():
    g = torch.Generator().manual_seed(2)
    st = torch.randint(0, 3, (2, 2, 6, 9), generator=g).to(torch.int8)
    st[0, 0, 3] = ABSENT  # a query block with no visitors
    st[1, 1, :, 0] = ABSENT  # no query block visited by key block 0
    bs = BlockSparse.from_block_states(st, 8, 8, 48, 72)
    for b in range(2):
        for h in range(2):
            for kb in range(9):
                for kind in ("full", "mask"):
                    csr = getattr(bs, f"k2q_{kind}")
                    lock = getattr(bs, f"k2q_{kind}_lock")
                    s = int(csr.rowptr[b, h, kb])
                    for i, qb in enumerate(csr.row(b, h, kb)):
                        visitors = [j for j in range(9) if st[b, h, qb, j] != ABSENT]
                        assert int(lock[b, h, s + i]) == visitors.index(kb)


def test_lock_values_hand_checked():
    # query block 0 visited by key blocks {1, 3}; query block 1 by {0, 3}
    st = torch.tensor([[[[A, F, A, M], [M, A, A, F]]]], dtype=torch.int8)
    bs = BlockSparse.from_block_states(st, 4, 4, 8, 16)
    assert bs.k2q_full.row(0, 0, 1) == [0] and bs.k2q_full_lock[0, 0, 0] == 0
    # k2q_mask: kb0 -> [qb1] (rank 0), kb3 -> [qb0] (rank 1)
    assert bs.k2q_mask.row(0, 0, 3) == [0]
    assert bs.k2q_mask_lock[0, 0, :2].tolist() == [0, 1]
    # k2q_full kb3 -> [qb1]: rank 1 among {0, 3}
    assert bs.k2q_full.row(0, 0, 3) == [1] and bs.k2q_full_lock[0, 0, 1] == 1


def test_block_sparse_from_key_ranges_equals_mask_in_oracle():
    g = torch.Generator().manual_seed(3)
    kr = segments_to_key_ranges([[10, 23, 4], [37]], 37, causal=True)
    q, k, v = (torch.randn(2, 37, 2, 16, generator=g) for _ in range(3))
    bs = BlockSparse.from_key_ranges(kr, 37, 37, 16, 8)
    a = dualattn.attention(q, k, v, key_ranges=kr, impl="torch")
    b = dualattn.attention(q, k, v, key_ranges=kr, block_sparse=bs, impl="torch")
    assert torch.equal(a, b)


def test_broadcast_shapes_and_to():
    bs = BlockSparse.from_key_ranges(None, 10, 10, 4, 4, causal=True)
    assert bs.broadcast_shape == (1, 1)
    assert bs.to("cpu").block_states().shape == (1, 1, 3, 3)


def test_transpose_follows_an_in_place_update_of_the_csr():
    # every call validates the q->k lists as they are now; the k->q lists and lock values the
    # backward reads must follow an in-place update (they were cached forever: stale dK/dV)
    rp = torch.tensor([0, 1, 2], dtype=torch.int32)
    empty_rp, empty_col = torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    bs = BlockSparse.from_csr(rp, torch.tensor([0, 1], dtype=torch.int32), empty_rp, empty_col, 16, 16, 32, 32)
    assert [bs.k2q_full.row(0, 0, kb) for kb in range(2)] == [[0], [1]]
    bs.q2k_full.col.copy_(torch.tensor([1, 0], dtype=torch.int32))
    assert [bs.k2q_full.row(0, 0, kb) for kb in range(2)] == [[1], [0]]
    fresh = BlockSparse.from_csr(rp, torch.tensor([1, 0], dtype=torch.int32), empty_rp, empty_col, 16, 16, 32, 32)
    assert torch.equal(bs.k2q_full_lock, fresh.k2q_full_lock)
    q, k, v = (torch.randn(1, 32, 1, 16, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(3))
    out = dualattn.attention(q, k, v, block_sparse=bs, impl="torch")
    want = dualattn.attention(q, k, v, block_sparse=fresh, impl="torch")
    assert torch.equal(out, want)


def test_a_reused_pattern_is_validated_once_and_again_after_a_change(monkeypatch):
    # validation reads the CSR back (a synchronisation, about 1.3 ms per call at 8k on the H100
    # host): a pattern reused across calls is checked once; an in-place update or a swapped
    # tensor is checked again, so a corrupted pattern is still refused before any kernel runs
    rp = torch.tensor([0, 1, 2], dtype=torch.int32)
    empty_rp, empty_col = torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    bs = BlockSparse.from_csr(rp, torch.tensor([0, 1], dtype=torch.int32), empty_rp, empty_col, 16, 16, 32, 32)
    runs = []
    real = BlockSparse.validate
    monkeypatch.setattr(BlockSparse, "validate", lambda self: (runs.append(1), real(self))[1])
    q, k, v = (torch.randn(1, 32, 1, 16) for _ in range(3))
    for _ in range(3):
        dualattn.attention(q, k, v, block_sparse=bs, impl="torch")
    assert len(runs) == 1
    bs.q2k_full.col.copy_(torch.tensor([1, 5], dtype=torch.int32))  # out of range: must be refused
    with pytest.raises(ValueError, match="out of range"):
        dualattn.attention(q, k, v, block_sparse=bs, impl="torch")
    with pytest.raises(ValueError, match="out of range"):  # and refused again, not remembered
        dualattn.attention(q, k, v, block_sparse=bs, impl="torch")
    bs.q2k_full.col.copy_(torch.tensor([1, 0], dtype=torch.int32))
    dualattn.attention(q, k, v, block_sparse=bs, impl="torch")
    n = len(runs)
    bs.q2k_full = type(bs.q2k_full)(bs.q2k_full.rowptr, torch.tensor([[[0, 7]]], dtype=torch.int32))  # swapped
    with pytest.raises(ValueError, match="out of range"):
        dualattn.attention(q, k, v, block_sparse=bs, impl="torch")
    assert len(runs) == n + 1
