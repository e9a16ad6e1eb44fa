"""Where one batch entry's rows live: dense (fixed lengths) or varlen (cu_seqlens)."""
import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def seq_bounds(batch: Int32, seqlen: Int32, cu_seqlens: cute.Tensor, varlen: cutlass.Constexpr):
    """(first packed row, length) of sequence ``batch``; dense layouts are batch * seqlen rows."""
    start = batch * seqlen
    length = seqlen
    if cutlass.const_expr(varlen):
        start = cu_seqlens[batch]
        length = cu_seqlens[batch + 1] - start
    return start, length
