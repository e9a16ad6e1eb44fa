"""FlashAttention-2 forward on warp-level mma.sync (SM80 class), sized for SM120's 99 KB of smem.

One CTA computes one (query block, query head, batch entry). Per key block, from the last to the
first:

    wait K[n] -> issue cp.async V[n] -> S = Q K^T (ldmatrix + mma.sync, fp32) -> wait V[n]
    -> issue cp.async K[n-1] -> mask (only blocks that need it) -> online softmax (exp2)
    -> O += P V with P taken straight from the S registers

so the load of one operand always overlaps the math on the other (K and V each have one smem
stage; Q stays in smem for the whole CTA). O and the softmax state live in fp32 registers.
Walking key blocks backwards puts the tail block and the causal diagonal first, where the mask
is needed; tiles that the causal/window bounds exclude are never loaded.

The same code runs on SM80/86/89/90 (mma.sync and cp.async exist there) and SM120; the tile
configs below all fit 99 KB so they are the ones used everywhere.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from dualattn.fast.common.block_info import block_needs_mask, csr_row, n_block_range
from dualattn.fast.common.layouts import acc_as_A, acc_mn_view, smem_layout_rowmajor
from dualattn.fast.common.mask import apply_key_ranges, apply_mask, cta_min_max, load_key_ranges
from dualattn.fast.common.packed_entry import PackedEntry
from dualattn.fast.common.seqlen_info import seq_bounds
from dualattn.fast.common.softmax import LOG2_E, make_softmax_state, online_softmax_step, softmax_finalize

SMEM_LIMIT_SM120 = 99 * 1024  # bytes of shared memory one CTA may use on sm_120


@dataclass(frozen=True)
class TileConfig:
    tile_m: int
    tile_n: int
    num_threads: int

    def smem_bytes(self, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
        # Q tile (reused for O at the end) + one K stage + one V stage, plus the CTA reduction
        # slot of key-range tile skipping, padded to the struct's 1024-byte alignment
        return elem_bytes * (self.tile_m * max(head_dim, head_dim_v) + self.tile_n * head_dim
                             + self.tile_n * head_dim_v) + 1024


# Tile table (head dim -> config). Every entry fits 99 KB; warps split the query rows in whole
# m16 slabs, so each warp owns whole rows and the softmax stays warp-local.
#   hd <= 64 : 128 x 128, 4 warps: 48 KB smem; a wide key tile amortises the per-block softmax.
#   hd <= 128: 128 x 64, 4 warps: 64 KB (hd128); 128 x 128 would need 96 KB and twice the S
#              registers (64 fp32 S + 64 fp32 O per thread spills), FA2 picks 128 x 64 too.
#   hd <= 256: 64 x 64, 4 warps: 96 KB at hd256; O alone is 128 fp32 registers per thread.
def tile_config(head_dim: int) -> TileConfig:
    # tuning hook: DUALATTN_SM120_TILES="128:128,64,256;64:128,128,128" overrides entries by head dim
    for entry in os.environ.get("DUALATTN_SM120_TILES", "").split(";"):
        if entry.strip():
            hd, cfg = entry.split(":")
            if int(hd) == head_dim:
                return TileConfig(*(int(x) for x in cfg.split(",")))
    if head_dim <= 64:
        return TileConfig(128, 128, 128)
    if head_dim <= 128:
        return TileConfig(128, 64, 128)
    return TileConfig(64, 64, 128)


class FlashFwdSm80(PackedEntry):
    """Kernel object for one static configuration; build via ``FlashFwdSm80(...)`` then ``cute.compile``."""

    def __init__(self, dtype, head_dim: int, cfg: TileConfig, *, varlen: bool, has_left: bool,
                 has_right: bool, has_softcap: bool, block_sparse: bool = False, num_key_ranges: int = 0):
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m, self.tile_n, self.num_threads = cfg.tile_m, cfg.tile_n, cfg.num_threads
        self.varlen = varlen
        self.has_left = has_left
        self.has_right = has_right
        self.has_softcap = has_softcap
        self.block_sparse = block_sparse
        self.num_key_ranges = num_key_ranges  # R of key_ranges (static: intervals live in registers)
        assert self.tile_m % (16 * (self.num_threads // 32)) == 0, "whole m16 row slabs per warp"
        assert head_dim % 32 == 0

    # ------------------------------------------------------------------ host-side setup (trace)
    @cute.jit
    def __call__(self, pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pO: cute.Pointer,
                 pLSE: cute.Pointer, pCuQ: cute.Pointer, pCuK: cute.Pointer,
                 total_q: Int32, total_k: Int32, seqlen_q: Int32, seqlen_k: Int32,
                 num_batch: Int32, heads_q: Int32, heads_kv: Int32,
                 lse_stride_h: Int32, lse_stride_b: Int32, win_left: Int32, win_right: Int32,
                 scale_log2: Float32, softcap_scale: Float32, softcap: Float32,
                 pFR: cute.Pointer, pFC: cute.Pointer, pMR: cute.Pointer, pMC: cute.Pointer,
                 bs_ratio_m: Int32, bs_ratio_n: Int32, f_rp_sb: Int32, f_rp_sh: Int32, f_col_sb: Int32,
                 f_col_sh: Int32, m_rp_sb: Int32, m_rp_sh: Int32, m_col_sb: Int32, m_col_sh: Int32,
                 pKR: cute.Pointer, kr_sb: Int32, kr_sh: Int32,
                 stream):
        D = self.head_dim
        # contiguous (rows, heads, D): the row stride is heads * D, a multiple of 32 elements since
        # D is, so every row starts 16-byte aligned and 16-byte cp.async is legal
        mQ = cute.make_tensor(pQ, cute.make_layout((total_q, heads_q, D), stride=(cute.assume(heads_q * D, divby=32), D, 1)))
        mO = cute.make_tensor(pO, cute.make_layout((total_q, heads_q, D), stride=(cute.assume(heads_q * D, divby=32), D, 1)))
        mK = cute.make_tensor(pK, cute.make_layout((total_k, heads_kv, D), stride=(cute.assume(heads_kv * D, divby=32), D, 1)))
        mV = cute.make_tensor(pV, cute.make_layout((total_k, heads_kv, D), stride=(cute.assume(heads_kv * D, divby=32), D, 1)))
        mCuQ = cute.make_tensor(pCuQ, cute.make_layout(num_batch + 1))
        mCuK = cute.make_tensor(pCuK, cute.make_layout(num_batch + 1))
        # block-sparse CSR arrays, flat: entry (b, h, i) sits at b * sb + h * sh + i, and a stride of
        # 0 broadcasts a size-1 batch or head dimension
        flat = cute.make_layout(1 << 30)
        bs = (cute.make_tensor(pFR, flat), cute.make_tensor(pFC, flat), cute.make_tensor(pMR, flat),
              cute.make_tensor(pMC, flat), bs_ratio_m, bs_ratio_n, f_rp_sb, f_rp_sh, f_col_sb, f_col_sh,
              m_rp_sb, m_rp_sh, m_col_sb, m_col_sh, cute.make_tensor(pKR, flat), kr_sb, kr_sh)

        s_layout, k_atom = smem_layout_rowmajor(self.dtype, self.tile_m, D)
        skv_layout, _ = smem_layout_rowmajor(self.dtype, self.tile_n, D)

        @cute.struct
        class Smem:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(s_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(skv_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(skv_layout)], 1024]
            red: cute.struct.Align[cute.struct.MemRange[Int32, 2 * (self.num_threads // 32)], 16]

        # recorded at trace time so compile-only tests can check the 99 KB budget of sm_120
        self.smem_bytes = Smem.size_in_bytes()
        vec = 128 // self.dtype.width  # elements per 16-byte access
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
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (warps, 1, 1),
                                        permutation_mnk=(warps * 16, 16, 16))
        grid = (cute.ceil_div(seqlen_q, self.tile_m), heads_q, num_batch)
        self.kernel(mQ, mK, mV, mO, pLSE, mCuQ, mCuK, seqlen_q, seqlen_k, heads_q, heads_kv,
                    lse_stride_h, lse_stride_b, win_left, win_right, scale_log2, softcap_scale, softcap,
                    *bs, s_layout, skv_layout, g2s, s2g, tiled_mma, Smem).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device code
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, pLSE: cute.Pointer,
               mCuQ: cute.Tensor, mCuK: cute.Tensor, seqlen_q_arg: Int32, seqlen_k_arg: Int32,
               heads_q: Int32, heads_kv: Int32, lse_stride_h: Int32, lse_stride_b: Int32,
               win_left: Int32, win_right: Int32, scale_log2: Float32, softcap_scale: Float32,
               softcap: Float32, mFR: cute.Tensor, mFC: cute.Tensor, mMR: cute.Tensor, mMC: cute.Tensor,
               bs_ratio_m: Int32, bs_ratio_n: Int32, f_rp_sb: Int32, f_rp_sh: Int32, f_col_sb: Int32,
               f_col_sh: Int32, m_rp_sb: Int32, m_rp_sh: Int32, m_col_sb: Int32, m_col_sh: Int32,
               mKR: cute.Tensor, kr_sb: Int32, kr_sh: Int32, s_layout: cute.ComposedLayout, skv_layout: cute.ComposedLayout,
               g2s: cute.TiledCopy, s2g: cute.TiledCopy, tiled_mma: cute.TiledMma,
               Smem: cutlass.Constexpr):
        D = self.head_dim
        tile_m, tile_n = self.tile_m, self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        # longest query blocks first (causal): better tail balance across the grid
        m_block = cute.ceil_div(seqlen_q_arg, tile_m) - 1 - bx
        head_kv = head // (heads_q // heads_kv)  # GQA/MQA: KV head indexed in the kernel

        q_start, seqlen_q = seq_bounds(batch, seqlen_q_arg, mCuQ, self.varlen)
        k_start, seqlen_k = seq_bounds(batch, seqlen_k_arg, mCuK, self.varlen)
        bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)

        if m_block * tile_m < seqlen_q:
            n_min, n_max = n_block_range(m_block, tile_m, tile_n, seqlen_q, seqlen_k, win_left, win_right,
                                         self.has_left, self.has_right)
            n_iters = cutlass.max(n_max - n_min, 0)
            f_col0 = Int32(0)
            m_col0 = Int32(0)
            m_cnt = Int32(0)
            if cutlass.const_expr(self.block_sparse):
                # this query tile's CSR rows: mask blocks are visited first, then full blocks;
                # each CSR key block covers bs_ratio_n key tiles of this kernel
                f_col0, f_cnt = csr_row(mFR, f_rp_sb * batch + f_rp_sh * head, m_block // bs_ratio_m)
                m_col0, m_cnt = csr_row(mMR, m_rp_sb * batch + m_rp_sh * head, m_block // bs_ratio_m)
                f_col0 = f_col0 + f_col_sb * batch + f_col_sh * head
                m_col0 = m_col0 + m_col_sb * batch + m_col_sh * head
                n_iters = (f_cnt + m_cnt) * bs_ratio_n

            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(Smem)
            sQ = st.sQ.get_tensor(s_layout)
            sK = st.sK.get_tensor(skv_layout)
            sV = st.sV.get_tensor(skv_layout)
            sVt = cute.composition(sV, cute.make_layout((D, tile_n), stride=(tile_n, 1)))

            gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]), (tile_m, D), (m_block, 0))
            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head_kv, None]), (tile_n, D), (None, 0))
            gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head_kv, None]), (tile_n, D), (None, 0))
            cQ = cute.local_tile(cute.make_identity_tensor((seqlen_q, D)), (tile_m, D), (m_block, 0))
            cK = cute.local_tile(cute.make_identity_tensor((seqlen_k, D)), (tile_n, D), (None, 0))

            thr_g2s = g2s.get_slice(tidx)
            tQgQ = thr_g2s.partition_S(gQ)
            tQsQ = thr_g2s.partition_D(sQ)
            tQcQ = thr_g2s.partition_S(cQ)
            tKgK = thr_g2s.partition_S(gK)
            tKsK = thr_g2s.partition_D(sK)
            tVgV = thr_g2s.partition_S(gV)
            tVsV = thr_g2s.partition_D(sV)
            tKcK = thr_g2s.partition_S(cK)

            thr_mma = tiled_mma.get_slice(tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, D)), Float32)
            acc_O.fill(0.0)

            ld_q = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma)
            ld_k = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma)
            ld_v = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype), tiled_mma)
            thr_ld_q = ld_q.get_slice(tidx)
            thr_ld_k = ld_k.get_slice(tidx)
            thr_ld_v = ld_v.get_slice(tidx)
            tSsQ = thr_ld_q.partition_S(sQ)
            tSrQ_v = thr_ld_q.retile(tSrQ)
            tSsK = thr_ld_k.partition_S(sK)
            tSrK_v = thr_ld_k.retile(tSrK)
            tOsVt = thr_ld_v.partition_S(sVt)
            tOrVt_v = thr_ld_v.retile(tOrVt)

            # coordinates of this thread's accumulator elements within an (tile_m, tile_n) tile
            tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n))))
            acc_O_mn = acc_mn_view(acc_O)
            row_max, row_sum = make_softmax_state(cute.size(acc_O_mn.shape[0]))
            # softcap applies the scale itself, leaving only the change of base for exp2
            sm_scale_log2 = Float32(LOG2_E) if cutlass.const_expr(self.has_softcap) else scale_log2

            kr = None
            if cutlass.const_expr(self.num_key_ranges > 0):
                kr_row0 = Int32(0)
                if cutlass.const_expr(self.varlen):
                    kr_row0 = q_start
                kr, lo_min, hi_max = load_key_ranges(mKR, kr_sb * batch + kr_sh * head, kr_row0, tScS_mn,
                                                     m_block * tile_m, seqlen_q, self.num_key_ranges)
                if cutlass.const_expr(not self.block_sparse):
                    # skip key tiles outside the union of this query tile's intervals
                    lo_min, hi_max = cta_min_max(lo_min, hi_max, st.red.get_tensor(cute.make_layout(2 * (self.num_threads // 32))), bar)
                    n_lo = cutlass.max(n_max - n_iters, lo_min // tile_n)
                    n_max = cutlass.min(n_max, cute.ceil_div(hi_max, tile_n))
                    n_iters = cutlass.max(n_max - n_lo, 0)
            visit = (n_max, mFC, mMC, f_col0, m_col0, m_cnt, bs_ratio_n)

            # prologue: Q (rows past seqlen_q zero-filled) and the first K block
            self.load_rows(g2s, tQgQ, tQsQ, tQcQ, seqlen_q)
            if n_iters > 0:
                self.load_kv(g2s, tKgK, tKsK, tKcK, self.block_at(Int32(0), *visit)[0], seqlen_k)
            cute.arch.cp_async_commit_group()

            for it in cutlass.range(n_iters, unroll=1):
                n_block, is_mask_entry = self.block_at(it, *visit)
                cute.arch.cp_async_wait_group(0)
                bar.arrive_and_wait()  # K[n] landed; every warp is done with V[n+1]
                self.load_kv(g2s, tVgV, tVsV, tKcK, n_block, seqlen_k)
                cute.arch.cp_async_commit_group()

                acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, tile_n)), Float32)
                acc_S.fill(0.0)
                self.gemm_ss(tiled_mma, acc_S, ld_q, ld_k, tSsQ, tSrQ_v, tSsK, tSrK_v, tSrQ, tSrK)

                cute.arch.cp_async_wait_group(0)
                bar.arrive_and_wait()  # V[n] landed; every warp is done reading K[n]
                if it + 1 < n_iters:
                    self.load_kv(g2s, tKgK, tKsK, tKcK, self.block_at(it + 1, *visit)[0], seqlen_k)
                    cute.arch.cp_async_commit_group()

                acc_S_mn = acc_mn_view(acc_S)
                if cutlass.const_expr(self.has_softcap):
                    # s = cap * tanh(s * scale / cap), in natural-log units; exp2 uses log2(e) only
                    for i in cutlass.range_constexpr(cute.size(acc_S)):
                        acc_S[i] = softcap * cute.math.tanh(acc_S[i] * softcap_scale, fastmath=True)
                need_mask = block_needs_mask(m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k, win_left,
                                             win_right, self.has_left, self.has_right)
                if cutlass.const_expr(self.num_key_ranges > 0):
                    need_mask = Boolean(True)  # intervals may cut any tile
                if cutlass.const_expr(self.block_sparse):
                    # a full block is the caller's promise that the predicate holds: only the tail
                    need_mask = (n_block + 1) * tile_n > seqlen_k or (is_mask_entry and need_mask)
                if need_mask:
                    if cutlass.const_expr(self.block_sparse):
                        if is_mask_entry:
                            self.mask_predicate(acc_S_mn, tScS_mn, m_block, n_block, seqlen_q, seqlen_k, win_left,
                                                win_right, kr)
                        else:  # a full entry that holds the key tail: only the tail
                            apply_mask(acc_S_mn, tScS_mn, m_block * tile_m, n_block * tile_n, seqlen_q, seqlen_k,
                                       win_left, win_right, False, False)
                    else:
                        self.mask_predicate(acc_S_mn, tScS_mn, m_block, n_block, seqlen_q, seqlen_k, win_left,
                                            win_right, kr)
                online_softmax_step(row_max, row_sum, sm_scale_log2, acc_S_mn, acc_O_mn)

                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                tOrP = acc_as_A(rP)
                cute.copy(ld_v, tOsVt[None, None, 0], tOrVt_v[None, None, 0])
                for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
                    k_next = (k + 1) % cute.size(tOrP.shape[2])
                    cute.copy(ld_v, tOsVt[None, None, k_next], tOrVt_v[None, None, k_next])
                    cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)

            # ------------------------------------------------------------------ epilogue
            lse_rows = cute.make_rmem_tensor(cute.size(acc_O_mn.shape[0]), Float32)
            softmax_finalize(row_max, row_sum, sm_scale_log2, acc_O_mn, lse_rows)
            rO = cute.make_fragment_like(acc_O, self.dtype)
            rO.store(acc_O.load().to(self.dtype))

            # with no key block to visit the Q copies were never waited for; they must land before
            # sQ becomes sO, or they would overwrite O
            cute.arch.cp_async_wait_group(0)
            bar.arrive_and_wait()  # all warps done with sQ before it becomes sO
            sO = cute.make_tensor(sQ.iterator, s_layout)
            r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype), tiled_mma)
            thr_r2s = r2s.get_slice(tidx)
            cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))

            # LSE: one thread of each quad holds the finished row value
            if tidx % 4 == 0:
                lse_base = head * lse_stride_h + batch * lse_stride_b
                if cutlass.const_expr(self.varlen):
                    lse_base = head * lse_stride_h + q_start
                mLSE = cute.make_tensor(pLSE, cute.make_layout(1 << 30))
                for r in cutlass.range_constexpr(cute.size(lse_rows)):
                    row = tScS_mn[r, 0][0] + m_block * tile_m
                    if row < seqlen_q:
                        mLSE[lse_base + row] = lse_rows[r]

            bar.arrive_and_wait()
            gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, head, None]), (tile_m, D), (m_block, 0))
            thr_s2g = s2g.get_slice(tidx)
            tOsO = thr_s2g.partition_S(sO)
            tOgO = thr_s2g.partition_D(gO)
            tOcO = thr_s2g.partition_D(cQ)
            tOrO = cute.make_fragment_like(tOgO, self.dtype)
            cute.copy(s2g, tOsO, tOrO)
            for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
                if tOcO[0, m, 0][0] < seqlen_q:
                    cute.copy(s2g, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def mask_predicate(self, acc_S_mn, tScS_mn, m_block: Int32, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                       win_left: Int32, win_right: Int32, kr):
        """-inf outside the element predicate: tail AND causal/window AND key ranges."""
        apply_mask(acc_S_mn, tScS_mn, m_block * self.tile_m, n_block * self.tile_n, seqlen_q, seqlen_k,
                   win_left, win_right, self.has_left, self.has_right)
        if cutlass.const_expr(self.num_key_ranges > 0):
            apply_key_ranges(acc_S_mn, tScS_mn, n_block * self.tile_n, kr, self.num_key_ranges)

    @cute.jit
    def block_at(self, it: Int32, n_max: Int32, mFC: cute.Tensor, mMC: cute.Tensor, f_col0: Int32, m_col0: Int32,
                 m_cnt: Int32, ratio_n: Int32):
        """(key tile, from a mask entry?) of visit number ``it``."""
        n_block = n_max - 1 - it  # dense: backwards, so the tail and the diagonal come first
        is_mask = Boolean(True)
        if cutlass.const_expr(self.block_sparse):
            e = it // ratio_n
            col = Int32(0)
            is_mask = e < m_cnt
            if is_mask:
                col = mMC[m_col0 + e]
            else:
                col = mFC[f_col0 + e - m_cnt]
            n_block = col * ratio_n + (it - e * ratio_n)
        return n_block, is_mask

    @cute.jit
    def gemm_ss(self, tiled_mma, acc, ld_a, ld_b, tAs, tAr_v, tBs, tBr_v, tAr, tBr):
        """acc += A B^T over the whole head dim, ldmatrix of k-slice k+1 overlapping mma of k."""
        cute.copy(ld_a, tAs[None, None, 0], tAr_v[None, None, 0])
        cute.copy(ld_b, tBs[None, None, 0], tBr_v[None, None, 0])
        for k in cutlass.range_constexpr(cute.size(tAs.shape[2])):
            k_next = (k + 1) % cute.size(tAs.shape[2])
            cute.copy(ld_a, tAs[None, None, k_next], tAr_v[None, None, k_next])
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
    def load_kv(self, g2s, src, dst, coords, n_block: Int32, seqlen_k: Int32):
        if (n_block + 1) * self.tile_n > seqlen_k:  # only the last key block has a tail
            self.load_rows(g2s, src[None, None, None, n_block], dst, coords[None, None, None, n_block], seqlen_k)
        else:
            cute.copy(g2s, src[None, None, None, n_block], dst)
