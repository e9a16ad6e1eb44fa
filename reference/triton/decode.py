"""KV-cache attention (decode): append, split-KV flash-decoding, combine.

1. ``_append_kv`` writes k_new / v_new into the cache at positions cache_seqlens[b] .. (paged or
   not); the cache_seqlens tensor itself is not advanced (FlashAttention's semantics).
2. ``_decode_split`` packs the query heads that share one KV head into the M dimension (row r is
   token r // gqa of query head hk * gqa + r % gqa), so one program reads each key block once for
   the whole group. The visible key blocks of a batch entry are cut into ``num_splits`` chunks,
   one per program; each writes its normalised partial output and LSE to a workspace.
3. ``_decode_combine`` merges the splits: out = sum_s exp(lse_s - lse) * out_s. With one split
   there is nothing to merge: the split kernel writes the output and LSE directly.

The split count fills the GPU in whole waves (``choose_num_splits``): decode reads every key once,
so its speed is the memory bandwidth of the programs in flight, and a last wave that is mostly
empty (say 576 programs on 264 resident slots) leaves it idle. The count follows from the
cache capacity, not the live lengths, so choosing it needs no synchronisation. It is part of a
plan made once per spec and GPU (tile, compiled kernel, occupancy, grid), so a call's host work
is the outputs, the workspace and two launches.

Everything data-dependent (cache lengths, pages) is read on the device: no host synchronisation,
and the only allocations are the outputs and a workspace whose size follows from the spec, so a
call can be captured in a CUDA graph.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime import driver

from .common import KERNELS_INTERPRETED, _block_range, _i64, _masked_block, next_pow2
from .configs import Tile, tile_for
from .forward import _attn_fwd_block
from .launch import head_constexprs, score_args, window_args


@triton.jit
def _append_kv(KNew, VNew, K, V, CacheSeqlens, PageTable, skn_b, skn_s, skn_h, svn_b, svn_s, svn_h,
               sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, spt_b, n_new, page_size,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr,
               PAGED: tl.constexpr):
    """Copy one new token of one KV head into the cache. Grid: (batch * n_new, num_heads_kv)."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = pid // n_new
    s = pid % n_new
    pos = tl.load(CacheSeqlens + b) + s
    bb = tl.cast(b, tl.int64)  # 64-bit: large caches pass 2**31 elements
    if PAGED:
        page = tl.cast(tl.load(PageTable + b * spt_b + pos // page_size), tl.int64)
        k_dst = K + page * sk_b + (pos % page_size) * sk_s + hk * sk_h
        v_dst = V + page * sv_b + (pos % page_size) * sv_s + hk * sv_h
    else:
        k_dst = K + bb * sk_b + _i64(pos) * sk_s + hk * sk_h
        v_dst = V + bb * sv_b + _i64(pos) * sv_s + hk * sv_h
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    kn = tl.load(KNew + bb * skn_b + s * skn_s + hk * skn_h + offs_d, mask=offs_d < HEAD_D)
    vn = tl.load(VNew + bb * svn_b + s * svn_s + hk * svn_h + offs_dv, mask=offs_dv < HEAD_DV)
    tl.store(k_dst + offs_d, kn, mask=offs_d < HEAD_D)
    tl.store(v_dst + offs_dv, vn, mask=offs_dv < HEAD_DV)


@triton.jit
def _kv_tile(k_head, v_head, PageTable, b, n0, sk_b, sk_s, sv_b, sv_s, spt_b, page_size, PAGED: tl.constexpr):
    """Pointers to key/value row n0 of batch entry b: through the page table when paged."""
    if PAGED:
        page = tl.cast(tl.load(PageTable + b * spt_b + n0 // page_size), tl.int64)  # 64-bit offsets
        return k_head + page * sk_b + (n0 % page_size) * sk_s, v_head + page * sv_b + (n0 % page_size) * sv_s
    else:
        bb = tl.cast(b, tl.int64)
        return k_head + bb * sk_b + _i64(n0) * sk_s, v_head + bb * sv_b + _i64(n0) * sv_s


@triton.jit(do_not_specialize=["num_splits"])  # one compiled kernel whatever the split count
def _decode_split(Q, K, V, OPart, LPart, CacheSeqlens, PageTable,
                  sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, spt_b,
                  so_s, so_b, so_h, so_t, sl_s, sl_b, sl_h,
                  seqlen_q, n_new, num_heads_kv, gqa, num_splits, page_size,
                  qk_scale, softcap, win_left, win_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, PAGED: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                  DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """One split of one (batch, KV head, packed-row tile).
    Grid: (num_splits, batch * num_heads_kv, cdiv(seqlen_q * gqa, BLOCK_M)).

    Writes OPart[split, b, h, t, :] (normalised) and LPart[split, b, h, t] (natural log; -inf
    when the split saw no key). With one split the host passes the output and LSE themselves
    (split stride 0), so the stored value is cast to OPart's element type. A paged cache maps key block n0 to page
    PageTable[b, n0 // page_size]; BLOCK_N divides page_size, so a block never straddles pages.
    """
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // num_heads_kv
    hk = pid_bh % num_heads_kv
    seqlen_k = tl.load(CacheSeqlens + b) + n_new  # the cache after the append
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed rows
    n_rows = seqlen_q * gqa
    tok = r // gqa
    h = hk * gqa + r % gqa
    row_in = r < n_rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + tl.cast(b, tl.int64) * sq_b + tok[:, None] * sq_s + h[:, None] * sq_h + offs_d[None, :],
                mask=row_in[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)

    # visible key blocks of this tile's tokens, then this split's share of them
    off = seqlen_k - seqlen_q
    tok_first = (pid_m * BLOCK_M) // gqa
    tok_last = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // gqa
    lo, full_lo, full_hi, hi = _block_range(tok_first, tok_last, seqlen_k, BLOCK_N, off - win_left,
                                            off + win_right, HAS_LEFT, HAS_RIGHT, False)
    per_split = (hi - lo + num_splits - 1) // num_splits
    s_lo = tl.minimum(lo + pid_s * per_split, hi)
    s_hi = tl.minimum(s_lo + per_split, hi)
    f_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
    f_hi = tl.minimum(tl.maximum(full_hi, f_lo), s_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_head = K + hk * sk_h
    v_head = V + hk * sv_h
    for blk in range(f_lo, f_hi):  # hot loop: no mask
        k_tile, v_tile = _kv_tile(k_head, v_head, PageTable, b, blk * BLOCK_N, sk_b, sk_s, sv_b, sv_s, spt_b,
                                  page_size, PAGED)
        acc, l_i, m_i = _attn_fwd_block(
            acc, l_i, m_i, q, k_tile, v_tile, sk_s, sv_s, tok, blk * BLOCK_N,
            seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, Q, 0,
            BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 0, HAS_LEFT, HAS_RIGHT, 0,
            SOFTCAP, DOT_FP32, IEEE)
    for t in range(0, (f_lo - s_lo) + (s_hi - f_hi)):  # this split's boundary blocks: masked
        n0 = _masked_block(t, s_lo, f_lo, f_hi) * BLOCK_N
        k_tile, v_tile = _kv_tile(k_head, v_head, PageTable, b, n0, sk_b, sk_s, sv_b, sv_s, spt_b, page_size, PAGED)
        acc, l_i, m_i = _attn_fwd_block(
            acc, l_i, m_i, q, k_tile, v_tile, sk_s, sv_s, tok, n0,
            seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, Q, 0,
            BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 2, HAS_LEFT, HAS_RIGHT, 0,
            SOFTCAP, DOT_FP32, IEEE)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_ptrs = OPart + pid_s * so_s + b * so_b + h[:, None] * so_h + tok[:, None] * so_t + offs_dv[None, :]
    tl.store(o_ptrs, out.to(OPart.dtype.element_ty), mask=row_in[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(LPart + pid_s * sl_s + b * sl_b + h * sl_h + tok, lse, mask=row_in)


@triton.jit
def _decode_combine(OPart, LPart, Out, Lse, so_s, sl_s, sout_b, sout_t, sout_h, num_splits, seqlen_q, num_heads_q,
                    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DV: tl.constexpr):
    """Merge the splits of one output row. Grid: (batch * num_heads_q * seqlen_q,).

    Row index = (b * Hq + h) * Sq + t, which is also its offset in one split's workspace slice
    and in the (B, Hq, Sq) LSE.
    """
    row = tl.program_id(0)
    t = row % seqlen_q
    bh = row // seqlen_q
    h = bh % num_heads_q
    b = bh // num_heads_q
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    lse_s = tl.load(LPart + offs_s * sl_s + row, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)
    total = tl.sum(w, 0)
    o = tl.load(OPart + offs_s[:, None] * so_s + row * HEAD_DV + offs_dv[None, :],
                mask=(offs_s[:, None] < num_splits) & (offs_dv[None, :] < HEAD_DV), other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(Out + b * sout_b + t * sout_t + h * sout_h + offs_dv, out.to(Out.dtype.element_ty),
             mask=offs_dv < HEAD_DV)
    tl.store(Lse + row, lse)


# ---------------------------------------------------------------------------------------------
# host side: a plan per (spec, GPU), then a lean per-call path
# ---------------------------------------------------------------------------------------------

# A split's fixed cost (query load, pipeline fill, partial write and its share of the combine),
# in units of the time one program takes for one key block when every slot is busy.
SPLIT_OVERHEAD_BLOCKS = 2
MAX_SPLITS = 64


def choose_num_splits(units: int, kv_blocks: int, slots: int) -> int:
    """How many splits to cut each of ``units`` work items (batch x KV head x row tile, each
    ``kv_blocks`` key blocks long) into, on a GPU that keeps ``slots`` programs resident.

    Programs run in waves of ``slots``, and a wave lasts as long as its programs, each
    (blocks per split + SPLIT_OVERHEAD_BLOCKS) long. Minimise waves x that length; on a tie take
    fewer splits (less combine work). E.g. batch 8 x 8 KV heads = 64 items of 64 blocks on an
    H100/H200 (132 slots with the hd128 tile, one program per SM): 2 splits fill one wave (32+2),
    1 split leaves half the SMs idle (64+2), 3 splits need two waves (2 x (22+2)).
    """
    best, best_cost = 1, None
    for s in range(1, max(1, min(kv_blocks, MAX_SPLITS)) + 1):
        cost = triton.cdiv(units * s, slots) * (triton.cdiv(kv_blocks, s) + SPLIT_OVERHEAD_BLOCKS)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


@dataclass
class DecodePlan:
    """Everything a decode call needs besides its tensors. It follows from the spec and the GPU,
    so it is made once per (spec, device, tile override) and kept (see ``decode_plan``)."""
    tile: Tile
    num_splits: int
    grid: Tuple[int, int, int]   # of _decode_split
    slots: int                   # programs of _decode_split resident on the whole GPU
    qk_scale: float
    softcap: float
    win_left: int
    win_right: int
    constexprs: dict             # of _decode_split (those of _append_kv / _decode_combine are a subset)


# plans per (spec, device, tile override), least recently used dropped past PLAN_CACHE_SIZE: a
# spec holds the batch size and cache capacity, so a server with changing batches would otherwise
# grow this without end (a plan is cheap to remake: the compiled kernel stays in Triton's cache)
PLAN_CACHE_SIZE = 256
_PLANS: "OrderedDict[tuple, DecodePlan]" = OrderedDict()
_PLANS_LOCK = threading.Lock()


def _resident_programs(call, tile: Tile, split_args: tuple, constexprs: dict) -> int:
    """Programs of _decode_split that fit on the whole GPU at once: SMs x min(by registers, by
    shared memory, by warps), read from the compiled kernel (as Triton's fused-softmax tutorial
    does). Compiling here also means the first call's launch finds the kernel ready."""
    if KERNELS_INTERPRETED:
        return 4  # the interpreter runs programs one after another; any small number will do
    props = driver.active.utils.get_device_properties(call.q.device.index or 0)
    kernel = _decode_split.warmup(*split_args, grid=(1,), **constexprs, num_warps=tile.num_warps,
                                  num_stages=tile.num_stages)
    kernel._init_handles()
    warps = tile.num_warps
    by_regs = props["max_num_regs"] // max(kernel.n_regs * props["warpSize"] * warps, 1)
    by_smem = props["max_shared_mem"] // max(kernel.metadata.shared, 1)
    per_sm = max(1, min(by_regs, by_smem, 64 // warps))
    return per_sm * props["multiprocessor_count"]


def decode_plan(call) -> DecodePlan:
    """The cached plan of this call's spec (made on first use: tile, compiled kernel, splits)."""
    spec = call.spec
    env = os.environ.get("DUALATTN_TRITON_TILE_DECODE")
    key = (spec, call.q.device, env)
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = _make_plan(call)  # compiles on first use: outside the lock
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def _make_plan(call) -> DecodePlan:
    spec = call.spec
    tile = tile_for("decode", max(spec.head_dim, spec.head_dim_v), spec.dtype, page_size=spec.page_size,
                    packed_rows=spec.seqlen_q * spec.gqa_ratio)
    qk_scale, softcap = score_args(spec)
    has_left, has_right, win_left, win_right = window_args(spec)
    cx = dict(head_constexprs(spec), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, PAGED=spec.paged,
              HAS_LEFT=has_left, HAS_RIGHT=has_right)
    plan = DecodePlan(tile, 1, (1, 1, 1), 1, qk_scale, softcap, win_left, win_right, cx)
    row_tiles = triton.cdiv(spec.seqlen_q * spec.gqa_ratio, tile.block_m)
    if spec.batch * spec.seqlen_q * spec.num_heads_q == 0:
        return plan
    # the workspace with 0 splits: the dtype and strides of the real one, which is what compiling needs
    B, Sq, Hq, Dv = spec.batch, spec.seqlen_q, spec.num_heads_q, spec.head_dim_v
    ws_o = call.q.new_empty((0, B, Hq, Sq, Dv), dtype=torch.float32)
    ws_l = call.q.new_empty((0, B, Hq, Sq), dtype=torch.float32)
    plan.slots = _resident_programs(call, tile, _split_args(call, plan, ws_o, ws_l), cx)
    units = spec.batch * spec.num_heads_kv * row_tiles
    plan.num_splits = spec.num_splits or choose_num_splits(units, triton.cdiv(spec.seqlen_k, tile.block_n),
                                                           plan.slots)
    plan.grid = (plan.num_splits, spec.batch * spec.num_heads_kv, row_tiles)
    return plan


def _split_args(call, plan: DecodePlan, o_part, l_part) -> tuple:
    """Runtime arguments of _decode_split. o_part is (splits, B, Hq, Sq, Dv) and l_part
    (splits, B, Hq, Sq), or, with one split, the output (B, Sq, Hq, Dv) and LSE (B, Hq, Sq)."""
    spec, q, k, v = call.spec, call.q, call.k, call.v
    paged = spec.paged
    if o_part.dim() == 5:
        so = o_part.stride()[:4]
        sl = l_part.stride()[:3]
    else:  # the output itself: no split index; its (b, t, h) strides into (s, b, h, t) order
        so = (0, o_part.stride(0), o_part.stride(2), o_part.stride(1))
        sl = (0, l_part.stride(0), l_part.stride(1))
    return (q, k, v, o_part, l_part, call.cache_seqlens, call.page_table if paged else q,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], call.page_table.stride(0) if paged else 0,
            *so, *sl, spec.seqlen_q, spec.num_new_kv, spec.num_heads_kv, spec.gqa_ratio, plan.num_splits,
            max(spec.page_size, 1), plan.qk_scale, plan.softcap, plan.win_left, plan.win_right)


def attention_decode(call):
    """kv-cache call: append k_new/v_new in place, attend, return (out, lse (B, Hq, Sq)).

    Per call: the cached plan, the outputs, a workspace of the plan's size, and one launch per
    kernel (append only with new tokens; combine only with more than one split)."""
    spec = call.spec
    k, v = call.k, call.v
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise NotImplementedError("triton decode: the kv cache needs a contiguous last dimension (it is written in place)")
    if call.q.stride(-1) != 1:
        call = call.with_tensors(q=call.q.contiguous())
    q = call.q
    plan = decode_plan(call)
    cx = plan.constexprs
    if spec.num_new_kv and spec.batch:
        kn, vn = (t if t.stride(-1) == 1 else t.contiguous() for t in (call.k_new, call.v_new))
        _append_kv[(spec.batch * spec.num_new_kv, spec.num_heads_kv)](
            kn, vn, k, v, call.cache_seqlens, call.page_table if spec.paged else q,
            *kn.stride()[:3], *vn.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            call.page_table.stride(0) if spec.paged else 0, spec.num_new_kv, max(spec.page_size, 1),
            BLOCK_D=cx["BLOCK_D"], BLOCK_DV=cx["BLOCK_DV"], HEAD_D=spec.head_dim, HEAD_DV=spec.head_dim_v,
            PAGED=spec.paged)

    B, Sq, Hq, Dv = spec.batch, spec.seqlen_q, spec.num_heads_q, spec.head_dim_v
    out = torch.empty(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    splits = plan.num_splits
    if splits == 1:  # the one split's normalised output is the answer: no workspace, no combine
        o_part, l_part = out, lse
    else:
        o_part = torch.empty(splits, B, Hq, Sq, Dv, dtype=torch.float32, device=q.device)
        l_part = torch.empty(splits, B, Hq, Sq, dtype=torch.float32, device=q.device)
    _decode_split[plan.grid](*_split_args(call, plan, o_part, l_part), **cx,
                             num_warps=plan.tile.num_warps, num_stages=plan.tile.num_stages)
    if splits > 1:
        _decode_combine[(B * Hq * Sq,)](
            o_part, l_part, out, lse, o_part.stride(0), l_part.stride(0), out.stride(0), out.stride(1),
            out.stride(2), splits, Sq, Hq, BLOCK_S=next_pow2(splits), BLOCK_DV=cx["BLOCK_DV"], HEAD_DV=Dv)
    return out, lse
