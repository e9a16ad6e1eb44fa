"""Property 7: fast-sm90's persistent schedules on small grids.

The GPU profile's shapes (a few hundred keys on 132 SMs) never cut a tile along the keys, so the
other properties do not reach stream-K's tail cuts, the split of small grids into pieces
(tile_order.split_pieces) or the causal chunks' plain order. Here the grid is drawn too: the SM
count the launch sizes its grid by (DUALATTN_SM90_NUM_SMS), the keys a piece keeps, the cap on
pieces and stream-K's key minimum (module knobs, read at call time), so that drawn shapes
take those paths (and the causal pairs' split tail, tile_order.split_tail_table, planned or
forced).

* ``test_sm90_split_plans_leave_no_piece_empty`` (no GPU): the launch's plan for drawn shapes
  and grids never gives a unit a piece that holds none of the key blocks the unit visits. Such a
  piece would never arrive at its tile's merge, and the tile would stay unstored. The plans
  include pieces in rounds (more CTAs than SMs, tile_order.wave_pieces).
* ``test_fast_sm90_small_grids_match_oracle`` (Hopper): the kernel on drawn shapes and grids meets
  the accuracy rule and repeats bit for bit; the pieces' merge order is fixed, whichever arrives
  last.
* ``test_sm90_csr_tables_run_every_unit_once`` (no GPU) and ``test_fast_sm90_csr_tables_match_oracle``
  (Hopper): block-sparse calls' unit tables (FastSm90Forward.csr_unit_plan) for drawn row counts
  and grids, and the kernel with the table forced on 1-12 CTAs.
"""
from __future__ import annotations

import contextlib
import pytest
import torch
from hypothesis import assume, event, example, given
from hypothesis import strategies as st

from props import harness, profiles
from props import strategies as S
from props.strategies import Case

from dualattn.spec import AttentionSpec

SM90_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128))


@contextlib.contextmanager
def sm90_grid(num_sms: int, piece_keys: int, max_pieces: str, stream_k_min_keys: str, split_tail: str = ""):
    """fast-sm90's grid knobs for one example; the launch memo is cleared on both sides, since it
    keeps a spec's plan."""
    import dualattn.fast.sm90 as sm90
    names = ("_NUM_SMS_ENV", "_SPLIT_PIECE_KEYS_ENV", "_SPLIT_UNITS_ENV", "_STREAM_K_MIN_KEYS_ENV",
             "_SPLIT_TAIL_ENV")
    saved = {n: getattr(sm90, n) for n in names}
    values = (str(num_sms), str(piece_keys) if piece_keys else "", max_pieces, stream_k_min_keys, split_tail)
    sm90.FORWARD._entries.clear()
    try:
        for n, v in zip(names, values):
            setattr(sm90, n, v)
        yield sm90.FORWARD
    finally:
        for n, v in saved.items():
            setattr(sm90, n, v)
        sm90.FORWARD._entries.clear()


def grids(max_sms: int):
    return st.fixed_dictionaries({
        "num_sms": st.integers(1, max_sms),
        "piece_keys": st.sampled_from([0, 128, 192, 256, 384, 512, 1024]),  # 0: the default
        "max_pieces": st.sampled_from(["", "", "2", "3", "5", "8"]),
        "stream_k_min_keys": st.sampled_from(["", "0", "0", "0"]),  # "0": short keys are cut too
        # causal pairs that stream-K does not cut: the launch's split-tail plan, or forced ("1")
        "split_tail": st.sampled_from(["", "", "1"]),
    })


def tile_visits(impl, spec):
    """Key blocks each query block of a plain-order call visits: all of them, or with the causal
    limit the kernel's bounds (FastSm90Forward.paired_key_blocks, checked against the kernel's
    own code in tests/test_compile_sm90.py)."""
    tile_m, tile_n = impl.config(spec)[:2]
    n = -(-(impl.pack_gqa(spec) * spec.seqlen_q) // tile_m)
    if not spec.causal:  # (no window drawn here)
        return [-(-spec.seqlen_k // tile_n)] * n
    kb = impl.paired_key_blocks(spec)
    return [kb(m) for m in range(n)]


@st.composite
def sm90_specs(draw):
    d, dv = draw(st.sampled_from(SM90_HEAD_DIMS))
    small = draw(st.booleans())  # half the draws small enough to fit half the SMs: those split
    hkv = draw(st.integers(1, 2 if small else 8))
    hq = hkv * draw(st.sampled_from([1, 2, 3, 4, 8]))
    sq = draw(st.one_of(st.integers(1, 300 if small else 600), st.integers(1, 4096), st.sampled_from(S.EDGE_LENGTHS)))
    sk = draw(st.one_of(st.integers(1, 40000), st.sampled_from([1024, 2047, 2048, 2049, 4096, 8191, 16384])))
    return AttentionSpec("batched", draw(st.integers(1, 2 if small else 4)), sq, sk, hq, hkv, d, dv,
                         draw(st.sampled_from([torch.bfloat16, torch.float16])), "cuda",
                         causal=draw(st.booleans()))


@pytest.mark.device_free
@profiles.examples(8.0)
@given(spec=sm90_specs(), grid=grids(132))
# a causal chunk whose first tile sees two of three key blocks: 64 queries x 4 packed heads (two
# tiles, the first's rows see all but 32 keys) against 257 keys, pieces of 128 keys. Pieces of
# the whole key range (section 48's cut, with a bound on the queries that this piece size
# breaks) would give three one-block pieces and leave the first tile's third empty
@example(spec=AttentionSpec("batched", 1, 64, 257, 4, 1, 128, 128, torch.bfloat16, "cuda", causal=True),
         grid={"num_sms": 8, "piece_keys": 128, "max_pieces": "", "stream_k_min_keys": "0"})
# a causal chunk whose 160 tiles fill more than half of 132 SMs: four pieces a tile on 640 CTAs,
# taken in rounds (tile_order.wave_pieces), not the pairs
@example(spec=AttentionSpec("batched", 1, 640, 32768, 32, 8, 128, 128, torch.bfloat16, "cuda", causal=True),
         grid={"num_sms": 132, "piece_keys": 0, "max_pieces": "", "stream_k_min_keys": ""})
def test_sm90_split_plans_leave_no_piece_empty(spec, grid):
    with sm90_grid(**grid) as impl:
        cut, blocks, pieces, ctas = impl.stream_k_plan(spec, torch.device("cuda"))
        event(f"pieces: {pieces}")
        if not pieces:
            return
        if impl.paired(spec):
            # pairs: two pieces, each tile narrowed to its share of the pair's key blocks
            # (tile_order.tile_share); a tile wholly in one piece is stored uncut, so an empty
            # share is no hazard there
            event("paired")
            assert pieces == 2
            return
        event("causal chunk" if spec.causal else "non-causal")
        if ctas > grid["num_sms"]:
            event("pieces in rounds (more CTAs than SMs)")
        # the plain order: every piece of a cut tile adds itself to the tile's merge, so each one
        # needs a key block the tile visits. A causal tile's pieces share out the blocks it sees
        # (FlashFwdSm90.item_coords), a non-causal one's all blocks: P pieces of v blocks are
        # none empty while P <= v
        visits = tile_visits(impl, spec)
        assert max(visits) == blocks
        assert pieces <= min(visits), (
            f"{spec.short()}: a tile visiting {min(visits)} key blocks cut into {pieces} pieces "
            f"(grid {grid})")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@st.composite
def small_grid_cases(draw):
    """Batched calls that fast-sm90 serves, few enough tiles for a drawn grid to cut them, with
    keys up to 8x the profile's length (the queries stay within it, so the oracle's scores stay
    small)."""
    lim = profiles.current()
    d, dv = draw(st.sampled_from(SM90_HEAD_DIMS))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.sampled_from([1, 2, 3, 4, 8]))
    sq = draw(S.seqlens(1))
    sk = draw(st.one_of(st.integers(1, 8 * lim.max_seqlen), st.sampled_from([1, 127, 128, 129, 1023, 1024, 1025])))
    causal = draw(st.booleans())
    window = draw(S.windows(sk)) if draw(st.integers(0, 4)) == 0 else (-1, -1)
    batch = draw(st.integers(1, 2))
    return Case("batched", (sq,) * batch, (sk,) * batch, hq, hkv, d, dv,
                draw(st.sampled_from(["bfloat16", "float16"])), causal=causal, window=window,
                softcap=draw(S.softcaps()), scale=draw(S.scales()), magnitude=draw(S.magnitudes()),
                seed=draw(st.integers(0, 2 ** 16)))


@pytest.mark.skipif(not _hopper(), reason="fast-sm90 runs on Hopper (sm_90) only")
@profiles.sharded(3.0)
@given(case=small_grid_cases(), grid=grids(48))
def test_fast_sm90_small_grids_match_oracle(shard, case: Case, grid):
    inp = S.materialize(case)
    call = S.build_call(inp)
    with sm90_grid(**grid) as impl:
        assume(impl.can_implement(call.spec) is None)
        event(f"pieces: {impl.stream_k_plan(call.spec, inp.q.device)[2] if impl.stream_k(call.spec) else 'no cut'}")
        if impl.split_tail(call.spec):
            groups = impl.split_tail_schedule(call.spec, int(grid["num_sms"]))[0]
            event("split tail" if groups else "split-tail config, whole pairs")
        harness.assert_matches_oracle(inp, impls=[impl])
        runs = [harness.run(impl, inp, call=call)[0][:2] for _ in range(3)]
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse.nan_to_num(), runs[0][1].nan_to_num()), \
                f"fast-sm90 differs bitwise between repeated runs on {call.spec.short()} (grid {grid})"


@contextlib.contextmanager
def sm90_csr_table(num_sms: int, forced: bool):
    """fast-sm90's block-sparse unit table (FastSm90Forward.csr_table): forced on ("1") or left to
    the launch's model (""), on a grid of ``num_sms`` CTAs; the launch memo cleared on both sides."""
    import dualattn.fast.sm90 as sm90
    saved = (sm90._NUM_SMS_ENV, sm90._CSR_LPT_ENV)
    sm90.FORWARD._entries.clear()
    try:
        sm90._NUM_SMS_ENV, sm90._CSR_LPT_ENV = str(num_sms), "1" if forced else ""
        yield sm90.FORWARD
    finally:
        sm90._NUM_SMS_ENV, sm90._CSR_LPT_ENV = saved
        sm90.FORWARD._entries.clear()


@st.composite
def csr_row_pointers(draw):
    """(spec, full row pointers, mask row pointers, (B', H'), block_m, block_n) of a block-sparse
    call fast-sm90 runs on the persistent grid: row counts drawn per (B', H', query block)."""
    d = draw(st.sampled_from([64, 96, 128]))
    hkv = draw(st.integers(1, 4))
    hq = hkv * draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.integers(1, 3))
    bm, bn = draw(st.sampled_from([(128, 128), (256, 128), (128, 256), (256, 256)]))
    sq, sk = draw(st.integers(1, 6000)), draw(st.integers(1, 6000))
    nq, nk = -(-sq // bm), -(-sk // bn)
    bp, hp = draw(st.sampled_from([(1, 1), (batch, 1), (1, hq), (batch, hq)]))
    spec = AttentionSpec("batched", batch, sq, sk, hq, hkv, d, d, torch.bfloat16, "cuda",
                         causal=draw(st.booleans()), block_size=(bm, bn))
    rows = st.lists(st.integers(0, nk), min_size=bp * hp * nq, max_size=bp * hp * nq)
    pointers = []
    for counts in (draw(rows), draw(rows)):
        flat = []
        for i in range(bp * hp):
            flat += [sum(counts[i * nq:i * nq + r]) for r in range(nq + 1)]
        pointers.append(tuple(flat))
    return spec, pointers[0], pointers[1], (bp, hp), bm, bn


@pytest.mark.device_free
@profiles.examples(8.0)
@given(drawn=csr_row_pointers(), num_sms=st.integers(1, 132), forced=st.booleans())
def test_sm90_csr_tables_run_every_unit_once(drawn, num_sms, forced):
    """The block-sparse unit table (FastSm90Forward.csr_unit_plan) for drawn row counts, shapes
    and grids: none, or every unit (bh x query blocks + m) exactly once in rounds x CTAs slots,
    each CTA's units section by section and heaviest first within one, and, unless forced, a
    busiest CTA at least 1 % under the kernel's own order's. (A table that lost or repeated a
    unit would leave a tile unstored or store it twice.)"""
    import dualattn.fast.sm90 as sm90
    from dualattn.fast.common.tile_order import static_stride_loads

    spec, full, mask, rows, bm, bn = drawn
    with sm90_csr_table(num_sms, forced) as impl:
        assume(impl.csr_table(spec))
        rounds, table = impl.csr_unit_plan(spec, full, mask, rows, bm, bn, num_sms)
        tile_m = impl.config(spec)[0]
        nm = -(-spec.seqlen_q // tile_m)
        units = nm * spec.batch * spec.num_heads_q
        ctas = min(units, num_sms)
        event("planned" if rounds else "the kernel's own order")
        if not rounds:
            assert not forced, "a forced table was not planned"
            return
        assert len(table) == rounds * ctas
        assert sorted(u for u in table if u >= 0) == list(range(units))
        costs = impl.csr_unit_costs(spec, full, mask, rows, bm, bn)
        hb = spec.batch * spec.num_heads_q
        section = impl.section_heads(spec, sm90.CSR_LPT_SECTION_BYTES)
        for c in range(ctas):
            mine = [table[k * ctas + c] for k in range(rounds) if table[k * ctas + c] >= 0]
            assert all(table[k * ctas + c] < 0 for k in range(len(mine), rounds))  # empty slots last
            order = [(u // nm // section, -costs[u]) for u in mine]
            assert order == sorted(order), f"CTA {c}'s units out of section / weight order"
        if not forced:
            loads = [sum(costs[table[k * ctas + c]] for k in range(rounds) if table[k * ctas + c] >= 0)
                     for c in range(ctas)]
            own = impl._own_order_costs(spec, costs, nm, hb, impl.section_heads(spec, sm90.L2_SECTION_BYTES))
            assert max(loads) <= 0.99 * max(static_stride_loads(own, ctas)) + 1e-9


@st.composite
def csr_table_cases(draw):
    """Block-sparse batched calls for the unit table on small grids (drawn CSR, any block size
    the strategies draw; fast-sm90 refuses those it cannot serve)."""
    return draw(S.batched_cases(blocks=True, backward=False))


@pytest.mark.skipif(not _hopper(), reason="fast-sm90 runs on Hopper (sm_90) only")
@profiles.sharded(2.0)
@given(case=csr_table_cases(), num_sms=st.integers(1, 12))
def test_fast_sm90_csr_tables_match_oracle(shard, case: Case, num_sms):
    """fast-sm90's block-sparse calls with the unit table forced on a grid of 1-12 CTAs (several
    units a CTA, empty slots): the accuracy rule, and bit-for-bit repeats."""
    inp = S.materialize(case)
    call = S.build_call(inp)
    with sm90_csr_table(num_sms, True) as impl:
        assume(impl.can_implement(call.spec) is None and impl.csr_table(call.spec))
        event("table" if impl.csr_unit_table(call.spec, call.block_sparse, inp.q.device, num_sms)[1]
              else "no table")
        harness.assert_matches_oracle(inp, impls=[impl])
        runs = [harness.run(impl, inp, call=call)[0][:2] for _ in range(2)]
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1].nan_to_num(), runs[1][1].nan_to_num()), \
            f"fast-sm90 differs bitwise between repeated runs on {call.spec.short()} ({num_sms} CTAs)"
