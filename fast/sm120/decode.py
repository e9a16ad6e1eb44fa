"""Split-KV decode (flash-decoding) on warp-level mma.sync (SM80 class), sized for SM120's 99 KB.

One CTA computes one (batch entry, KV head, split of the key blocks, tile of packed rows). The
query heads that share a KV head are packed into the M dimension of the mma tile (packed row
r = token r // gqa of query head hk * gqa + r % gqa), so a key block is read once for the whole
group. Decode has few rows (GQA 32/8 with one token: 4), so the CTA's warps split the *keys*, not
the rows: each key block of ``tile_n = num_warps * chunk_n`` keys is loaded by all threads with
16-byte cp.async into a ring of ``stages`` smem stages, and warp w computes on its own chunk of
``chunk_n`` keys:

    S_w = Q K_w^T (ldmatrix + mma.sync, fp32) -> mask (tail / causal / window) -> online softmax
    -> O_w += P_w V_w   (P straight from the S registers)

with its own running max, sum and O. Warps never talk inside the loop (one CTA barrier per key
block, for the cp.async ring). At the end the warps' (max, sum, O) are merged through shared
memory in a fixed order (bitwise repeatable), and the CTA writes its normalised fp32 partial
output and natural-log LSE to the split workspace. A second kernel, launched by the same host
call, merges the splits of each output row (``combine_kernel``).

Paged caches: a chunk of ``chunk_n`` keys never straddles a page (page size a multiple of
chunk_n), so each chunk's base address is looked up in the page table on its own; offsets are
64-bit (pools over 2**31 elements). Rows past the live length (cache_seqlens[b] + new tokens) are
zero-filled in smem and masked, so stale or garbage cache slots can never inject NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync, warp

from dualattn.fast.common.layouts import acc_as_A, acc_mn_view, smem_layout_rowmajor
from dualattn.fast.common.mask import score_or_neg_inf
from dualattn.fast.common.softmax import LN_2, LOG2_E, make_softmax_state, online_softmax_step, quad_sum

from .fwd import SMEM_LIMIT_SM120, FlashFwdSm80

# head dims the decode kernel serves (D == Dv): a multiple of 64 keeps the 16-byte cp.async
# thread layout at 8 threads per row, so one pass of a 128-thread CTA covers 16 whole rows
DECODE_HEAD_DIMS = (64, 128, 192, 256)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class DecodeConfig:
    tile_m: int     # packed (token, query head) rows per CTA
    chunk_n: int    # keys per warp per key block (the k16 of the P V product)
    num_warps: int
    stages: int     # key blocks in the cp.async ring

    @property
    def tile_n(self) -> int:
        return self.chunk_n * self.num_warps

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    def smem_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        # Q tile + K ring + V ring (each 1024-aligned) + the per-warp (max, sum) exchange; the
        # fp32 merge buffer of the epilogue reuses the K ring
        q = _round_up(elem_bytes * self.tile_m * head_dim, 1024)
        kv = _round_up(elem_bytes * self.stages * self.tile_n * head_dim, 1024)
        return q + 2 * kv + 4 * 2 * self.num_warps * self.tile_m

    def merge_fits(self, head_dim: int, elem_bytes: int = 2) -> bool:
        return 4 * self.tile_m * head_dim <= elem_bytes * self.stages * self.tile_n * head_dim


# Config table (head dim -> config); every entry fits 99 KB (sm_120) with room for the compiler:
#   hd 64 : 4 warps x 16 keys, 4 stages: 64 KB of K/V ring; 16 or 32 packed rows.
#   hd 128: 4 warps x 16 keys, 2 stages: 64 KB ring (3 stages would be 96 KB + Q > 99 KB);
#           16 or 32 rows (32 rows: 128 fp32 O registers per thread).
#   hd 192, 256: 2 warps x 16 keys (a 64-key block of 256-wide rows is 64 KB per stage), 3 / 2
#           stages; 16 rows only, so O stays at <= 128 fp32 registers per thread.
# On Hopper (228 KB per SM) the same configs give 3 CTAs per SM, i.e. 6-12 key blocks in flight.
def decode_config(head_dim: int, packed_rows: int) -> DecodeConfig:
    rows32 = packed_rows > 16
    if head_dim <= 64:
        return DecodeConfig(32 if rows32 else 16, 16, 4, 4)
    if head_dim <= 128:
        return DecodeConfig(32 if rows32 else 16, 16, 4, 2)
    if head_dim <= 192:
        return DecodeConfig(16, 16, 2, 3)
    return DecodeConfig(16, 16, 2, 2)


class FlashDecodeSm80:
    """Kernel object for one static configuration (see ``compile_key``); ``from_packed`` is the
    entry that ``cute.compile`` takes, with one ``PackedArgs`` (``arg_schema``) and a stream."""

    def __init__(self, dtype, head_dim: int, cfg: DecodeConfig, *, paged: bool, has_left: bool,
                 has_right: bool, has_softcap: bool):
        assert head_dim in DECODE_HEAD_DIMS
        self.dtype = dtype
        self.head_dim = head_dim
        self.cfg = cfg
        self.tile_m, self.chunk_n, self.num_warps, self.stages = cfg.tile_m, cfg.chunk_n, cfg.num_warps, cfg.stages
        self.tile_n, self.num_threads = cfg.tile_n, cfg.num_threads
        self.combine_threads = min(head_dim, 128)  # one output column per thread (two at hd > 128)
        self.paged = paged
        self.has_left = has_left
        self.has_right = has_right
        self.has_softcap = has_softcap
        assert self.stages >= 2, "the ring overlaps the load of block i+1 with the math on block i"
        assert cfg.merge_fits(head_dim), "the fp32 merge buffer reuses the K ring"

    # the forward's helpers take everything as arguments: reused as they are
    gemm_ss = FlashFwdSm80.gemm_ss
    load_rows = FlashFwdSm80.load_rows

    # ------------------------------------------------------------------ static description
    @staticmethod
    def compile_key(spec, arch: int) -> tuple:
        """Everything the generated code depends on. Batch, heads, lengths, cache lengths, pages,
        strides, window sizes, scale, cap and the number of splits are runtime values."""
        from .impl import window_bounds
        has_left, has_right, _, _ = window_bounds(spec)  # causal is a right bound of 0
        cfg = decode_config(spec.head_dim, spec.seqlen_q * spec.gqa_ratio)
        return ("decode", str(spec.dtype), spec.head_dim, spec.head_dim_v, cfg, bool(spec.paged),
                has_left, has_right, spec.softcap > 0, arch)

    @staticmethod
    def can_implement(spec) -> "str | None":
        """The arch-independent refusals (decode_impl adds device checks)."""
        import torch
        if spec.mode != "kvcache":
            return f"mode {spec.mode!r}: this is the kv-cache (decode) kernel; batched/varlen go to fast-sm120"
        if spec.needs_grad:
            return "no backward through the kv-cache path"
        if spec.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {spec.dtype} not supported (float16, bfloat16)"
        if spec.head_dim != spec.head_dim_v:
            return "head_dim_v must equal head_dim"
        if spec.head_dim not in DECODE_HEAD_DIMS:
            return f"head dim {spec.head_dim} not supported (one of {DECODE_HEAD_DIMS})"
        cfg = decode_config(spec.head_dim, spec.seqlen_q * spec.gqa_ratio)
        if spec.paged and spec.page_size % cfg.chunk_n:
            return (f"page size {spec.page_size} must be a multiple of {cfg.chunk_n} (a warp's key chunk "
                    f"may not straddle pages)")
        if cfg.smem_bytes(spec.head_dim) > SMEM_LIMIT_SM120:
            return "tile does not fit 99 KB of shared memory"
        return None

    @staticmethod
    def arg_schema(dtype):
        """Fields of the packed per-call argument, in the order ``from_packed`` unpacks them."""
        from dualattn.fast.common.launch_args import ArgSchema
        fields = [("q", ("ptr", dtype, 16)), ("k", ("ptr", dtype, 16)), ("v", ("ptr", dtype, 16)),
                  ("out", ("ptr", dtype, 16)), ("lse", ("ptr", Float32, 4)),
                  ("o_part", ("ptr", Float32, 16)), ("l_part", ("ptr", Float32, 4)),
                  ("cache_seqlens", ("ptr", Int32, 4)), ("page_table", ("ptr", Int32, 4))]
        fields += [(n, "i32") for n in ("batch", "seqlen_q", "heads_q", "heads_kv", "n_new", "num_splits",
                                         "page_size", "pt_stride", "q_stride_b", "q_stride_s", "q_stride_h",
                                         "win_left", "win_right")]
        # 64-bit: a cache (or page pool) may hold more than 2**31 elements
        fields += [(n, "i64") for n in ("k_stride_b", "k_stride_s", "k_stride_h",
                                         "v_stride_b", "v_stride_s", "v_stride_h")]
        fields += [("scale_log2", "f32"), ("softcap_scale", "f32"), ("softcap", "f32")]
        return ArgSchema(fields)

    # ------------------------------------------------------------------ host-side setup (trace)
    @cute.jit
    def from_packed(self, args, stream):
        (pQ, pK, pV, pOut, pLse, pO, pL, pLens, pPT, batch, seqlen_q, heads_q, heads_kv, n_new, num_splits, page_size,
         pt_stride, q_sb, q_ss, q_sh, win_left, win_right, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh,
         scale_log2, softcap_scale, softcap) = args.values
        D = self.head_dim
        cn = self.chunk_n
        nbuf = self.num_warps * self.stages  # one (chunk_n, D) buffer per warp and stage

        sQ_layout, k_atom = smem_layout_rowmajor(self.dtype, self.tile_m, D)
        chunk_layout, _ = smem_layout_rowmajor(self.dtype, cn, D)
        # chunk-major ring: buffer (warp w, stage s) is [None, None, w + num_warps * s]
        sKV_layout = cute.tile_to_shape(chunk_layout, (cn, D, nbuf), (0, 1, 2))

        @cute.struct
        class Smem:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            red: cute.struct.Align[cute.struct.MemRange[Float32, 2 * self.num_warps * self.tile_m], 16]

        # recorded at trace time so compile-only tests can check the 99 KB budget of sm_120
        self.smem_bytes = Smem.size_in_bytes()
        vec = 128 // self.dtype.width  # elements per 16-byte access
        thr_cols = k_atom // vec
        assert cn % (self.num_threads // thr_cols) == 0, "a chunk is whole passes of the copy"
        g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dtype,
                                num_bits_per_copy=128),
            cute.make_layout((self.num_threads // thr_cols, thr_cols), stride=(thr_cols, 1)),
            cute.make_layout((1, vec)))
        # one warp's mma: m16 slabs of packed rows x its own chunk of keys
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (1, 1, 1),
                                        permutation_mnk=(16, 16, 16))
        gqa = heads_q // heads_kv
        grid = (batch * heads_kv, num_splits, cute.ceil_div(seqlen_q * gqa, self.tile_m))
        self.kernel(pQ, pK, pV, pO, pL, pLens, pPT, batch, seqlen_q, heads_q, heads_kv, n_new, num_splits,
                    page_size, pt_stride, q_sb, q_ss, q_sh, win_left, win_right, k_sb, k_ss, k_sh, v_sb, v_ss,
                    v_sh, scale_log2, softcap_scale, softcap, sQ_layout, sKV_layout, g2s, tiled_mma,
                    Smem).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)
        # the combine, in the same host call (one launch each, stream-ordered after the splits)
        self.combine_kernel(pOut, pLse, pO, pL, batch, seqlen_q, heads_q, num_splits).launch(
            grid=(batch * heads_q * seqlen_q, 1, 1), block=[self.combine_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------ device code
    @cute.kernel
    def kernel(self, pQ: cute.Pointer, pK: cute.Pointer, pV: cute.Pointer, pO: cute.Pointer, pL: cute.Pointer,
               pLens: cute.Pointer, pPT: cute.Pointer, batch: Int32, seqlen_q: Int32, heads_q: Int32,
               heads_kv: Int32, n_new: Int32, num_splits: Int32, page_size: Int32, pt_stride: Int32,
               q_sb: Int32, q_ss: Int32, q_sh: Int32, win_left: Int32, win_right: Int32,
               k_sb: Int64, k_ss: Int64, k_sh: Int64, v_sb: Int64, v_ss: Int64, v_sh: Int64,
               scale_log2: Float32, softcap_scale: Float32, softcap: Float32,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout, g2s: cute.TiledCopy,
               tiled_mma: cute.TiledMma, Smem: cutlass.Constexpr):
        D = self.head_dim
        tile_m, tile_n, cn, W, nthr = self.tile_m, self.tile_n, self.chunk_n, self.num_warps, self.num_threads
        tidx, _, _ = cute.arch.thread_idx()
        bh, split, m_block = cute.arch.block_idx()
        warp_i = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        b = bh // heads_kv
        hk = bh % heads_kv
        gqa = heads_q // heads_kv
        n_rows = seqlen_q * gqa
        m0 = m_block * tile_m
        flat = cute.make_layout(1 << 30)
        mLens = cute.make_tensor(pLens, flat)
        mPT = cute.make_tensor(pPT, flat)
        mQ = cute.make_tensor(pQ, flat)
        mO = cute.make_tensor(pO, flat)
        mL = cute.make_tensor(pL, flat)
        bar = pipeline.NamedBarrier(barrier_id=1, num_threads=nthr)

        # ---- this CTA's key blocks: the visible range of its tokens, then this split's share
        seqlen_k = mLens[b] + n_new  # the cache after the append
        off = seqlen_k - seqlen_q  # bottom-right diagonal of token t: t + off
        t_first = m0 // gqa
        t_last = (cutlass.min(m0 + tile_m, n_rows) - 1) // gqa
        y_lo = Int32(0)
        y_hi = seqlen_k
        if cutlass.const_expr(self.has_left):
            y_lo = cutlass.min(cutlass.max(t_first + off - win_left, 0), seqlen_k)
        if cutlass.const_expr(self.has_right):
            y_hi = cutlass.min(cutlass.max(t_last + off + win_right + 1, 0), seqlen_k)
        y_hi = cutlass.max(y_hi, y_lo)
        blk_lo = y_lo // tile_n
        blk_hi = cute.ceil_div(y_hi, tile_n)
        per_split = cute.ceil_div(blk_hi - blk_lo, num_splits)
        s_lo = cutlass.min(blk_lo + split * per_split, blk_hi)
        s_hi = cutlass.min(s_lo + per_split, blk_hi)
        n_iters = s_hi - s_lo

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(Smem)
        sQ = st.sQ.get_tensor(sQ_layout)
        sK = st.sK.get_tensor(sKV_layout)
        sV = st.sV.get_tensor(sKV_layout)
        # V^T view of every buffer: (d, key, buffer)
        sVt = cute.composition(sV, cute.make_layout((D, cn, W * self.stages), stride=(cn, 1, cn * D)))

        # ---- Q: gather the packed rows (rows past the last one zero-filled); read once per CTA
        for i in cutlass.range_constexpr(tile_m * D // nthr):
            e = tidx + nthr * i
            row = e // D
            col = e % D
            r_glob = m0 + row
            val = self.dtype(0.0)
            if r_glob < n_rows:
                t = r_glob // gqa
                h = hk * gqa + r_glob % gqa
                val = mQ[b * q_sb + t * q_ss + h * q_sh + col]
            sQ[row, col] = val

        # ---- per-thread views
        thr_g2s = g2s.get_slice(tidx)
        tKsK = thr_g2s.partition_D(sK)
        tVsV = thr_g2s.partition_D(sV)
        tCc = thr_g2s.partition_S(cute.make_identity_tensor((cn, D)))
        kv = (pK, pV, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, b, hk, mPT, pt_stride, page_size, seqlen_k)

        thr_mma = tiled_mma.get_slice(lane)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, D)), Float32)
        acc_O.fill(0.0)
        ld_q = cute.make_tiled_copy_A(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma)
        ld_k = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma)
        ld_v = cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype), tiled_mma)
        thr_ld_q = ld_q.get_slice(lane)
        thr_ld_k = ld_k.get_slice(lane)
        thr_ld_v = ld_v.get_slice(lane)
        tSsQ = thr_ld_q.partition_S(sQ)
        tSrQ_v = thr_ld_q.retile(tSrQ)
        tSrK_v = thr_ld_k.retile(tSrK)
        tOrVt_v = thr_ld_v.retile(tOrVt)

        # (row, key) coordinates of this thread's S elements within (tile_m, chunk_n)
        tScS_mn = acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((tile_m, cn))))
        acc_O_mn = acc_mn_view(acc_O)
        n_my_rows = cute.size(acc_O_mn.shape[0])
        row_max, row_sum = make_softmax_state(n_my_rows)
        tok = cute.make_rmem_tensor(n_my_rows, Int32)  # token of each of this thread's rows
        for r in cutlass.range_constexpr(n_my_rows):
            tok[r] = (m0 + tScS_mn[r, 0][0]) // gqa
        # softcap applies the scale itself, leaving only the change of base for exp2
        sm_scale_log2 = Float32(LOG2_E) if cutlass.const_expr(self.has_softcap) else scale_log2

        # ---- prologue: the first stages - 1 key blocks (one commit group each, empty or not)
        for s in cutlass.range_constexpr(self.stages - 1):
            if s < n_iters:
                self.load_block(g2s, thr_g2s, tKsK, tVsV, tCc, Int32(s), (s_lo + s) * tile_n, *kv)
            cute.arch.cp_async_commit_group()

        for it in cutlass.range(n_iters, unroll=1):
            cute.arch.cp_async_wait_group(self.stages - 2)
            bar.arrive_and_wait()  # block it landed for every thread; every warp is done with block it-1
            nxt = it + self.stages - 1
            if nxt < n_iters:
                self.load_block(g2s, thr_g2s, tKsK, tVsV, tCc, nxt % self.stages, (s_lo + nxt) * tile_n, *kv)
            cute.arch.cp_async_commit_group()

            buf = warp_i + W * (it % self.stages)
            n0 = (s_lo + it) * tile_n
            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((tile_m, cn)), Float32)
            acc_S.fill(0.0)
            tSsK = thr_ld_k.partition_S(sK[None, None, buf])
            self.gemm_ss(tiled_mma, acc_S, ld_q, ld_k, tSsQ, tSrQ_v, tSsK, tSrK_v, tSrQ, tSrK)

            acc_S_mn = acc_mn_view(acc_S)
            if cutlass.const_expr(self.has_softcap):
                for i in cutlass.range_constexpr(cute.size(acc_S)):
                    acc_S[i] = softcap * cute.math.tanh(acc_S[i] * softcap_scale, fastmath=True)
            # the whole block is visible to every row unless it holds the tail or a window edge
            need_mask = n0 + tile_n > seqlen_k
            if cutlass.const_expr(self.has_right):
                need_mask = need_mask or (n0 + tile_n - 1 > t_first + off + win_right)
            if cutlass.const_expr(self.has_left):
                need_mask = need_mask or (n0 < t_last + off - win_left)
            if need_mask:
                self.mask_packed(acc_S_mn, tScS_mn, tok, n0 + warp_i * cn, seqlen_k, off, win_left, win_right)
            online_softmax_step(row_max, row_sum, sm_scale_log2, acc_S_mn, acc_O_mn)

            rP = cute.make_fragment_like(acc_S, self.dtype)
            rP.store(acc_S.load().to(self.dtype))
            tOrP = acc_as_A(rP)
            tOsVt = thr_ld_v.partition_S(sVt[None, None, buf])
            cute.copy(ld_v, tOsVt[None, None, 0], tOrVt_v[None, None, 0])
            for k in cutlass.range_constexpr(cute.size(tOrP.shape[2])):
                k_next = (k + 1) % cute.size(tOrP.shape[2])
                cute.copy(ld_v, tOsVt[None, None, k_next], tOrVt_v[None, None, k_next])
                cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)

        # ---- epilogue: merge the warps' (max, sum, O) in a fixed order, write the split's partials
        cute.arch.cp_async_wait_group(0)
        red = st.red.get_tensor(cute.make_layout((tile_m, W, 2), stride=(2 * W, 2, 1)))
        for r in cutlass.range_constexpr(n_my_rows):
            total = quad_sum(row_sum[r])
            if lane % 4 == 0:
                row = tScS_mn[r, 0][0]
                red[row, warp_i, 0] = row_max[r]
                red[row, warp_i, 1] = total
        bar.arrive_and_wait()  # (max, sum) of every warp visible; every warp done with the K ring
        for r in cutlass.range_constexpr(n_my_rows):
            m_all, l_all = self.merged_row(red, tScS_mn[r, 0][0], sm_scale_log2)
            m_off = m_all * sm_scale_log2
            if m_all == -Float32.inf:
                m_off = Float32(0.0)
            inv = Float32(0.0)
            if l_all > 0.0:
                inv = cute.math.exp2(row_max[r] * sm_scale_log2 - m_off, fastmath=True) / l_all
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
        # fp32 sum of the warps' scaled O, in warp order, in the (now idle) K ring
        sO = cute.make_tensor(cute.recast_ptr(st.sK.data_ptr(), dtype=Float32),
                              cute.make_layout((tile_m, D), stride=(D, 1)))
        tOsO = thr_mma.partition_C(sO)
        for w in cutlass.range_constexpr(W):
            if warp_i == w:
                for i in cutlass.range_constexpr(cute.size(acc_O)):
                    if cutlass.const_expr(w == 0):
                        tOsO[i] = acc_O[i]
                    else:
                        tOsO[i] = tOsO[i] + acc_O[i]
            bar.arrive_and_wait()
        # o_part (splits, B, Hq, Sq, D) and l_part (splits, B, Hq, Sq), fp32, contiguous
        for i in cutlass.range_constexpr(tile_m * D // nthr):
            e = tidx + nthr * i
            row = e // D
            r_glob = m0 + row
            if r_glob < n_rows:
                t = r_glob // gqa
                h = hk * gqa + r_glob % gqa
                mO[(((split * batch + b) * heads_q + h) * seqlen_q + t) * D + e % D] = sO[row, e % D]
        if tidx < tile_m:
            r_glob = m0 + tidx
            if r_glob < n_rows:
                m_all, l_all = self.merged_row(red, tidx, sm_scale_log2)
                lse = -Float32.inf
                if l_all > 0.0:
                    lse = (m_all * sm_scale_log2 + cute.math.log2(l_all, fastmath=True)) * LN_2
                t = r_glob // gqa
                h = hk * gqa + r_glob % gqa
                mL[((split * batch + b) * heads_q + h) * seqlen_q + t] = lse

    @cute.kernel
    def combine_kernel(self, pOut: cute.Pointer, pLse: cute.Pointer, pO: cute.Pointer, pL: cute.Pointer,
                       batch: Int32, seqlen_q: Int32, heads_q: Int32, num_splits: Int32):
        """Merge the splits of one output row: out = sum_s exp(lse_s - lse) out_s, lse = log sum_s exp(lse_s).

        One CTA per row ``(b * Hq + h) * Sq + t`` (also its index in a split's workspace slice and in
        the (B, Hq, Sq) LSE); splits summed in order (bitwise repeatable); a row no split saw gets
        out 0 and LSE -inf.
        """
        D = self.head_dim
        nthr = self.combine_threads
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        rows = batch * heads_q * seqlen_q
        flat = cute.make_layout(1 << 30)
        mOut = cute.make_tensor(pOut, flat)
        mLse = cute.make_tensor(pLse, flat)
        mO = cute.make_tensor(pO, flat)
        mL = cute.make_tensor(pL, flat)
        t = row % seqlen_q
        h = (row // seqlen_q) % heads_q
        b = row // (seqlen_q * heads_q)
        m = -Float32.inf
        # unrolled: the loads of 8 splits are in flight together (one at a time left a 45-split
        # b1 decode waiting ~45 memory latencies per column: 41 vs 29 us on the H100)
        for s in cutlass.range(num_splits, unroll=8):
            m = cute.arch.fmax(m, mL[s * rows + row])
        m_off = m
        if m == -Float32.inf:
            m_off = Float32(0.0)
        total = Float32(0.0)
        for s in cutlass.range(num_splits, unroll=8):
            total = total + cute.math.exp2((mL[s * rows + row] - m_off) * LOG2_E, fastmath=True)
        inv = Float32(0.0)
        if total > 0.0:
            inv = Float32(1.0) / total
        for j in cutlass.range_constexpr((D + nthr - 1) // nthr):
            c = tidx + nthr * j
            if c < D:
                acc = Float32(0.0)
                for s in cutlass.range(num_splits, unroll=8):
                    w = cute.math.exp2((mL[s * rows + row] - m_off) * LOG2_E, fastmath=True)
                    acc = acc + w * mO[(s * rows + row) * D + c]
                mOut[((b * seqlen_q + t) * heads_q + h) * D + c] = self.dtype(acc * inv)
        if tidx == 0:
            lse = -Float32.inf
            if total > 0.0:
                lse = m_off + cute.math.log2(total, fastmath=True) * LN_2
            mLse[row] = lse

    @cute.jit
    def merged_row(self, red: cute.Tensor, row: Int32, sm_scale_log2: Float32):
        """(max, sum) of one packed row over all warps; the sum is relative to the max."""
        m_all = red[row, 0, 0]
        for w in cutlass.range_constexpr(1, self.num_warps):
            m_all = cute.arch.fmax(m_all, red[row, w, 0])
        m_off = m_all * sm_scale_log2
        if m_all == -Float32.inf:
            m_off = Float32(0.0)
        l_all = Float32(0.0)
        for w in cutlass.range_constexpr(self.num_warps):
            l_all = l_all + red[row, w, 1] * cute.math.exp2(red[row, w, 0] * sm_scale_log2 - m_off, fastmath=True)
        return m_all, l_all

    @cute.jit
    def mask_packed(self, acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, tok: cute.Tensor, col0: Int32,
                    seqlen_k: Int32, off: Int32, win_left: Int32, win_right: Int32):
        """-inf outside the predicate; a packed row's diagonal is that of its token."""
        for r in cutlass.range_constexpr(cute.size(acc_S_mn.shape[0])):
            diag = tok[r] + off
            hi = seqlen_k  # exclusive
            lo = Int32(0)
            if cutlass.const_expr(self.has_right):
                hi = cutlass.min(hi, diag + win_right + 1)
            if cutlass.const_expr(self.has_left):
                lo = cutlass.max(lo, diag - win_left)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                j = tScS_mn[0, c][1] + col0
                acc_S_mn[r, c] = score_or_neg_inf((j < hi) & (j >= lo), acc_S_mn[r, c])

    @cute.jit
    def load_block(self, g2s: cute.TiledCopy, thr_g2s, tKsK: cute.Tensor, tVsV: cute.Tensor, tCc: cute.Tensor,
                   stage: Int32, n0: Int32, pK: cute.Pointer, pV: cute.Pointer, k_sb: Int64, k_ss: Int64,
                   k_sh: Int64, v_sb: Int64, v_ss: Int64, v_sh: Int64, b: Int32, hk: Int32, mPT: cute.Tensor,
                   pt_stride: Int32, page_size: Int32, seqlen_k: Int32):
        """cp.async key block [n0, n0 + tile_n) of K and V into ring stage ``stage``, chunk by chunk."""
        cn, D = self.chunk_n, self.head_dim
        for c in cutlass.range_constexpr(self.num_warps):
            n0c = n0 + c * cn
            buf = c + self.num_warps * stage
            if n0c < seqlen_k:
                # (batch | page, row) of the chunk's first key; the page table is read only for
                # live keys (entries past the live length may be anything)
                base = Int64(b)
                row = Int64(n0c)
                if cutlass.const_expr(self.paged):
                    base = Int64(mPT[b * pt_stride + n0c // page_size])
                    row = Int64(n0c % page_size)
                k_off = cute.assume(base * k_sb + row * k_ss + Int64(hk) * k_sh, divby=8)
                v_off = cute.assume(base * v_sb + row * v_ss + Int64(hk) * v_sh, divby=8)
                gK = cute.make_tensor(pK + k_off, cute.make_layout((cn, D), stride=(cute.assume(k_ss, divby=8), 1)))
                gV = cute.make_tensor(pV + v_off, cute.make_layout((cn, D), stride=(cute.assume(v_ss, divby=8), 1)))
                tKgK = thr_g2s.partition_S(gK)
                tVgV = thr_g2s.partition_S(gV)
                if n0c + cn <= seqlen_k:
                    cute.copy(g2s, tKgK, tKsK[None, None, None, buf])
                    cute.copy(g2s, tVgV, tVsV[None, None, None, buf])
                else:  # the tail chunk: rows past the live length are zero-filled
                    self.load_rows(g2s, tKgK, tKsK[None, None, None, buf], tCc, seqlen_k - n0c)
                    self.load_rows(g2s, tVgV, tVsV[None, None, None, buf], tCc, seqlen_k - n0c)
            else:
                tKsK[None, None, None, buf].fill(0)
                tVsV[None, None, None, buf].fill(0)
