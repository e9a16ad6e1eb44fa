"""Element masks on accumulator fragments: sequence tails, bottom-right causal, windows, key ranges.

Query row i (local to its sequence) sees key j iff ``j < seqlen_k`` and, measured from the
bottom-right diagonal ``d = i + seqlen_k - seqlen_q``, ``d - left <= j`` (when a left bound
exists) and ``j <= d + right`` (when a right bound exists; causal is right = min(right, 0)).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Uint32


@cute.jit
def score_or_neg_inf(visible, score):
    """``score`` where ``visible``, else -inf: one select per element. Writing it as
    ``if hidden: frag[i] = -inf`` makes the DSL's if-region yield the whole register fragment, and
    ptxas then re-selects every earlier element at each condition: a select chain quadratic in the
    fragment size (sm_90a hd128 causal: ~1100 extra instructions per masked key block;
    tests/test_sm90_sass.py keeps it out)."""
    return Float32(cutlass.select_(visible, score, -Float32.inf))


# ---- row masks as bit sets (the wgmma / mma.sync accumulator's column pattern) -------------
# A thread's accumulator row holds columns in pairs, one pair in every 8: element c of the row is
# column base + 8 * (c // 2) + c % 2 (base = 2 * (lane % 4)). The visible keys of a row are one
# interval, so "element c visible" is one bit of a 32-bit set built once per row: a few integer
# operations per row, then one bit test and one select per element, where comparing each
# element's column with both bounds costs two compares and two selects (sm_90a hd128 window:
# 128 ISETP + 128 FSEL per masked key block).
FRAG_PAIR = 2      # consecutive columns per pair
FRAG_PAIR_STRIDE = 8   # columns from one pair to the next


@cute.jit
def frag_cols_below(limit: Int32):
    """How many of a row's fragment elements lie at columns < ``limit``, ``limit`` measured from
    the thread's first column (any sign; the count is not capped at the row's length)."""
    u = cutlass.max(limit, 0)
    return (u // FRAG_PAIR_STRIDE) * FRAG_PAIR + cutlass.min(u % FRAG_PAIR_STRIDE, FRAG_PAIR)


@cute.jit
def low_bits(n: Int32):
    """The 32-bit set of bits 0 .. n - 1 (all 32 for n >= 32, none for n <= 0). Two shifts of at
    most 16 each: a single shift by 32 is undefined in LLVM."""
    m = Uint32(cutlass.min(cutlass.max(n, 0), 32))
    half = m >> 1
    return ((Uint32(1) << half) << (m - half)) - Uint32(1)


@cute.jit
def mask_row_by_bits(acc_S_mn: cute.Tensor, r: cutlass.Constexpr, keep):
    """Row ``r``'s element c becomes -inf unless bit c of ``keep`` is set."""
    for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
        acc_S_mn[r, c] = score_or_neg_inf(Boolean((keep >> c) & Uint32(1)), acc_S_mn[r, c])


@cute.jit
def apply_mask(acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, row0: Int32, col0: Int32,
               seqlen_q: Int32, seqlen_k: Int32, win_left: Int32, win_right: Int32,
               has_left: cutlass.Constexpr, has_right: cutlass.Constexpr):
    """Set invisible scores to -inf. ``tScS_mn`` holds the (row, col) coordinates within the tile."""
    for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
        i = tScS_mn[r, 0][0] + row0
        diag = i + seqlen_k - seqlen_q
        hi = seqlen_k  # exclusive
        lo = Int32(0)
        if cutlass.const_expr(has_right):
            hi = cutlass.min(hi, diag + win_right + 1)
        if cutlass.const_expr(has_left):
            lo = cutlass.max(lo, diag - win_left)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
            j = tScS_mn[0, c][1] + col0
            # an if-region here, not score_or_neg_inf: on this kernel's mma.sync fragments (fast-sm120
            # forward) the select form measured worse (sm_120a, hd64 window: 3104 -> 3832 SASS
            # instructions, spills 44 -> 224 bytes), while the if-region form stays select-free
            if j >= hi or j < lo:
                acc_S_mn[r, c] = -Float32.inf


@cute.jit
def load_key_ranges(mKR: cute.Tensor, base: Int32, row0: Int32, tScS_mn: cute.Tensor, tile_row0: Int32,
                    seqlen_q: Int32, num_ranges: cutlass.Constexpr, query_mode: cutlass.Constexpr = 0):
    """This thread's query rows' ``num_ranges`` half-open key intervals (queries, R, 2) in registers.

    ``query_mode`` says which mode of the fragment indexes queries: 0 for S (forward), 1 for the
    backward's S^T (keys x queries). ``mKR`` is flat; query i's intervals start at
    ``base + (row0 + i) * 2R``. Queries past seqlen_q get empty intervals. Also returns the min lo /
    max hi over this thread's non-empty intervals.
    """
    nrows = cute.size(tScS_mn.shape[query_mode])
    kr = cute.make_rmem_tensor((nrows, num_ranges, 2), Int32)
    lo_min = Int32(2 ** 30)
    hi_max = Int32(0)
    for r in cutlass.range_constexpr(nrows):
        i = tile_row0
        if cutlass.const_expr(query_mode == 0):
            i = tScS_mn[r, 0][0] + tile_row0
        else:
            i = tScS_mn[0, r][1] + tile_row0
        for q in cutlass.range_constexpr(num_ranges):
            lo = Int32(0)
            hi = Int32(0)
            if i < seqlen_q:
                off = base + (row0 + i) * (2 * num_ranges) + 2 * q
                lo = mKR[off]
                hi = mKR[off + 1]
            kr[r, q, 0] = lo
            kr[r, q, 1] = hi
            if lo < hi:
                lo_min = cutlass.min(lo_min, lo)
                hi_max = cutlass.max(hi_max, hi)
    return kr, lo_min, hi_max


@cute.jit
def apply_key_ranges(acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, col0: Int32, kr: cute.Tensor,
                     num_ranges: cutlass.Constexpr, query_mode: cutlass.Constexpr = 0):
    """-inf where key j lies in none of its query's intervals. ``kr`` comes from load_key_ranges with
    the same ``query_mode``; ``col0`` is the tile's first key."""
    for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
        for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
            qi = r if query_mode == 0 else c  # both Python ints: the loops are unrolled
            j = col0
            if cutlass.const_expr(query_mode == 0):
                j = tScS_mn[0, c][1] + col0
            else:
                j = tScS_mn[r, 0][0] + col0
            inside = Boolean(False)
            for q in cutlass.range_constexpr(num_ranges):
                inside = inside or (j >= kr[qi, q, 0] and j < kr[qi, q, 1])
            acc_S_mn[r, c] = score_or_neg_inf(inside, acc_S_mn[r, c])


@cute.jit
def cta_min_max(lo: Int32, hi: Int32, red: cute.Tensor, bar):
    """(min lo, max hi) over the whole CTA: warp butterflies, then one smem slot pair per warp."""
    for off in cutlass.range_constexpr(5):
        lo = cutlass.min(lo, cute.arch.shuffle_sync_bfly(lo, offset=16 >> off))
        hi = cutlass.max(hi, cute.arch.shuffle_sync_bfly(hi, offset=16 >> off))
    warp_id = cute.arch.warp_idx()
    nwarps = cute.size(red) // 2
    if cute.arch.lane_idx() == 0:
        red[2 * warp_id] = lo
        red[2 * warp_id + 1] = hi
    bar.arrive_and_wait()
    lo = red[0]
    hi = red[1]
    for w in cutlass.range_constexpr(1, nwarps):
        lo = cutlass.min(lo, red[2 * w])
        hi = cutlass.max(hi, red[2 * w + 1])
    return lo, hi


@cute.jit
def key_range_span_warp(mKR: cute.Tensor, base: Int32, row0: Int32, tile_row0: Int32,
                        tile_rows: cutlass.Constexpr, seqlen_q: Int32,
                        num_ranges: cutlass.Constexpr):
    """Key-range bounds of one query tile, computed by one whole warp (every lane returns the
    same values, so warps that must agree on a key-block range can each compute it alone).

    Rows ``tile_row0 .. tile_row0 + tile_rows - 1`` below ``seqlen_q`` are scanned (lane l takes
    rows l, l + 32, ...); row i's intervals start at ``base + (row0 + i) * 2R`` of the flat ``mKR``.
    Returns ``(lo_min, hi_max, inter)``: the bounds of the union of all non-empty intervals
    (lo_min = 2**30, hi_max = 0 when there is none) and ``inter`` (R, 2), per interval index q
    the intersection over the rows of interval q, [max lo, min hi): a key block inside one of
    them is visible to every row of the tile.
    """
    lane = cute.arch.lane_idx()
    lo_min = Int32(2 ** 30)
    hi_max = Int32(0)
    inter = cute.make_rmem_tensor((num_ranges, 2), Int32)
    for q in cutlass.range_constexpr(num_ranges):
        inter[q, 0] = Int32(0)
        inter[q, 1] = Int32(2 ** 30)
    for k in cutlass.range_constexpr(tile_rows // 32):
        i = tile_row0 + k * 32 + lane
        if i < seqlen_q:
            off = base + (row0 + i) * (2 * num_ranges)
            for q in cutlass.range_constexpr(num_ranges):
                lo = mKR[off + 2 * q]
                hi = mKR[off + 2 * q + 1]
                if lo < hi:
                    lo_min = cutlass.min(lo_min, lo)
                    hi_max = cutlass.max(hi_max, hi)
                inter[q, 0] = cutlass.max(inter[q, 0], lo)
                inter[q, 1] = cutlass.min(inter[q, 1], hi)
    for off in cutlass.range_constexpr(5):
        lo_min = cutlass.min(lo_min, cute.arch.shuffle_sync_bfly(lo_min, offset=16 >> off))
        hi_max = cutlass.max(hi_max, cute.arch.shuffle_sync_bfly(hi_max, offset=16 >> off))
        for q in cutlass.range_constexpr(num_ranges):
            inter[q, 0] = cutlass.max(inter[q, 0], cute.arch.shuffle_sync_bfly(inter[q, 0], offset=16 >> off))
            inter[q, 1] = cutlass.min(inter[q, 1], cute.arch.shuffle_sync_bfly(inter[q, 1], offset=16 >> off))
    return lo_min, hi_max, inter


@cute.jit
def block_inside_ranges(inter: cute.Tensor, col0: Int32, col1: Int32, num_ranges: cutlass.Constexpr):
    """True if keys [col0, col1) lie inside one of the tile-wide intervals ``inter`` (R, 2) of
    ``key_range_span_warp``: then no row of the tile needs the key-range mask there."""
    inside = Boolean(False)
    for q in cutlass.range_constexpr(num_ranges):
        inside = inside or (col0 >= inter[q, 0] and col1 <= inter[q, 1])
    return inside
