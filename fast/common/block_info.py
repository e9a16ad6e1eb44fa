"""Which key blocks a query block visits (tile skipping) and which of them need the element mask."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def n_block_range(m_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                  seqlen_q: Int32, seqlen_k: Int32, win_left: Int32, win_right: Int32,
                  has_left: cutlass.Constexpr, has_right: cutlass.Constexpr):
    """[n_min, n_max) of key blocks with at least one visible element for this query block."""
    n_max = cute.ceil_div(seqlen_k, tile_n)
    n_min = Int32(0)
    if cutlass.const_expr(has_right):
        last_row = cutlass.min((m_block + 1) * tile_m, seqlen_q) - 1
        hi = cutlass.max(last_row + seqlen_k - seqlen_q + win_right + 1, 0)
        n_max = cutlass.min(n_max, cute.ceil_div(hi, tile_n))
    if cutlass.const_expr(has_left):
        lo = cutlass.max(m_block * tile_m + seqlen_k - seqlen_q - win_left, 0)
        n_min = lo // tile_n
    return n_min, n_max


@cute.jit
def block_needs_mask(m_block: Int32, n_block: Int32, tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                     seqlen_q: Int32, seqlen_k: Int32, win_left: Int32, win_right: Int32,
                     has_left: cutlass.Constexpr, has_right: cutlass.Constexpr):
    """True unless every (row, key) of the tile is visible (rows past seqlen_q are never stored)."""
    col_end = (n_block + 1) * tile_n
    need = col_end > seqlen_k
    if cutlass.const_expr(has_right):
        need = need or (col_end - 1 > m_block * tile_m + seqlen_k - seqlen_q + win_right)
    if cutlass.const_expr(has_left):
        need = need or (n_block * tile_n < m_block * tile_m + tile_m - 1 + seqlen_k - seqlen_q - win_left)
    return need


@cute.jit
def csr_row(rowptr: cute.Tensor, base: Int32, row: Int32):
    """(first entry, entry count) of CSR row ``row``; ``base`` offsets to the (batch, head) slice."""
    lo = rowptr[base + row]
    return lo, rowptr[base + row + 1] - lo


@cute.jit
def csr_block_at(it: Int32, mFC: cute.Tensor, mMC: cute.Tensor, f_col0: Int32, m_col0: Int32,
                 m_cnt: Int32, ratio_n: Int32):
    """(kernel key tile, from a mask entry?) of visit number ``it`` of one query tile's CSR row:
    the ``m_cnt`` mask entries first (from ``mMC[m_col0:]``), then the full ones (``mFC[f_col0:]``);
    each CSR key block covers ``ratio_n`` key tiles of the kernel. (The division by the run-time
    ratio is ~30 instructions a visit, branched around where the ratio is 1: CSR blocks the size
    of the key tile, the common case.)"""
    e = it
    if ratio_n != 1:
        e = it // ratio_n
    col = Int32(0)
    is_mask = e < m_cnt
    if is_mask:
        col = mMC[m_col0 + e]
    else:
        col = mFC[f_col0 + e - m_cnt]
    return col * ratio_n + (it - e * ratio_n), is_mask


def masked_last_groups(n_blocks, n_masked, n_masked_left, maximum):
    """(u0, unmasked, right, l0) of a tile's key-block visits in the narrow_last order, visits
    numbered v = 0 .. n_blocks - 1 from the top block down (v = 0: block n_block_max - 1). The
    top ``n_masked`` visits need the right mask, the bottom ``n_masked_left`` the left one. Other
    configs visit them in that order; this one keeps v = 0 first, then the unmasked visits
    [u0, u0 + unmasked), then the rest of the right-masked ones [1, 1 + right), then the
    left-masked ones [l0, n_blocks): the masked visits after the first run together in one
    loop, whose steps can then be masked or narrow at run time without a second copy of the
    masked step in the code (FlashFwdSm90.narrow_last)."""
    u0 = maximum(n_masked, 1)
    l0 = maximum(n_blocks - n_masked_left, 1)
    return u0, maximum(l0 - u0, 0), maximum(n_masked - 1, 0), l0


def masked_last_visit(i, n_blocks, n_masked, n_masked_left, maximum, select):
    """Visit v of the ``i``-th key block a tile loads in the narrow_last order
    (masked_last_groups): plain integer arithmetic, so the TMA warp (``select`` =
    cutlass.select_) and the CPU tests run the same code."""
    u0, unmasked, right, l0 = masked_last_groups(n_blocks, n_masked, n_masked_left, maximum)
    j = i - 1
    v = select(j < unmasked + right, 1 + j - unmasked, l0 + j - unmasked - right)
    v = select(j < unmasked, u0 + j, v)
    return select(i == 0, i, v)
