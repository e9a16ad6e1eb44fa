"""The causal tile order of fast/common/tile_order (CPU: the same arithmetic the kernels trace)."""
from __future__ import annotations

from math import gcd

import pytest

from dualattn.fast.common.tile_order import (STREAM_K_MIN_KEYS, STREAM_K_PIECES_PER_CTA, heads_per_section,
                                              heavy_first_in_sections, pair_of_unit, paired_tile,
                                              rotated_m_block, rotation_window,
                                              paired_unit_blocks, paired_units, split_tail_groups,
                                              pair_prefix, split_tail_pair_slots, split_tail_table,
                                              split_tail_plan, split_tail_slots, split_tail_tile,
                                              stream_k_grid, stream_k_piece, stream_k_tiles,
                                              split_pieces, wave_makespan, wave_pieces, deep_pieces,
                                              SPLIT_DEEP_MAX_PIECES,
                                              WAVE_CALL_BLOCKS, WAVE_PIECE_BLOCKS, WAVE_TILE_BLOCKS,
                                              tile_share, varlen_paired_tile, varlen_paired_units,
                                              lpt_unit_table, static_stride_loads, varlen_paired_tile_from_table,
                                              varlen_paired_unit_costs,
                                              light_query_blocks, window_order_slots, window_order_tile)


@pytest.mark.parametrize("num_m_blocks, num_bh, section", [
    (16, 128, 24), (16, 128, 128), (16, 128, 1), (128, 16, 3), (1, 7, 4), (5, 7, 3), (3, 1, 8)])
def test_every_tile_once_heaviest_first_within_sections(num_m_blocks, num_bh, section):
    section = min(section, num_bh)
    order = [heavy_first_in_sections(t, num_m_blocks, num_bh, section, min)
             for t in range(num_m_blocks * num_bh)]
    assert sorted(order) == [(m, bh) for m in range(num_m_blocks) for bh in range(num_bh)]
    # sections come one after another, and inside one the query blocks never get heavier
    sections = [bh // section for _, bh in order]
    assert sections == sorted(sections)
    for s in set(sections):
        ms = [m for (m, bh), sec in zip(order, sections) if sec == s]
        assert ms == sorted(ms, reverse=True)


@pytest.mark.parametrize("num_m_blocks, num_bh, num_ctas", [
    (6, 512, 132), (11, 256, 132), (22, 128, 132), (6, 7, 6), (3, 5, 9), (8, 256, 132),
    (86, 2, 132), (5, 40, 132), (1, 300, 132), (6, 1, 132), (9, 256, 132), (9, 7, 6), (20, 64, 132)])
def test_rotated_query_blocks_cover_every_tile_and_spread_the_last(num_m_blocks, num_bh, num_ctas):
    """A bijection that keeps a head's tiles together; every CTA holds the last (lightest) query
    block equally often in each cycle of G x blocks tiles (within 2 of the others overall),
    where the plain order gave it to the CTAs congruent to blocks - 1 modulo gcd(G, blocks)
    alone."""
    n = num_m_blocks * num_bh
    window = rotation_window(num_m_blocks, num_ctas)
    assert window % num_m_blocks == 0 and window % num_ctas == 0
    ms = [rotated_m_block(t, num_m_blocks, window) for t in range(n)]
    order = [(m, t // num_m_blocks) for t, m in zip(range(n), ms)]
    assert sorted(order) == sorted((m, bh) for bh in range(num_bh) for m in range(num_m_blocks))
    last = [0] * num_ctas
    plain = [0] * num_ctas
    for t, m in enumerate(ms):
        last[t % num_ctas] += m == num_m_blocks - 1
        plain[t % num_ctas] += t % num_m_blocks == num_m_blocks - 1
    cycle = num_ctas * num_m_blocks  # gcd(G, blocks) windows: every CTA through every block
    whole = n - n % cycle  # the tiles of whole cycles are shared exactly evenly
    assert len({sum(ms[t] == num_m_blocks - 1 for t in range(c, whole, num_ctas))
                for c in range(num_ctas)}) <= 1
    if n >= cycle:
        assert max(last) - min(last) <= 2
    if gcd(num_ctas, num_m_blocks) > 1 and num_m_blocks > 1 and n >= cycle:
        # (the plain order gave the 132 / 6 = 22 CTAs of hd64 1k every last block, the rest none)
        assert min(plain) == 0 and min(last) > 0


def test_one_section_is_heaviest_first_across_all_heads():
    """A section as large as the grid gives the plain longest-processing-time order."""
    m_blocks, bh = 6, 10
    order = [heavy_first_in_sections(t, m_blocks, bh, bh, min) for t in range(m_blocks * bh)]
    assert order == [(m_blocks - 1 - t // bh, t % bh) for t in range(m_blocks * bh)]


def test_heads_per_section_fits_the_budget():
    row = (128 + 128) * 2  # K + V bytes of one key row, hd128 bf16
    assert heads_per_section(2048, row, max, 24 << 20) == 24   # 1 MB of K/V per head
    assert heads_per_section(16384, row, max, 24 << 20) == 3
    assert heads_per_section(1 << 20, row, max, 24 << 20) == 1  # a head larger than the budget
    assert heads_per_section(0, row, max, 24 << 20) == (24 << 20) // row  # no keys: any number
    assert heads_per_section(1 << 30, 1024, max, 24 << 20) == 1  # no 32-bit overflow on the way


def _paired_schedule(num_m_blocks, num_bh, num_sms):
    """Per CTA, the (m_block, bh) it runs in order, as the kernel's grid and slot loop give them."""
    ctas = min(paired_units(num_m_blocks, num_bh), num_sms)
    slots = 2 * ctas * -(-paired_units(num_m_blocks, num_bh) // ctas)
    runs = [[] for _ in range(ctas)]
    for t in range(slots):
        m, bh, valid = paired_tile(t, ctas, num_m_blocks, num_bh)
        if valid:
            runs[t % ctas].append((m, bh))
    return runs


@pytest.mark.parametrize("num_m_blocks, num_bh, num_sms", [
    (8, 256, 132), (7, 256, 132), (1, 5, 132), (2, 3, 132), (3, 1, 132), (128, 16, 132), (9, 40, 7),
    (16, 128, 1), (5, 2, 4)])
def test_paired_order_runs_every_tile_once(num_m_blocks, num_bh, num_sms):
    runs = _paired_schedule(num_m_blocks, num_bh, num_sms)
    tiles = sorted(t for r in runs for t in r)
    assert tiles == [(m, bh) for m in range(num_m_blocks) for bh in range(num_bh)]
    for r in runs:
        _check_units(r, num_m_blocks, num_bh)


def _check_units(run, num_m_blocks, num_heads, key=lambda t: t):
    """A CTA's run is whole units back to back: query blocks p and n - 1 - p of one head, the
    heavier first, or an odd count's middle blocks of heads 2k and 2k + 1 (a lone last head's
    middle alone). ``key`` maps an entry to (m_block, head)."""
    i = 0
    while i < len(run):
        m0, h0 = key(run[i])
        if 2 * m0 == num_m_blocks - 1:
            if h0 == num_heads - 1 and num_heads % 2:
                i += 1
                continue
            assert h0 % 2 == 0 and i + 1 < len(run) and key(run[i + 1]) == (m0, h0 + 1), run[i:i + 2]
            assert run[i][:-2] == run[i + 1][:-2]  # (varlen: the same sequence)
            i += 2
            continue
        m1, h1 = key(run[i + 1])
        assert h0 == h1 and m0 + m1 == num_m_blocks - 1 and m0 > m1
        i += 2


@pytest.mark.parametrize("seqlen, head_dim", [(512, 128), (1024, 128), (2048, 128), (4096, 128), (1024, 64),
                                              (8192, 64), (1024, 256)])
def test_paired_order_balances_causal_work(seqlen, head_dim):
    """The bench's causal shapes (16k tokens, heads x dim = 2048) on 132 SMs: with a tile costing
    its key blocks plus a fixed overhead, the busiest CTA has at most one unit more than the mean,
    and no more than the heaviest-first stride over sections leaves it."""
    nm, bh, sms, overhead = seqlen // 128, (16384 // seqlen) * (2048 // head_dim), 132, 1.2

    def cost(m):
        return overhead + m + 1

    work = [sum(cost(m) for m, _ in r) for r in _paired_schedule(nm, bh, sms)]
    mean = sum(cost(m) for m in range(nm)) * bh / len(work)
    assert max(work) - mean <= nm + 1 + 2 * overhead
    section = min(heads_per_section(seqlen, head_dim * 4, max, 32 << 20), bh)
    strided = [0.0] * sms
    for t in range(nm * bh):
        strided[t % sms] += cost(heavy_first_in_sections(t, nm, bh, section, min)[0])
    assert mean / max(work) >= 0.96 and max(work) <= max(strided) + 1e-9



def _causal_visits(seqlen_q, seqlen_k, tile_m, tile_n, end_aligned):
    """Key blocks the query tiles of one (head, batch) of a causal call visit, each tile up to
    its last row's diagonal (FlashFwdSm90.key_block_bounds), the tiles aligned to the
    sequence's start or (end_aligned) its end, the first tile then starting before row 0."""
    n = -(-seqlen_q // tile_m)
    shift = (n * tile_m - seqlen_q) // 64 * 64 if end_aligned else 0  # (whole 64-row slices)
    total = 0
    for m in range(n):
        last = min((m + 1) * tile_m - shift, seqlen_q) - 1
        total += -(-min(max(last + 1 + seqlen_k - seqlen_q, 0), seqlen_k) // tile_n)
    return total


@pytest.mark.parametrize("tile_m, tile_n", [(192, 128), (128, 128), (128, 112), (128, 80), (128, 64)])
def test_end_aligned_tiles_never_visit_more_key_blocks(tile_m, tile_n):
    """FastSm90Forward.end_aligned: every tile's last row moves up by the shift or stays, so no
    tile visits more key blocks; with tile_m == tile_n and Sq = Sk the count is the same; and hd64's causal
    192-row tiles at the bench's 2k / 4k queries visit 0.950 / 0.945 of them."""
    import random
    rng = random.Random(7)
    for _ in range(300):
        sq = rng.randint(1, 9000)
        sk = rng.choice([sq, rng.randint(1, 9000), sq + rng.randint(-130, 130)])
        sk = max(sk, 1)
        start, end = (_causal_visits(sq, sk, tile_m, tile_n, e) for e in (False, True))
        assert end <= start
        if tile_m == tile_n and sq == sk:
            assert end == start
    if (tile_m, tile_n) == (192, 128):
        ratios = [_causal_visits(s, s, 192, 128, True) / _causal_visits(s, s, 192, 128, False)
                  for s in (2048, 4096)]
        assert [round(r, 3) for r in ratios] == [0.950, 0.945]


def _varlen_paired_schedule(tiles_per_sequence, num_heads, num_sms):
    """Per CTA, the (sequence, head, m_block) it runs in order (the kernel's grid: one CTA per SM
    up to the padded tile count; its slot bound: two per unit, whole rounds of the grid)."""
    units = varlen_paired_units(tiles_per_sequence, num_heads)
    ctas = min(max(tiles_per_sequence, default=0) * num_heads * len(tiles_per_sequence), num_sms)
    runs = [[] for _ in range(ctas)]
    for t in range(2 * ctas * -(-units // ctas)):
        m, seq, head, valid = varlen_paired_tile(t, ctas, tiles_per_sequence, num_heads)
        if valid:
            runs[t % ctas].append((seq, head, m))
    return runs


@pytest.mark.parametrize("tiles_per_sequence, num_heads, num_sms", [
    ([14, 18, 9, 8, 17, 16, 7, 10, 19, 13], 16, 132), ([0, 1, 0, 3, 1, 2], 3, 132), ([5], 1, 132),
    ([2, 0, 7, 7, 1], 4, 5), ([1] * 64, 2, 132), ([33, 1], 2, 1)])
def test_varlen_paired_order_runs_every_tile_once(tiles_per_sequence, num_heads, num_sms):
    runs = _varlen_paired_schedule(tiles_per_sequence, num_heads, num_sms)
    tiles = sorted(t for r in runs for t in r)
    assert tiles == [(s, h, m) for s, n in enumerate(tiles_per_sequence) for h in range(num_heads)
                     for m in range(n)]
    for r in runs:  # whole units of one sequence back to back
        i = 0
        while i < len(r):
            seq = r[i][0]
            j = i
            while j < len(r) and r[j][0] == seq:
                j += 1
            _check_units([(s, m, h) for s, h, m in r[i:j]], tiles_per_sequence[seq], num_heads,
                         key=lambda t: t[1:])
            i = j


@pytest.mark.parametrize("num_m_blocks, num_bh", [(7, 300), (5, 200), (11, 96), (3, 400), (1, 1000), (9, 77)])
def test_paired_order_balances_odd_block_counts(num_m_blocks, num_bh):
    """Odd counts of query blocks on 132 SMs: two heads' middle blocks make one unit of a pair's
    work, so the busiest CTA carries at most one unit more than the mean. (A middle block as a
    unit of its own, half a pair's work, fell on the same CTAs every round whenever the units per
    head divided the grid: 7 blocks, 4 units a head, CTAs 3, 7, ... ran only middles.)"""
    overhead = 1.2

    def cost(m):
        return overhead + m + 1

    work = [sum(cost(m) for m, _ in r) for r in _paired_schedule(num_m_blocks, num_bh, 132)]
    mean = sum(cost(m) for m in range(num_m_blocks)) * num_bh / len(work)
    assert max(work) - mean <= num_m_blocks + 1 + 2 * overhead


def _tail_groups(num_m_blocks, num_bh, ctas):
    """The smallest tail split_tail_groups gives (G + R units' worth of whole groups of heads)."""
    hpg = 1 + num_m_blocks % 2
    return split_tail_groups(paired_units(num_m_blocks, num_bh), paired_units(num_m_blocks, hpg),
                             -(-num_bh // hpg), ctas, min)


def _tile_cost(m):
    """A tile's modelled work: its key blocks (m + 1, Sq = Sk) and a fixed overhead."""
    return m + 1 + 1.2


def _split_tail_schedule(num_m_blocks, num_bh, num_sms, tail=None, table=None, deal="lpt"):
    """Per CTA, the (m_block, bh) it runs in order with the paired order's last ``tail`` groups
    of heads split (split_tail_tile; default: the smallest tail, split_tail_groups') and the tail
    table (default: split_tail_table's LPT one), as the kernel's grid and slot loop give them,
    the table read only at tail slots as the kernel reads it."""
    ctas = min(paired_units(num_m_blocks, num_bh), num_sms)
    if tail is None:
        tail = _tail_groups(num_m_blocks, num_bh, ctas)
    rounds = 0
    if table is None:
        rounds, table, _ = split_tail_table(num_m_blocks, num_bh, ctas, tail, _tile_cost, deal)
    else:
        rounds = len(table) // ctas
    pair_slots = split_tail_pair_slots(num_m_blocks, num_bh, ctas, tail, min)
    runs = [[] for _ in range(ctas)]
    for t in range(split_tail_slots(num_m_blocks, num_bh, ctas, tail, rounds, min)):
        tail_j = table[t - pair_slots] if t >= pair_slots else -1
        m, bh, valid = split_tail_tile(t, ctas, num_m_blocks, num_bh, tail, tail_j, max, min)
        if valid:
            runs[t % ctas].append((m, bh))
    return runs


def _busiest(runs):
    work = [sum(_tile_cost(m) for m, _ in r) for r in runs]
    return max(work) / (sum(work) / len(work))


@pytest.mark.parametrize("num_m_blocks, num_bh, num_sms", [
    (8, 512, 132), (16, 256, 132), (7, 300, 132), (13, 77, 132), (1, 5, 132), (2, 3, 132), (3, 1, 132),
    (9, 40, 7), (16, 128, 1), (5, 2, 4), (1, 1, 1), (3, 43, 1), (7, 3, 4), (33, 5, 9)]
    + [(1 + (i * 7919) % 37, 1 + (i * 104729) % 301, 1 + (i * 1299709) % 140) for i in range(40)])
def test_split_tail_runs_every_tile_once(num_m_blocks, num_bh, num_sms):
    """Any number of split groups (0: whole pairs, up to all of them), dealt either way, covers
    every tile once, each CTA's tail heaviest first, after its whole pairs; with 0 groups it is
    the paired order, and a CTA's column of the table holds its tail tiles, then -1 to the end
    (slots the kernel's loop skips)."""
    ctas = min(paired_units(num_m_blocks, num_bh), num_sms)
    num_groups = -(-num_bh // (1 + num_m_blocks % 2))
    for tail, deal in [(t, d) for t in sorted({0, 1, _tail_groups(num_m_blocks, num_bh, ctas), num_groups // 2,
                                               num_groups}) for d in ("lpt", "snake")]:
        runs = _split_tail_schedule(num_m_blocks, num_bh, num_sms, tail, deal=deal)
        assert sorted(t for r in runs for t in r) == [(m, bh) for m in range(num_m_blocks)
                                                      for bh in range(num_bh)], (tail, deal)
        rounds, table, _ = split_tail_table(num_m_blocks, num_bh, ctas, tail, _tile_cost, deal)
        assert len(table) == rounds * ctas
        for c in range(ctas):  # a CTA's entries: its tail tiles, then -1 to the table's end
            column = table[c::ctas]
            live = sum(j >= 0 for j in column)
            assert all(j >= 0 for j in column[:live]) and all(j == -1 for j in column[live:]), (tail, deal, c)
        first_tail_head = split_tail_tile(split_tail_pair_slots(num_m_blocks, num_bh, ctas, tail, min),
                                          ctas, num_m_blocks, num_bh, tail, 0, max, min)[1]
        for r in runs:
            tail_ms = [m for m, bh in r if tail and bh >= first_tail_head]
            assert tail_ms == sorted(tail_ms, reverse=True)
    assert _split_tail_schedule(num_m_blocks, num_bh, num_sms, 0) == _paired_schedule(num_m_blocks, num_bh, num_sms)


@pytest.mark.parametrize("num_m_blocks, num_bh", [(8, 512), (16, 256), (8, 256), (16, 128), (16, 64),
                                                  (7, 300), (32, 16), (13, 77), (21, 20)])
def test_split_tail_fills_the_last_round(num_m_blocks, num_bh):
    """The bench's short causal cells (1k / 2k keys, 128-row tiles, 132 SMs: 7.76 or 15.5 rounds
    of pairs) and odd ones: with a tile costing its key blocks plus a fixed overhead, whole pairs
    leave the busiest CTA 3 % over the mean (hd64 causal 1k: 1.031); the plan's tail and LPT table
    bring it within 1 % at the bench's shapes and never above whole pairs."""
    whole = _busiest(_paired_schedule(num_m_blocks, num_bh, 132))
    groups, _, table = split_tail_plan(num_m_blocks, num_bh, 132, _tile_cost)
    split = _busiest(_split_tail_schedule(num_m_blocks, num_bh, 132, groups, table) if groups
                     else _paired_schedule(num_m_blocks, num_bh, 132))
    assert split <= whole + 1e-9
    if (num_m_blocks, num_bh) in ((8, 512), (16, 256), (8, 256), (16, 128), (16, 64), (32, 16)):
        assert whole > 1.025 and split < 1.01


def test_split_tail_table_is_longest_processing_time_first():
    """Every tail tile goes to a CTA that carried the least modelled work when it was dealt (the
    whole pairs first), so the busiest CTA ends within one tail tile of the least busy one, and
    where a snake left a 4.2-round shape (b3 x 24 heads, 1500 keys: 432 pairs) 6 % over the
    mean, the plan leaves it within 3 %."""
    nm, bh, ctas = 8, 512, 132
    tail = _tail_groups(nm, bh, ctas)
    rounds, table, busiest = split_tail_table(nm, bh, ctas, tail, _tile_cost)
    runs = _split_tail_schedule(nm, bh, ctas, tail, table)
    work = [sum(_tile_cost(m) for m, _ in r) for r in runs]
    assert max(work) == pytest.approx(busiest)
    assert max(work) - min(work) <= _tile_cost(nm - 1) + 1e-9
    groups, rounds, table = split_tail_plan(12, 72, 132, _tile_cost)
    assert groups > 0 and _busiest(_split_tail_schedule(12, 72, 132, groups, table)) < 1.03
    assert _busiest(_paired_schedule(12, 72, 132)) > 1.2


def test_split_tail_counts_each_ctas_own_pairs():
    """The tail is dealt against each CTA's own whole pairs, not a mean pair: 192-row tiles on
    128-key blocks (hd64 causal 2k: 11 query blocks of 2, 3, 5, 6, ... 16 key blocks) make pairs
    of 18 and 19 blocks and the middle units 18, so the stride leaves the busiest CTA 6 % over
    the mean; dealt against the mean pair, the tail left 3.6 %; against each CTA's pairs, under
    1.5 %."""
    def cost(m):
        return min(-(-3 * (m + 1) // 2), 16) + 1.2

    nm, bh = 11, 256
    prefix = pair_prefix(nm, bh, 132, cost)
    work = [p[-1] for p in prefix]
    assert max(work) / (sum(work) / 132) > 1.06
    groups, rounds, table = split_tail_plan(nm, bh, 132, cost)
    assert groups > 0
    pair_slots = split_tail_pair_slots(nm, bh, 132, groups, min)
    loads = [0.0] * 132
    for t in range(split_tail_slots(nm, bh, 132, groups, rounds, min)):
        m, _, valid = split_tail_tile(t, 132, nm, bh, groups, table[t - pair_slots] if t >= pair_slots else -1,
                                      max, min)
        loads[t % 132] += cost(m) if valid else 0.0
    assert max(loads) / (sum(loads) / 132) < 1.015


def test_split_tail_plan_returns_at_once_where_nothing_can_gain(monkeypatch):
    """Grids of many rounds (16 query blocks x 16384 heads on 132 SMs: 993 rounds of pairs) leave
    whole pairs within 1 % of the mean: the plan returns whole pairs before its O(units) model
    (pair_prefix, 0.2-0.4 s at such sizes), which a shape of few rounds still builds."""
    import dualattn.fast.common.tile_order as T

    built = []
    real = T.pair_prefix
    monkeypatch.setattr(T, "pair_prefix", lambda *a: built.append(a) or real(*a))
    assert T.split_tail_plan(16, 16384, 132, _tile_cost) == (0, 0, [])
    assert not built
    assert T.split_tail_plan(16, 256, 132, _tile_cost)[0] > 0 and built


def test_split_tail_plan_splits_where_its_model_gains_and_the_tail_fits_l2():
    """The launch's choice (split_tail_plan, tile = key blocks + 1.2): the bench's causal hd64 /
    hd128 cells at 1k and 2k split (3 % -> under 1 %); a tail whose K/V does not fit is never
    chosen and a plan that needs one is refused; whole rounds have no tail; 4 query blocks a head
    (512 keys) split only where the table gains (many heads)."""
    def plan(nm, bh, fits=lambda heads: True):
        return split_tail_plan(nm, bh, 132, _tile_cost, fits)

    def busiest(nm, bh, fits=lambda heads: True):
        groups, _, table = plan(nm, bh, fits)
        return _busiest(_split_tail_schedule(nm, bh, 132, groups, table) if groups
                        else _paired_schedule(nm, bh, 132))

    for nm, bh in ((8, 512), (16, 256), (8, 256), (16, 128)):
        assert plan(nm, bh)[0] > 0 and busiest(nm, bh) < 1.01
    assert plan(8, 256, lambda heads: heads <= 64)[0] <= 64
    assert plan(16, 64, lambda heads: heads <= 16)[0] in range(1, 17)   # hd256 causal 2k: 16 heads fit
    assert plan(16, 64, lambda heads: heads <= 2)[0] == 0               # too few fit to gain
    assert plan(8, 33 * 4)[0] == 0  # 528 units: 4 whole rounds
    assert plan(13, 77)[0] > 0 and plan(9, 100)[0] > 0  # odd block counts, few rounds
    assert plan(7, 300)[0] == 0  # 1050 units: 7.95 rounds, nothing to gain


def test_varlen_paired_order_balances_the_bench_documents():
    """The bench's 10 packed causal documents (hd128, 16 heads, 132 SMs): with a tile costing its
    key blocks plus a fixed overhead, the busiest CTA of the paired order carries at most one unit
    (the longest document's) more than the mean, and less than the heaviest-first stride over the
    padded grid leaves it."""
    from dualattn.bench import doc_lengths

    tiles = [-(-n // 128) for n in doc_lengths(16384, 10)]
    heads, sms, overhead = 16, 132, 1.2
    work = [sum(overhead + m + 1 for _, _, m in r) for r in _varlen_paired_schedule(tiles, heads, sms)]
    mean = sum(heads * sum(overhead + m + 1 for m in range(n)) for n in tiles) / sms
    assert max(work) - mean <= max(tiles) + 1 + 2 * overhead
    nm, bh = max(tiles), heads * len(tiles)
    section = min(heads_per_section(128 * nm, 128 * 4, max, 32 << 20), bh)
    strided = [0.0] * sms
    for t in range(nm * bh):
        m, rest = heavy_first_in_sections(t, nm, bh, section, min)
        if m < tiles[rest // heads]:
            strided[t % sms] += overhead + m + 1
    assert max(work) < max(strided)


def _doc_unit_costs(lengths, heads, overhead=1.2):
    """The varlen paired order's unit costs of self-attention documents (128 x 128 tiles)."""
    tiles = [-(-n // 128) for n in lengths]
    return tiles, varlen_paired_unit_costs(tiles, heads, lambda seq, m: overhead + min(m + 1, tiles[seq]))


@pytest.mark.parametrize("tiles_per_sequence, num_heads, num_sms", [
    ([14, 18, 9, 8, 17, 16, 7, 10, 19, 13], 16, 132), ([0, 1, 0, 3, 1, 2], 3, 132), ([5], 1, 132),
    ([2, 0, 7, 7, 1], 4, 5), ([1] * 64, 2, 132), ([33, 1], 2, 1)])
def test_varlen_unit_table_runs_every_tile_once(tiles_per_sequence, num_heads, num_sms):
    """The launch's unit table (lpt_unit_table) read as the kernel reads it
    (varlen_paired_tile_from_table, 2 x grid x rounds slots): every tile of every sequence and
    head once, a unit's two blocks back to back on one CTA, each CTA's units heaviest first."""
    costs = varlen_paired_unit_costs(tiles_per_sequence, num_heads, lambda seq, m: 1.2 + m + 1)
    ctas = min(max(tiles_per_sequence, default=0) * num_heads * len(tiles_per_sequence), num_sms)
    rounds, table, busiest = lpt_unit_table(costs, ctas)
    assert len(table) == rounds * ctas and sorted(u for u in table if u >= 0) == list(range(len(costs)))
    runs = [[] for _ in range(ctas)]
    for t in range(2 * ctas * rounds):
        m, seq, head, valid = varlen_paired_tile_from_table(t, ctas, tiles_per_sequence, num_heads, table)
        if valid:
            runs[t % ctas].append((seq, head, m))
    assert sorted(t for r in runs for t in r) == [(s, h, m) for s, n in enumerate(tiles_per_sequence)
                                                 for h in range(num_heads) for m in range(n)]
    for c in range(ctas):
        mine = [table[k * ctas + c] for k in range(rounds) if table[k * ctas + c] >= 0]
        assert [costs[u] for u in mine] == sorted((costs[u] for u in mine), reverse=True)
    loads = [sum(costs[table[k * ctas + c]] for k in range(rounds) if table[k * ctas + c] >= 0)
             for c in range(ctas)]
    assert max(loads) == pytest.approx(busiest)
    # LPT's bound: the busiest CTA carries at most the mean plus one unit
    assert busiest <= sum(costs) / ctas + max(costs, default=0) + 1e-9


def test_varlen_paired_unit_costs_follow_the_order_unit_by_unit():
    """varlen_paired_unit_costs costs one group of heads and repeats it: the same list as costing
    every unit of the order through pair_of_unit (random block counts, heads, tile costs)."""
    import random

    rng = random.Random(7)
    for _ in range(200):
        tiles = [rng.randint(0, 21) for _ in range(rng.randint(1, 9))]
        heads = rng.randint(1, 9)

        def cost(seq, m):
            return 1.5 * seq + m * m + 0.25

        direct = []
        for seq, n in enumerate(tiles):
            for r in range(varlen_paired_units([n], heads)):
                direct.append(sum(cost(seq, m) for second in (0, 1)
                                  for m, _, valid in [pair_of_unit(r, second, n, heads)] if valid))
        assert varlen_paired_unit_costs(tiles, heads, cost) == direct


def test_varlen_unit_table_balances_the_bench_documents():
    """The bench's 10 documents (hd128, 16 heads, 132 SMs): the static stride's busiest CTA
    carries 1 / 0.968 of the mean, the LPT table's 1 / 0.995 (the figures in
    FastSm90Forward.varlen_unit_table's docstring)."""
    from dualattn.bench import doc_lengths

    _, costs = _doc_unit_costs(doc_lengths(16384, 10), 16)
    mean = sum(costs) / 132
    static = max(static_stride_loads(costs, 132))
    rounds, _, busiest = lpt_unit_table(costs, 132)
    assert round(mean / static, 3) == 0.968 and round(mean / busiest, 3) == 0.995 and rounds == 8


def _stream_k_schedule(num_tiles, num_ctas, blocks):
    """Per CTA: its work in key blocks (uncut tiles first, then its pieces), as the kernel walks
    it (FlashFwdSm90.item_coords), and a count of the pieces that cover each (tile, key block)."""
    sk = stream_k_tiles(num_tiles, min(num_tiles, num_ctas), blocks, 128, min_keys=0)
    pieces = 0 if sk else split_pieces(num_tiles, num_ctas, blocks, 128, min_keys=0)
    sk = sk or (num_tiles if pieces else 0)
    num_ctas = stream_k_grid(num_tiles, num_ctas, sk, pieces)  # the launch's: pieces x tiles where split
    dp_end = num_tiles - sk
    assert dp_end % num_ctas == 0  # the uncut tiles are whole rounds: the slots stay aligned
    cover, pieces, work = {}, {}, []
    for c in range(num_ctas):
        w = 0
        for t in range(c, dp_end, num_ctas):
            for k in range(blocks):
                cover[(t, k)] = cover.get((t, k), 0) + 1
            w += blocks
        for p in range(STREAM_K_PIECES_PER_CTA if sk else 0):
            t, start, end, valid = stream_k_piece(c, p, num_ctas, sk, blocks, max, min)
            if not valid:
                continue
            assert 0 <= start < end <= blocks and t < sk
            pieces[t] = pieces.get(t, 0) + 1
            for k in range(start, end):
                cover[(dp_end + t, k)] = cover.get((dp_end + t, k), 0) + 1
            w += end - start
        work.append(w)
    return sk, cover, pieces, work, num_ctas


@pytest.mark.parametrize("num_tiles, num_ctas, blocks", [
    (2048, 132, 64), (2048, 132, 32), (1024, 132, 128), (2752, 132, 86), (160, 132, 32), (8, 5, 7),
    (24, 5, 5), (24, 16, 8), (7, 5, 4), (3000, 114, 9), (2048, 132, 1)])
def test_stream_k_covers_every_key_block_once_and_cuts_a_tile_at_most_once(num_tiles, num_ctas, blocks):
    sk, cover, pieces, work, grid = _stream_k_schedule(num_tiles, num_ctas, blocks)
    assert sk > 0 and grid == num_ctas
    assert len(cover) == num_tiles * blocks and set(cover.values()) == {1}
    assert max(pieces.values()) <= 2  # a cut tile has two pieces: one merge, by whichever is second
    # the busiest CTA carries the average work up to a key block (uncut: a whole extra tile)
    assert max(work) <= -(-num_tiles * blocks // num_ctas)
    if blocks > 1:  # (one key block per tile: nothing finer than a tile to share out)
        assert max(work) < -(-num_tiles // num_ctas) * blocks


@pytest.mark.parametrize("num_tiles, num_sms, blocks, want", [
    (64, 132, 64, 2), (66, 132, 33, 2), (32, 132, 256, 4), (1, 132, 2, 2), (7, 20, 17, 2),
    (16, 32, 3, 2), (5, 11, 128, 2), (8, 132, 256, 8), (40, 132, 64, 3), (10, 132, 19, 4), (3, 132, 40, 8)])
def test_split_pieces_run_p_ctas_a_tile_each_on_a_share_of_its_keys(num_tiles, num_sms, blocks, want):
    """A grid of at most half the SMs: every tile cut into P pieces of nearly equal key blocks
    (none empty), on a grid of P CTAs a tile, CTA P t + p holding piece p of tile t (the kernel
    derives the piece from the CTA and the tile)."""
    sk, cover, pieces, work, grid = _stream_k_schedule(num_tiles, num_sms, blocks)
    assert sk == num_tiles and grid == want * num_tiles <= num_sms
    assert len(cover) == num_tiles * blocks and set(cover.values()) == {1}
    assert set(pieces.values()) == {want} and len(pieces) == num_tiles
    assert min(work) >= blocks // want and max(work) <= -(-blocks // want)
    for c in range(grid):  # piece 0 of CTA c is tile c // P, its key blocks from c % P's share
        t, start, end, valid = stream_k_piece(c, 0, grid, sk, blocks, max, min)
        assert valid and t == c // want and start == (c % want) * blocks // want


def test_wave_pieces_cut_units_into_rounds_where_the_model_gains():
    """Units that fill more than half of the SMs run in P pieces on P x units CTAs, in rounds,
    where the wave model's makespan beats the order's own by WAVE_MIN_GAIN (split_pieces with
    waves); never pairs."""
    assert wave_makespan(96, 132, 256, 1) == WAVE_CALL_BLOCKS + 256 + WAVE_TILE_BLOCKS
    assert wave_makespan(96, 132, 256, 4) == WAVE_CALL_BLOCKS + 3 * (64 + WAVE_PIECE_BLOCKS)
    assert wave_pieces(96, 132, 256, 8) == 4           # 384 CTAs in 3 rounds of 64-block pieces
    assert split_pieces(96, 132, 256, 128, waves=True) == 4 and split_pieces(96, 132, 256, 128) == 0
    assert split_pieces(96, 132, 256, 128, waves=True, pairs=True) == 0
    assert wave_pieces(128, 132, 256, 8) == 0          # a nearly full round: nothing to gain
    assert wave_pieces(96, 132, 256, 3) == 0           # 2-3 pieces: 2-3 rounds of longer pieces
    # against the order's own time (a causal chunk's pairs: one round of first + last blocks)
    pairs = WAVE_CALL_BLOCKS + 251 + 256 + 2 * WAVE_TILE_BLOCKS
    assert wave_pieces(160, 132, 256, 8, whole=pairs) == 4
    assert wave_pieces(160, 132, 256, 8, whole=0.5 * pairs) == 0


def test_deep_pieces_beyond_eight_where_the_grid_stays_small():
    """More than SPLIT_MAX_PIECES pieces (split_pieces with deep) for calls of 1-4 units, while
    the grid stays within half the SMs and a piece keeps 2k keys; never more than
    SPLIT_DEEP_MAX_PIECES or what the keys allow."""
    assert deep_pieces(8, 132, 131072) == 0                 # 8 units: 64 CTAs already
    assert deep_pieces(5, 132, 131072) == 0                 # past the units measured
    assert split_pieces(5, 132, 1024, 128, deep=True) == 8
    assert [deep_pieces(4, 132, k) for k in (16384, 32768, 65536)] == [8, 16, 16]
    assert deep_pieces(1, 132, 131072) == SPLIT_DEEP_MAX_PIECES == 32
    assert deep_pieces(1, 132, 32768) == 16                 # 2k keys a piece
    assert split_pieces(4, 132, 512, 128, deep=True) == 16  # 64k keys: 16 x 4 CTAs
    assert split_pieces(4, 132, 512, 128) == 8              # without: the flat cap
    assert split_pieces(8, 132, 1024, 128, deep=True) == 8
    assert split_pieces(1, 132, 1024, 128, deep=True) == 32
    assert split_pieces(1, 20, 1024, 128, deep=True) == 10  # half the SMs
    assert split_pieces(2, 132, 512, 64, deep=True, min_piece_keys=1024) == 16  # hd256 16/2, 32k
    assert split_pieces(1, 132, 40, 128, deep=True) == 8    # 5k keys: the cap stays
    assert split_pieces(200, 132, 512, 128, deep=True) == 0  # more units than half the SMs


def test_split_pieces_only_where_two_ctas_a_unit_fit():
    assert split_pieces(66, 132, 16, 128) == 0             # 2k keys: under STREAM_K_MIN_KEYS
    assert split_pieces(66, 132, 32, 128) == 2
    assert split_pieces(67, 132, 32, 128) == 0             # 134 CTAs: more than the SMs
    assert split_pieces(40, 132, 1, 128, min_keys=0) == 0  # one key block: nothing to cut
    assert split_pieces(8, 132, 256, 128, max_pieces=2) == 2
    assert split_pieces(8, 132, 256, 128, pairs=True) == 2  # pairs: two pieces only
    assert split_pieces(8, 132, 24, 128, min_keys=0) == 6   # a piece keeps SPLIT_MIN_PIECE_KEYS
    assert split_pieces(8, 132, 24, 128, min_keys=0, min_piece_keys=1024) == 3  # causal chunks'
    # a piece never holds less than a key block, whatever it is asked to keep: P <= blocks
    assert split_pieces(4, 132, 5, 128, min_keys=0, min_piece_keys=16) == 5
    assert stream_k_grid(66, 132, 66, 2) == 132 and stream_k_grid(66, 132, 0) == 66
    assert stream_k_grid(8, 132, 8, 8) == 64
    # stream_k_tiles cuts only calls of more units than SMs, whose grid stays one CTA an SM
    assert stream_k_grid(200, 132, 200) == 132


def test_stream_k_cuts_only_where_the_last_round_idles():
    assert stream_k_tiles(2048, 132, 64, 128) == 200      # 15.5 rounds: the last two are cut
    assert stream_k_tiles(2112, 132, 64, 128) == 0        # whole rounds
    assert stream_k_tiles(100, 132, 64, 128) == 0         # one round, not full: nothing to gain
    assert stream_k_tiles(132 * 16 + 130, 132, 64, 128) == 0  # 2 of 132 SMs idle: under 1/8
    assert stream_k_tiles(2048, 132, 16, 128) == 0        # 2k keys: under STREAM_K_MIN_KEYS
    assert stream_k_tiles(2048, 132, 16, 128, min_keys=0) == 200
    assert STREAM_K_MIN_KEYS == 4096


def _paired_stream_k_schedule(num_m_blocks, num_bh, num_ctas, key_blocks):
    """The paired order with its stream-K tail, as FlashFwdSm90.paired_item_coords walks it: per
    CTA its work in key blocks; per (m_block, bh, key block) how many pieces visit it; per cut
    tile its merge record (the unit's number among the cut units) and piece count."""
    units = paired_units(num_m_blocks, num_bh)
    unit_blocks, fewest = paired_unit_blocks(num_m_blocks, key_blocks)
    assert fewest > 0
    cut = stream_k_tiles(units, min(units, num_ctas), unit_blocks, 128, min_keys=0)
    pieces = 0 if cut else split_pieces(units, num_ctas, unit_blocks, 128, min_keys=0, pairs=True)
    cut = cut or (units if pieces else 0)
    grid = stream_k_grid(units, num_ctas, cut, pieces)
    dp_end = 2 * (units - cut)
    assert dp_end % (2 * grid) == 0  # the uncut units are whole rounds: the slots stay aligned
    total = dp_end + 2 * STREAM_K_PIECES_PER_CTA * grid if cut else 2 * grid * -(-units // grid)
    cover, cut_pieces, records, work = {}, {}, {}, []
    for c in range(grid):
        w = 0
        for tile in range(c, total, grid):
            if tile < dp_end or not cut:
                m, bh, active = paired_tile(tile, grid, num_m_blocks, num_bh)
                start, end, is_cut = 0, key_blocks(m), False
            else:
                piece = (tile - dp_end) // grid
                second = piece % 2
                slot, u_start, u_end, valid = stream_k_piece(c, piece // 2, grid, cut, unit_blocks, max, min)
                unit = units - cut + slot
                m, bh, active = pair_of_unit(unit, second, num_m_blocks, num_bh)
                m_heavy = pair_of_unit(unit, 0, num_m_blocks, num_bh)[0]
                blocks = key_blocks(m)
                start, end = tile_share(u_start, u_end, second * key_blocks(m_heavy), blocks, max, min)
                active = active and valid and start < end
                is_cut = start > 0 or end < blocks
                if active and is_cut:
                    cut_pieces[(m, bh)] = cut_pieces.get((m, bh), 0) + 1
                    assert records.setdefault(slot, (m, bh)) == (m, bh)  # one cut tile per unit
            if not active:
                continue
            for n in range(start, end):
                cover[(m, bh, n)] = cover.get((m, bh, n), 0) + 1
            w += end - start
        work.append(w)
    return cut, unit_blocks, cover, cut_pieces, work


@pytest.mark.parametrize("num_m_blocks, num_bh, num_ctas, shape", [
    (128, 16, 132, "diag"), (64, 32, 132, "diag"), (32, 64, 132, "diag"), (64, 64, 132, "diag"),
    (86, 32, 132, "wide"), (43, 64, 132, "wide"), (22, 128, 132, "wide"), (17, 40, 132, "diag"),
    (9, 7, 5, "wide"), (4, 33, 16, "offset"), (7, 3, 5, "offset"), (1, 300, 132, "diag"),
    (32, 4, 132, "diag"), (8, 4, 40, "diag"), (9, 3, 40, "wide"), (3, 4, 30, "offset")])  # cut in two
def test_paired_stream_k_covers_every_key_block_once_and_cuts_a_tile_at_most_once(
        num_m_blocks, num_bh, num_ctas, shape):
    """Units of (nearly) equal work: square causal tiles (diag), 192-row query tiles over 128-key
    blocks (wide: hd64's three warpgroups) and a bottom-right offset (more keys than queries)."""
    key_blocks = {"diag": lambda m: m + 1, "wide": lambda m: -(-(m + 1) * 3 // 2),
                  "offset": lambda m: m + 3}[shape]
    cut, unit_blocks, cover, cut_pieces, work = _paired_stream_k_schedule(
        num_m_blocks, num_bh, num_ctas, key_blocks)
    assert cut > 0
    want = {(m, bh, n) for m in range(num_m_blocks) for bh in range(num_bh) for n in range(key_blocks(m))}
    assert set(cover) == want and set(cover.values()) == {1}
    assert set(cut_pieces.values()) <= {2}  # a cut tile has two pieces: one merge
    total = sum(key_blocks(m) for m in range(num_m_blocks)) * num_bh
    units = paired_units(num_m_blocks, num_bh)
    grid = stream_k_grid(units, num_ctas, cut, 2 if cut == units and 2 * units <= num_ctas else 0)
    # the busiest CTA carries the average work up to a unit's spread of work plus a key block;
    # without the cut it would carry a whole unit more than most (the last round)
    mid = num_m_blocks // 2
    costs = [key_blocks(num_m_blocks - 1 - p) + key_blocks(p) for p in range(mid)]
    if num_m_blocks % 2:  # two heads' middle blocks (a lone last head's alone)
        costs += [2 * key_blocks(mid)] + ([key_blocks(mid)] if num_bh % 2 else [])
    spread = unit_blocks - min(costs)
    assert max(work) <= -(-total // grid) + spread + 1
    if unit_blocks > 1:  # (one key block per unit: nothing finer than a unit to share out)
        assert max(work) < -(-paired_units(num_m_blocks, num_bh) // grid) * unit_blocks


def test_paired_unit_blocks_is_the_heaviest_pair_and_flags_empty_tiles():
    assert paired_unit_blocks(128, lambda m: m + 1) == (129, 1)
    assert paired_unit_blocks(5, lambda m: m + 1) == (6, 1)      # middle unit: block 2 alone, 3 keys
    assert paired_unit_blocks(3, lambda m: max(m - 1, 0)) == (1, 0)  # a tile with no key block


def _window_blocks(m, win_left, seqlen_q, seqlen_k, tile=128):
    """Key blocks query block m visits under a causal window (the kernel's key_block_bounds)."""
    off = seqlen_k - seqlen_q
    lo = max(m * tile + off - win_left, 0) // tile
    hi = min(-(-(min((m + 1) * tile, seqlen_q) + off) // tile), -(-seqlen_k // tile))
    return max(hi - lo, 0)


def _window_schedule(num_m_blocks, num_bh, num_sms, light, section, light_section):
    """Per CTA, the (m_block, bh) it runs (grid: one CTA per SM up to the tile count)."""
    ctas = min(num_m_blocks * num_bh, num_sms)
    runs = [[] for _ in range(ctas)]
    for t in range(window_order_slots(num_m_blocks * num_bh, ctas)):
        m, bh, valid = window_order_tile(t, ctas, num_m_blocks, num_bh, light, section, light_section, min, max)
        if valid:
            runs[t % ctas].append((m, bh))
    return runs


@pytest.mark.parametrize("num_m_blocks, num_bh, num_sms, light, section, light_section", [
    (128, 16, 132, 8, 4, 16), (64, 32, 132, 8, 8, 32), (8, 16, 132, 8, 16, 16), (8, 16, 132, 0, 16, 16),
    (5, 3, 132, 2, 2, 3), (1, 1, 132, 1, 1, 1), (33, 7, 5, 4, 3, 2), (16, 128, 132, 16, 128, 56),
    (9, 2, 4, 3, 1, 1), (16, 128, 132, 8, 32, 56)])
def test_window_order_runs_every_tile_once(num_m_blocks, num_bh, num_sms, light, section, light_section):
    runs = _window_schedule(num_m_blocks, num_bh, num_sms, light, section, light_section)
    tiles = sorted(t for r in runs for t in r)
    assert tiles == [(m, bh) for m in range(num_m_blocks) for bh in range(num_bh)]
    order = [window_order_tile(t, 10 ** 6, num_m_blocks, num_bh, light, section, light_section, min, max)
             for t in range(num_m_blocks * num_bh)]  # one round: the order itself
    full = num_m_blocks - light
    assert all(m >= light for m, _, _ in order[:full * num_bh])  # full tiles first
    # then the light ones, section by section of heads, heaviest first within each
    sections = [bh // light_section for _, bh, _ in order[full * num_bh:]]
    assert sections == sorted(sections)
    for s in set(sections):
        ms = [m for (m, _, _), sec in zip(order[full * num_bh:], sections) if sec == s]
        assert ms == sorted(ms, reverse=True)


@pytest.mark.parametrize("seqlen_q, seqlen_k, win_left", [(16384, 16384, 1024), (1000, 1000, 1000),
                                                          (300, 900, 700), (900, 300, 100), (4096, 4096, 0),
                                                          (2048, 2048, 5000), (129, 129, 127)])
def test_light_query_blocks_are_the_ones_the_key_start_clips(seqlen_q, seqlen_k, win_left):
    nm = -(-seqlen_q // 128)
    light = light_query_blocks(win_left, seqlen_q, seqlen_k, 128, nm, min, max)
    full = max(_window_blocks(m, win_left, seqlen_q, seqlen_k) for m in range(nm))
    for m in range(nm):
        if m >= light:  # past the light ones the window's start is at key 0 or later
            assert m * 128 + seqlen_k - seqlen_q - win_left >= 0
        else:
            assert m * 128 + seqlen_k - seqlen_q - win_left < 0
            assert _window_blocks(m, win_left, seqlen_q, seqlen_k) <= full


@pytest.mark.parametrize("seqlen, batch, win_left", [(16384, 1, 1024), (8192, 2, 1024), (16384, 1, 2048),
                                                     (2048, 8, 1024), (4096, 4, 1024)])
def test_window_order_balances_window_work(seqlen, batch, win_left):
    """The bench's window cell (hd128, 16 heads x 16k, W = 1024) and its neighbours on 132 SMs,
    a tile costing its key blocks plus a fixed overhead: the mean load is at least 0.94 of the
    window order's busiest CTA (0.948-0.995 here; the paired order it replaced: 0.889-0.952)."""
    nm, bh, sms, overhead = seqlen // 128, 16 * batch, 132, 1.5

    def cost(m):
        return _window_blocks(m, win_left, seqlen, seqlen) + overhead

    light = light_query_blocks(win_left, seqlen, seqlen, 128, nm, min, max)
    section = min(heads_per_section(seqlen, 128 * 4, max), bh)
    light_section = min(heads_per_section((light + 1) * 128, 128 * 4, max), bh)
    work = [sum(cost(m) for m, _ in r) for r in _window_schedule(nm, bh, sms, light, section, light_section)]
    mean = sum(cost(m) for m in range(nm)) * bh / sms
    paired = [0.0] * sms
    for t in range(2 * sms * -(-paired_units(nm, bh) // sms)):
        m, _, valid = paired_tile(t, sms, nm, bh)
        paired[t % sms] += cost(m) if valid else 0.0
    assert mean / max(work) >= 0.94 and max(work) < max(paired)


@pytest.mark.parametrize("units, sections_of, num_ctas", [(2048, 512, 132), (64, 16, 9), (48, 48, 7), (5, 2, 8)])
def test_lpt_unit_table_deals_sections_one_after_another(units, sections_of, num_ctas):
    """lpt_unit_table with sections (the block-sparse unit table's L2 sections of heads): every
    unit once, each CTA's units section by section and heaviest first within one, and the
    busiest CTA still within LPT's bound (the mean plus one unit)."""
    import random

    rng = random.Random(units)
    costs = [rng.randint(8, 26) + 1.5 for _ in range(units)]
    sections = [u // sections_of for u in range(units)]
    ctas = min(units, num_ctas)
    rounds, table, busiest = lpt_unit_table(costs, ctas, sections)
    assert len(table) == rounds * ctas and sorted(u for u in table if u >= 0) == list(range(units))
    for c in range(ctas):
        mine = [table[k * ctas + c] for k in range(rounds) if table[k * ctas + c] >= 0]
        # a CTA's units come in table order with no gap (its -1 slots are its last)
        assert all(table[k * ctas + c] < 0 for k in range(len(mine), rounds))
        keys = [(sections[u], -costs[u]) for u in mine]
        assert keys == sorted(keys)
    assert busiest <= sum(costs) / ctas + max(costs) + 1e-9
