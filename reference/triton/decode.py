"""KV-cache attention (decode): append, split-KV flash-decoding, combine.

1. ``_append_kv`` writes k_new / v_new into the cache at positions cache_seqlens[b] .. (paged or
   not); the cache_seqlens tensor itself is not advanced (FlashAttention's semantics).
2. ``_decode_split`` packs the query heads that share one KV head into the M dimension (row r is
   token r // gqa of query head hk * gqa + r % gqa), so one program reads each key block once for
   the whole group. The visible key blocks of a batch entry are cut into ``num_splits`` chunks,
   one per program; each writes its normalised partial output and LSE to a workspace.
3. ``_decode_combine`` merges the splits: out = sum_s exp(lse_s - lse) * out_s.

Everything data-dependent (cache lengths, pages) is read on the device: no host synchronisation,
and the only allocations are the outputs and a workspace whose size follows from the spec, so a
call can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import _block_range, _masked_block, next_pow2
from .forward import _attn_fwd_block
from .launch import Launch


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
        k_dst = K + bb * sk_b + pos * sk_s + hk * sk_h
        v_dst = V + bb * sv_b + pos * sv_s + hk * sv_h
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
        return k_head + bb * sk_b + n0 * sk_s, v_head + bb * sv_b + n0 * sv_s


@triton.jit
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

    Writes OPart[split, b, h, t, :] (normalised, fp32) and LPart[split, b, h, t] (natural log;
    -inf when the split saw no key). A paged cache maps key block n0 to page
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
    tl.store(o_ptrs, out, mask=row_in[:, None] & (offs_dv[None, :] < HEAD_DV))
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


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(spec, block_n: int, block_m: int, device) -> int:
    """Static choice from the spec (capacity, not the live lengths, so it needs no sync):
    about four programs per SM (small tail wave), at least 4 key blocks per split, at most 64."""
    if spec.num_splits > 0:
        return spec.num_splits
    sms = 4 if device.type != "cuda" else _num_sms(device.index or 0)
    work = spec.batch * spec.num_heads_kv * triton.cdiv(spec.seqlen_q * spec.gqa_ratio, block_m)
    kv_blocks = triton.cdiv(spec.seqlen_k, block_n)
    return max(1, min(triton.cdiv(4 * sms, max(work, 1)), triton.cdiv(kv_blocks, 4), 64))


def attention_decode(call):
    """kv-cache call: append k_new/v_new in place, attend, return (out, lse (B, Hq, Sq))."""
    spec = call.spec
    L = Launch(call, "decode")
    k, v = call.k, call.v
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise NotImplementedError("triton decode: the kv cache needs a contiguous last dimension (it is written in place)")
    q = L.q
    cx = L.constexprs()
    page_table = call.page_table if spec.paged else q
    spt_b = call.page_table.stride(0) if spec.paged else 0
    page_size = max(spec.page_size, 1)
    if spec.num_new_kv and spec.batch:
        kn, vn = (t if t.stride(-1) == 1 else t.contiguous() for t in (call.k_new, call.v_new))
        _append_kv[(spec.batch * spec.num_new_kv, spec.num_heads_kv)](
            kn, vn, k, v, call.cache_seqlens, page_table, *kn.stride()[:3], *vn.stride()[:3],
            *k.stride()[:3], *v.stride()[:3], spt_b, spec.num_new_kv, page_size,
            BLOCK_D=cx["BLOCK_D"], BLOCK_DV=cx["BLOCK_DV"], HEAD_D=spec.head_dim, HEAD_DV=spec.head_dim_v,
            PAGED=spec.paged)

    B, Sq, Hq, Dv = spec.batch, spec.seqlen_q, spec.num_heads_q, spec.head_dim_v
    out = torch.empty(B, Sq, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.fill_(float("-inf"))
    cfg = L.cfg
    splits = choose_num_splits(spec, cfg.block_n, cfg.block_m, q.device)
    o_part = torch.empty(splits, B, Hq, Sq, Dv, dtype=torch.float32, device=q.device)
    l_part = torch.empty(splits, B, Hq, Sq, dtype=torch.float32, device=q.device)
    grid = (splits, B * spec.num_heads_kv, triton.cdiv(Sq * spec.gqa_ratio, cfg.block_m))
    _decode_split[grid](
        q, k, v, o_part, l_part, call.cache_seqlens, page_table,
        *L.qkv_strides(q), *k.stride()[:3], *v.stride()[:3], spt_b,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        l_part.stride(0), l_part.stride(1), l_part.stride(2),
        Sq, spec.num_new_kv, spec.num_heads_kv, spec.gqa_ratio, splits, page_size,
        L.qk_scale, L.softcap, L.win_left, L.win_right,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cx["BLOCK_D"], BLOCK_DV=cx["BLOCK_DV"],
        HEAD_D=spec.head_dim, HEAD_DV=Dv, PAGED=spec.paged, HAS_LEFT=L.has_left, HAS_RIGHT=L.has_right,
        SOFTCAP=cx["SOFTCAP"], DOT_FP32=cx["DOT_FP32"], IEEE=cx["IEEE"],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _decode_combine[(B * Hq * Sq,)](
        o_part, l_part, out, lse, o_part.stride(0), l_part.stride(0), out.stride(0), out.stride(1), out.stride(2),
        splits, Sq, Hq, BLOCK_S=next_pow2(splits), BLOCK_DV=cx["BLOCK_DV"], HEAD_DV=Dv)
    return out, lse
