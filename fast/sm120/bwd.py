"""FlashAttention-2 backward on warp-level mma.sync (SM80 class), sized for SM120's 99 KB of smem.

One CTA owns one key block (tile_n keys) of one KV head of one batch entry and keeps K, V and the
fp32 dK/dV accumulators resident for its whole life. It walks every query head of the GQA group
and, per head, every query block that can see the key block (causal/window bounds, inverted):

    wait Q[m], dO[m] (cp.async) -> S^T = K Q^T, dP^T = V dO^T (keys on the M side)
    -> P^T = exp2(S^T * scale*log2e - LSE2), dS^T = P^T (dP^T - delta) * scale   (fp32 registers)
    -> dV += P^T dO, dK += dS^T Q (P^T / dS^T reused from the accumulator registers as A operand)
    -> dS^T to smem -> issue cp.async of Q[m+1], dO[m+1] -> dQ[m] = dS K (ldmatrix.trans of both)
    -> fp32 atomics into the global dQ accumulator

GQA: the query heads of a group are looped inside the CTA (dK/dV stay in registers across them)
instead of writing per-query-head fp32 partials and reducing: no extra HBM traffic or buffer of
B*Sk*Hq*D fp32, no extra kernel, and the group's heads reuse the resident K/V tiles.

Deterministic mode: before its atomics into dQ[m], a CTA waits on the per-(batch, query head,
query block) semaphore for the rank of its key block among the key blocks that visit that query
block (dualattn.sparse.compute_lock_values semantics; for the dense/causal/window ranges here the
visitors of query block m are the contiguous n_block_range(m), so the rank is n - n_min(m)), then
releases rank + 1. Summation order is then fixed (bitwise reproducible), and a CTA only ever waits
for a lower key block of the same (batch, KV head), which is earlier in the grid's launch order, so
it cannot deadlock.

Delta (rowsum(dO * O)), the log2-domain LSE and the fp32 -> dtype conversion of dQ are elementwise,
memory-bound and done by torch on the host side (impl/bwd host code).
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from dualattn.fast.common.block_info import block_needs_mask, n_block_range
from dualattn.fast.common.layouts import acc_as_A, acc_mn_view, smem_layout_rowmajor
from dualattn.fast.common.seqlen_info import seq_bounds

SMEM_LIMIT_SM120 = 99 * 1024


@dataclass(frozen=True)
class BwdTileConfig:
    tile_m: int      # query rows per inner step
    tile_n: int      # keys per CTA (16 per warp: warps split the key rows of S^T, dK, dV)
    num_threads: int
    dq_warps_m: int  # warp grid (dq_warps_m, warps / dq_warps_m) of the dQ = dS K product

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        # Q, dO (tile_m x D), K, V (tile_n x D), dS^T (tile_n x tile_m), LSE2 and delta (fp32)
        b = elem_bytes * (2 * self.tile_m * head_dim + 2 * self.tile_n * head_dim + self.tile_n * self.tile_m)
        return b + 2 * 4 * self.tile_m


# Tile table. 8 warps, 128 keys per CTA (16 key rows per warp); the query step shrinks with the
# head dim so that smem stays under 99 KB and registers (dK + dV accumulators: 2 * 16 * D / 32 fp32
# per thread) stay under 255:
#   hd 64 : 64 x 128: 64 KB smem; 64 fp32 dK/dV + 2 x 32 S/dP registers per thread.
#   hd 128: 32 x 128: 88 KB smem (64 x 128 would need 112 KB); 128 fp32 dK/dV + 2 x 16 S/dP.
def bwd_tile_config(head_dim: int) -> BwdTileConfig:
    if head_dim <= 64:
        return BwdTileConfig(64, 128, 256, 4)
    return BwdTileConfig(32, 128, 256, 2)


SUPPORTED_HEAD_DIMS = (64, 128)


class FlashBwdSm80:
    """dK/dV (and dQ by atomics) kernel for one static configuration."""

    def __init__(self, dtype, head_dim: int, cfg: BwdTileConfig, *, varlen: bool, has_left: bool,
                 has_right: bool, deterministic: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = cfg
        self.tile_m, self.tile_n, self.num_threads = cfg.tile_m, cfg.tile_n, cfg.num_threads
        self.varlen = varlen
        self.has_left = has_left
        self.has_right = has_right
        self.deterministic = deterministic
        warps = self.num_threads // 32
        assert self.tile_n == 16 * warps, "each warp owns 16 key rows"
        assert self.tile_m % (16 * cfg.dq_warps_m) == 0
        assert head_dim % (16 * (warps // cfg.dq_warps_m)) == 0
        assert head_dim % 64 == 0

    @cute.jit
    def __call__(self, pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pdO: cute.Pointer,
                 pdK: cute.Pointer, pdV: cute.Pointer, pdQ: cute.Pointer, pLSE: cute.Pointer,
                 pDelta: cute.Pointer, pSem: cute.Pointer, pCuQ: cute.Pointer, pCuK: cute.Pointer,
                 total_q: Int32, total_k: Int32, seqlen_q: Int32, seqlen_k: Int32, num_batch: Int32,
                 heads_q: Int32, heads_kv: Int32, lse_stride_h: Int32, lse_stride_b: Int32,
                 win_left: Int32, win_right: Int32, n_mblocks: Int32, scale_log2: Float32, scale: Float32,
                 stream):
        D = self.head_dim
        sq = cute.assume(heads_q * D, divby=64)
        skv = cute.assume(heads_kv * D, divby=64)
        mQ = cute.make_tensor(pQ, cute.make_layout((total_q, heads_q, D), stride=(sq, D, 1)))
        mdO = cute.make_tensor(pdO, cute.make_layout((total_q, heads_q, D), stride=(sq, D, 1)))
        mK = cute.make_tensor(pK, cute.make_layout((total_k, heads_kv, D), stride=(skv, D, 1)))
        mV = cute.make_tensor(pV, cute.make_layout((total_k, heads_kv, D), stride=(skv, D, 1)))
        mdK = cute.make_tensor(pdK, cute.make_layout((total_k, heads_kv, D), stride=(skv, D, 1)))
        mdV = cute.make_tensor(pdV, cute.make_layout((total_k, heads_kv, D), stride=(skv, D, 1)))
        flat = cute.make_layout(1 << 30)
        mdQ = cute.make_tensor(pdQ, flat)
        mLSE = cute.make_tensor(pLSE, flat)
        mDelta = cute.make_tensor(pDelta, flat)
        mSem = cute.make_tensor(pSem, flat)
        mCuQ = cute.make_tensor(pCuQ, cute.make_layout(num_batch + 1))
        mCuK = cute.make_tensor(pCuK, cute.make_layout(num_batch + 1))

        sq_layout, k_atom = smem_layout_rowmajor(self.dtype, self.tile_m, D)
        sk_layout, _ = smem_layout_rowmajor(self.dtype, self.tile_n, D)
        sds_layout, _ = smem_layout_rowmajor(self.dtype, self.tile_n, self.tile_m)

        @cute.struct
        class Smem:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sq_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sk_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sk_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sds_layout)], 1024]
            lse: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m], 16]
            delta: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m], 16]

        self.smem_bytes = Smem.size_in_bytes()
        vec = 128 // self.dtype.width
        thr_cols = k_atom // vec
        thr_layout = cute.make_layout((self.num_threads // thr_cols, thr_cols), stride=(thr_cols, 1))
        val_layout = cute.make_layout((1, vec))
        g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                num_bits_per_copy=128), thr_layout, val_layout)
        s2g = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            thr_layout, val_layout)
        warps = self.num_threads // 32
        mma_kv = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (warps, 1, 1),
                                     permutation_mnk=(warps * 16, 16, 16))
        wm = self.cfg.dq_warps_m
        wn = warps // wm
        mma_q = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (wm, wn, 1),
                                    permutation_mnk=(wm * 16, wn * 16, 16))
        grid = (cute.ceil_div(seqlen_k, self.tile_n), heads_kv, num_batch)
        self.kernel(mQ, mK, mV, mdO, mdK, mdV, mdQ, mLSE, mDelta, mSem, mCuQ, mCuK, seqlen_q, seqlen_k,
                    heads_q, heads_kv, lse_stride_h, lse_stride_b, win_left, win_right, n_mblocks,
                    scale_log2, scale, sq_layout, sk_layout, sds_layout, g2s, s2g, mma_kv, mma_q, Smem).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mdQ: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mSem: cute.Tensor,
               mCuQ: cute.Tensor, mCuK: cute.Tensor, seqlen_q_arg: Int32, seqlen_k_arg: Int32,
               heads_q: Int32, heads_kv: Int32, lse_stride_h: Int32, lse_stride_b: Int32,
               win_left: Int32, win_right: Int32, n_mblocks: Int32, scale_log2: Float32, scale: Float32,
               sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, sds_layout: cute.ComposedLayout,
               g2s: cute.TiledCopy, s2g: cute.TiledCopy, mma_kv: cute.TiledMma, mma_q: cute.TiledMma,
               Smem: cutlass.Constexpr):
        D = self.head_dim
        tile_m, tile_n = self.tile_m, self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        group = heads_q // heads_kv
        q_start, seqlen_q = seq_bounds(batch, seqlen_q_arg, mCuQ, self.varlen)
        k_start, seqlen_k = seq_bounds(batch, seqlen_k_arg, mCuK, self.varlen)
        bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)

        if n_block * tile_n < seqlen_k:
            m_lo, m_hi = self.m_block_range(n_block, seqlen_q, seqlen_k, win_left, win_right)
            n_m = cutlass.max(m_hi - m_lo, 0)
            n_iters = n_m * group

            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(Smem)
            sQ = st.sQ.get_tensor(sq_layout)
            sdO = st.sdO.get_tensor(sq_layout)
            sK = st.sK.get_tensor(sk_layout)
            sV = st.sV.get_tensor(sk_layout)
            sdSt = st.sdS.get_tensor(sds_layout)
            sLSE = st.lse.get_tensor(cute.make_layout(tile_m))
            sDelta = st.delta.get_tensor(cute.make_layout(tile_m))
            # transposed views (ldmatrix.trans reads them): Q^T, dO^T (D, m), K^T (D, n), dS (m, n)
            sQt = cute.composition(sQ, cute.make_layout((D, tile_m), stride=(tile_m, 1)))
            sdOt = cute.composition(sdO, cute.make_layout((D, tile_m), stride=(tile_m, 1)))
            sKt = cute.composition(sK, cute.make_layout((D, tile_n), stride=(tile_n, 1)))
            sdS = cute.composition(sdSt, cute.make_layout((tile_m, tile_n), stride=(tile_n, 1)))

            thr_g2s = g2s.get_slice(tidx)
            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head_kv, None]), (tile_n, D), (n_block, 0))
            gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head_kv, None]), (tile_n, D), (n_block, 0))
            cK = cute.local_tile(cute.make_identity_tensor((seqlen_k, D)), (tile_n, D), (n_block, 0))
            tKcK = thr_g2s.partition_S(cK)
            tKsK = thr_g2s.partition_D(sK)
            tVsV = thr_g2s.partition_D(sV)
            tQsQ = thr_g2s.partition_D(sQ)
            tQsdO = thr_g2s.partition_D(sdO)

            # ---- MMA fragments and ldmatrix copies
            thr_kv = mma_kv.get_slice(tidx)
            thr_q = mma_q.get_slice(tidx)
            ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
            ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
            ld_a = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, self.dtype), mma_kv)
            ld_b = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, self.dtype), mma_kv)
            ld_bt = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, self.dtype), mma_kv)
            ld_qa_t = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm_t, self.dtype), mma_q)
            ld_qb_t = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, self.dtype), mma_q)

            # S^T = K Q^T and dP^T = V dO^T
            tSrK = thr_kv.make_fragment_A(thr_kv.partition_A(sK))
            tSrV = thr_kv.make_fragment_A(thr_kv.partition_A(sV))
            tSrQ = thr_kv.make_fragment_B(thr_kv.partition_B(sQ))
            tSrdO = thr_kv.make_fragment_B(thr_kv.partition_B(sdO))
            t_ld_a, t_ld_b, t_ld_bt = ld_a.get_slice(tidx), ld_b.get_slice(tidx), ld_bt.get_slice(tidx)
            tSsK, tSrK_v = t_ld_a.partition_S(sK), t_ld_a.retile(tSrK)
            tSsV, tSrV_v = t_ld_a.partition_S(sV), t_ld_a.retile(tSrV)
            tSsQ, tSrQ_v = t_ld_b.partition_S(sQ), t_ld_b.retile(tSrQ)
            tSsdO, tSrdO_v = t_ld_b.partition_S(sdO), t_ld_b.retile(tSrdO)
            # dV += P^T dO, dK += dS^T Q: B operands are dO^T and Q^T (D, m)
            tVrdOt = thr_kv.make_fragment_B(thr_kv.partition_B(sdOt))
            tKrQt = thr_kv.make_fragment_B(thr_kv.partition_B(sQt))
            tVsdOt, tVrdOt_v = t_ld_bt.partition_S(sdOt), t_ld_bt.retile(tVrdOt)
            tKsQt, tKrQt_v = t_ld_bt.partition_S(sQt), t_ld_bt.retile(tKrQt)
            # dQ = dS K: A = dS (m, n) and B = K^T (D, n), both transposed views
            tQrdS = thr_q.make_fragment_A(thr_q.partition_A(sdS))
            tQrKt = thr_q.make_fragment_B(thr_q.partition_B(sKt))
            t_ld_qa, t_ld_qb = ld_qa_t.get_slice(tidx), ld_qb_t.get_slice(tidx)
            tQsdS, tQrdS_v = t_ld_qa.partition_S(sdS), t_ld_qa.retile(tQrdS)
            tQsKt, tQrKt_v = t_ld_qb.partition_S(sKt), t_ld_qb.retile(tQrKt)

            acc_dK = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, D)), Float32)
            acc_dV = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, D)), Float32)
            acc_dK.fill(0.0)
            acc_dV.fill(0.0)
            # (key, query) coordinates of this thread's S^T elements; (query, d) of its dQ elements
            tScS_mn = acc_mn_view(thr_kv.partition_C(cute.make_identity_tensor((tile_n, tile_m))))
            tQcdQ = thr_q.partition_C(cute.make_identity_tensor((tile_m, D)))
            r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), mma_kv)
            thr_r2s = r2s.get_slice(tidx)
            tdSsdS = thr_r2s.partition_D(sdSt)

            # ---- prologue: K, V for the CTA's life, then Q, dO, LSE, delta of the first step
            self.load_rows(g2s, thr_g2s.partition_S(gK), tKsK, tKcK, seqlen_k)
            self.load_rows(g2s, thr_g2s.partition_S(gV), tVsV, tKcK, seqlen_k)
            if n_iters > 0:
                self.load_q_step(g2s, thr_g2s, mQ, mdO, mLSE, mDelta, sLSE, sDelta, tQsQ, tQsdO, Int32(0), n_m,
                                 m_lo, head_kv * group, q_start, seqlen_q, batch, lse_stride_h, lse_stride_b, tidx)
            cute.arch.cp_async_commit_group()

            for it in cutlass.range(n_iters, unroll=1):
                g = it // n_m
                m_block = m_lo + it - g * n_m
                head = head_kv * group + g
                cute.arch.cp_async_wait_group(0)
                bar.arrive_and_wait()  # Q/dO/LSE/delta of this step landed; previous dQ read of sdS done

                acc_S = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, tile_m)), Float32)
                acc_S.fill(0.0)
                self.gemm_ss(mma_kv, acc_S, ld_a, ld_b, tSsK, tSrK_v, tSsQ, tSrQ_v, tSrK, tSrQ)
                acc_dP = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, tile_m)), Float32)
                acc_dP.fill(0.0)
                self.gemm_ss(mma_kv, acc_dP, ld_a, ld_b, tSsV, tSrV_v, tSsdO, tSrdO_v, tSrV, tSrdO)

                acc_S_mn = acc_mn_view(acc_S)
                acc_dP_mn = acc_mn_view(acc_dP)
                if block_needs_mask(m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k, win_left, win_right,
                                    self.has_left, self.has_right):
                    self.mask_t(acc_S_mn, tScS_mn, m_block * tile_m, n_block * tile_n, seqlen_q, seqlen_k,
                                win_left, win_right)
                for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                    qc = tScS_mn[0, c][1]
                    lse2 = sLSE[qc]
                    dlt = sDelta[qc]
                    for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
                        p = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - lse2, fastmath=True)
                        acc_S_mn[r, c] = p
                        acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - dlt) * scale

                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                rdS = cute.make_fragment_like(acc_dP, self.dtype)
                rdS.store(acc_dP.load().to(self.dtype))
                self.gemm_rs(mma_kv, acc_dV, ld_bt, acc_as_A(rP), tVsdOt, tVrdOt_v, tVrdOt)
                self.gemm_rs(mma_kv, acc_dK, ld_bt, acc_as_A(rdS), tKsQt, tKrQt_v, tKrQt)
                cute.copy(r2s, thr_r2s.retile(rdS), tdSsdS)
                bar.arrive_and_wait()  # dS^T complete in smem; every warp is done with Q, dO, LSE, delta

                if it + 1 < n_iters:
                    self.load_q_step(g2s, thr_g2s, mQ, mdO, mLSE, mDelta, sLSE, sDelta, tQsQ, tQsdO, it + 1, n_m,
                                     m_lo, head_kv * group, q_start, seqlen_q, batch, lse_stride_h, lse_stride_b,
                                     tidx)
                    cute.arch.cp_async_commit_group()

                acc_dQ = cute.make_rmem_tensor(thr_q.partition_shape_C((tile_m, D)), Float32)
                acc_dQ.fill(0.0)
                self.gemm_ss(mma_q, acc_dQ, ld_qa_t, ld_qb_t, tQsdS, tQrdS_v, tQsKt, tQrKt_v, tQrdS, tQrKt)

                sem_idx = (batch * heads_q + head) * n_mblocks + m_block
                if cutlass.const_expr(self.deterministic):
                    n_min, _ = n_block_range(m_block, tile_m, tile_n, seqlen_q, seqlen_k, win_left, win_right,
                                             self.has_left, self.has_right)
                    rank = n_block - n_min
                    if tidx == 0:
                        cur = cute.arch.load((mSem.iterator + sem_idx).llvm_ptr, Int32, sem="acquire", scope="gpu")
                        while cur != rank:
                            cur = cute.arch.load((mSem.iterator + sem_idx).llvm_ptr, Int32, sem="acquire",
                                                 scope="gpu")
                    bar.arrive_and_wait()
                row_base = (q_start + m_block * tile_m) * heads_q * D + head * D
                for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                    rr, cc = tQcdQ[i]
                    if m_block * tile_m + rr < seqlen_q:
                        cute.arch.red((mdQ.iterator + (row_base + rr * heads_q * D + cc)).llvm_ptr, acc_dQ[i],
                                      op="add", dtype=Float32, sem="relaxed", scope="gpu")
                if cutlass.const_expr(self.deterministic):
                    cute.arch.fence_acq_rel_gpu()  # this thread's adds are visible before the release
                    bar.arrive_and_wait()
                    if tidx == 0:
                        cute.arch.red((mSem.iterator + sem_idx).llvm_ptr, Int32(1), op="add", dtype=Int32,
                                      sem="release", scope="gpu")

            # ---- epilogue: dK (scale already folded into dS), dV -> dtype -> smem (K, V tiles) -> global
            cute.arch.cp_async_wait_group(0)
            bar.arrive_and_wait()
            rdK = cute.make_fragment_like(acc_dK, self.dtype)
            rdK.store(acc_dK.load().to(self.dtype))
            rdV = cute.make_fragment_like(acc_dV, self.dtype)
            rdV.store(acc_dV.load().to(self.dtype))
            r2s_o = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), mma_kv)
            thr_r2s_o = r2s_o.get_slice(tidx)
            cute.copy(r2s_o, thr_r2s_o.retile(rdK), thr_r2s_o.partition_D(sK))
            cute.copy(r2s_o, thr_r2s_o.retile(rdV), thr_r2s_o.partition_D(sV))
            bar.arrive_and_wait()
            thr_s2g = s2g.get_slice(tidx)
            gdK = cute.local_tile(cute.domain_offset((k_start, 0), mdK[None, head_kv, None]), (tile_n, D), (n_block, 0))
            gdV = cute.local_tile(cute.domain_offset((k_start, 0), mdV[None, head_kv, None]), (tile_n, D), (n_block, 0))
            self.store_rows(s2g, thr_s2g.partition_S(sK), thr_s2g.partition_D(gdK), thr_s2g.partition_D(cK), seqlen_k)
            self.store_rows(s2g, thr_s2g.partition_S(sV), thr_s2g.partition_D(gdV), thr_s2g.partition_D(cK), seqlen_k)

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def m_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, win_left: Int32, win_right: Int32):
        """[m_lo, m_hi): exactly the query blocks m whose n_block_range(m) contains n_block."""
        m_lo = Int32(0)
        m_hi = cute.ceil_div(seqlen_q, self.tile_m)
        if cutlass.const_expr(self.has_right):
            # n < n_max(m) <=> last row of m >= x
            x = n_block * self.tile_n - (seqlen_k - seqlen_q) - win_right
            if x > seqlen_q - 1:
                m_hi = Int32(0)
            m_lo = cutlass.max(x, 0) // self.tile_m
        if cutlass.const_expr(self.has_left):
            # n >= n_min(m) <=> m * tile_m <= z
            z = (n_block + 1) * self.tile_n - 1 - (seqlen_k - seqlen_q) + win_left
            if z < 0:
                m_hi = Int32(0)
            else:
                m_hi = cutlass.min(m_hi, z // self.tile_m + 1)
        return m_lo, m_hi

    @cute.jit
    def load_q_step(self, g2s, thr_g2s, mQ, mdO, mLSE, mDelta, sLSE, sDelta, tQsQ, tQsdO, it: Int32, n_m: Int32,
                    m_lo: Int32, head0: Int32, q_start: Int32, seqlen_q: Int32, batch: Int32,
                    lse_stride_h: Int32, lse_stride_b: Int32, tidx):
        """cp.async Q and dO of step ``it``; LSE2 and delta rows into smem (+inf / 0 past the end)."""
        D = self.head_dim
        g = it // n_m
        m_block = m_lo + it - g * n_m
        head = head0 + g
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]), (self.tile_m, D), (m_block, 0))
        gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, head, None]), (self.tile_m, D), (m_block, 0))
        cQ = cute.local_tile(cute.make_identity_tensor((seqlen_q, D)), (self.tile_m, D), (m_block, 0))
        tQcQ = thr_g2s.partition_S(cQ)
        self.load_rows(g2s, thr_g2s.partition_S(gQ), tQsQ, tQcQ, seqlen_q)
        self.load_rows(g2s, thr_g2s.partition_S(gdO), tQsdO, tQcQ, seqlen_q)
        if tidx < self.tile_m:
            row = m_block * self.tile_m + tidx
            base = head * lse_stride_h + batch * lse_stride_b
            if cutlass.const_expr(self.varlen):
                base = head * lse_stride_h + q_start
            lse2 = Float32.inf
            dlt = Float32(0.0)
            if row < seqlen_q:
                lse2 = mLSE[base + row]
                dlt = mDelta[base + row]
            sLSE[tidx] = lse2
            sDelta[tidx] = dlt

    @cute.jit
    def mask_t(self, acc_mn, tScS_mn, row0_q: Int32, col0_k: Int32, seqlen_q: Int32, seqlen_k: Int32,
               win_left: Int32, win_right: Int32):
        """-inf where key j (rows of S^T) is invisible to query i (columns)."""
        for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
            diag = tScS_mn[0, c][1] + row0_q + seqlen_k - seqlen_q
            hi = seqlen_k
            lo = Int32(0)
            if cutlass.const_expr(self.has_right):
                hi = cutlass.min(hi, diag + win_right + 1)
            if cutlass.const_expr(self.has_left):
                lo = cutlass.max(lo, diag - win_left)
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                j = tScS_mn[r, 0][0] + col0_k
                if j >= hi or j < lo:
                    acc_mn[r, c] = -Float32.inf

    @cute.jit
    def gemm_ss(self, tiled_mma, acc, ld_a, ld_b, tAs, tAr_v, tBs, tBr_v, tAr, tBr):
        """acc += A B^T, both operands from smem; ldmatrix of k-slice k+1 overlaps mma of k."""
        cute.copy(ld_a, tAs[None, None, 0], tAr_v[None, None, 0])
        cute.copy(ld_b, tBs[None, None, 0], tBr_v[None, None, 0])
        for k in cutlass.range_constexpr(cute.size(tAs.shape[2])):
            k_next = (k + 1) % cute.size(tAs.shape[2])
            cute.copy(ld_a, tAs[None, None, k_next], tAr_v[None, None, k_next])
            cute.copy(ld_b, tBs[None, None, k_next], tBr_v[None, None, k_next])
            cute.gemm(tiled_mma, acc, tAr[None, None, k], tBr[None, None, k], acc)

    @cute.jit
    def gemm_rs(self, tiled_mma, acc, ld_b, tAr, tBs, tBr_v, tBr):
        """acc += A B^T with A already in registers (an accumulator reused as A operand)."""
        cute.copy(ld_b, tBs[None, None, 0], tBr_v[None, None, 0])
        for k in cutlass.range_constexpr(cute.size(tAr.shape[2])):
            k_next = (k + 1) % cute.size(tAr.shape[2])
            cute.copy(ld_b, tBs[None, None, k_next], tBr_v[None, None, k_next])
            cute.gemm(tiled_mma, acc, tAr[None, None, k], tBr[None, None, k], acc)

    @cute.jit
    def load_rows(self, g2s, src, dst, coords, limit: Int32):
        """cp.async rows below ``limit``; zero the rest so padding can never inject NaN/Inf."""
        for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
            if coords[0, m, 0][0] < limit:
                cute.copy(g2s, src[None, m, None], dst[None, m, None])
            else:
                dst[None, m, None].fill(0)

    @cute.jit
    def store_rows(self, s2g, src, dst, coords, limit: Int32):
        rO = cute.make_fragment_like(dst, self.dtype)
        cute.copy(s2g, src, rO)
        for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
            if coords[0, m, 0][0] < limit:
                cute.copy(s2g, rO[None, m, None], dst[None, m, None])
