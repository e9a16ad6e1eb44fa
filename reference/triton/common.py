"""Pieces shared by the forward, backward and decode kernels.

Vocabulary (the same as the fast kernels'):

* a *tile* of one side is BLOCK_M query rows or BLOCK_N key columns;
* along the other side the kernel visits *blocks*; a block is **full** when the element predicate
  (causal AND window AND key ranges, plus the sequence bound) holds everywhere in it, and a
  **mask** block otherwise. Full blocks run through the inner-loop helper with ``MASK=0`` (no
  mask arithmetic at all), mask blocks with ``MASK=2``;
* ``MASK=1`` applies only the key/query bound: used for blocks that a block-sparse CSR lists as
  full, since the CSR's last block may stick out of the sequence.

Scores are kept in the log2 domain: ``s2 = q.k * scale * log2(e)`` (the scale folded into one
multiply) and ``exp2`` replaces ``exp``. With a softcap ``c``: ``s2 = c * tanh(q.k * scale / c) *
log2(e)``.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# triton.jit chooses compiled or interpreted kernels when they are defined, i.e. on import
KERNELS_INTERPRETED = interpreting()


def _interpreter_range_fix() -> None:
    """Let the interpreter take tensor loop bounds (``for blk in range(lo, hi)``) on Triton <= 3.6.

    The interpreter holds a scalar as a 1-element numpy array; ``range`` calls ``tensor.__index__``,
    which Triton 3.6 implements as ``int(handle.data)``: NumPy >= 2.4 refuses that for a (1,) array
    ("only 0-dimensional arrays can be converted to Python scalars", triton-lang/triton#9171).
    Newer Triton squeezes first (``int(handle.data.squeeze())``); where the installed interpreter
    does not, set that after Triton's own patch of ``tensor`` (undone with it after each launch).
    """
    import types

    import numpy as np
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "dualattn_range_fix", False):
        return
    one = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.zeros(1, np.int32)))

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        try:
            tensor.__index__(one)
        except TypeError:
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor.dualattn_range_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


if KERNELS_INTERPRETED:
    _interpreter_range_fix()


def next_pow2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """Matrix product with an fp32 accumulator.

    DOT_FP32: the interpreter multiplies bf16 operands wrongly, so there both operands are
    upcast first (the values are the same bf16 numbers; only the product is exact fp32).
    IEEE: fp32 inputs get a true fp32 product instead of tf32.
    """
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _accumulate(acc, comp, x, COMPENSATED: tl.constexpr):
    """``acc += x`` across the blocks of a loop; returns (acc, comp).

    COMPENSATED (fp32 inputs): Kahan summation, ``comp`` holding the low-order part lost so far.
    A plain fp32 accumulator adds one rounding per block at the magnitude of the running sum, so
    a dK/dV row summed over every query block of every head of a GQA group drifts by ~sqrt(blocks)
    roundings: on the H100 that broke the accuracy rule for fp32 dV (props gpu profile, e.g. 7 heads
    x 154 rows onto one key). 16-bit inputs keep the plain form (their rounding dominates), which
    Triton fuses into the dot's accumulator; ``comp`` then passes through untouched.
    """
    if COMPENSATED:
        y = x - comp
        t = acc + y
        comp = (t - acc) - y
        acc = t
    else:
        acc += x
    return acc, comp


@triton.jit
def _i64(x):
    """``x`` as int64, for a row index that multiplies a row stride: S x H x D passes 2**31 for
    long sequences and caches (2M tokens x 8 heads x 128), where int32 offsets wrap."""
    return tl.cast(x, tl.int64)


@triton.jit
def _row(x, WIDE: tl.constexpr):
    """A row index within a sequence about to multiply a row stride: int64 when the host found that
    rows x stride can pass 2**31 (``Launch.wide_rows``), else left in int32, so that only calls
    that need 64-bit offsets pay for them in registers (see _attn_bwd_dkdv_block)."""
    if WIDE:
        x = tl.cast(x, tl.int64)
    return x


@triton.jit
def _sequence_bounds(CuQ, CuK, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """Where sequence ``b`` starts and how long it is. Varlen: rows cu[b]..cu[b+1] of the packed
    (total, H, D) tensors; batched: row 0 and the given lengths. The starts and the batch index come
    back as int64, so base offsets of long batches or large caches (past 2**31 elements) do not wrap."""
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
        k_start = tl.load(CuK + b)
        seqlen_k = tl.load(CuK + b + 1) - k_start
    return tl.cast(b, tl.int64), tl.cast(q_start, tl.int64), tl.cast(k_start, tl.int64), seqlen_q, seqlen_k


@triton.jit
def _tanh(x):
    # tanh accurate to a few ulps of fp32, portable across the GPU backend and the interpreter.
    # (2 * sigmoid(2x) - 1 cancels for small x: an absolute error of ~u, i.e. softcap * u in the
    # capped score, which fp32 inputs notice.) Large |x|: (1 - e) / (1 + e) with e = exp(-2|x|)
    # has no cancellation for |x| >= 0.25; small |x|: the odd Taylor series to x^11, whose
    # truncation error there is below 1e-9 relative.
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * -0.008863235529902197)))))
    r = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _scores(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw q.k -> scores in the log2 domain. Returns (s2, t) where t = tanh(...) for the softcap
    derivative in the backward (t is qk itself, unused, without a softcap)."""
    if SOFTCAP:
        t = _tanh(qk * qk_scale)  # qk_scale = scale / softcap
        return t * (softcap * 1.4426950408889634), t
    else:
        return qk * qk_scale, qk  # qk_scale = scale * log2(e)


@triton.jit
def _element_mask(rows, cols, seqlen_q, seqlen_k, win_left, win_right, kr_ptrs, kr_stride_r,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_KR: tl.constexpr):
    """The element predicate for broadcastable index arrays ``rows`` (query) and ``cols`` (key).

    Causal is folded into the window by the host (right = 0). ``kr_ptrs`` points at the key
    ranges of each row (same shape as ``rows``); row r sees key c iff lo <= c < hi for some range.
    """
    diag = rows + (seqlen_k - seqlen_q)  # bottom-right aligned diagonal
    vis = (cols < seqlen_k) & (rows < seqlen_q)
    if HAS_LEFT:
        vis = vis & (cols >= diag - win_left)
    if HAS_RIGHT:
        vis = vis & (cols <= diag + win_right)
    if NUM_KR > 0:
        in_any = cols < 0  # all False, with the broadcast shape
        for r in tl.static_range(NUM_KR):
            lo = tl.load(kr_ptrs + r * kr_stride_r, mask=rows < seqlen_q, other=0)
            hi = tl.load(kr_ptrs + r * kr_stride_r + 1, mask=rows < seqlen_q, other=0)
            in_any = in_any | ((cols >= lo) & (cols < hi))
        vis = vis & in_any
    return vis


@triton.jit
def _block_range(x_first, x_last, len_y, BLOCK_Y: tl.constexpr, lo_off, hi_off,
                 HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, ALL_MASKED: tl.constexpr):
    """Blocks of the other side that a tile touches.

    Index x of this side sees indices y of the other side with ``x + lo_off <= y <= x + hi_off``
    (each bound only if HAS_LO / HAS_HI) and ``0 <= y < len_y``. For the tile x in
    [x_first, x_last] returns block indices ``lo <= full_lo <= full_hi <= hi``: blocks in
    [lo, hi) are visited, [full_lo, full_hi) are full (every (x, y) pair visible, y < len_y).
    """
    y_lo = 0
    y_hi = len_y  # exclusive
    f_lo = 0
    f_hi = len_y
    if HAS_LO:
        y_lo = tl.minimum(tl.maximum(x_first + lo_off, 0), len_y)
        f_lo = tl.minimum(tl.maximum(x_last + lo_off, 0), len_y)
    if HAS_HI:
        y_hi = tl.minimum(tl.maximum(x_last + hi_off + 1, 0), len_y)
        f_hi = tl.minimum(tl.maximum(x_first + hi_off + 1, 0), len_y)
    y_hi = tl.maximum(y_hi, y_lo)
    lo = y_lo // BLOCK_Y
    hi = (y_hi + BLOCK_Y - 1) // BLOCK_Y
    if ALL_MASKED:  # key ranges: no block is known to be full
        full_lo = hi
        full_hi = hi
    else:
        full_lo = tl.minimum(tl.maximum((f_lo + BLOCK_Y - 1) // BLOCK_Y, lo), hi)
        full_hi = tl.minimum(tl.maximum(f_hi // BLOCK_Y, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _masked_block(t, lo, full_lo, full_hi):
    """The t-th mask block: first those below the full range, then those above it."""
    n_below = full_lo - lo
    return tl.where(t < n_below, lo + t, full_hi + (t - n_below))
