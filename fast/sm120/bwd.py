"""FlashAttention-2 backward on warp-level mma.sync (SM80 class), sized for SM120's 99 KB of smem.

One CTA owns one key block (tile_n keys) of one KV head of one batch entry and keeps K, V and the
fp32 dK/dV accumulators resident for its whole life (each warp owns tile_n / warps key rows). It
walks every query head of the GQA group and, per head, every query block that can see the key
block (causal/window bounds, inverted):

    wait Q[m], dO[m] (cp.async) -> S^T = K Q^T, dP^T = V dO^T (keys on the M side)
    -> P^T = exp2(S^T * scale*log2e - LSE2), dS^T = P^T (dP^T - delta) * scale   (fp32 registers)
       (softcap: S^T = cap tanh(S^T scale / cap) first, and dS^T gains the factor 1 - tanh^2;
       key ranges: each query column's intervals, loaded per step, mask the keys it cannot see)
    -> dV += P^T dO, dK += dS^T Q (P^T / dS^T reused from the accumulator registers as A operand)
    -> dS^T to smem -> dQ[m] = dS K (ldmatrix.trans of both) -> fp32 atomics into the dQ accumulator

Head dims past 128 split D (BwdTileConfig.d_split): the kernel of slice s keeps dK / dV and adds
dQ for columns [s D / d_split, (s + 1) D / d_split) only; S^T and dP^T still contract over all of D.

Loads overlap the math in one of two schedules (the tile config picks, see bwd_tile_config):
* two stages: Q, dO, LSE2, delta of step m+1 are issued into the other stage at the top of step m,
  so they land during all of step m's math;
* one stage with dS^T over dO (hd128, where K + V leave no room for a second stage): once dV and
  dK of step m are done, Q[m+1] is issued and dS^T is written where dO was; once the dQ product
  has read dS^T, dO[m+1] is issued in a cp.async group of its own. Step m+1 waits for Q only,
  computes S^T, and waits for dO just before dP^T (early_s), so the dO load overlaps the S^T
  product. (Issuing dO[m+1] at the top of step m+1 instead left its load, and a reload of its
  spilled address, exposed.)

The dQ atomics of step m go out between the MMAs of step m+1's S^T product (defer_dq; the last
step's after the loop): issued back to back at the end of a step they filled the LSU queue
(lg-throttle stalls) while the tensor pipe idled. Deterministic mode keeps them in place, where
the semaphore orders them. H100, hd128, each A/B'd in one call: defer_dq 4k 248 -> 266 TFLOP/s,
16k 264 -> 271; then early_s 16k 269 -> 279-283.

GQA: the query heads of a group are looped inside the CTA (dK/dV stay in registers across them)
instead of writing per-query-head fp32 partials and reducing: no extra HBM traffic or buffer of
B*Sk*Hq*D fp32, no extra kernel, and the group's heads reuse the resident K/V tiles.

Block-sparse: the CTA walks its key block's k->q CSR row instead of a range (mask entries, then
full entries, per head of the group; a CSR query block is several query tiles); full entries skip
the element predicate, keeping only the key tail.

Deterministic mode: before its atomics into dQ[m], a CTA waits on the per-(batch, query head,
query block) semaphore for the rank of its key block among the key blocks that visit that query
block (dualattn.sparse.compute_lock_values semantics; for the dense/causal/window ranges here the
visitors of query block m are the contiguous n_block_range(m), so the rank is n - n_min(m); with a
CSR it is the entry's lock value times the key tiles per CSR key block, plus the tile's place in
it), then releases rank + 1. Missing visitors (key tiles past seqlen_k) are always the highest
ranks, so nobody waits for them. Summation order is then fixed (bitwise reproducible), and a CTA only ever waits
for a lower key block of the same (batch, KV head), which is earlier in the grid's launch order (in
either grid order), so it cannot deadlock.

FlashBwdPreprocess (one memory-bound pass before the main kernel): delta = rowsum(dO * O) and the
log2-domain LSE. The fp32 -> dtype conversion of dQ stays a torch cast on the host side.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector

from dualattn.fast.common.block_info import block_needs_mask, csr_row, n_block_range
from dualattn.fast.common.layouts import acc_as_A, acc_mn_view, smem_layout_rowmajor
from dualattn.fast.common.mask import apply_key_ranges, load_key_ranges, score_or_neg_inf
from dualattn.fast.common.packed_entry import PackedEntry
from dualattn.fast.common.seqlen_info import seq_bounds
from dualattn.fast.common.softmax import LOG2_E

SMEM_LIMIT_SM120 = 99 * 1024


@dataclass(frozen=True)
class BwdTileConfig:
    tile_m: int      # query rows per inner step
    tile_n: int      # keys per CTA (16 or 32 per warp: warps split the key rows of S^T, dK, dV)
    num_threads: int
    dq_warps_m: int  # warp grid (dq_warps_m, warps / dq_warps_m) of the dQ = dS K product
    stages: int = 1  # smem stages of Q, dO, LSE2, delta: 2 loads the next query block during this one
    ds_in_do: bool = False  # dS^T is written over the dO stage just consumed (see the asserts in FlashBwdSm80)
    n_slowest: bool = False  # grid order: key blocks slowest (else fastest), see FlashBwdSm80.__call__
    d_split: int = 1  # D-slices of dK/dV/dQ, one kernel launch each (head dims past 128, see below)

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Bytes of the kernel's shared-memory struct (tiles are 1024-byte aligned, rows 16)."""
        def al(x, a):
            return -(-x // a) * a
        b = 2 * al(elem_bytes * self.stages * self.tile_m * head_dim, 1024)   # Q, dO
        b += 2 * al(elem_bytes * self.tile_n * head_dim, 1024)                # K, V
        if not self.ds_in_do:
            b += al(elem_bytes * self.tile_n * self.tile_m, 1024)             # dS^T
        return b + 2 * al(4 * self.stages * self.tile_m, 16)                  # LSE2, delta


# Tile table. dK and dV of a warp's key rows stay in fp32 registers for the CTA's life; what the
# kernel mostly waits on is shared-memory bandwidth (every warp ldmatrix-loads all of Q, dO for
# its S^T, dP^T, dV, dK products), so the more key rows a warp owns, the fewer bytes per FLOP.
#   hd 64 : 32 x 256, 8 warps of 32 key rows (128 fp32 dK/dV registers per thread), Q/dO/LSE/
#           delta double-buffered, dS^T in its own tile: 96 KB. H100, bf16, 16k tokens: 0.90-0.99x
#           FA2 (64 x 128 with 16-row warps: 0.75-0.80x; 32 x 128 with 4 warps: 0.81-1.00x).
#   hd 128: 32 key rows per warp would need 256 dK/dV registers, so 16; K + V take 64 KB;
#           64 x 128 single-buffered with dS^T written over the dO tile once dK is done (96 KB):
#           the next Q loads while dS^T is stored and dQ runs, the next dO during the next S^T.
#           H100 (2026-11-24, with defer_dq and early_s): 0.90-1.02x FA2 (three runs, 1k-16k,
#           causal and not); 32 x 128 double-buffered (also 96 KB, no spill; before those two
#           changes): 0.78-0.99x.
#   hd 32 : 64 x 256, 8 warps of 32 key rows, double-buffered: 80 KB (dQ warp grid 4 x 2, as
#           D = 32 holds only two 16-column warps).
#   hd 96 : 64 x 128 single-buffered with its own dS^T tile (88 KB; a 128 x 64 dS^T does not fit
#           the 64 x 96 dO tile, and 96-key tiles would not divide 128-key CSR blocks), dQ warp
#           grid 4 x 2.
#   Not measured against FA2 (hd 32 / 96 are not in the benchmark matrix): tested for accuracy.
# Grid order (n_slowest): with key blocks slowest the longest causal CTAs start first and the CTAs
# running together belong to different heads (their dQ atomics spread out); with key blocks
# fastest the running CTAs share their head's Q/dO in L2. Each entry uses the order it was
# measured fastest with: hd128 without a causal/window band keeps key blocks fastest, with one
# key blocks slowest (H100, one run, causal 4k-16k: 0.87-0.94x FA2 against 0.85-0.89x; without a
# band key blocks slowest lost at 1k and 16k: 0.86 / 0.80 against 1.02 / 0.86). A causal call of
# at most 2k keys counts as unbanded here (bwd_impl.CAUSAL_KEYS_FASTEST_MAX_SEQLEN: its Q / dO do
# not fit L2 when every running CTA is on another head).
# DUALATTN_SM120_BWD_TILES="128:64,128,256,2,1,1,0;64:..." overrides entries by head dim (tuning):
# tile_m, tile_n, threads, dq_warps_m, stages, ds_in_do[, n_slowest[, d_split]].
def bwd_tile_config(head_dim: int, block_n: int = 0, banded: bool = False) -> BwdTileConfig:
    """The tile of ``head_dim``; ``block_n`` > 0 is the key-block width of a block-sparse CSR, which
    the key tile must divide (hd64's 256-key tile gives way to 128 keys with 4 warps: 0.81-1.00x FA2);
    ``banded``: a causal or window mask bounds each key block's query range (grid order above)."""
    cfg = _bwd_tile_config(head_dim, banded)
    if block_n and block_n % cfg.tile_n and head_dim <= 64:
        cfg = BwdTileConfig(32, 128, 128, 2, 2, False, True)
    return cfg


def _bwd_tile_config(head_dim: int, banded: bool) -> BwdTileConfig:
    for entry in os.environ.get("DUALATTN_SM120_BWD_TILES", "").split(";"):
        if entry.strip():
            hd, cfg = entry.split(":")
            if int(hd) == head_dim:
                v = [int(x) for x in cfg.split(",")]
                return BwdTileConfig(v[0], v[1], v[2], v[3], v[4], bool(v[5]), bool(v[6]) if len(v) > 6 else False,
                                     v[7] if len(v) > 7 else 1)
    if head_dim <= 32:
        return BwdTileConfig(64, 256, 256, 4, 2, False, True)
    if head_dim <= 64:
        return BwdTileConfig(32, 256, 256, 2, 2, False, True)
    if head_dim <= 96:
        return BwdTileConfig(64, 128, 256, 4, 1, False, False)
    if head_dim <= 128:
        return BwdTileConfig(64, 128, 256, 2, 1, True, banded)
    if head_dim <= 192:
        return BwdTileConfig(64, 64, 128, 2, 1, True, banded, 3)
    return BwdTileConfig(32, 64, 128, 2, 1, True, banded, 2)


# Past D = 128, dK and dV of a warp's 16 key rows over the whole D (2 x D / 2 fp32 registers per
# thread: 192 at D = 192, 256 at D = 256) do not fit beside the S^T / dP^T accumulators in 255
# registers. Those head dims split D: kernel s of d_split computes dK, dV and dQ for columns
# [s D / d_split, (s + 1) D / d_split) only (64 at D = 192, 128 at D = 256: slices on whole 64-column
# swizzle atoms), recomputing S^T and dP^T (full-D products) in each; 64 key rows per CTA so that K
# and V of the full D fit beside Q and dO (96 KB). The recomputation costs 1.8x (D = 192) and 1.4x
# (D = 256) the FLOPs of one pass: correctness first where 99 KB leaves no room for FA2's layout.
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def _staged_layout(dtype, rows: int, cols: int, stages: int):
    """(rows, cols, stages) swizzled row-major tiles; a stage is one smem_layout_rowmajor tile."""
    k_atom = 64 if cols % 64 == 0 else 32
    bits = 3 if k_atom == 64 else 2
    atom = cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0,
                                     cute.make_layout((8, k_atom), stride=(k_atom, 1)))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2)), k_atom


class FlashBwdSm80(PackedEntry):
    """dK/dV (and dQ by atomics) kernel for one static configuration."""

    def __init__(self, dtype, head_dim: int, cfg: BwdTileConfig, *, varlen: bool, has_left: bool,
                 has_right: bool, deterministic: bool, vec_red: bool = False, has_softcap: bool = False,
                 num_key_ranges: int = 0, block_sparse: bool = False, d_slice: int = 0, rotate_m: bool = False,
                 defer_dq: bool = False, early_s: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        # the columns of dK, dV and dQ this kernel computes: slice d_slice of cfg.d_split
        self.d_out = head_dim // cfg.d_split
        self.d_slice = d_slice
        assert 0 <= d_slice < cfg.d_split and head_dim % cfg.d_split == 0
        assert cfg.d_split == 1 or self.d_out % 64 == 0  # slices on whole swizzle atoms
        self.cfg = cfg
        self.tile_m, self.tile_n, self.num_threads = cfg.tile_m, cfg.tile_n, cfg.num_threads
        self.stages = cfg.stages
        self.ds_in_do = cfg.ds_in_do
        self.varlen = varlen
        self.has_left = has_left
        self.has_right = has_right
        self.deterministic = deterministic
        self.vec_red = vec_red  # red.global.add.v2.f32 (sm_90+): half the dQ atomic requests
        self.has_softcap = has_softcap
        self.num_key_ranges = num_key_ranges  # R of key_ranges (static: a column's intervals live in registers)
        self.block_sparse = block_sparse  # visit the k->q CSR row of the key block instead of a range
        # rotate_m: each key block walks its query tiles starting at its own offset (n_block mod the
        # count), so the CTAs running together add into different dQ tiles instead of all into the
        # same one at once (bwd_impl._rotate_m: where it was measured faster). Not with a CSR (its
        # own order) nor deterministic mode (whose semaphores have the key blocks add in ascending
        # order: rotation would serialise them)
        self.rotate_m = rotate_m and not block_sparse and not deterministic
        # defer_dq: the dQ atomics of step m are issued between the MMAs of step m+1's S^T product
        # instead of back to back at the end of step m, where they filled the LSU queue (lg-throttle
        # stalls) while the tensor pipe idled. Not in deterministic mode (its semaphore orders the
        # adds of a step before its release)
        self.defer_dq = defer_dq and not deterministic
        # early_s: with dO issued after the dQ product (one stage, dS^T over dO), a step waits for
        # Q only, computes S^T, and waits for dO just before dP^T: the dO load overlaps the S^T
        # product instead of being waited for whole at the top of the step
        self.early_s = early_s and self.stages == 1 and self.ds_in_do
        warps = self.num_threads // 32
        # each warp owns tile_n / warps key rows (16 or 32): its rows of S^T, dP^T, dK, dV
        assert self.tile_n % (16 * warps) == 0 and self.tile_n // warps in (16, 32)
        assert self.tile_m % (16 * cfg.dq_warps_m) == 0
        assert self.d_out % (16 * (warps // cfg.dq_warps_m)) == 0
        assert head_dim % 32 == 0
        assert self.stages in (1, 2)
        assert 2 * self.tile_m <= self.num_threads  # one thread per LSE2 and per delta row (load_q_step)
        # dS^T (tile_n x tile_m) fills a dO stage (tile_m x D) exactly, with the same stage stride
        # (one stage: it only has to fit)
        assert not self.ds_in_do or self.tile_n == head_dim or (self.stages == 1 and self.tile_n <= head_dim)

    @cute.jit
    def __call__(self, pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pdO: cute.Pointer,
                 pdK: cute.Pointer, pdV: cute.Pointer, pdQ: cute.Pointer, pLSE: cute.Pointer,
                 pDelta: cute.Pointer, pSem: cute.Pointer, pCuQ: cute.Pointer, pCuK: cute.Pointer,
                 pKR: cute.Pointer, pFR: cute.Pointer, pFC: cute.Pointer, pMR: cute.Pointer, pMC: cute.Pointer,
                 pFL: cute.Pointer, pML: cute.Pointer,
                 total_q: Int32, total_k: Int32, seqlen_q: Int32, seqlen_k: Int32, num_batch: Int32,
                 heads_q: Int32, heads_kv: Int32, lse_stride_h: Int32, lse_stride_b: Int32,
                 win_left: Int32, win_right: Int32, n_mblocks: Int32, kr_sb: Int32, kr_sh: Int32,
                 scale_log2: Float32, scale: Float32, softcap_scale: Float32, softcap: Float32,
                 bs_ratio_m: Int32, bs_ratio_n: Int32, f_rp_sb: Int32, f_rp_sh: Int32, f_col_sb: Int32,
                 f_col_sh: Int32, m_rp_sb: Int32, m_rp_sh: Int32, m_col_sb: Int32, m_col_sh: Int32,
                 stream):
        D = self.head_dim
        sq = cute.assume(heads_q * D, divby=32)
        skv = cute.assume(heads_kv * D, divby=32)
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
        mKR = cute.make_tensor(pKR, flat)
        # k->q CSR (rowptr, col of full and mask entries) and the lock values aligned with the cols
        csr = tuple(cute.make_tensor(ptr, flat) for ptr in (pFR, pFC, pMR, pMC, pFL, pML))
        bs_ints = (bs_ratio_m, bs_ratio_n, f_rp_sb, f_rp_sh, f_col_sb, f_col_sh, m_rp_sb, m_rp_sh, m_col_sb, m_col_sh)

        S = self.stages
        sq_layout, k_atom = _staged_layout(self.dtype, self.tile_m, D, S)
        sk_layout, _ = smem_layout_rowmajor(self.dtype, self.tile_n, D)
        sds_layout, _ = _staged_layout(self.dtype, self.tile_n, self.tile_m, S if self.ds_in_do else 1)
        ds_elems = 16 if self.ds_in_do else cute.cosize(sds_layout)  # aliased: a placeholder

        @cute.struct
        class Smem:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sq_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sq_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sk_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sk_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, ds_elems], 1024]
            lse: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * S], 16]
            delta: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * S], 16]

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
        # n_slowest: CTAs start in order of their key block, so under a causal mask the longest (first
        # key blocks: every query block sees them) start first and the short ones fill the tail, and
        # the CTAs running at once belong to different heads; otherwise the key blocks of one head
        # run together and share its Q/dO in L2
        if cutlass.const_expr(self.cfg.n_slowest):
            grid = (heads_kv, num_batch, cute.ceil_div(seqlen_k, self.tile_n))
        else:
            grid = (cute.ceil_div(seqlen_k, self.tile_n), heads_kv, num_batch)
        self.kernel(mQ, mK, mV, mdO, mdK, mdV, mdQ, mLSE, mDelta, mSem, mCuQ, mCuK, mKR, seqlen_q, seqlen_k,
                    heads_q, heads_kv, lse_stride_h, lse_stride_b, win_left, win_right, n_mblocks, kr_sb, kr_sh,
                    scale_log2, scale, softcap_scale, softcap, *csr, *bs_ints, sq_layout, sk_layout, sds_layout, g2s, s2g, mma_kv, mma_q, Smem).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mdQ: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mSem: cute.Tensor,
               mCuQ: cute.Tensor, mCuK: cute.Tensor, mKR: cute.Tensor, seqlen_q_arg: Int32, seqlen_k_arg: Int32,
               heads_q: Int32, heads_kv: Int32, lse_stride_h: Int32, lse_stride_b: Int32,
               win_left: Int32, win_right: Int32, n_mblocks: Int32, kr_sb: Int32, kr_sh: Int32,
               scale_log2: Float32, scale: Float32, softcap_scale: Float32, softcap: Float32,
               mFR: cute.Tensor, mFC: cute.Tensor, mMR: cute.Tensor, mMC: cute.Tensor, mFL: cute.Tensor,
               mML: cute.Tensor, bs_ratio_m: Int32, bs_ratio_n: Int32, f_rp_sb: Int32, f_rp_sh: Int32,
               f_col_sb: Int32, f_col_sh: Int32, m_rp_sb: Int32, m_rp_sh: Int32, m_col_sb: Int32, m_col_sh: Int32,
               sq_layout: cute.ComposedLayout, sk_layout: cute.ComposedLayout, sds_layout: cute.ComposedLayout,
               g2s: cute.TiledCopy, s2g: cute.TiledCopy, mma_kv: cute.TiledMma, mma_q: cute.TiledMma,
               Smem: cutlass.Constexpr):
        D = self.head_dim
        tile_m, tile_n = self.tile_m, self.tile_n
        S = self.stages
        two_stage = self.stages == 2
        # single stage with dS^T over dO: the next step's dO can only load once this step's dQ
        # product has read dS^T; it is issued right then, before this step's dQ atomics
        do_after_dq = self.stages == 1 and self.ds_in_do
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        n_block, head_kv, batch = bx, by, bz
        if cutlass.const_expr(self.cfg.n_slowest):
            head_kv, batch, n_block = bx, by, bz
        group = heads_q // heads_kv
        q_start, seqlen_q = seq_bounds(batch, seqlen_q_arg, mCuQ, self.varlen)
        k_start, seqlen_k = seq_bounds(batch, seqlen_k_arg, mCuK, self.varlen)
        bar = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)

        if n_block * tile_n < seqlen_k:
            m_lo, m_hi = self.m_block_range(n_block, seqlen_q, seqlen_k, win_left, win_right)
            n_m = cutlass.max(m_hi - m_lo, 0)
            n_iters = n_m * group
            kb = n_block // bs_ratio_n  # the CSR key block holding this key tile
            # rotate_m: this key block starts its walk over the query blocks at its own offset
            m_rot = n_block % cutlass.max(n_m, 1)
            vis = (n_m, m_lo, head_kv * group, group, batch, kb, mFR, mFC, mMR, mMC, mFL, mML, bs_ratio_m,
                   f_rp_sb, f_rp_sh, f_col_sb, f_col_sh, m_rp_sb, m_rp_sh, m_col_sb, m_col_sh)
            if cutlass.const_expr(self.block_sparse):
                n_iters = Int32(0)
                for g in cutlass.range(group, unroll=1):
                    n_iters = n_iters + self.csr_visits(g, *vis)

            smem = cutlass.memory.SmemAllocator()
            st = smem.allocate(Smem)
            sQ = st.sQ.get_tensor(sq_layout)      # (m, D, stage)
            sdO = st.sdO.get_tensor(sq_layout)
            sK = st.sK.get_tensor(sk_layout)
            sV = st.sV.get_tensor(sk_layout)
            if cutlass.const_expr(self.ds_in_do):
                sdSt = cute.make_tensor(sdO.iterator, sds_layout)  # (n, m, stage) over the dO stages
            else:
                sdSt = st.sdS.get_tensor(sds_layout)               # (n, m, 1)
            sLSE = st.lse.get_tensor(cute.make_layout(tile_m * S))
            sDelta = st.delta.get_tensor(cute.make_layout(tile_m * S))
            SD = S if cutlass.const_expr(self.ds_in_do) else 1
            # transposed views (ldmatrix.trans reads them): Q^T, dO^T (D, m), K^T (D, n), dS (m, n)
            sQt = cute.composition(sQ, cute.make_layout((D, tile_m, S), stride=(tile_m, 1, tile_m * D)))
            sdOt = cute.composition(sdO, cute.make_layout((D, tile_m, S), stride=(tile_m, 1, tile_m * D)))
            sKt = cute.composition(sK, cute.make_layout((D, tile_n), stride=(tile_n, 1)))
            # this kernel's D-slice (all of D unless cfg.d_split > 1) of the operands of dV, dK, dQ
            Do, d0 = self.d_out, self.d_slice * self.d_out
            sQt_o = cute.local_tile(sQt, (Do, tile_m, S), (self.d_slice, 0, 0))
            sdOt_o = cute.local_tile(sdOt, (Do, tile_m, S), (self.d_slice, 0, 0))
            sKt_o = cute.local_tile(sKt, (Do, tile_n), (self.d_slice, 0))
            sdS = cute.composition(sdSt, cute.make_layout((tile_m, tile_n, SD), stride=(tile_n, 1, tile_m * tile_n)))

            thr_g2s = g2s.get_slice(tidx)
            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, head_kv, None]), (tile_n, D), (n_block, 0))
            gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, head_kv, None]), (tile_n, D), (n_block, 0))
            cK = cute.local_tile(cute.make_identity_tensor((seqlen_k, D)), (tile_n, D), (n_block, 0))
            tKcK = thr_g2s.partition_S(cK)
            tKsK = thr_g2s.partition_D(sK)
            tVsV = thr_g2s.partition_D(sV)
            tQsQ = thr_g2s.partition_D(sQ)    # (CPY, M, K, stage)
            tQsdO = thr_g2s.partition_D(sdO)

            # ---- MMA fragments and ldmatrix copies (smem partitions keep the stage mode last)
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
            tSrQ = thr_kv.make_fragment_B(thr_kv.partition_B(sQ[None, None, 0]))
            tSrdO = thr_kv.make_fragment_B(thr_kv.partition_B(sdO[None, None, 0]))
            t_ld_a, t_ld_b, t_ld_bt = ld_a.get_slice(tidx), ld_b.get_slice(tidx), ld_bt.get_slice(tidx)
            tSsK, tSrK_v = t_ld_a.partition_S(sK), t_ld_a.retile(tSrK)
            tSsV, tSrV_v = t_ld_a.partition_S(sV), t_ld_a.retile(tSrV)
            tSsQ, tSrQ_v = t_ld_b.partition_S(sQ), t_ld_b.retile(tSrQ)
            tSsdO, tSrdO_v = t_ld_b.partition_S(sdO), t_ld_b.retile(tSrdO)
            # dV += P^T dO, dK += dS^T Q: B operands are dO^T and Q^T (D, m)
            tVrdOt = thr_kv.make_fragment_B(thr_kv.partition_B(sdOt_o[None, None, 0]))
            tKrQt = thr_kv.make_fragment_B(thr_kv.partition_B(sQt_o[None, None, 0]))
            tVsdOt, tVrdOt_v = t_ld_bt.partition_S(sdOt_o), t_ld_bt.retile(tVrdOt)
            tKsQt, tKrQt_v = t_ld_bt.partition_S(sQt_o), t_ld_bt.retile(tKrQt)
            # dQ = dS K: A = dS (m, n) and B = K^T (D, n), both transposed views
            tQrdS = thr_q.make_fragment_A(thr_q.partition_A(sdS[None, None, 0]))
            tQrKt = thr_q.make_fragment_B(thr_q.partition_B(sKt_o))
            t_ld_qa, t_ld_qb = ld_qa_t.get_slice(tidx), ld_qb_t.get_slice(tidx)
            tQsdS, tQrdS_v = t_ld_qa.partition_S(sdS), t_ld_qa.retile(tQrdS)
            tQsKt, tQrKt_v = t_ld_qb.partition_S(sKt_o), t_ld_qb.retile(tQrKt)

            acc_dK = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, Do)), Float32)
            acc_dV = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, Do)), Float32)
            acc_dK.fill(0.0)
            acc_dV.fill(0.0)
            # (key, query) coordinates of this thread's S^T elements; (query, d) of its dQ elements
            tScS_mn = acc_mn_view(thr_kv.partition_C(cute.make_identity_tensor((tile_n, tile_m))))
            tQcdQ = thr_q.partition_C(cute.make_identity_tensor((tile_m, Do)))
            # dS^T to smem two elements (4 bytes) at a time: the accumulator pairs adjacent queries
            r2s = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width),
                mma_kv)
            thr_r2s = r2s.get_slice(tidx)
            tdSsdS = thr_r2s.partition_D(sdSt)   # (CPY, N, M, stage)
            qargs = (g2s, thr_g2s, mQ, mdO, mLSE, mDelta, sLSE, sDelta, tQsQ, tQsdO,
                     q_start, seqlen_q, batch, lse_stride_h, lse_stride_b, tidx)

            # ---- prologue: K, V for the CTA's life, then Q (+ dO), LSE, delta of the first step
            self.load_rows(g2s, thr_g2s.partition_S(gK), tKsK, tKcK, seqlen_k)
            self.load_rows(g2s, thr_g2s.partition_S(gV), tVsV, tKcK, seqlen_k)
            if n_iters > 0:
                h0, mb0, _, _ = self.step_at(Int32(0), *vis, m_rot)
                self.load_q_step(*qargs, mb0, h0, Int32(0), True, not self.early_s)
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.early_s):  # dO in a group of its own, as in every later step
                if n_iters > 0:
                    h0d, mb0d, _, _ = self.step_at(Int32(0), *vis, m_rot)
                    self.load_q_step(*qargs, mb0d, h0d, Int32(0), False, True)
                cute.arch.cp_async_commit_group()

            # defer_dq: the previous step's dQ tile (in acc_dQ) and where it goes; no rows before step 0
            acc_dQ = cute.make_rmem_tensor(thr_q.partition_shape_C((tile_m, Do)), Float32)
            pend_base = Int32(0)
            pend_rows = Int32(0)
            for it in cutlass.range(n_iters, unroll=1):
                head, m_block, is_mask_entry, lock = self.step_at(it, *vis, m_rot)
                stg = Int32(0)
                if cutlass.const_expr(two_stage):
                    stg = it % 2
                dstg = Int32(0)  # the dS^T stage
                if cutlass.const_expr(self.ds_in_do):
                    dstg = stg
                # early_s: only Q (+ LSE2, delta) has to be here; dO (the most recent group) may still load
                cute.arch.cp_async_wait_group(1 if self.early_s else 0)
                # B1: this step's loads landed; every warp is done with the previous step (its dQ read
                # dS^T, its GEMMs read the other stage), so that stage / dS^T may be overwritten
                bar.arrive_and_wait()
                if cutlass.const_expr(two_stage):
                    if it + 1 < n_iters:
                        h1, mb1, _, _ = self.step_at(it + 1, *vis, m_rot)
                        self.load_q_step(*qargs, mb1, h1, 1 - stg, True, True)
                    cute.arch.cp_async_commit_group()

                acc_S = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, tile_m)), Float32)
                acc_S.fill(0.0)
                pending = None
                if cutlass.const_expr(self.defer_dq):
                    pending = (mdQ, acc_dQ, tQcdQ, pend_base, heads_q * D, pend_rows)
                self.gemm_ss(mma_kv, acc_S, ld_a, ld_b, tSsK, tSrK_v, tSsQ[None, None, None, stg], tSrQ_v,
                             tSrK, tSrQ, pending)
                if cutlass.const_expr(self.early_s):
                    cute.arch.cp_async_wait_group(0)
                    bar.arrive_and_wait()  # B2: dO landed (every thread's share of it)
                acc_dP = cute.make_rmem_tensor(thr_kv.partition_shape_C((tile_n, tile_m)), Float32)
                acc_dP.fill(0.0)
                self.gemm_ss(mma_kv, acc_dP, ld_a, ld_b, tSsV, tSrV_v, tSsdO[None, None, None, stg], tSrdO_v,
                             tSrV, tSrdO)

                acc_S_mn = acc_mn_view(acc_S)
                acc_dP_mn = acc_mn_view(acc_dP)
                if cutlass.const_expr(self.has_softcap):
                    # s = cap * tanh(s * scale / cap) in natural-log units, before any -inf of the masks
                    for i in cutlass.range_constexpr(cute.size(acc_S)):
                        acc_S[i] = softcap * cute.math.tanh(acc_S[i] * softcap_scale, fastmath=True)
                if is_mask_entry:  # dense: always; block-sparse: the element predicate applies to mask entries
                    if block_needs_mask(m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k, win_left, win_right,
                                        self.has_left, self.has_right):
                        self.mask_t(acc_S_mn, tScS_mn, m_block * tile_m, n_block * tile_n, seqlen_q, seqlen_k,
                                    win_left, win_right, True)
                    if cutlass.const_expr(self.num_key_ranges > 0):
                        kr_row0 = Int32(0)
                        if cutlass.const_expr(self.varlen):
                            kr_row0 = q_start
                        kr, _, _ = load_key_ranges(mKR, kr_sb * batch + kr_sh * head, kr_row0, tScS_mn,
                                                   m_block * tile_m, seqlen_q, self.num_key_ranges, 1)
                        apply_key_ranges(acc_S_mn, tScS_mn, n_block * tile_n, kr, self.num_key_ranges, 1)
                elif (n_block + 1) * tile_n > seqlen_k:
                    # a full CSR entry is the caller's promise that the predicate holds: only the key tail
                    self.mask_t(acc_S_mn, tScS_mn, m_block * tile_m, n_block * tile_n, seqlen_q, seqlen_k,
                                win_left, win_right, False)
                # softcap: the scores are already scaled; exp2 needs only the change of base
                sl2 = Float32(LOG2_E) if cutlass.const_expr(self.has_softcap) else scale_log2
                for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                    qc = tScS_mn[0, c][1] + stg * tile_m
                    lse2 = sLSE[qc]
                    dlt = sDelta[qc]
                    for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
                        s_rc = acc_S_mn[r, c]
                        p = cute.math.exp2(s_rc * sl2 - lse2, fastmath=True)
                        acc_S_mn[r, c] = p
                        if cutlass.const_expr(self.has_softcap):
                            # d(cap tanh(x scale / cap))/dx = scale (1 - tanh^2); a masked score is -inf
                            # (p = 0): the clamp keeps its factor finite (0) instead of 0 * inf
                            t = cutlass.max(s_rc / softcap, Float32(-1.0))
                            acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - dlt) * (scale * (Float32(1.0) - t * t))
                        else:
                            acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - dlt) * scale

                rP = cute.make_fragment_like(acc_S, self.dtype)
                rP.store(acc_S.load().to(self.dtype))
                rdS = cute.make_fragment_like(acc_dP, self.dtype)
                rdS.store(acc_dP.load().to(self.dtype))
                self.gemm_rs(mma_kv, acc_dV, ld_bt, acc_as_A(rP), tVsdOt[None, None, None, stg], tVrdOt_v, tVrdOt)
                self.gemm_rs(mma_kv, acc_dK, ld_bt, acc_as_A(rdS), tKsQt[None, None, None, stg], tKrQt_v, tKrQt)
                if cutlass.const_expr(self.ds_in_do or not two_stage):
                    bar.arrive_and_wait()  # B3: every warp is done with Q, dO, LSE, delta of this step
                if cutlass.const_expr(not two_stage):
                    if it + 1 < n_iters:  # the next Q (+ dO) loads while dS^T is stored and dQ runs
                        h1, mb1, _, _ = self.step_at(it + 1, *vis, m_rot)
                        self.load_q_step(*qargs, mb1, h1, Int32(0), True, not do_after_dq)
                    cute.arch.cp_async_commit_group()
                cute.copy(r2s, thr_r2s.retile(rdS), tdSsdS[None, None, None, dstg])
                bar.arrive_and_wait()  # B4: dS^T complete in smem

                acc_dQ.fill(0.0)
                self.gemm_ss(mma_q, acc_dQ, ld_qa_t, ld_qb_t, tQsdS[None, None, None, dstg], tQrdS_v, tQsKt,
                             tQrKt_v, tQrdS, tQrKt)
                if cutlass.const_expr(do_after_dq):
                    # B5: every warp has read dS^T, so the dO stage under it may take the next dO,
                    # which then loads during this step's atomics (and lands with the next Q)
                    bar.arrive_and_wait()
                    if it + 1 < n_iters:
                        h1, mb1, _, _ = self.step_at(it + 1, *vis, m_rot)
                        self.load_q_step(*qargs, mb1, h1, Int32(0), False, True)
                    cute.arch.cp_async_commit_group()

                row_base = (q_start + m_block * tile_m) * heads_q * D + head * D + d0
                if cutlass.const_expr(self.defer_dq):
                    pend_base = row_base
                    pend_rows = seqlen_q - m_block * tile_m  # <= 0 past the sequence: nothing is added
                # a CSR query block may reach past the sequence: its tiles there add nothing and, for
                # every visitor alike, touch no semaphore (the array has ceil(seqlen_q / tile_m) per head)
                if cutlass.const_expr(not self.defer_dq):
                    if m_block * tile_m < seqlen_q:
                        sem_idx = (batch * heads_q + head) * n_mblocks + m_block
                        if cutlass.const_expr(self.deterministic):
                            rank = Int32(0)
                            if cutlass.const_expr(self.block_sparse):
                                # the entry's lock value ranks its CSR key block among the query block's
                                # visitors (ascending key blocks); each covers bs_ratio_n key tiles
                                rank = lock * bs_ratio_n + (n_block - kb * bs_ratio_n)
                            else:
                                n_min, _ = n_block_range(m_block, tile_m, tile_n, seqlen_q, seqlen_k, win_left,
                                                         win_right, self.has_left, self.has_right)
                                rank = n_block - n_min
                            if tidx == 0:
                                cur = cute.arch.load((mSem.iterator + sem_idx).llvm_ptr, Int32, sem="acquire",
                                                     scope="gpu")
                                while cur != rank:
                                    cur = cute.arch.load((mSem.iterator + sem_idx).llvm_ptr, Int32, sem="acquire",
                                                         scope="gpu")
                            bar.arrive_and_wait()
                        self.red_dq(mdQ, acc_dQ, tQcdQ, row_base, heads_q * D, seqlen_q - m_block * tile_m)
                        if cutlass.const_expr(self.deterministic):
                            cute.arch.fence_acq_rel_gpu()  # this thread's adds are visible before the release
                            bar.arrive_and_wait()
                            if tidx == 0:
                                cute.arch.red((mSem.iterator + sem_idx).llvm_ptr, Int32(1), op="add", dtype=Int32,
                                              sem="release", scope="gpu")

            if cutlass.const_expr(self.defer_dq):
                self.red_dq(mdQ, acc_dQ, tQcdQ, pend_base, heads_q * D, pend_rows)  # the last step's dQ
            # ---- epilogue: dK (scale already folded into dS), dV -> dtype -> smem (K, V tiles) -> global
            cute.arch.cp_async_wait_group(0)
            bar.arrive_and_wait()
            rdK = cute.make_fragment_like(acc_dK, self.dtype)
            rdK.store(acc_dK.load().to(self.dtype))
            rdV = cute.make_fragment_like(acc_dV, self.dtype)
            rdV.store(acc_dV.load().to(self.dtype))
            r2s_o = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width),
                mma_kv)
            thr_r2s_o = r2s_o.get_slice(tidx)
            sK_o = cute.local_tile(sK, (tile_n, Do), (0, self.d_slice))
            sV_o = cute.local_tile(sV, (tile_n, Do), (0, self.d_slice))
            cute.copy(r2s_o, thr_r2s_o.retile(rdK), thr_r2s_o.partition_D(sK_o))
            cute.copy(r2s_o, thr_r2s_o.retile(rdV), thr_r2s_o.partition_D(sV_o))
            bar.arrive_and_wait()
            thr_s2g = s2g.get_slice(tidx)
            gdK = cute.local_tile(cute.domain_offset((k_start, 0), mdK[None, head_kv, None]), (tile_n, Do),
                                  (n_block, self.d_slice))
            gdV = cute.local_tile(cute.domain_offset((k_start, 0), mdV[None, head_kv, None]), (tile_n, Do),
                                  (n_block, self.d_slice))
            cK_o = cute.local_tile(cK, (tile_n, Do), (0, self.d_slice))
            self.store_rows(s2g, thr_s2g.partition_S(sK_o), thr_s2g.partition_D(gdK), thr_s2g.partition_D(cK_o),
                            seqlen_k)
            self.store_rows(s2g, thr_s2g.partition_S(sV_o), thr_s2g.partition_D(gdV), thr_s2g.partition_D(cK_o),
                            seqlen_k)

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def red_dq(self, mdQ: cute.Tensor, acc_dQ: cute.Tensor, tQcdQ: cute.Tensor, row_base: Int32, row_stride: Int32,
               rows_left: Int32, part: cutlass.Constexpr = 0, parts: cutlass.Constexpr = 1):
        """fp32 atomic adds of this thread's dQ elements (rows below ``rows_left``) into the accumulator;
        only share ``part`` of ``parts`` of them (interleaved with another product's MMAs)."""
        if cutlass.const_expr(self.vec_red):
            # elements (2j, 2j+1) of an m16n8 accumulator are adjacent columns of one row: one
            # 8-byte vector reduction each
            n2 = cute.size(acc_dQ) // 2
            for j in cutlass.range_constexpr(part * n2 // parts, (part + 1) * n2 // parts):
                rr, cc = tQcdQ[2 * j]
                if rr < rows_left:
                    v = vector.from_elements(ir.VectorType.get([2], Float32.mlir_type),
                                             [acc_dQ[2 * j].ir_value(), acc_dQ[2 * j + 1].ir_value()])
                    cute.arch.red((mdQ.iterator + (row_base + rr * row_stride + cc)).llvm_ptr, v, op="add",
                                  dtype=Float32, sem="relaxed", scope="gpu")
        else:
            n1 = cute.size(acc_dQ)
            for i in cutlass.range_constexpr(part * n1 // parts, (part + 1) * n1 // parts):
                rr, cc = tQcdQ[i]
                if rr < rows_left:
                    cute.arch.red((mdQ.iterator + (row_base + rr * row_stride + cc)).llvm_ptr, acc_dQ[i],
                                  op="add", dtype=Float32, sem="relaxed", scope="gpu")

    @cute.jit
    def csr_visits(self, g: Int32, n_m: Int32, m_lo: Int32, head0: Int32, group: Int32, batch: Int32, kb: Int32,
                   mFR: cute.Tensor, mFC: cute.Tensor, mMR: cute.Tensor, mMC: cute.Tensor, mFL: cute.Tensor,
                   mML: cute.Tensor, ratio_m: Int32, f_rp_sb: Int32, f_rp_sh: Int32, f_col_sb: Int32,
                   f_col_sh: Int32, m_rp_sb: Int32, m_rp_sh: Int32, m_col_sb: Int32, m_col_sh: Int32):
        """Query tiles that head ``head0 + g`` visits for key block ``kb``: its k->q entries x ratio_m."""
        head = head0 + g
        _, f_cnt = csr_row(mFR, f_rp_sb * batch + f_rp_sh * head, kb)
        _, m_cnt = csr_row(mMR, m_rp_sb * batch + m_rp_sh * head, kb)
        return (f_cnt + m_cnt) * ratio_m

    @cute.jit
    def step_at(self, it: Int32, n_m: Int32, m_lo: Int32, head0: Int32, group: Int32, batch: Int32, kb: Int32,
                mFR: cute.Tensor, mFC: cute.Tensor, mMR: cute.Tensor, mMC: cute.Tensor, mFL: cute.Tensor,
                mML: cute.Tensor, ratio_m: Int32, f_rp_sb: Int32, f_rp_sh: Int32, f_col_sb: Int32,
                f_col_sh: Int32, m_rp_sb: Int32, m_rp_sh: Int32, m_col_sb: Int32, m_col_sh: Int32,
                m_rot: Int32):
        """(query head, query tile, element predicate applies?, CSR lock value) of visit ``it``.

        Dense: heads outermost, then the query tiles m_lo.. of the key block's range. Block-sparse:
        per head of the group, the key block's k->q mask entries, then its full entries, each a CSR
        query block of ratio_m tiles. With a per-head CSR the heads' visit counts differ, so the
        head is found by walking the group (a CSR broadcast over heads divides instead)."""
        g = it // cutlass.max(n_m, 1)
        r = it - g * n_m
        if cutlass.const_expr(self.rotate_m):
            # the query tiles in the order m_rot, m_rot + 1, .., n_m - 1, 0, .., m_rot - 1
            r = r + m_rot
            if r >= n_m:
                r = r - n_m
        m_block = m_lo + r
        is_mask = Boolean(True)
        lock = Int32(0)
        if cutlass.const_expr(self.block_sparse):
            vargs = (n_m, m_lo, head0, group, batch, kb, mFR, mFC, mMR, mMC, mFL, mML, ratio_m, f_rp_sb, f_rp_sh,
                     f_col_sb, f_col_sh, m_rp_sb, m_rp_sh, m_col_sb, m_col_sh)
            cnt = self.csr_visits(Int32(0), *vargs)
            g = Int32(0)
            rem = it
            if f_rp_sh == 0 and m_rp_sh == 0:
                g = it // cutlass.max(cnt, 1)
                rem = it - g * cnt
            else:
                while rem >= cnt and g + 1 < group:
                    rem = rem - cnt
                    g = g + 1
                    cnt = self.csr_visits(g, *vargs)
            head = head0 + g
            f_col0, f_cnt = csr_row(mFR, f_rp_sb * batch + f_rp_sh * head, kb)
            m_col0, m_cnt = csr_row(mMR, m_rp_sb * batch + m_rp_sh * head, kb)
            e = rem // ratio_m
            is_mask = e < m_cnt
            col = Int32(0)
            if is_mask:
                idx = m_col_sb * batch + m_col_sh * head + m_col0 + e
                col = mMC[idx]
                lock = mML[idx]
            else:
                idx = f_col_sb * batch + f_col_sh * head + f_col0 + e - m_cnt
                col = mFC[idx]
                lock = mFL[idx]
            m_block = col * ratio_m + (rem - e * ratio_m)
        return head0 + g, m_block, is_mask, lock

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
    def load_q_step(self, g2s, thr_g2s, mQ, mdO, mLSE, mDelta, sLSE, sDelta, tQsQ, tQsdO,
                    q_start: Int32, seqlen_q: Int32, batch: Int32,
                    lse_stride_h: Int32, lse_stride_b: Int32, tidx, m_block: Int32, head: Int32, stage: Int32,
                    with_q: cutlass.Constexpr, with_do: cutlass.Constexpr):
        """cp.async Q (with_q) and dO (with_do) of query block ``m_block`` of ``head`` into ``stage``; with
        Q, the LSE2 and delta rows go to smem by plain stores (+inf / 0 past the end)."""
        D = self.head_dim
        cQ = cute.local_tile(cute.make_identity_tensor((seqlen_q, D)), (self.tile_m, D), (m_block, 0))
        tQcQ = thr_g2s.partition_S(cQ)
        if cutlass.const_expr(with_q):
            gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, head, None]), (self.tile_m, D),
                                 (m_block, 0))
            self.load_rows(g2s, thr_g2s.partition_S(gQ), tQsQ[None, None, None, stage], tQcQ, seqlen_q)
        if cutlass.const_expr(with_do):
            gdO = cute.local_tile(cute.domain_offset((q_start, 0), mdO[None, head, None]), (self.tile_m, D),
                                  (m_block, 0))
            self.load_rows(g2s, thr_g2s.partition_S(gdO), tQsdO[None, None, None, stage], tQcQ, seqlen_q)
        if cutlass.const_expr(with_q):
            # LSE2 by threads [0, tile_m), delta by [tile_m, 2 tile_m), 4-byte cp.async each: they
            # land with Q, so no warp waits on a global load here (a plain load held its warps,
            # and every other warp at the next barrier, for the load's whole latency)
            if tidx < 2 * self.tile_m:
                r = tidx % self.tile_m
                row = m_block * self.tile_m + r
                base = head * lse_stride_h + batch * lse_stride_b
                if cutlass.const_expr(self.varlen):
                    base = head * lse_stride_h + q_start
                sidx = stage * self.tile_m + r
                if tidx < self.tile_m:
                    self.load_row_scalar(mLSE, sLSE, base + row, sidx, row < seqlen_q, Float32.inf)
                else:
                    self.load_row_scalar(mDelta, sDelta, base + row, sidx, row < seqlen_q, Float32(0.0))

    @cute.jit
    def load_row_scalar(self, mSrc: cute.Tensor, sDst: cute.Tensor, gidx: Int32, sidx: Int32, in_range,
                        fill: Float32):
        """sDst[sidx] = mSrc[gidx] by a 4-byte cp.async where ``in_range``, else ``fill`` (rows past
        the sequence: +inf LSE2 makes their P exactly 0)."""
        if in_range:
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
            cute.copy(atom, cute.make_tensor(mSrc.iterator + gidx, cute.make_layout(1)),
                      cute.make_tensor(sDst.iterator + sidx, cute.make_layout(1)))
        else:
            sDst[sidx] = fill

    @cute.jit
    def mask_t(self, acc_mn, tScS_mn, row0_q: Int32, col0_k: Int32, seqlen_q: Int32, seqlen_k: Int32,
               win_left: Int32, win_right: Int32, with_window: cutlass.Constexpr):
        """-inf where key j (rows of S^T) is invisible to query i (columns): past seqlen_k, and outside
        the causal/window bounds when ``with_window``."""
        for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
            diag = tScS_mn[0, c][1] + row0_q + seqlen_k - seqlen_q
            hi = seqlen_k
            lo = Int32(0)
            if cutlass.const_expr(self.has_right and with_window):
                hi = cutlass.min(hi, diag + win_right + 1)
            if cutlass.const_expr(self.has_left and with_window):
                lo = cutlass.max(lo, diag - win_left)
            for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                j = tScS_mn[r, 0][0] + col0_k
                acc_mn[r, c] = score_or_neg_inf((j < hi) & (j >= lo), acc_mn[r, c])

    @cute.jit
    def gemm_ss(self, tiled_mma, acc, ld_a, ld_b, tAs, tAr_v, tBs, tBr_v, tAr, tBr, pending=None):
        """acc += A B^T, both operands from smem; ldmatrix of k-slice k+1 overlaps mma of k.
        ``pending``: red_dq arguments of a dQ tile whose atomics are spread over the k-slices."""
        n_k = cute.size(tAs.shape[2])
        cute.copy(ld_a, tAs[None, None, 0], tAr_v[None, None, 0])
        cute.copy(ld_b, tBs[None, None, 0], tBr_v[None, None, 0])
        for k in cutlass.range_constexpr(n_k):
            k_next = (k + 1) % n_k
            cute.copy(ld_a, tAs[None, None, k_next], tAr_v[None, None, k_next])
            cute.copy(ld_b, tBs[None, None, k_next], tBr_v[None, None, k_next])
            cute.gemm(tiled_mma, acc, tAr[None, None, k], tBr[None, None, k], acc)
            if cutlass.const_expr(pending is not None):
                self.red_dq(*pending, k, n_k)

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


class FlashBwdPreprocess(PackedEntry):
    """delta = rowsum(dO * O) in fp32 and LSE2 = LSE * log2(e) (+inf where LSE is -inf), one pass,
    which also zeroes the fp32 dQ accumulator (the same rows: one launch less than a separate fill).

    Rows are (token, head) pairs of the (total_q, heads, D) tensors; D / 8 threads share a row
    (16-byte loads), reduce by butterfly shuffles, and one of them writes both values in the LSE
    layout: index head * lse_stride_h + b * lse_stride_b + s with (b, s) = divmod(token, seqlen_q)
    (varlen passes seqlen_q = total_q and lse_stride_b = 0). +inf makes exp2(s - LSE2) exactly 0 for
    rows that see no key, instead of NaN.
    """

    num_threads = 256

    def __init__(self, dtype, head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.vec = 128 // dtype.width
        assert head_dim % self.vec == 0
        # threads per row: the largest power of two dividing D / vec (12 vectors at D = 96: 4
        # threads of 3 vectors each), so the butterfly reduction below stays within the row
        self.thr_cols = min((head_dim // self.vec) & -(head_dim // self.vec), 32)
        self.rows = self.num_threads // self.thr_cols

    @cute.jit
    def __call__(self, pO: cute.Pointer, pdO: cute.Pointer, pLSE: cute.Pointer, pLSE2: cute.Pointer,
                 pDelta: cute.Pointer, pdQacc: cute.Pointer, n_rows: Int32, heads: Int32, seqlen_q: Int32,
                 lse_stride_h: Int32, lse_stride_b: Int32, stream):
        D = self.head_dim
        mO = cute.make_tensor(pO, cute.make_layout((n_rows, D), stride=(D, 1)))
        mdO = cute.make_tensor(pdO, cute.make_layout((n_rows, D), stride=(D, 1)))
        mdQacc = cute.make_tensor(pdQacc, cute.make_layout((n_rows, D), stride=(D, 1)))
        flat = cute.make_layout(1 << 30)
        copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_layout((self.rows, self.thr_cols), stride=(self.thr_cols, 1)), cute.make_layout((1, self.vec)))
        # the dQ accumulator's rows: the same thread -> (row, vector) mapping, vec fp32 per thread
        zero = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout((self.rows, self.thr_cols), stride=(self.thr_cols, 1)), cute.make_layout((1, self.vec)))
        self.kernel(mO, mdO, cute.make_tensor(pLSE, flat), cute.make_tensor(pLSE2, flat), cute.make_tensor(pDelta, flat),
                    mdQacc, n_rows, heads, seqlen_q, lse_stride_h, lse_stride_b, copy, zero).launch(
            grid=(cute.ceil_div(n_rows, self.rows), 1, 1), block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mLSE2: cute.Tensor, mDelta: cute.Tensor,
               mdQacc: cute.Tensor, n_rows: Int32, heads: Int32, seqlen_q: Int32, lse_stride_h: Int32,
               lse_stride_b: Int32, copy: cute.TiledCopy, zero: cute.TiledCopy):
        D = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        thr = copy.get_slice(tidx)
        tOgO = thr.partition_S(cute.local_tile(mO, (self.rows, D), (bid, 0)))
        tOgdO = thr.partition_S(cute.local_tile(mdO, (self.rows, D), (bid, 0)))
        tOcO = thr.partition_S(cute.local_tile(cute.make_identity_tensor((n_rows, D)), (self.rows, D), (bid, 0)))
        row = tOcO[0][0]
        acc = Float32(0.0)
        if row < n_rows:
            rO = cute.make_fragment_like(tOgO, self.dtype)
            rdO = cute.make_fragment_like(tOgdO, self.dtype)
            cute.copy(copy, tOgO, rO)
            cute.copy(copy, tOgdO, rdO)
            prod = rO.load().to(Float32) * rdO.load().to(Float32)
            acc = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
            tZgdQ = zero.get_slice(tidx).partition_D(cute.local_tile(mdQacc, (self.rows, D), (bid, 0)))
            rZ = cute.make_fragment_like(tZgdQ, Float32)
            rZ.fill(0.0)
            cute.copy(zero, rZ, tZgdQ)
        for k in cutlass.range_constexpr(self.thr_cols.bit_length() - 1):  # log2(thr_cols) butterflies
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=self.thr_cols >> (k + 1))
        if tidx % self.thr_cols == 0 and row < n_rows:
            t = row // heads
            h = row - t * heads
            b = t // seqlen_q
            idx = h * lse_stride_h + b * lse_stride_b + (t - b * seqlen_q)
            mDelta[idx] = acc
            lse = mLSE[idx]
            lse2 = lse * Float32(1.4426950408889634)
            if lse == -Float32.inf:
                lse2 = Float32.inf
            mLSE2[idx] = lse2
