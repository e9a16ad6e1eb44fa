"""Online softmax on mma.sync accumulator fragments (FA2 style), shared by the arch kernels.

Scores arrive as fp32 fragments viewed as (rows, cols) of one thread (see ``layouts.acc_mn_view``).
Rows of an m16n8k16 accumulator are spread over the 4 threads of a quad, so row reductions finish
with two butterfly shuffles. Exponentials use exp2 with log2(e) folded into the scale.
"""
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def quad_max(x):
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2, mask=-1, mask_and_clamp=31))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1, mask=-1, mask_and_clamp=31))


def quad_sum(x):
    x = x + cute.arch.shuffle_sync_bfly(x, offset=2, mask=-1, mask_and_clamp=31)
    return x + cute.arch.shuffle_sync_bfly(x, offset=1, mask=-1, mask_and_clamp=31)


def tree_reduce(vals, op):
    """op over a list of values as a balanced tree, unrolled at trace time: log2(n) dependent
    steps instead of n - 1 (a row's partial maxima / sums kept in independent chains)."""
    while len(vals) > 1:
        vals = [op(vals[i], vals[i + 1]) if i + 1 < len(vals) else vals[i]
                for i in range(0, len(vals), 2)]
    return vals[0]


def make_softmax_state(num_rows: int):
    """Running row max (score units) and this thread's partial row sums, fp32 registers."""
    row_max = cute.make_rmem_tensor(num_rows, Float32)
    row_sum = cute.make_rmem_tensor(num_rows, Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    return row_max, row_sum


@cute.jit
def online_softmax_step(row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32,
                        acc_S_mn: cute.Tensor, acc_O_mn: cute.Tensor):
    """Fold one key block: update max/sum, rescale O, turn S into unnormalised P in place.

    ``scale_log2`` turns a score into a base-2 logit: softmax scale * log2(e), or log2(e) alone
    when the kernel already applied scale (and softcap) to the scores.
    """
    for r in cutlass.range_constexpr(cute.size(row_max)):
        s_row = acc_S_mn[r, None].load()
        m_blk = quad_max(s_row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
        m_old = row_max[r]
        m_new = cute.arch.fmax(m_old, m_blk)
        # a row that has seen no visible key yet keeps max -inf; offset by 0 so that
        # exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN
        m_off = m_new * scale_log2
        if m_new == -Float32.inf:
            m_off = Float32(0.0)
        p_row = cute.math.exp2(s_row * scale_log2 - m_off, fastmath=True)
        corr = cute.math.exp2(m_old * scale_log2 - m_off, fastmath=True)
        row_sum[r] = row_sum[r] * corr + p_row.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
        row_max[r] = m_new
        acc_O_mn[r, None] = acc_O_mn[r, None].load() * corr
        acc_S_mn[r, None] = p_row


@cute.jit
def softmax_finalize(row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32,
                     acc_O_mn: cute.Tensor, lse: cute.Tensor):
    """Normalise O; write natural-log LSE per row into ``lse`` (-inf, and O = 0, for empty rows)."""
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = quad_sum(row_sum[r])
        inv = Float32(0.0)
        lse_r = -Float32.inf
        if total > 0.0:
            inv = cute.arch.rcp_approx(total)
            lse_r = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
        acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
        lse[r] = lse_r


@cute.jit
def merge_scales(m_a: Float32, m_b: Float32, scale_log2: Float32):
    """(max, scale of state a, scale of state b) for merging two online-softmax states whose
    running row maxima (score units) are m_a and m_b, e.g. the two key ranges of a split tile:
    each state's O and row sum are multiplied by its scale, exp2((m - max) * scale_log2).
    Symmetric in a and b; a row with no visible key in either (both -inf) gets scales 0, not NaN."""
    m = cute.arch.fmax(m_a, m_b)
    m_off = m * scale_log2
    if m == -Float32.inf:
        m_off = Float32(0.0)
    return (m, cute.math.exp2(m_a * scale_log2 - m_off, fastmath=True),
            cute.math.exp2(m_b * scale_log2 - m_off, fastmath=True))


@dsl_user_op
def mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """a * b rounded on its own (PTX ``mul.rn``: never fused into an FMA by the compiler or ptxas).
    Merging two online-softmax states as mul_rn(x, cx) + mul_rn(y, cy) then gives the same bits
    whichever state is x: the sum of two rounded products commutes, an FMA of one product into
    the other does not."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "mul.rn.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


def write_state(put, acc_O, row_max, row_sum) -> None:
    """A thread's online-softmax state as values 0.. (``put(i, x)``): its rows' maxima, then
    their partial sums, then its O accumulator (stream_k_merge's workspace, key_split_merge's
    record). Traced inline: its plain Python loops unroll."""
    num_rows = cute.size(row_max)
    for r in range(num_rows):
        put(r, row_max[r])
        put(num_rows + r, row_sum[r])
    for i in range(cute.size(acc_O)):
        put(2 * num_rows + i, acc_O[i])


@cute.jit
def merge_states_in_order(ws: cute.Tensor, base: Int32, state_stride: Int32, value_stride: Int32,
                          count: Int32, acc_O_mn: cute.Tensor, row_max: cute.Tensor,
                          row_sum: cute.Tensor, scale_log2: Float32, batch: cutlass.Constexpr[int] = 1):
    """This thread's online-softmax state made the merge of ``count`` states that threads wrote
    for the same rows and columns, this thread's own among them (value i of state p at
    ``ws[base + p * state_stride + i * value_stride]``, laid out as write_state does): the largest
    max, then every state scaled to it and added in the order p = 0, 1, ..., products rounded
    apart, so the bits depend on the states alone, not on which thread merges them. The states
    are read ``batch`` at a time (the loops unrolled so): each pass costs a memory round trip per
    batch, not per state, and the order of the sums stays the same."""
    num_rows = cute.size(row_max)
    for r in cutlass.range_constexpr(num_rows):
        row_max[r] = -Float32.inf
    for p in cutlass.range(count, unroll=batch):
        for r in cutlass.range_constexpr(num_rows):
            row_max[r] = cute.arch.fmax(row_max[r], ws[base + p * state_stride + r * value_stride])
    for r in cutlass.range_constexpr(num_rows):
        row_sum[r] = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
            acc_O_mn[r, c] = Float32(0.0)
    for p in cutlass.range(count, unroll=batch):
        at = base + p * state_stride
        for r in cutlass.range_constexpr(num_rows):
            # merge_scales' scale of state p against the merged max (0 for a row with no key)
            c_p = merge_scales(row_max[r], ws[at + r * value_stride], scale_log2)[2]
            row_sum[r] = row_sum[r] + mul_rn(ws[at + (num_rows + r) * value_stride], c_p)
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                i = 2 * num_rows + cute.crd2idx((r, c), acc_O_mn.layout)
                acc_O_mn[r, c] = acc_O_mn[r, c] + mul_rn(ws[at + i * value_stride], c_p)


def merge_twin_state(twin, acc_O_mn, row_max, row_sum, scale_log2) -> None:
    """Merge the state another thread wrote for the same rows and columns (value i is ``twin(i)``,
    laid out as write_state does) into this thread's: the larger max, each state scaled to it,
    products rounded apart and then added, so the result is bitwise the same whichever of the
    two is this thread's."""
    num_rows = cute.size(row_max)
    for r in range(num_rows):
        m, c_own, c_twin = merge_scales(row_max[r], twin(r), scale_log2)
        row_max[r] = m
        row_sum[r] = mul_rn(row_sum[r], c_own) + mul_rn(twin(num_rows + r), c_twin)
        for c in range(cute.size(acc_O_mn, mode=[1])):
            o_twin = twin(2 * num_rows + cute.crd2idx((r, c), acc_O_mn.layout))
            acc_O_mn[r, c] = mul_rn(acc_O_mn[r, c], c_own) + mul_rn(o_twin, c_twin)
