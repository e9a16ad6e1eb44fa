"""Order of the (query block, batch x head) tiles of a causal grid: heaviest first, in L2 sections.

Causal query blocks differ in work (block m visits about m + 1 key blocks), so the grid hands out
the heaviest first (longest-processing-time first; the hardware, or a persistent grid's stride,
then balances the light ones at the end). Doing that across *all* heads at once makes the CTAs
that run together belong to different heads: each streams its own head's K and V, nobody shares
them in L2, and short causal sequences become bound by memory (H100, hd128 2k causal: ~1.1 GB of
K/V reads per call at b8 x h16). So the heads are cut into sections whose K and V fit in
``L2_SECTION_BYTES``; the tiles of one section come together, heaviest first within it.

``heavy_first_in_sections`` is plain integer arithmetic, so the same code runs inside a CuTe DSL
kernel (Int32 operands, ``minimum=cutlass.min``) and in the CPU tests (Python ints, ``min``).
"""
from __future__ import annotations

import heapq
import math
import os

# K + V bytes of the heads whose tiles run together. H100/H200 have 50 / 60 MB of L2. Measured on
# an H100 (bf16 causal forward, 16k tokens, TFLOP/s at 1k / 2k; one section = the old order):
#   hd128: one section 251 / 311, 12 MB 325 / 452, 24 MB 311 / 445, 48 MB 295 / 438
#   hd256: one section 255 / 465, 12 MB 380 / 516, 24 MB 377 / 501, 48 MB 371 / 527
#   hd64 : one section 226 / 295, 12 MB 205 / 298, 24 MB 203 / 291, 48 MB 200 / 287
# (8k-16k within +-5 % of each other); 32 MB, with GQA groups counted once (their query heads
# share K/V), is the middle of what won. DUALATTN_L2_SECTION_BYTES
# overrides it (tuning; it is part of the sm90 compile key, so cached kernels never mix values);
# a huge value gives one section, i.e. heaviest first across all heads.
L2_SECTION_BYTES = int(os.environ.get("DUALATTN_L2_SECTION_BYTES", 32 * 1024 * 1024))


def heads_per_section(seqlen_k, kv_row_bytes: int, maximum: callable, section_bytes: int = L2_SECTION_BYTES):
    """How many (batch, head) pairs' K and V (``seqlen_k`` rows of ``kv_row_bytes``) fit in a section
    (at least 1)."""
    # rows first: seqlen_k * kv_row_bytes could pass 2**31 in an Int32 kernel value
    return maximum((section_bytes // kv_row_bytes) // maximum(seqlen_k, 1), 1)


def heavy_first_in_sections(tile, num_m_blocks, num_bh, section_heads, minimum):
    """(m_block, bh) of linear tile index ``tile`` in [0, num_m_blocks * num_bh): sections of
    ``section_heads`` consecutive bh in order; inside a section the last query block of each of
    its heads first, then the one before, ... The last section may hold fewer heads."""
    section_tiles = section_heads * num_m_blocks
    section = tile // section_tiles
    idx = tile - section * section_tiles
    heads_here = minimum(section_heads, num_bh - section * section_heads)
    m_block = num_m_blocks - 1 - idx // heads_here
    bh = section * section_heads + idx - (idx // heads_here) * heads_here
    return m_block, bh


def rotation_window(num_m_blocks, num_ctas):
    """Tiles between two turns of rotated_m_block: lcm(G, blocks), the tiles after which every
    CTA has been through all the query blocks that its stride reaches (host side; the kernel
    computes the same by Euclid's algorithm, FlashFwdSm90.rotation_window)."""
    return num_ctas * num_m_blocks // math.gcd(num_ctas, num_m_blocks)


def rotated_m_block(tile, num_m_blocks, window):
    """Query block of linear tile ``tile`` in the non-causal order (query block fastest: the CTAs
    of one round share heads' K / V in L2), turned by one every ``window`` tiles
    (rotation_window). On a persistent grid CTA c runs tiles c, c + G, ..., whose plain query
    blocks c + k G (mod blocks) reach only the blocks congruent to c modulo gcd(G, blocks): where
    that gcd is above 1, only some CTAs ever hold the last, partly filled block (hd64's 192-row
    tiles at 1k queries: 6 blocks on 132 SMs, the last with 64 rows, two of three warpgroups
    idle; hd128 at 1088 queries: 9 blocks, gcd 3), and with its empty warpgroups passed those
    CTAs would idle while the others still run full tiles. Turning the blocks by one each time
    the strides have cycled moves every CTA on to the next residue, so each holds the last block
    once in every ``blocks`` of its tiles. A window is a multiple of the block count, so the
    tiles of a head stay together and it stays a bijection; where gcd(G, blocks) = 1 the plain
    order spreads the blocks already and the turns change nothing that matters. Plain integer
    arithmetic (CPU model and kernel)."""
    return (tile % num_m_blocks + tile // window) % num_m_blocks


def _pair_groups(num_m_blocks):
    """(pairs per head, heads per group, units per group) of the paired order. An even count of
    query blocks pairs within each head (a group is one head); an odd count leaves each head a
    middle block, and the middle blocks of two heads make one more unit (a group is two heads:
    both heads' pairs, then their middles), so every unit costs the same (pair_of_unit)."""
    pairs = num_m_blocks // 2
    odd = num_m_blocks - 2 * pairs
    return pairs, 1 + odd, (1 + odd) * pairs + odd


def paired_units(num_m_blocks, num_bh):
    """Work units of the paired order (``paired_tile``): a pair of query blocks of one head, or
    (odd counts) the middle blocks of two heads; a last, lone head's middle block is a unit
    alone."""
    pairs, _, _ = _pair_groups(num_m_blocks)
    odd = num_m_blocks - 2 * pairs
    return num_bh * pairs + odd * ((num_bh + 1) // 2)


def paired_slot(tile, num_ctas):
    """(unit, second) of slot ``tile`` of the paired order: CTA c strides by ``num_ctas`` over
    two slots per unit, so it runs units c, c + num_ctas, ... whole (``second``: 0 for the
    unit's heavier block, 1 for its lighter one)."""
    k = tile // num_ctas
    unit = (tile - k * num_ctas) + (k // 2) * num_ctas
    return unit, k - (k // 2) * 2


def pair_of_unit(unit, second, num_m_blocks, num_bh):
    """(m_block, bh, valid) of block ``second`` of ``unit``. Units go group by group
    (_pair_groups): with an even count, head by head, each head's num_m_blocks / 2 units
    pairing query blocks p and num_m_blocks - 1 - p (heavier first); with an odd count, two
    heads at a time, their middle blocks first (one unit: the first head's, then the second's),
    then each head's pairs. ``valid`` is false past the last head (a lone last head's middle
    unit has one block). Branch-free (the kernel traces it with Int32 operands)."""
    pairs, heads_per_group, units_per_group = _pair_groups(num_m_blocks)
    odd = heads_per_group - 1
    group = unit // units_per_group
    r = unit - group * units_per_group
    middle = odd * (1 - (r + units_per_group - 1) // units_per_group)  # 1 for an odd count's r = 0
    rp = r - odd + middle  # the pair's number within the group (0 for the middle unit)
    head_of_pair = rp // (pairs + 1 // (pairs + 1))  # (one query block: no pairs, all middles)
    light = rp - head_of_pair * pairs
    heavy = num_m_blocks - 1 - light
    m_block = (heavy - second * (heavy - light)) * (1 - middle) + pairs * middle
    bh = group * heads_per_group + head_of_pair * (1 - middle) + second * middle
    return m_block, bh, bh < num_bh


def paired_tile(tile, num_ctas, num_m_blocks, num_bh):
    """(m_block, bh, valid) of slot ``tile`` of a persistent causal grid of ``num_ctas`` CTAs that
    strides by ``num_ctas`` over 2 * num_ctas * ceil(units / num_ctas) slots.

    The unit of work is a pair of query blocks of one head, p and num_m_blocks - 1 - p (heavier
    first), or with an odd count the middle blocks of two heads (pair_of_unit). Causal block m
    visits about m + 1 key blocks, so every unit costs about the same (num_m_blocks + 1 blocks;
    with Sq != Sk the offset is the same for all). CTA c runs unit
    c, c + num_ctas, ... whole, two slots per unit: the static stride is then balanced up to one
    unit, where heaviest-first single tiles left 11-13 % of the SM time idle at hd128 1k-4k (the
    CPU model of tests/test_tile_order.py; Nsight Compute measured 12 % at 1k). Units go head
    by head, so the CTAs running together share a few heads' K/V in L2.
    Plain integer arithmetic: the kernels trace it with Int32 operands."""
    unit, second = paired_slot(tile, num_ctas)
    return pair_of_unit(unit, second, num_m_blocks, num_bh)


# -- the paired order's tail as single tiles -----------------------------------------------------
#
# Pairs too short to be cut along the keys (stream-K's key minimum) keep the static stride's
# partly filled last round: R = units % G of the G CTAs run one unit more than the rest, about
# 1 / rounds of the SM time idle (the bench's 16k-token causal cells at 1k / 2k keys: 7.76 or
# 15.5 rounds on 132 SMs, ~3 %; a 4.2-round shape, 22 %). Instead the order's last groups of
# heads (_pair_groups) can run as single tiles, heaviest first (query block n - 1 of every tail
# head, then n - 2, ...), dealt to the CTAs by the launch (split_tail_table): each to the CTA
# with the least modelled work so far (longest-processing-time first, LPT: the CTAs' whole pairs
# count first), or in a snake (round k forwards from the CTAs with fewer pairs, round k + 1
# backwards), whichever models better: LPT wins on most shapes (a 4.2-round shape: 1.06 -> 1.02
# of the mean), the snake on some with few tiles a CTA. The kernel reads the deal from a table of
# tail tile numbers, one per slot (round k of CTA c at k G + c, -1 for none), once per tail slot.
# Nothing is cut, so nothing is merged. The tail's heads run at once, so their K/V must fit in
# L2; the launch tries the tail sizes that fit, up to the smallest covering the partly filled round
# and one more, and keeps the smallest of the best modelled ones, or none where it gains under
# 1 % (split_tail_plan; H100 / H200 A/Bs: docs sections 25 and 52).

def split_tail_groups(units, units_per_group, num_groups, num_ctas, minimum):
    """The smallest tail that covers the grid's partly filled last round and one round more
    (G + R units' worth of whole groups of heads); 0 where every round is full (R = 0, also when
    there are no more units than CTAs). The plan's search goes no further."""
    rem = units - (units // num_ctas) * num_ctas
    return (minimum((num_ctas + rem + units_per_group - 1) // units_per_group, num_groups)
            * minimum(rem, 1))


def _split_tail(num_m_blocks, num_bh, num_ctas, tail, minimum):
    """(units before the tail, slots they take, first tail head, tail heads) of split_tail_tile
    with ``tail`` groups split."""
    _, heads_per_group, units_per_group = _pair_groups(num_m_blocks)
    num_groups = (num_bh + heads_per_group - 1) // heads_per_group
    dp_units = (num_groups - tail) * units_per_group
    first_head = minimum((num_groups - tail) * heads_per_group, num_bh)  # (a lone last head)
    return dp_units, 2 * num_ctas * ((dp_units + num_ctas - 1) // num_ctas), first_head, num_bh - first_head


def split_tail_pair_slots(num_m_blocks, num_bh, num_ctas, tail, minimum):
    """Slots of the whole pairs before the tail (two per unit, whole rounds of the grid): slot
    t >= this reads entry t - this of the tail table."""
    return _split_tail(num_m_blocks, num_bh, num_ctas, tail, minimum)[1]


def split_tail_slots(num_m_blocks, num_bh, num_ctas, tail, rounds, minimum):
    """Bound of the loop over split_tail_tile's slots: the pairs' slots, then ``rounds`` rounds
    of tail slots (the table's)."""
    return split_tail_pair_slots(num_m_blocks, num_bh, num_ctas, tail, minimum) + num_ctas * rounds


def split_tail_tile(tile, num_ctas, num_m_blocks, num_bh, tail, tail_j, maximum, minimum):
    """(m_block, bh, valid) of slot ``tile`` of the paired order with its last ``tail`` groups
    split: slots before the tail are paired_tile's, restricted to the units before it; a tail
    slot takes tail tile ``tail_j`` (the table's entry for the slot, which the caller reads; -1
    for none, and any value for a pair's slot), the tail's tiles numbered heaviest first (tile j:
    query block n - 1 - j // heads of tail head j % heads). ``tail`` = 0 is the paired order.
    Branch-free, so the kernel and the CPU model run the same code."""
    dp_units, dp_slots, first_head, heads = _split_tail(num_m_blocks, num_bh, num_ctas, tail, minimum)
    unit, second = paired_slot(tile, num_ctas)
    m_dp, bh_dp, valid_dp = pair_of_unit(unit, second, num_m_blocks, num_bh)
    j = maximum(tail_j, 0)
    per_block = maximum(heads, 1)
    m_tail = num_m_blocks - 1 - j // per_block
    bh_tail = first_head + j - (j // per_block) * per_block
    in_tail = minimum(maximum(tile - dp_slots + 1, 0), 1)  # 0 or 1
    m_block = m_dp + (m_tail - m_dp) * in_tail
    bh = bh_dp + (bh_tail - bh_dp) * in_tail
    valid = ((valid_dp & (unit < dp_units) & (tile < dp_slots))
             | ((tail_j >= 0) & (tail_j < heads * num_m_blocks) & (tile >= dp_slots)))
    return m_block, bh, valid


def pair_prefix(num_m_blocks, num_bh, num_ctas, tile_cost):
    """Per CTA, the running modelled work of the whole pairs the paired order's stride gives it
    (CTA c runs units c, c + G, ...): ``prefix[c][i]`` is its first i units' work, each tile
    ``tile_cost(m_block)`` (units differ: an odd count's middle unit, tiles whose key blocks do
    not grow evenly, such as 192-row tiles on 128-key blocks). O(units), once per plan."""
    _, heads_per_group, units_per_group = _pair_groups(num_m_blocks)
    prefix = [[0.0] for _ in range(num_ctas)]
    # (whole groups: a lone last head's group has slots past its units, which cost nothing)
    for u in range(-(-num_bh // heads_per_group) * units_per_group):
        work = 0.0
        for second in (0, 1):
            m, _, valid = pair_of_unit(u, second, num_m_blocks, num_bh)
            work += tile_cost(m) if valid else 0.0
        runs = prefix[u % num_ctas]
        runs.append(runs[-1] + work)
    return prefix


def _tail_loads(num_m_blocks, num_bh, num_ctas, tail, prefix):
    """(each CTA's modelled work before the tail: its whole pairs, tail heads, CTAs with one pair
    more)."""
    dp_units, _, _, heads = _split_tail(num_m_blocks, num_bh, num_ctas, tail, min)
    base, extra = dp_units // num_ctas, dp_units % num_ctas
    return [prefix[c][base + (c < extra)] for c in range(num_ctas)], heads, extra


def _lpt(num_m_blocks, num_ctas, loads, heads, extra, costs, per_cta):
    """Deal the tail tiles in order (heaviest first; ``costs`` by j // heads), each to the CTA
    with the least work so far, ties to the lowest CTA; appends them to ``per_cta`` (if given)
    and returns the busiest CTA's work."""
    heap = [(w, c) for c, w in enumerate(loads)]
    heapq.heapify(heap)
    for j in range(heads * num_m_blocks):
        work, c = heap[0]
        if per_cta is not None:
            per_cta[c].append(j)
        heapq.heapreplace(heap, (work + costs[j // heads], c))
    return max(w for w, _ in heap)


def _snake(num_m_blocks, num_ctas, loads, heads, extra, costs, per_cta):
    """Deal the tail tiles in a snake: round k deals tiles k G .. k G + G - 1 forwards when k
    is even, backwards when odd, from the CTAs that ran one unit less (``extra`` on); appends
    them to ``per_cta`` (if given) and returns the busiest CTA's work."""
    loads = list(loads)
    for j in range(heads * num_m_blocks):
        k, pos = divmod(j, num_ctas)
        c = ((num_ctas - 1 - pos if k % 2 else pos) + extra) % num_ctas
        loads[c] += costs[j // heads]
        if per_cta is not None:
            per_cta[c].append(j)
    return max(loads)


TAIL_DEALS = {"lpt": _lpt, "snake": _snake}


def _deal(num_m_blocks, num_bh, num_ctas, tail, costs, deal, prefix, per_cta=None):
    loads, heads, extra = _tail_loads(num_m_blocks, num_bh, num_ctas, tail, prefix)
    return TAIL_DEALS[deal](num_m_blocks, num_ctas, loads, heads, extra, costs, per_cta)


def split_tail_table(num_m_blocks, num_bh, num_ctas, tail, tile_cost, deal="lpt", prefix=None):
    """(rounds, table, busiest CTA's modelled work) of the tail's tiles dealt to the CTAs
    (``deal``: "lpt", longest-processing-time first: each tile, heaviest first, to the CTA with
    the least work so far, its whole pairs counted (``prefix``: pair_prefix's, made here if not
    given); or "snake", alternate rounds forwards and backwards from the CTAs with fewer pairs).
    ``table[k * num_ctas + c]`` is CTA c's k-th tail tile, -1 past its last. Host-side, O(tail
    tiles x log CTAs), and O(units) for the prefix where none is given."""
    costs = [tile_cost(num_m_blocks - 1 - m) for m in range(num_m_blocks)]  # heaviest first
    if prefix is None:
        prefix = pair_prefix(num_m_blocks, num_bh, num_ctas, tile_cost)
    per_cta = [[] for _ in range(num_ctas)]
    busiest = _deal(num_m_blocks, num_bh, num_ctas, tail, costs, deal, prefix, per_cta)
    rounds = max(len(r) for r in per_cta)
    table = [-1] * (rounds * num_ctas)
    for c, r in enumerate(per_cta):
        for k, j in enumerate(r):
            table[k * num_ctas + c] = j
    return rounds, table, busiest


SPLIT_TAIL_MIN_GAIN = 0.01  # see split_tail_plan
SPLIT_TAIL_SLACK = 0.005    # see split_tail_plan
SPLIT_TAIL_SEARCH_TILES = 20000  # tail tiles split_tail_plan deals over its tries, per deal (two deals)


def split_tail_plan(num_m_blocks, num_bh, num_ctas, tile_cost, tail_fits=lambda heads: True,
                    min_gain=SPLIT_TAIL_MIN_GAIN):
    """(groups, rounds, table) the launch passes (split_tail_tile, split_tail_table), or (0, 0,
    []) for whole pairs. Tail sizes up to the smallest that covers the partly filled round and
    one more (split_tail_groups) whose heads' K/V fit L2 (``tail_fits(tail heads)``), every one
    or evenly spread ones within SPLIT_TAIL_SEARCH_TILES dealt tiles, are modelled with both deals
    (``tile_cost(m_block)`` per tile); the smallest whose busiest CTA carries within
    SPLIT_TAIL_SLACK of the least is kept if that is ``min_gain`` below whole pairs' busiest
    CTA. Larger tails measured slower: they trade more pairs (two tiles of
    one head back to back on a CTA) for single tiles of many heads at once, which the model does
    not price (H200, GQA 32/8 causal 2k: 34 / 106 groups against 25 ran 1.0 / 3.5 % slower;
    13 groups level). Host-side, once per spec (the launch memo): 1-11 ms at the bench's shapes;
    grids of many rounds return before modelling (nothing to gain)."""
    _, heads_per_group, units_per_group = _pair_groups(num_m_blocks)
    units = paired_units(num_m_blocks, num_bh)
    num_groups = (num_bh + heads_per_group - 1) // heads_per_group
    smallest = split_tail_groups(units, units_per_group, num_groups, num_ctas, min)
    if smallest == 0:
        return 0, 0, []

    def heads_of(tail):
        return _split_tail(num_m_blocks, num_bh, num_ctas, tail, min)[3]

    span = [t for t in range(1, smallest + 1) if tail_fits(heads_of(t))]
    if not span:
        return 0, 0, []
    # no plan's busiest CTA carries less than the mean, and whole pairs' busiest carries at most
    # its rounds of the heaviest unit: where even that is within min_gain of the mean (many
    # rounds), nothing can gain, and the O(units) model below is skipped
    costs = [tile_cost(num_m_blocks - 1 - m) for m in range(num_m_blocks)]  # heaviest first
    heaviest_unit = max([costs[p] + costs[num_m_blocks - 1 - p] for p in range(num_m_blocks // 2)]
                        + [2 * costs[num_m_blocks // 2]] * (num_m_blocks % 2))
    mean = num_bh * sum(costs) / num_ctas
    if mean > (1 - min_gain) * -(-units // num_ctas) * heaviest_unit:
        return 0, 0, []
    prefix = pair_prefix(num_m_blocks, num_bh, num_ctas, tile_cost)
    whole = max(p[-1] for p in prefix)
    # every size where the deals stay within SPLIT_TAIL_SEARCH_TILES tiles in all (the model is
    # not monotone in the size: a 1.94-round GQA shape gains 2.6 % at 16 groups, nothing at 17),
    # else evenly spaced ones
    tiles = len(span) * (span[-1] + 1) * heads_per_group * num_m_blocks // 2
    step = max(1, -(-tiles // SPLIT_TAIL_SEARCH_TILES))
    tries = sorted(set(span[::-step]))
    plans = [(_deal(num_m_blocks, num_bh, num_ctas, tail, costs, deal, prefix), tail, deal)
             for tail in tries for deal in TAIL_DEALS]
    # the smallest tail within SPLIT_TAIL_SLACK of the best (see above)
    least = min(p[0] for p in plans)
    busiest, tail, deal = min((p for p in plans if p[0] <= least * (1 + SPLIT_TAIL_SLACK)),
                              key=lambda p: (p[1], p[0]))
    if busiest > (1 - min_gain) * whole:
        return 0, 0, []
    rounds, table, _ = split_tail_table(num_m_blocks, num_bh, num_ctas, tail, tile_cost, deal, prefix)
    return tail, rounds, table


# -- the window order: full tiles in L2 sections, then the light ones, dealt in a snake ---------
#
# A causal sliding window (left bound W) gives every query block the same W / tile_n + 1 key
# blocks, except the first ceil(W / tile_m) blocks of each head, clipped at key 0 (1, 2, ... W /
# tile_n blocks). The paired order's units (p, n - 1 - p) then differ in work wherever p is light,
# and its static stride left the bench's window 1024 cell (hd128, 16 heads x 16k, 132 SMs) at
# 0.944 of the mean CTA load in tests/test_tile_order.py's model (CTAs of 16 full tiles beside
# ones of 14 and two light). Instead: the full tiles first, heaviest-first L2 sections as the
# causal order has them (their K/V window stays in L2), then every head's light tiles heaviest
# first (in sections of heads whose first key blocks fit L2 together), the slots dealt in a snake
# (round k forwards, round k + 1 backwards) so that the heavy light tiles meet the CTAs the snake
# left lighter: 0.991 in the same model, as longest-processing-time first (0.991).

def light_query_blocks(win_left, seqlen_q, seqlen_k, tile_m, num_m_blocks, minimum, maximum):
    """Query blocks at the start of a head whose first row's left window bound falls before
    key 0 (bottom-right aligned: row i sees keys from i + Sk - Sq - W), i.e. the blocks the
    clip at key 0 leaves lighter; at most ``num_m_blocks``."""
    return minimum((maximum(win_left - (seqlen_k - seqlen_q), 0) + tile_m - 1) // tile_m,
                   num_m_blocks)


def window_order_slots(num_tiles, num_ctas):
    """Bound of the loop over window_order_tile's slots: whole rounds of the grid."""
    return num_ctas * ((num_tiles + num_ctas - 1) // num_ctas)


def window_order_tile(slot, num_ctas, num_m_blocks, num_bh, light, section_heads, light_section_heads,
                      minimum, maximum):
    """(m_block, bh, valid) of slot ``slot`` of the window order: slot k G + c (CTA c of a grid
    of G striding by G) takes item k G + c in even rounds and k G + G - 1 - c in odd ones;
    items [0, F) are the F = (num_m_blocks - light) * num_bh full tiles in
    heavy_first_in_sections' order over query blocks light .. num_m_blocks - 1, then the light
    tiles in the same order over blocks 0 .. light - 1 in sections of ``light_section_heads``
    (heads whose first light + 1 key blocks fit L2 together: every head at the bench's shapes).
    ``valid`` is false for the items past the last tile (the last round's snake). Branch-free
    (the kernel traces it with Int32 operands)."""
    k = slot // num_ctas
    pos = slot - k * num_ctas
    item = k * num_ctas + pos + (k - (k // 2) * 2) * (num_ctas - 1 - 2 * pos)
    full_blocks = num_m_blocks - light
    full_tiles = full_blocks * num_bh
    in_light = minimum(maximum(item - full_tiles + 1, 0), 1)  # 0 or 1
    m_full, bh_full = heavy_first_in_sections(minimum(item, maximum(full_tiles - 1, 0)),
                                              maximum(full_blocks, 1), num_bh, section_heads, minimum)
    # (both clamped into their ranges: the last round's items past the tiles divide by nothing)
    j = minimum(maximum(item - full_tiles, 0), maximum(light * num_bh - 1, 0))
    m_light, bh_light = heavy_first_in_sections(j, maximum(light, 1), num_bh, light_section_heads, minimum)
    m_block = (m_full + light) + (m_light - m_full - light) * in_light
    bh = bh_full + (bh_light - bh_full) * in_light
    return m_block, bh, item < num_m_blocks * num_bh


def varlen_paired_units(tiles_per_sequence, num_heads):
    """Units of the varlen paired order: sequence by sequence, paired_units(n, heads) for a
    sequence of n query blocks. A CPU model of the kernel's search (FlashFwdSm90.varlen_unit_doc)
    and of its slot bound; the kernel computes the same sums with a warp scan over cu_seqlens."""
    return sum(paired_units(n, num_heads) for n in tiles_per_sequence)


def varlen_paired_tile(tile, num_ctas, tiles_per_sequence, num_heads):
    """(m_block, sequence, head, valid) of slot ``tile`` of the varlen paired order (CPU model):
    units numbered across sequences without gaps, so the static stride stays balanced up to one
    unit as in the batched order; a unit pairs blocks p and n - 1 - p of its own sequence."""
    unit, second = paired_slot(tile, num_ctas)
    first = 0
    for seq, n in enumerate(tiles_per_sequence):
        count = paired_units(n, num_heads)
        if unit < first + count:
            m_block, head, valid = pair_of_unit(unit - first, second, n, num_heads)
            return m_block, seq, head, valid
        first += count
    return 0, len(tiles_per_sequence), 0, False


def varlen_paired_unit_costs(tiles_per_sequence, num_heads, tile_cost):
    """Modelled work of every unit of the varlen paired order, in the kernel's unit order
    (varlen_paired_units): ``tile_cost(sequence, m_block)`` per tile of the unit."""
    costs = []
    for seq, n in enumerate(tiles_per_sequence):
        units = paired_units(n, num_heads)
        if units == 0:
            continue
        _, heads_per_group, per_group = _pair_groups(n)

        def unit_cost(r):
            work = 0.0
            for second in (0, 1):
                m_block, _, valid = pair_of_unit(r, second, n, num_heads)
                work += tile_cost(seq, m_block) if valid else 0.0
            return work

        # a unit's work depends on its place in its group of heads only, except in a last,
        # partly filled group (a lone head's middle unit): one group costed, then repeated
        group = [unit_cost(r) for r in range(per_group)]
        whole = num_heads // heads_per_group
        costs += group * whole
        costs += [unit_cost(r) for r in range(whole * per_group, units)]
    return costs


def static_stride_loads(costs, num_ctas):
    """Each CTA's modelled work when CTA c runs units c, c + num_ctas, ... (the static stride)."""
    loads = [0.0] * num_ctas
    for u, work in enumerate(costs):
        loads[u % num_ctas] += work
    return loads


def lpt_unit_table(costs, num_ctas, sections=None):
    """(rounds, table, busiest CTA's modelled work) of units dealt longest-processing-time first:
    each unit, heaviest first (ties: the lower unit, so a sequence's units stay together), to
    the CTA with the least work so far (ties: the lower CTA). ``table[k * num_ctas + c]`` is CTA
    c's k-th unit, -1 past its last; every CTA's units come heaviest first, so the grid's k-th
    round runs units of about one weight together, as the static stride's rounds do. With
    ``sections`` (a section number per unit) the sections are dealt one after another, each
    heaviest first, onto the loads the earlier ones left: the CTAs then run one section's units
    at about the same time (heads whose K / V fit in L2 together), and the busiest CTA's work
    stays that of one deal. Host-side, O(units x log CTAs)."""
    heap = [(0.0, c) for c in range(num_ctas)]
    per_cta = [[] for _ in range(num_ctas)]
    replace = heapq.heapreplace
    order = ([(0, -w, u) for u, w in enumerate(costs)] if sections is None
             else [(sec, -w, u) for u, (w, sec) in enumerate(zip(costs, sections))])
    for _, minus_work, u in sorted(order):
        work, c = heap[0]
        per_cta[c].append(u)
        replace(heap, (work - minus_work, c))
    rounds = max((len(r) for r in per_cta), default=0)
    table = [-1] * (rounds * num_ctas)
    for c, r in enumerate(per_cta):
        for k, u in enumerate(r):
            table[k * num_ctas + c] = u
    return rounds, table, max((w for w, _ in heap), default=0.0)


def varlen_paired_tile_from_table(tile, num_ctas, tiles_per_sequence, num_heads, table):
    """varlen_paired_tile with the units dealt by a launch table (lpt_unit_table): slot
    ``tile``'s unit slot is looked up, and -1 (past a CTA's last unit) is an empty slot. A CPU
    model of FlashFwdSm90.varlen_paired_tile with the table."""
    unit_slot, second = paired_slot(tile, num_ctas)
    unit = table[unit_slot] if unit_slot < len(table) else -1
    if unit < 0:
        return 0, len(tiles_per_sequence), 0, False
    return varlen_paired_tile(_slot_of_unit(unit, second, num_ctas), num_ctas, tiles_per_sequence,
                              num_heads)


def _slot_of_unit(unit, second, num_ctas):
    """The static order's slot of block ``second`` of ``unit`` (paired_slot's inverse)."""
    k = 2 * (unit // num_ctas) + second
    return k * num_ctas + unit % num_ctas


# -- stream-K tail: the grid's last, partly filled round split along the keys -----------------
#
# A persistent grid of G CTAs walking T equal tiles with a stride finishes in ceil(T / G) rounds;
# with T % G = R > 0 the last round leaves G - R SMs idle. The bench's 16k-token hd128 cells have
# T = 2048 = 15.5 x 132 tiles: H100, bf16, non-causal, kernels against kernels (ci/wave_probe.py),
# fast-sm90 ran 713 TFLOP/s at 2048 tiles against 739 / 736 at 1980 / 2112 (whole rounds), and
# cuDNN 679 against 694 / 692. So the last round and the one before it (G + R tiles) are cut
# along the keys instead: CTA c takes key blocks [c U / G, (c + 1) U / G) of their
# U = (G + R) * blocks, at least one whole tile's worth, so no tile is cut more than once. A cut
# tile's two pieces meet in the kernel (FlashFwdSm90.stream_k_merge): the one that finishes
# second combines both online-softmax states and stores the tile.

# Keys a tile must visit to be cut. Each piece pays a tile start and the merge (its O, row maxima
# and sums through L2), which short tiles do not earn back. H100, bf16, CUDA-graph replays
# interleaved (DUALATTN_AB_GRAPH=1 python ci/sm90_grid_ab.py stream_k), time cut / uncut:
#   hd64  512 / 1k / 2k / 4k / 8k / 16k: 1.016 / 1.001 / 0.972 / 0.969 / 0.997 / 0.997
#   hd128 same lengths: 1.051 / 1.025 / 1.000 / 0.996 / 1.000 / 0.975; GQA 32/8 2k / 8k 0.980 / 0.981
#   hd256 same lengths: 1.119 / 1.052 / 1.012 / 0.990 / 0.971 / 0.965; hd256 7936 (992 tiles) 0.952
# (a shape of whole rounds, which cuts nothing, moved by 1 %: the noise).
STREAM_K_MIN_KEYS = 4096
# The same for tiles of one query block at D <= 128 (hd64, hd96, hd128, GQA; not the paired
# causal order): 2k keys earn the cut back there. H200, same A/B with the minimum at 0, four runs
# (docs section 29), time cut / uncut at 2k: hd64 0.978-0.987, hd128 0.956-0.993, GQA 32/8
# 0.978-0.985; hd256 0.998-1.024 and hd64 1k 0.984-1.000 (so neither moves).
STREAM_K_MIN_KEYS_NARROW = 2048


def stream_k_tiles(num_tiles, num_ctas, blocks_per_tile, tile_n, min_keys=STREAM_K_MIN_KEYS):
    """Tiles at the end of the order that run cut along the keys: G + R, or 0 where no round is
    partly filled, the grid has a single round, the idle share of the last round is under 1/8,
    or the tiles visit fewer than ``min_keys`` keys. Host-side (the launch passes it; the
    kernel obeys)."""
    rem = num_tiles % num_ctas
    if (num_tiles <= num_ctas or rem == 0 or (num_ctas - rem) * 8 < num_ctas
            or blocks_per_tile * tile_n < min_keys):
        return 0
    return num_ctas + rem


# -- a grid of at most half the SMs: every unit cut into pieces ---------------------------------
#
# A call whose units (tiles, or pairs of the paired causal order) fill at most half of the SMs in
# one round leaves the rest idle however its last round is cut: stream_k_tiles cuts nothing there.
# Such a call (a few heads of short queries against long keys: b1 x 256 queries x 32k keys x 8
# heads is 16 tiles on 132 SMs) instead runs on P CTAs a unit, each visiting 1 / P of its key
# blocks: the same stream-K pieces with G = P x units (share c = key blocks
# [floor(c B / P), floor((c + 1) B / P)) of the U = units x B: CTAs P u .. P u + P - 1 split unit
# u and meet in the merge, stream_k_merge for two, stream_k_merge_pieces for more). Pairs of the
# causal order are cut in two only (a unit's two tiles each cut at most once: one merge record
# per unit). The launch passes the grid's CTAs as its SM count, and the kernel tells this grid
# from stream_k_tiles' by its cut count alone: stream_k_tiles cuts only calls of more units
# than SMs.
# keys a piece visits at least beyond two pieces (a tile start and a merge each): 512 (H200,
# docs section 49: against 1024, time 0.86-0.96 where it gives more pieces at Dv <= 128); causal
# chunks (0.99-1.04 at 512) and Dv > 128 (1.017-1.019) keep 1024 (fast/sm90 _split_piece_keys)
SPLIT_MIN_PIECE_KEYS = 512
SPLIT_MIN_PIECE_KEYS_CAUSAL = 1024
SPLIT_MAX_PIECES = 8  # the last piece reads every record: its merge grows with the count
# Beyond SPLIT_MAX_PIECES, up to SPLIT_DEEP_MAX_PIECES, where the grid of pieces stays within
# half the SMs and each piece keeps SPLIT_DEEP_PIECE_KEYS keys: a call of one to a few units
# (decoding through attention(): one packed tile a KV head) otherwise leaves most SMs idle. Past
# half the SMs the pieces' K / V reads fill the memory bus (H100) and the deeper merge costs more
# than it saves. Graph A/B, time deeper / 8 pieces (docs section 51; H100 unless H200):
#   1 query, 1-4 units: hd64 8/1 128k 16 pieces 0.576 (H200), 32 against 16 0.755 (H100) /
#   0.684 (H200); hd256 16/2 32k 16 pieces 0.850 (0.755 H200), 16k 0.956; hd128 16/4 64k 16
#   pieces 0.880, 32k 0.978; 1k-key pieces lose (hd128 8/1 32k, 32 against 16: 1.095).
#   8 units (GQA 32/8: 64 CTAs already): 11-16 pieces at 32k-128k keys 1.062-1.096 (H100),
#   where the H200 gained 0.93-0.96: left at 8.
#   Calls of 5-7 units (63-66 CTAs at 9-13 pieces on 132 SMs) were not measured: the rule stops
#   at SPLIT_DEEP_MAX_UNITS.
SPLIT_DEEP_MAX_PIECES = 32
SPLIT_DEEP_PIECE_KEYS = 2048
SPLIT_DEEP_MAX_UNITS = 4


def deep_pieces(num_units, num_sms, keys) -> int:
    """The most pieces a unit of ``keys`` keys may be cut into beyond SPLIT_MAX_PIECES on a grid
    of ``num_units`` units and ``num_sms`` SMs (the rule above; 0 past SPLIT_DEEP_MAX_UNITS)."""
    if num_units > SPLIT_DEEP_MAX_UNITS:
        return 0
    return min(SPLIT_DEEP_MAX_PIECES, num_sms // (2 * num_units), keys // SPLIT_DEEP_PIECE_KEYS)


def split_pieces(num_units, num_sms, blocks_per_unit, tile_n, min_keys=STREAM_K_MIN_KEYS,
                 max_pieces=SPLIT_MAX_PIECES, pairs=False, min_piece_keys=SPLIT_MIN_PIECE_KEYS,
                 waves=False, whole=None, deep=False):
    """Pieces each unit is cut into on a grid of pieces x units CTAs: 0 where a unit has fewer
    than two key blocks or ``min_keys`` keys; where twice the units fit the SMs, 2 (pairs), or as
    many as fit the SMs, up to ``max_pieces`` (with ``deep``, deep_pieces where that is more),
    while a piece keeps ``min_piece_keys`` keys (at least 2 pieces). Where they do not fit: with
    ``waves``, the count wave_pieces picks (the grid then runs in several rounds of CTAs), else 0. A piece never holds less than a key block (the
    floor is the key tile), so P <= blocks_per_unit: no piece of a unit that visits every key
    block is empty. Host-side."""
    if blocks_per_unit < 2 or blocks_per_unit * tile_n < min_keys:
        return 0
    by_keys = blocks_per_unit * tile_n // max(min_piece_keys, tile_n)
    if 2 * num_units > num_sms:
        if not waves or pairs:
            return 0
        return wave_pieces(num_units, num_sms, blocks_per_unit, min(max_pieces, by_keys), whole)
    if pairs:
        return 2
    if deep:
        max_pieces = max(max_pieces, deep_pieces(num_units, num_sms, blocks_per_unit * tile_n))
    return max(2, min(num_sms // num_units, max_pieces, by_keys))


# -- a grid of more than half the SMs: pieces in rounds, where a model says they pay ---------------
#
# Units that fill more than half of the SMs but leave some idle (a round and a bit of causal
# pairs, or one partly filled round of tiles that stream_k_tiles does not cut) can still run
# faster cut into P pieces on P x units CTAs, which the SMs take in several rounds: the longest
# CTA is then a piece, not a unit. Whether that pays is a makespan model in key blocks: a call's
# own cost, then per round its longest item, a whole unit with a tile's start and end or a piece
# with its start and its share of the merge. The costs are fitted to H200 CUDA-graph A/Bs of
# hd128 calls forced onto P pieces (docs section 50: 96-192 units, 16k-32k keys, P = 2-8; the
# model's time ratios within 0-4 % of the measured 0.69-1.12).
WAVE_CALL_BLOCKS = 10.0   # the launch and the first loads of a call
WAVE_TILE_BLOCKS = 1.7    # a whole tile's start and epilogue (docs section 35)
WAVE_PIECE_BLOCKS = 6.0   # a piece's start, its state written, the last one's merge
WAVE_MIN_GAIN = 0.10      # the model's margin: it was up to 4 % optimistic on 16k keys


def wave_makespan(num_units, num_sms, blocks_per_unit, pieces) -> float:
    """The model's time, in key blocks, of ``num_units`` units of ``blocks_per_unit`` blocks on
    ``num_sms`` SMs, whole (pieces <= 1) or each cut into ``pieces`` pieces."""
    if pieces <= 1:
        return WAVE_CALL_BLOCKS + -(-num_units // num_sms) * (blocks_per_unit + WAVE_TILE_BLOCKS)
    return WAVE_CALL_BLOCKS + -(-pieces * num_units // num_sms) * (blocks_per_unit / pieces + WAVE_PIECE_BLOCKS)


def wave_pieces(num_units, num_sms, blocks_per_unit, max_pieces, whole=None) -> int:
    """The piece count of 2..max_pieces with the shortest wave_makespan, or 0 where it does not
    beat ``whole`` (the order's own time, in the model's key blocks; default the units uncut) by
    WAVE_MIN_GAIN."""
    base = wave_makespan(num_units, num_sms, blocks_per_unit, 1) if whole is None else whole
    best, best_time = 0, (1.0 - WAVE_MIN_GAIN) * base
    for p in range(2, max_pieces + 1):
        t = wave_makespan(num_units, num_sms, blocks_per_unit, p)
        if t <= best_time:
            best, best_time = p, t
    return best


def stream_k_grid(num_units, num_sms, cut, pieces=0):
    """CTAs of a persistent stream-K launch: ``pieces`` a unit where every unit is cut
    (split_pieces), else one per SM or per unit."""
    if cut == num_units and pieces >= 2:
        return pieces * num_units
    return min(num_units, num_sms)


STREAM_K_PIECES_PER_CTA = 3  # a CTA's key range spans parts of at most three tiles


def stream_k_piece(cta, piece, num_ctas, sk_tiles, blocks_per_tile, maximum, minimum):
    """(tile, first key block, end key block, valid) of piece ``piece`` (0, 1, 2) of CTA ``cta``'s
    share of the cut tiles (tile numbered within them, 0 .. sk_tiles - 1). The share is
    [c U / G, (c + 1) U / G) of the U = sk_tiles * blocks_per_tile key blocks; since
    sk_tiles >= G it holds at least blocks_per_tile of them, so a tile meets at most two shares
    (one cut); with G = P x sk_tiles (split_pieces) tile t is shares P t .. P t + P - 1
    exactly (each of them non-empty while the tile has P key blocks). Plain integer arithmetic (``maximum`` / ``minimum``: max / min, or cutlass.max /
    cutlass.min when the kernel traces it with Int32 operands)."""
    units = sk_tiles * blocks_per_tile
    lo = cta * units // num_ctas
    hi = (cta + 1) * units // num_ctas
    tile = lo // blocks_per_tile + piece
    first = tile * blocks_per_tile
    start = maximum(lo - first, 0)
    end = minimum(hi - first, blocks_per_tile)
    return tile, start, end, first < hi


# -- stream-K tail of the paired causal order -------------------------------------------------
#
# The paired order (paired_tile) has the same partly filled last round: the bench's 16k-token
# hd128 causal cells are 1024 units on 132 SMs (7.76 rounds), hd64's 192-row tiles 1408 (10.67).
# Its last two rounds' units are cut the same way, a unit standing for a tile: a unit's key
# blocks are its heavier tile's, then its lighter one's, and ``unit_blocks`` (the most any unit
# holds; the launch computes it, FastSm90Forward.stream_k_plan) is the length every unit is given
# in stream_k_piece; a unit holding fewer leaves the rest of its length empty. A tile holds fewer
# than unit_blocks <= a CTA's share of key blocks, so it too is cut at most once, and a unit's
# tiles at most once between them: the merge record of a cut tile is its unit's number among the
# cut units. H100, bf16, CUDA-graph replays interleaved, three runs (DUALATTN_AB_GRAPH=1 python
# ci/sm90_grid_ab.py stream_k causal), time cut / uncut: hd128 causal 4k 0.954-1.008, 8k
# 0.986-0.989, 16k 0.965-0.975; GQA 32/8 causal 8k 0.974-0.976; hd64 causal 4k 0.936-0.989, 8k
# 0.976-0.979; with no key minimum the short pairs lost (hd128 causal 512 / 1k / 2k: 1.129 /
# 1.090 / 1.040), so STREAM_K_MIN_KEYS holds for a pair.

def tile_share(unit_start, unit_end, first, blocks, maximum, minimum):
    """[start, end) of a tile's own key blocks (0 .. blocks) that a piece [unit_start, unit_end)
    of its unit covers, the tile holding the unit's blocks [first, first + blocks); empty
    (start >= end) when the piece misses it. Plain integer arithmetic (kernel and CPU model)."""
    return maximum(unit_start - first, 0), minimum(unit_end - first, blocks)


def paired_unit_blocks(num_m_blocks, key_blocks):
    """(most, fewest) key blocks of a unit of the paired order and of one of its tiles, given
    ``key_blocks(m_block)``, the key blocks a query block visits (a unit of two heads' middle
    blocks counts both). Host-side (the launch passes
    the first; a tile with no key block at all rules the cut out, see FastSm90Forward)."""
    pairs = num_m_blocks // 2
    most, fewest = 0, 1 << 30
    for light in range(pairs):
        a, b = key_blocks(num_m_blocks - 1 - light), key_blocks(light)
        most, fewest = max(most, a + b), min(fewest, a, b)
    if num_m_blocks % 2:  # two heads' middle blocks (a lone last head's alone: fewer)
        mid = key_blocks(pairs)
        most, fewest = max(most, 2 * mid), min(fewest, mid)
    return most, fewest
