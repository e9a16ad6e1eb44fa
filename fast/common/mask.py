"""Element masks on accumulator fragments: sequence tails, bottom-right causal and windows.

Query row i (local to its sequence) sees key j iff ``j < seqlen_k`` and, measured from the
bottom-right diagonal ``d = i + seqlen_k - seqlen_q``, ``d - left <= j`` (when a left bound
exists) and ``j <= d + right`` (when a right bound exists; causal is right = min(right, 0)).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


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
            if j >= hi or j < lo:
                acc_S_mn[r, c] = -Float32.inf
