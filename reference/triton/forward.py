"""Forward attention, FlashAttention-2 style: output and LSE for batched and varlen calls.

One program computes one query tile (BLOCK_M rows of one query head) against the key blocks it
can see, with an online softmax in the log2 domain. The key-block loop is split into blocks
that need no mask (``MASK=0``: the hot loop has no mask arithmetic) and blocks that do; with a
block-sparse CSR the loop visits only the listed blocks (full ones with the sequence bound only,
mask ones with the element predicate). A CSR block wider than the key tile is visited in one
flat loop over (entry, tile) pairs: in nested loops Triton's software pipeliner would only see the
inner loop of a few trips (0.74x FlexAttention on a window CSR at 16k, H100, before flattening).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _block_range, _i64, _dot, _element_mask, _masked_block, _scores, _sequence_bounds
from .launch import Launch


@triton.jit
def _attn_fwd_block(acc, l_i, m_i, q, k_tile, v_tile, stride_ks, stride_vs, rows, n0,
                    seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, kr_stride_r,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, MASK: tl.constexpr,
                    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_KR: tl.constexpr,
                    SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """Inner loop body: fold one key block (keys n0 .. n0+BLOCK_N) into (acc, l_i, m_i).

    ``k_tile``/``v_tile`` point at key row n0 of the right head (rows are ``stride_ks`` apart).
    ``rows``: the query index of each accumulator row, for the mask. MASK: 0 none, 1 key bound,
    2 key bound and element predicate.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = k_tile + offs_n[None, :] * stride_ks + offs_d[:, None]  # K^T tile (D, N)
    v_ptrs = v_tile + offs_n[:, None] * stride_vs + offs_dv[None, :]
    if MASK == 0 and BLOCK_D == HEAD_D and BLOCK_DV == HEAD_DV:
        kT = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        key_in = (n0 + offs_n) < seqlen_k
        kT = tl.load(k_ptrs, mask=key_in[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        v = tl.load(v_ptrs, mask=key_in[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    s, _ = _scores(_dot(q, kT, DOT_FP32, IEEE), qk_scale, softcap, SOFTCAP)
    if MASK == 1:
        s = tl.where(((n0 + offs_n) < seqlen_k)[None, :], s, float("-inf"))
    if MASK == 2:
        vis = _element_mask(rows[:, None], (n0 + offs_n)[None, :], seqlen_q, seqlen_k, win_left, win_right,
                            kr_ptrs, kr_stride_r, HAS_LEFT, HAS_RIGHT, NUM_KR)
        s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK > 0:  # a row that has seen no key yet keeps m = -inf; shift by 0 instead of -inf - -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32, IEEE)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd(Q, K, V, Out, Lse, CuQ, CuK, KR, FullPtr, FullCol, MaskPtr, MaskCol,
              sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_s, so_h, sl_b, sl_h,
              skr_b, skr_h, skr_s, skr_r, sbp_b, sbp_h, sfc_b, sfc_h, smc_b, smc_h,
              seqlen_q, seqlen_k, num_heads_q, gqa, qk_scale, softcap, win_left, win_right,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, IS_VARLEN: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_KR: tl.constexpr, HAS_BS: tl.constexpr,
              BS_M: tl.constexpr, BS_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
              IEEE: tl.constexpr):
    """Forward. Grid: (cdiv(max_seqlen_q, BLOCK_M), batch * num_heads_q).

    Program (m, b*Hq + h) writes Out rows m*BLOCK_M.. of head h and their LSE (natural log).
    GQA/MQA: query head h reads KV head h // gqa. Causal is a window with right = 0 (host).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    hk = h // gqa
    bb, q0, k0, seqlen_q, seqlen_k = _sequence_bounds(CuQ, CuK, b, seqlen_q, seqlen_k, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < seqlen_q
    q = tl.load(Q + bb * sq_b + (q0 + m0) * sq_s + tl.arange(0, BLOCK_M)[:, None] * sq_s + h * sq_h + offs_d[None, :],
                mask=row_in[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    k_seq = K + bb * sk_b + k0 * sk_s + hk * sk_h  # key row 0 of this sequence and KV head
    v_seq = V + bb * sv_b + k0 * sv_s + hk * sv_h
    kr_ptrs = KR + bb * skr_b + h * skr_h + q0 * skr_s + offs_m[:, None] * skr_s

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    if HAS_BS:
        # CSR row of the query block holding this tile; each listed key block is BS_N keys wide,
        # visited as BS_N // BLOCK_N key tiles
        row = m0 // BS_M
        bp = b * sbp_b + h * sbp_h + row
        start = tl.load(FullPtr + bp)
        end = tl.load(FullPtr + bp + 1)
        for i in range(start * (BS_N // BLOCK_N), end * (BS_N // BLOCK_N)):  # one flat loop: pipelined
            kb = tl.load(FullCol + b * sfc_b + h * sfc_h + i // (BS_N // BLOCK_N))
            t = i % (BS_N // BLOCK_N)
            n0 = kb * BS_N + t * BLOCK_N
            acc, l_i, m_i = _attn_fwd_block(
                acc, l_i, m_i, q, k_seq + _i64(n0) * sk_s, v_seq + _i64(n0) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 1, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)
        start = tl.load(MaskPtr + bp)
        end = tl.load(MaskPtr + bp + 1)
        for i in range(start * (BS_N // BLOCK_N), end * (BS_N // BLOCK_N)):  # one flat loop: pipelined
            kb = tl.load(MaskCol + b * smc_b + h * smc_h + i // (BS_N // BLOCK_N))
            t = i % (BS_N // BLOCK_N)
            n0 = kb * BS_N + t * BLOCK_N
            acc, l_i, m_i = _attn_fwd_block(
                acc, l_i, m_i, q, k_seq + _i64(n0) * sk_s, v_seq + _i64(n0) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 2, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)
    else:
        # query i sees key j iff i + off - left <= j <= i + off + right, off = Sk - Sq
        off = seqlen_k - seqlen_q
        lo, full_lo, full_hi, hi = _block_range(m0, tl.minimum(m0 + BLOCK_M, seqlen_q) - 1, seqlen_k, BLOCK_N,
                                                off - win_left, off + win_right, HAS_LEFT, HAS_RIGHT,
                                                NUM_KR > 0)
        for blk in range(full_lo, full_hi):  # hot loop: no mask
            n0 = blk * BLOCK_N
            acc, l_i, m_i = _attn_fwd_block(
                acc, l_i, m_i, q, k_seq + _i64(n0) * sk_s, v_seq + _i64(n0) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 0, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)
        for t in range(0, (full_lo - lo) + (hi - full_hi)):  # boundary blocks: masked
            n0 = _masked_block(t, lo, full_lo, full_hi) * BLOCK_N
            acc, l_i, m_i = _attn_fwd_block(
                acc, l_i, m_i, q, k_seq + _i64(n0) * sk_s, v_seq + _i64(n0) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 2, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)

    # rows that saw no key: output 0, LSE -inf
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(Out + bb * so_b + (q0 + m0) * so_s + tl.arange(0, BLOCK_M)[:, None] * so_s + h * so_h + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=row_in[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(Lse + bb * sl_b + h * sl_h + q0 + offs_m, lse, mask=row_in)


def attention_forward(call):
    """Launch the forward for a batched or varlen call. Returns (out, lse)."""
    L = Launch(call, "fwd")
    spec = call.spec
    q, k, v = L.q, L.k, L.v
    if spec.mode == "varlen":
        out = torch.empty(q.shape[0], spec.num_heads_q, spec.head_dim_v, dtype=q.dtype, device=q.device)
        lse = torch.empty(spec.num_heads_q, q.shape[0], dtype=torch.float32, device=q.device)
        so = (0, out.stride(0), out.stride(1))
        sl = (0, lse.stride(0))
    else:
        out = torch.empty(spec.batch, spec.seqlen_q, spec.num_heads_q, spec.head_dim_v, dtype=q.dtype,
                          device=q.device)
        lse = torch.empty(spec.batch, spec.num_heads_q, spec.seqlen_q, dtype=torch.float32, device=q.device)
        so = (out.stride(0), out.stride(1), out.stride(2))
        sl = (lse.stride(0), lse.stride(1))
    if out.numel() == 0 or lse.numel() == 0:
        return out, lse.fill_(float("-inf"))
    cfg = L.cfg
    grid = (triton.cdiv(spec.seqlen_q, cfg.block_m), spec.batch * spec.num_heads_q)
    csr = L.csr("q2k")
    _attn_fwd[grid](
        q, k, v, out, lse, L.cu_q, L.cu_k, L.kr, *csr.ptrs,
        *L.qkv_strides(q), *L.qkv_strides(k), *L.qkv_strides(v), *so, *sl,
        *L.kr_strides, *csr.strides,
        spec.seqlen_q, spec.seqlen_k, spec.num_heads_q, spec.gqa_ratio, L.qk_scale, L.softcap,
        L.win_left, L.win_right,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **L.constexprs(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse
