"""Backward attention, FlashAttention-2 style, in three kernels and without atomics.

1. ``_attn_bwd_preprocess``: delta_i = sum_d dO_i * O_i, and the LSE moved to the log2 domain.
2. ``_attn_bwd_dkdv``: one program per key tile of one KV head; it loops over the query heads of
   its group (GQA) and the query blocks that see the tile, and owns dK/dV of those keys.
3. ``_attn_bwd_dq``: one program per query tile of one query head; it loops over the key blocks
   like the forward and owns dQ of those rows.

Each output element is written by exactly one program that sums in a fixed order, so the
backward is **deterministic by construction**: dQ, dK, dV are bitwise identical across runs, and
``deterministic=True`` changes nothing here. The price is recomputing P and dP in both passes.

With P = exp2(s2 - lse2), dP = dO V^T, dS = P * (dP - delta):
dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K (times 1 - tanh^2 with a softcap).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _accumulate, _block_range, _dot, _element_mask, _masked_block, _row, _scores, _sequence_bounds
from .launch import Launch, last_dim_contiguous


@triton.jit
def _attn_bwd_preprocess(O, DO, Lse, Delta, Lse2, CuQ, so_b, so_s, so_h, sdo_b, sdo_s, sdo_h, sl_b, sl_h,
                         seqlen_q, num_heads_q,
                         BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DV: tl.constexpr,
                         IS_VARLEN: tl.constexpr):
    """Delta and log2-domain LSE. Grid: (cdiv(max_seqlen_q, BLOCK_M), batch * num_heads_q).

    Rows without a visible key (LSE -inf) get lse2 = +inf, so that exp2(s2 - lse2) = 0 for them.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    q_start = 0
    if IS_VARLEN:
        q_start = tl.load(CuQ + b)
        seqlen_q = tl.load(CuQ + b + 1) - q_start
    bb = tl.cast(b, tl.int64)
    q0 = tl.cast(q_start, tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < seqlen_q
    mask = row_in[:, None] & (offs_dv[None, :] < HEAD_DV)
    # (q0 + row) * stride in 64 bits (q0 is int64): rows x stride pass 2**31 for long sequences
    o = tl.load(O + bb * so_b + (q0 + pid_m * BLOCK_M) * so_s + tl.arange(0, BLOCK_M)[:, None] * so_s + h * so_h
                + offs_dv[None, :], mask=mask, other=0.0)
    do = tl.load(DO + bb * sdo_b + (q0 + pid_m * BLOCK_M) * sdo_s + tl.arange(0, BLOCK_M)[:, None] * sdo_s
                 + h * sdo_h + offs_dv[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse_off = bb * sl_b + h * sl_h + q0 + offs_m
    lse2 = tl.load(Lse + lse_off, mask=row_in, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    tl.store(Delta + lse_off, delta, mask=row_in)
    tl.store(Lse2 + lse_off, lse2, mask=row_in)


@triton.jit
def _attn_bwd_dkdv_block(dk, dv, dk_c, dv_c, k, v, q_tile, do_tile, lse2_tile, delta_tile, sq_s, sdo_s, offs_n, m0,
                         seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_tile, skr_s, skr_r,
                         BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, MASK: tl.constexpr,
                         HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_KR: tl.constexpr,
                         SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
                         WIDE_ROWS: tl.constexpr):
    """Inner loop body of the dK/dV pass: add query rows m0 .. m0+BLOCK_M into (dk, dv)
    (compensated by (dk_c, dv_c) for fp32 inputs, see common._accumulate).

    Works on transposed scores (keys x queries) so that dK and dV come out as plain products.
    ``*_tile`` point at query row 0 of the sequence and head. MASK: 0 none, 1 query bound only,
    2 query bound and element predicate. Rows past the sequence have lse2 = +inf, so P = 0.
    """
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if WIDE_ROWS:  # the tile's start in 64 bits, the offsets within it in 32
        rows = tl.arange(0, BLOCK_M)
        q_ptrs = q_tile + _row(m0, WIDE_ROWS) * sq_s + rows[None, :] * sq_s + offs_d[:, None]  # Q^T (D, M)
        do_ptrs = do_tile + _row(m0, WIDE_ROWS) * sdo_s + rows[:, None] * sdo_s + offs_dv[None, :]
    else:
        # one int32 offset tensor from the loop-varying rows: in the form above the offsets within the
        # tile are loop-invariant, get hoisted and stay live across the loop, and the sm_90 kernel
        # (255 registers) spilled 3x more (552 against 180 bytes of spill loads, ptxas -v)
        q_ptrs = q_tile + offs_m[None, :] * sq_s + offs_d[:, None]
        do_ptrs = do_tile + offs_m[:, None] * sdo_s + offs_dv[None, :]
    if MASK == 0 and BLOCK_D == HEAD_D and BLOCK_DV == HEAD_DV:
        qT = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse2 = tl.load(lse2_tile + offs_m)
        delta = tl.load(delta_tile + offs_m)
    else:
        row_in = offs_m < seqlen_q
        qT = tl.load(q_ptrs, mask=row_in[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        do = tl.load(do_ptrs, mask=row_in[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
        lse2 = tl.load(lse2_tile + offs_m, mask=row_in, other=float("inf"))
        delta = tl.load(delta_tile + offs_m, mask=row_in, other=0.0)
    sT, tT = _scores(_dot(k, qT, DOT_FP32, IEEE), qk_scale, softcap, SOFTCAP)
    pT = tl.math.exp2(sT - lse2[None, :])
    if MASK == 2:
        vis = _element_mask(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, win_left, win_right,
                            kr_tile + offs_m[None, :] * skr_s, skr_r, HAS_LEFT, HAS_RIGHT, NUM_KR)
        pT = tl.where(vis, pT, 0.0)
    dv, dv_c = _accumulate(dv, dv_c, _dot(pT.to(do.dtype), do, DOT_FP32, IEEE), IEEE)
    dpT = _dot(v, tl.trans(do), DOT_FP32, IEEE)
    dsT = pT * (dpT - delta[None, :])
    if SOFTCAP:
        dsT = dsT * (1.0 - tT * tT)
    dk, dk_c = _accumulate(dk, dk_c, _dot(dsT.to(qT.dtype), tl.trans(qT), DOT_FP32, IEEE), IEEE)
    return dk, dv, dk_c, dv_c


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, Lse2, Delta, DK, DV, CuQ, CuK, KR, FullPtr, FullCol, MaskPtr, MaskCol,
                   sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sdo_b, sdo_s, sdo_h,
                   sdk_b, sdk_s, sdk_h, sdv_b, sdv_s, sdv_h, sl_b, sl_h,
                   skr_b, skr_h, skr_s, skr_r, sbp_b, sbp_h, sfc_b, sfc_h, smc_b, smc_h,
                   seqlen_q, seqlen_k, num_heads_kv, gqa, qk_scale, softcap, win_left, win_right, sm_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, IS_VARLEN: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_KR: tl.constexpr, HAS_BS: tl.constexpr,
                   BS_M: tl.constexpr, BS_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
                   IEEE: tl.constexpr, WIDE_ROWS: tl.constexpr):
    """dK, dV. Grid: (cdiv(max_seqlen_k, BLOCK_N), batch * num_heads_kv).

    Program (n, b*Hkv + hk) owns dK/dV rows n*BLOCK_N.. of KV head hk and sums, in a fixed order,
    over the gqa query heads hk*gqa .. and the query blocks that see the tile (no atomics).
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_kv
    hk = pid_bh % num_heads_kv
    bb, q0, k0, seqlen_q, seqlen_k = _sequence_bounds(CuQ, CuK, b, seqlen_q, seqlen_k, IS_VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen_k:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_in = offs_n < seqlen_k
    k = tl.load(K + bb * sk_b + (k0 + n0) * sk_s + tl.arange(0, BLOCK_N)[:, None] * sk_s + hk * sk_h + offs_d[None, :],
                mask=key_in[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    v = tl.load(V + bb * sv_b + (k0 + n0) * sv_s + tl.arange(0, BLOCK_N)[:, None] * sv_s + hk * sv_h + offs_dv[None, :],
                mask=key_in[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if IEEE:  # fp32 inputs: compensation terms of the sums over the group's heads and query blocks
        dk_c = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv_c = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    else:  # 16-bit inputs: plain sums; one-element placeholders pass through untouched
        dk_c = tl.zeros([1, 1], tl.float32)
        dv_c = tl.zeros([1, 1], tl.float32)
    # key j sees query i iff j - off - right <= i <= j - off + left (the forward rule, transposed)
    off = seqlen_k - seqlen_q
    for g in range(0, gqa):
        h = hk * gqa + g
        q_seq = Q + bb * sq_b + q0 * sq_s + h * sq_h
        do_seq = DO + bb * sdo_b + q0 * sdo_s + h * sdo_h
        l_seq = Lse2 + bb * sl_b + h * sl_h + q0
        d_seq = Delta + bb * sl_b + h * sl_h + q0
        kr_seq = KR + bb * skr_b + h * skr_h + q0 * skr_s
        if HAS_BS:
            # k2q CSR row of the key block holding this tile; listed query blocks are BS_M rows,
            # visited as BS_M // BLOCK_M query tiles
            bp = b * sbp_b + h * sbp_h + n0 // BS_N
            start = tl.load(FullPtr + bp)
            end = tl.load(FullPtr + bp + 1)
            for i in range(start * (BS_M // BLOCK_M), end * (BS_M // BLOCK_M)):  # one flat loop: pipelined
                qb = tl.load(FullCol + b * sfc_b + h * sfc_h + i // (BS_M // BLOCK_M))
                t = i % (BS_M // BLOCK_M)
                dk, dv, dk_c, dv_c = _attn_bwd_dkdv_block(
                    dk, dv, dk_c, dv_c, k, v, q_seq, do_seq, l_seq, d_seq, sq_s, sdo_s, offs_n, qb * BS_M + t * BLOCK_M,
                    seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_seq, skr_s, skr_r,
                    BLOCK_M, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 1, HAS_LEFT, HAS_RIGHT, NUM_KR,
                    SOFTCAP, DOT_FP32, IEEE, WIDE_ROWS)
            start = tl.load(MaskPtr + bp)
            end = tl.load(MaskPtr + bp + 1)
            for i in range(start * (BS_M // BLOCK_M), end * (BS_M // BLOCK_M)):  # one flat loop: pipelined
                qb = tl.load(MaskCol + b * smc_b + h * smc_h + i // (BS_M // BLOCK_M))
                t = i % (BS_M // BLOCK_M)
                dk, dv, dk_c, dv_c = _attn_bwd_dkdv_block(
                    dk, dv, dk_c, dv_c, k, v, q_seq, do_seq, l_seq, d_seq, sq_s, sdo_s, offs_n, qb * BS_M + t * BLOCK_M,
                    seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_seq, skr_s, skr_r,
                    BLOCK_M, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 2, HAS_LEFT, HAS_RIGHT, NUM_KR,
                    SOFTCAP, DOT_FP32, IEEE, WIDE_ROWS)
        else:
            lo, full_lo, full_hi, hi = _block_range(n0, tl.minimum(n0 + BLOCK_N, seqlen_k) - 1, seqlen_q, BLOCK_M,
                                                    -off - win_right, -off + win_left, HAS_RIGHT, HAS_LEFT,
                                                    NUM_KR > 0)
            for blk in range(full_lo, full_hi):
                dk, dv, dk_c, dv_c = _attn_bwd_dkdv_block(
                    dk, dv, dk_c, dv_c, k, v, q_seq, do_seq, l_seq, d_seq, sq_s, sdo_s, offs_n, blk * BLOCK_M,
                    seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_seq, skr_s, skr_r,
                    BLOCK_M, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 0, HAS_LEFT, HAS_RIGHT, NUM_KR,
                    SOFTCAP, DOT_FP32, IEEE, WIDE_ROWS)
            for t in range(0, (full_lo - lo) + (hi - full_hi)):
                dk, dv, dk_c, dv_c = _attn_bwd_dkdv_block(
                    dk, dv, dk_c, dv_c, k, v, q_seq, do_seq, l_seq, d_seq, sq_s, sdo_s, offs_n,
                    _masked_block(t, lo, full_lo, full_hi) * BLOCK_M,
                    seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_seq, skr_s, skr_r,
                    BLOCK_M, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 2, HAS_LEFT, HAS_RIGHT, NUM_KR,
                    SOFTCAP, DOT_FP32, IEEE, WIDE_ROWS)
    dk = dk * sm_scale
    tl.store(DK + bb * sdk_b + (k0 + n0) * sdk_s + tl.arange(0, BLOCK_N)[:, None] * sdk_s + hk * sdk_h
             + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=key_in[:, None] & (offs_d[None, :] < HEAD_D))
    tl.store(DV + bb * sdv_b + (k0 + n0) * sdv_s + tl.arange(0, BLOCK_N)[:, None] * sdv_s + hk * sdv_h
             + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=key_in[:, None] & (offs_dv[None, :] < HEAD_DV))


@triton.jit
def _attn_bwd_dq_block(dq, dq_c, q, do, lse2, delta, k_tile, v_tile, sk_s, sv_s, rows, n0,
                       seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, MASK: tl.constexpr,
                       HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_KR: tl.constexpr,
                       SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    """Inner loop body of the dQ pass: add key block n0 .. n0+BLOCK_N into dq (MASK as forward;
    compensated by dq_c for fp32 inputs)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = k_tile + offs_n[None, :] * sk_s + offs_d[:, None]  # K^T (D, N)
    v_ptrs = v_tile + offs_n[None, :] * sv_s + offs_dv[:, None]  # V^T (Dv, N)
    if MASK == 0 and BLOCK_D == HEAD_D and BLOCK_DV == HEAD_DV:
        kT = tl.load(k_ptrs)
        vT = tl.load(v_ptrs)
    else:
        key_in = (n0 + offs_n) < seqlen_k
        kT = tl.load(k_ptrs, mask=key_in[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        vT = tl.load(v_ptrs, mask=key_in[None, :] & (offs_dv[:, None] < HEAD_DV), other=0.0)
    s, t = _scores(_dot(q, kT, DOT_FP32, IEEE), qk_scale, softcap, SOFTCAP)
    p = tl.math.exp2(s - lse2[:, None])
    if MASK == 1:
        p = tl.where(((n0 + offs_n) < seqlen_k)[None, :], p, 0.0)
    if MASK == 2:
        vis = _element_mask(rows[:, None], (n0 + offs_n)[None, :], seqlen_q, seqlen_k, win_left, win_right,
                            kr_ptrs, skr_r, HAS_LEFT, HAS_RIGHT, NUM_KR)
        p = tl.where(vis, p, 0.0)
    dp = _dot(do, vT, DOT_FP32, IEEE)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq, dq_c = _accumulate(dq, dq_c, _dot(ds.to(kT.dtype), tl.trans(kT), DOT_FP32, IEEE), IEEE)
    return dq, dq_c


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, Lse2, Delta, DQ, CuQ, CuK, KR, FullPtr, FullCol, MaskPtr, MaskCol,
                 sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sdo_b, sdo_s, sdo_h,
                 sdq_b, sdq_s, sdq_h, sl_b, sl_h,
                 skr_b, skr_h, skr_s, skr_r, sbp_b, sbp_h, sfc_b, sfc_h, smc_b, smc_h,
                 seqlen_q, seqlen_k, num_heads_q, gqa, qk_scale, softcap, win_left, win_right, sm_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, IS_VARLEN: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, NUM_KR: tl.constexpr, HAS_BS: tl.constexpr,
                 BS_M: tl.constexpr, BS_N: tl.constexpr, SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
                 IEEE: tl.constexpr, WIDE_ROWS: tl.constexpr):
    """dQ. Grid: (cdiv(max_seqlen_q, BLOCK_M), batch * num_heads_q).

    Program (m, b*Hq + h) owns dQ rows m*BLOCK_M.. of head h; it visits key blocks exactly like
    the forward (full blocks unmasked, boundary or CSR-mask blocks masked).
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
    do = tl.load(DO + bb * sdo_b + (q0 + m0) * sdo_s + tl.arange(0, BLOCK_M)[:, None] * sdo_s + h * sdo_h
                 + offs_dv[None, :],
                 mask=row_in[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    lse2 = tl.load(Lse2 + bb * sl_b + h * sl_h + q0 + offs_m, mask=row_in, other=float("inf"))
    delta = tl.load(Delta + bb * sl_b + h * sl_h + q0 + offs_m, mask=row_in, other=0.0)
    k_seq = K + bb * sk_b + k0 * sk_s + hk * sk_h
    v_seq = V + bb * sv_b + k0 * sv_s + hk * sv_h
    kr_ptrs = KR + bb * skr_b + h * skr_h + q0 * skr_s + offs_m[:, None] * skr_s
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if IEEE:  # fp32 inputs: compensation term of the sum over the key blocks
        dq_c = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    else:
        dq_c = tl.zeros([1, 1], tl.float32)
    if HAS_BS:
        bp = b * sbp_b + h * sbp_h + m0 // BS_M
        start = tl.load(FullPtr + bp)
        end = tl.load(FullPtr + bp + 1)
        for i in range(start * (BS_N // BLOCK_N), end * (BS_N // BLOCK_N)):  # one flat loop: pipelined
            kb = tl.load(FullCol + b * sfc_b + h * sfc_h + i // (BS_N // BLOCK_N))
            t = i % (BS_N // BLOCK_N)
            n0 = kb * BS_N + t * BLOCK_N
            dq, dq_c = _attn_bwd_dq_block(
                dq, dq_c, q, do, lse2, delta, k_seq + _row(n0, WIDE_ROWS) * sk_s, v_seq + _row(n0, WIDE_ROWS) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 1, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)
        start = tl.load(MaskPtr + bp)
        end = tl.load(MaskPtr + bp + 1)
        for i in range(start * (BS_N // BLOCK_N), end * (BS_N // BLOCK_N)):  # one flat loop: pipelined
            kb = tl.load(MaskCol + b * smc_b + h * smc_h + i // (BS_N // BLOCK_N))
            t = i % (BS_N // BLOCK_N)
            n0 = kb * BS_N + t * BLOCK_N
            dq, dq_c = _attn_bwd_dq_block(
                dq, dq_c, q, do, lse2, delta, k_seq + _row(n0, WIDE_ROWS) * sk_s, v_seq + _row(n0, WIDE_ROWS) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 2, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)
    else:
        off = seqlen_k - seqlen_q
        lo, full_lo, full_hi, hi = _block_range(m0, tl.minimum(m0 + BLOCK_M, seqlen_q) - 1, seqlen_k, BLOCK_N,
                                                off - win_left, off + win_right, HAS_LEFT, HAS_RIGHT, NUM_KR > 0)
        for blk in range(full_lo, full_hi):
            n0 = blk * BLOCK_N
            dq, dq_c = _attn_bwd_dq_block(
                dq, dq_c, q, do, lse2, delta, k_seq + _row(n0, WIDE_ROWS) * sk_s, v_seq + _row(n0, WIDE_ROWS) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 0, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)
        for t in range(0, (full_lo - lo) + (hi - full_hi)):
            n0 = _masked_block(t, lo, full_lo, full_hi) * BLOCK_N
            dq, dq_c = _attn_bwd_dq_block(
                dq, dq_c, q, do, lse2, delta, k_seq + _row(n0, WIDE_ROWS) * sk_s, v_seq + _row(n0, WIDE_ROWS) * sv_s, sk_s, sv_s, offs_m, n0,
                seqlen_q, seqlen_k, qk_scale, softcap, win_left, win_right, kr_ptrs, skr_r,
                BLOCK_N, BLOCK_D, BLOCK_DV, HEAD_D, HEAD_DV, 2, HAS_LEFT, HAS_RIGHT, NUM_KR,
                SOFTCAP, DOT_FP32, IEEE)
    dq = dq * sm_scale
    tl.store(DQ + bb * sdq_b + (q0 + m0) * sdq_s + tl.arange(0, BLOCK_M)[:, None] * sdq_s + h * sdq_h + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=row_in[:, None] & (offs_d[None, :] < HEAD_D))


def attention_backward(call, out, lse, dout):
    """Launch the three backward kernels. Returns (dq, dk, dv) in the input dtype."""
    spec = call.spec
    L = Launch(call, "dkdv")
    cfg_dkdv = L.cfg
    cfg_dq = Launch(call, "dq").cfg
    q, k, v = L.q, L.k, L.v
    out = last_dim_contiguous(out)
    dout = last_dim_contiguous(dout.to(q.dtype))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.float().contiguous()
    sl = (0, lse.stride(0)) if spec.mode == "varlen" else (lse.stride(0), lse.stride(1))
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    lse2 = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    assert delta.stride() == lse.stride()
    cx = L.constexprs()
    wide = L.wide_rows(q_like=(dout, dq), k_like=(dk, dv))  # row offsets in 64 bits only if needed
    scal = (L.qk_scale, L.softcap, L.win_left, L.win_right, spec.scale)

    pre_bm = 64
    _attn_bwd_preprocess[(triton.cdiv(spec.seqlen_q, pre_bm), spec.batch * spec.num_heads_q)](
        out, dout, lse, delta, lse2, L.cu_q, *L.qkv_strides(out), *L.qkv_strides(dout), *sl,
        spec.seqlen_q, spec.num_heads_q,
        BLOCK_M=pre_bm, BLOCK_DV=cx["BLOCK_DV"], HEAD_DV=spec.head_dim_v, IS_VARLEN=cx["IS_VARLEN"])

    k2q = L.csr("k2q")
    _attn_bwd_dkdv[(triton.cdiv(spec.seqlen_k, cfg_dkdv.block_n), spec.batch * spec.num_heads_kv)](
        q, k, v, dout, lse2, delta, dk, dv, L.cu_q, L.cu_k, L.kr, *k2q.ptrs,
        *L.qkv_strides(q), *L.qkv_strides(k), *L.qkv_strides(v), *L.qkv_strides(dout),
        *L.qkv_strides(dk), *L.qkv_strides(dv), *sl, *L.kr_strides, *k2q.strides,
        spec.seqlen_q, spec.seqlen_k, spec.num_heads_kv, spec.gqa_ratio, *scal,
        BLOCK_M=cfg_dkdv.block_m, BLOCK_N=cfg_dkdv.block_n, **cx, WIDE_ROWS=wide,
        num_warps=cfg_dkdv.num_warps, num_stages=cfg_dkdv.num_stages)

    q2k = L.csr("q2k")
    _attn_bwd_dq[(triton.cdiv(spec.seqlen_q, cfg_dq.block_m), spec.batch * spec.num_heads_q)](
        q, k, v, dout, lse2, delta, dq, L.cu_q, L.cu_k, L.kr, *q2k.ptrs,
        *L.qkv_strides(q), *L.qkv_strides(k), *L.qkv_strides(v), *L.qkv_strides(dout),
        *L.qkv_strides(dq), *sl, *L.kr_strides, *q2k.strides,
        spec.seqlen_q, spec.seqlen_k, spec.num_heads_q, spec.gqa_ratio, *scal,
        BLOCK_M=cfg_dq.block_m, BLOCK_N=cfg_dq.block_n, **cx, WIDE_ROWS=wide,
        num_warps=cfg_dq.num_warps, num_stages=cfg_dq.num_stages)
    return dq, dk, dv
