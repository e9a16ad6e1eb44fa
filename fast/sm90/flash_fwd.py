"""Hopper (SM90) attention forward in the CuTe DSL: TMA + WGMMA, warp-specialized.

One CTA computes a (tile_m = 128, or 192 with 3 consumer warpgroups) x Dv block of O for one
(query block, query head, batch):

* warpgroup 0 is the producer: after giving registers back (setmaxnreg.dec), its warp 0 issues
  the TMA loads of Q (once) and of K and V (one tile_n x D block per stage) into a multi-stage
  shared-memory ring guarded by mbarriers (full: TMA transaction bytes, empty: one arrive per
  consumer warp);
* warpgroups 1 and 2 (and 3) are the consumers (setmaxnreg.inc); each owns 64 rows of the query block and
  runs, per key block, S = Q K^T (WGMMA, both operands in shared memory), the mask, the online
  softmax in registers (exp2, scale folded into the exponent) and O += P V (WGMMA with P taken
  from registers). A pair of named barriers orders the two warpgroups' Q K^T issue (ping-pong), so
  one warpgroup's softmax runs while the other's GEMMs use the tensor cores;
* the epilogue normalises O, writes LSE (natural log) from registers, stages O in shared memory
  (reusing Q's buffer) and stores it with one TMA store, which clips the tail rows.

Key blocks are visited from the last to the first, so the blocks that need masking (the
sequence tail and, for causal, the diagonal) come first, those crossing a left window edge come
last, and the rest run without mask arithmetic. Bottom-right causal blocks past the diagonal (and
blocks left of a window) are never loaded. A query tile whose rows see no key writes O = 0 and
LSE = -inf.

Variants (compile-time flags, see __init__): varlen (cu_seqlens; a sequence's last, partial tile
leaves shared memory by row-predicated stores instead of the TMA store), key ranges and block-sparse (a per-tile visit
plan computed identically by the producer warp and each consumer warp; a run-time mask decision
per key tile), head dims with Dv != D.

GQA: the kernel maps query head h to KV head h // (Hq // Hkv) when it builds the K/V views; with
pack_gqa = g (short query blocks, FastSm90Forward.pack_gqa) the g query heads of a KV head share
the M tile instead (tensors_from_pointers folds them into the rows; masks use q_pos).
Sequence lengths, batch and head counts are dynamic (one compile serves every shape).
"""
from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint32, const_expr
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from cutlass import Boolean

from dualattn.fast.common.codegen import per_use_i32, trace_registers
from dualattn.fast.common.softmax import merge_states_in_order, merge_twin_state, tree_reduce, write_state
from dualattn.fast.common.block_info import (block_needs_mask, csr_block_at, csr_row, masked_last_groups,
                                             masked_last_visit)
from dualattn.fast.common.tile_order import (STREAM_K_PIECES_PER_CTA, heads_per_section,
                                              heavy_first_in_sections, pair_of_unit, paired_slot,
                                              paired_tile, paired_units, rotated_m_block,
                                              split_tail_pair_slots, split_tail_slots,
                                              split_tail_tile, stream_k_piece,
                                              light_query_blocks, window_order_slots, window_order_tile,
                                              tile_share)
from dualattn.fast.common.mask import (
    apply_key_ranges,
    block_inside_ranges,
    frag_cols_below,
    key_range_span_warp,
    load_key_ranges,
    low_bits,
    mask_row_by_bits,
    score_or_neg_inf,
)
from dualattn.fast.common.sm90_pipeline import (
    check_pipeline_config,
    check_smem_budget,
)

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# Named barrier ids (0 is __syncthreads).
_BAR_EPILOGUE = 1     # the consumer threads, around the O staging in shared memory
_BAR_WG_SCHED = 2     # 2, 3 (, 4): round-robin order of the consumer warpgroups' GEMM issue
_BAR_EPILOGUE_WG = 5  # 5, 6 (, 7): one warpgroup's threads around its own O rows (wg_epilogue)
_BAR_O_SLOT = 8       # 8, 9: the shared O slot handed from one warpgroup to the other (shared_o_slot)
_BAR_SPLIT = 10       # 10, 11: key_split, warpgroup w + 1's record ready for warpgroup w
_BAR_SPLIT_FREE = 12  # key_split: warpgroup 0 has read the record (the last warpgroup may write anew)
# L2 cache policies of a TMA copy (createpolicy's fractional encoding at fraction 1.0; the values
# of CUTLASS's CacheHintSm90)
L2_EVICT_FIRST = 0x12F0000000000000
L2_EVICT_LAST = 0x14F0000000000000
# tile_info: the producer decodes each tile's coordinates once and hands them to the consumers
# through shared memory (the fields of item_coords the consumers read; m_block < 0 ends the loop)
TILE_INFO_FIELDS = ("m_block", "head", "head_kv", "batch", "n_block_min", "n_block_max",
                    "seqlen_q", "seqlen_k", "offset_q", "cut", "sk_slot")
TILE_INFO_STAGES = 2
TILE_INFO_STAGES_DECODER = 4  # with the decoder warp: it runs up to 4 tiles ahead of the consumers


def _select(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def _acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """WGMMA accumulator ((2, 2, N/8), MMA_M, MMA_N) -> ((2, MMA_M), (2, N/8, MMA_N)) = (rows, cols)."""
    cm = cute.make_layout(acc_layout.shape)
    shape = ((cm.shape[0][1], cm.shape[1]), (cm.shape[0][0], cm.shape[0][2], cm.shape[2]))
    stride = ((cm.stride[0][1], cm.stride[1]), (cm.stride[0][0], cm.stride[0][2], cm.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def _acc_as_frg_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    """View a 16-bit WGMMA accumulator ((2, 2, N/8), 1, 1) as an A operand ((2, 2, 2), 1, N/16).

    Register order coincides: accumulator value (c, r, j) of column 8j + 2t + c is A value
    (c, r, j % 2) of k-block j // 2, so the P -> A conversion is a pure relabelling.
    """
    n8 = acc_layout.shape[0][2]
    assert n8 % 2 == 0, "tile_n must be a multiple of 16"
    cm = cute.make_layout(acc_layout.shape)
    view = cute.make_layout(((2, 2, 2), 1, n8 // 2), stride=((1, 2, 4), 0, 8))
    return cute.composition(acc_layout, cute.composition(cm, view))


def o_store_threads(head_dim_v: int, dtype_width: int, tile_m: int = 128,
                    num_threads: int = 256):
    """(rows per step, threads per row) of the varlen O store (shared -> global, one 16-byte
    vector per thread and step).

    Threads per row is the largest power of two dividing the row's vector count, so that the
    thread block tiles the (tile_m, Dv) tile exactly: rows per step divides tile_m and
    threads per row x vector divides Dv. With one thread per vector of the row (Dv / 8 = 12 at
    Dv 96, 24 at Dv 192) 256 threads make 21 or 10 rows per step, which do not divide 128: the
    copy then ran over rows 128..147 (resp. 128..130), i.e. it wrote the first rows of the
    sequence's next query tile from shared memory past O's tile, racing with the CTA that owns
    them (the row predicate only checks the sequence's end)."""
    vec = 128 // dtype_width
    assert head_dim_v % vec == 0
    chunks = head_dim_v // vec
    tpr = min(chunks & -chunks, num_threads)  # largest power of two dividing the vector count
    rows = num_threads // tpr
    assert rows * tpr == num_threads and tile_m % rows == 0 and head_dim_v % (tpr * vec) == 0, \
        (head_dim_v, dtype_width, tile_m, rows, tpr)
    return rows, tpr


def _frg_a_shape(acc_shape):
    """Shape of the A-operand fragment that holds P for an accumulator of shape acc_shape."""
    return ((2, 2, 2), 1, acc_shape[0][2] // 2)


# trace_phases: the stamps' rows within each warpgroup's 64 LSE rows (ci/phase_trace.py reads them)
TRACE_SLOTS = dict(smid=0, start=1, gtime=2, n_blocks=3, q_ready=4, first_block=5, last_pv=6, end=7,
                   # the producer warp's, in the first warpgroup's rows: it reaches the tile, it
                   # has Q's buffer (the Q load issued), it has issued the tile's last K / V load
                   p_start=8, p_q_issued=9, p_kv_issued=10)


def _advanced(state):
    """``state`` advanced by one stage (as a value, so a dynamic loop carries it)."""
    state.advance()
    return state


class _ReleaseForAll:
    """A TMA pipeline whose consumer release arrives for every consumer warpgroup at once (count
    ``count`` per warp): a split tile's stage is read by one warpgroup only, and the others skip
    it without touching its barriers (key_split_blocks)."""

    def __init__(self, pipe, count: int):
        self.pipe, self.count = pipe, count

    def consumer_wait(self, state):
        self.pipe.consumer_wait(state)

    @cute.jit
    def consumer_release(self, state):
        if self.pipe.is_signaling_thread:
            cute.arch.mbarrier_arrive(self.pipe.sync_object_empty.get_barrier(state.index),
                                      self.pipe.consumer_mask, arrive_count=self.count)


class _Ctx:
    """The per-tile state the main-loop helpers share (a plain trace-time namespace)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _CsrBlockSteps:
    """The kernel's steps for FlashFwdSm90.csr_visits: one key block each, with or without
    the intra-warpgroup overlap (``masked`` / ``mask_entry``: see maybe_mask)."""

    def __init__(self, kern, ctx, tOrP):
        self.kern, self.ctx, self.tOrP = kern, ctx, tOrP
        self.split_first = kern.overlap

    def first(self, n_block, masked, mask_entry, kv_state):
        self.kern.first_half_block(self.ctx, n_block, kv_state, self.tOrP, masked, mask_entry)

    def step(self, masked, mask_entry, n_block, kv_state):
        if const_expr(self.kern.overlap):
            return self.kern.overlapped_block(self.ctx, masked, n_block, kv_state, self.tOrP, mask_entry)
        return self.kern.one_block(self.ctx, masked, n_block, kv_state, mask_entry)


class FlashFwdSm90:
    """Forward kernel for one static configuration (see fast/sm90/__init__ for the cache key)."""

    arch = "sm_90a"
    num_threads_per_wg = 128
    # register split per warpgroup kind: (producer, consumer) per thread, by consumer count; the
    # producer warpgroup needs few (TMA issue), the consumers hold S, P and O
    REGS = {2: (24, 240), 3: (32, 160)}

    @staticmethod
    def launch_registers(num_threads: int) -> int:
        """Registers per thread a CTA of ``num_threads`` starts with: the 64K register file split
        evenly, rounded down to the allocation step of 8."""
        return 65536 // num_threads // 8 * 8

    def key_split_values(self) -> int:
        """fp32 values per thread in key_split's shared record (0 without it): the row maxima
        and partial row sums of the thread's 2 rows, then its O accumulator (64 x Dv / 128)."""
        return 2 * 2 + 64 * self.head_dim_v // 128 if self.key_split else 0

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, tile_n: int,
                 num_stages: int, pingpong: bool = True, overlap: bool = True,
                 persistent: bool = True, separate_o: bool = False, window_left: bool = False,
                 window_right: bool = False, softcap: bool = False, varlen: bool = False,
                 num_key_ranges: int = 0, block_sparse: bool = False, write_lse: bool = True,
                 num_mma_wg: int = 2, pack_gqa: int = 1, q_stages: int = 1, paired: bool = False,
                 rescale_threshold: float = 0.0, rescale_before_pv: bool = False,
                 varlen_sections: bool = False, wg_epilogue: bool = False, stream_k: bool = False,
                 reduce_chains: int = 1, wg_key_bound: bool = False, split_tail: bool = False,
                 bit_mask: bool = False, tile_info: bool = False, q_regs: bool = False,
                 pass_empty_wg: bool = False, rotate_m_blocks: bool = False,
                 shared_o_slot: bool = False, staging_per_tile: bool = True,
                 narrow_first: bool = False, trace_phases: bool = False, tile_decoder: bool = False,
                 stmatrix_o: bool = False, warp_store_o: bool = False, l2_hints: bool = False,
                 window_order: bool = False, narrow_last: bool = False, key_split: bool = False,
                 merge_live_rows: bool = False, merge_batch: int = 1, end_aligned: bool = False,
                 lse_after_o: bool = False, csr_table: bool = False):
        self.dtype = dtype
        # diagnostics (ci/phase_trace.py): each consumer warpgroup writes stamps of its phases in
        # every tile (the SM clock, TRACE_SLOTS) into the first 11 of its rows of the LSE buffer,
        # instead of the LSE; dense batched configs (unpacked rows) with the intra-warpgroup overlap
        assert not trace_phases or (write_lse and overlap and not varlen and num_key_ranges == 0
                                    and not block_sparse and pack_gqa == 1)
        self.trace_phases = trace_phases
        # a warpgroup whose rows see no key of the upper half of the tile's first key block
        # (the diagonal of causal tiles: the first warpgroup's 64 rows see its first 64 keys)
        # computes that block's Q K^T and softmax on the lower half only (an N = tile_n / 2
        # wgmma), with P's upper half zero for the P V
        assert not narrow_first or (overlap and (tile_n // 2) % 8 == 0 and (causal or window_right)
                                    and num_key_ranges == 0 and not block_sparse)
        self.narrow_first = narrow_first
        # the mirror image at the left window edge: a warpgroup whose rows see none of the lower
        # half of the tile's last key block (a left bound: the second warpgroup's 64 rows of a
        # 128-row tile whose edge crosses that block) computes its upper half only. Configs
        # with it run the masked blocks after the first in one loop, each iteration a whole
        # masked or narrow step (blocks_after_first_narrow_last), so the narrow step costs no
        # extra copy of the step in the code
        assert not narrow_last or (overlap and (tile_n // 2) % 8 == 0 and window_left
                                   and num_key_ranges == 0 and not block_sparse and not wg_key_bound)
        self.narrow_last = narrow_last
        # tile_decoder: a warp of the producer warpgroup (warp 1) decodes the tiles' coordinates
        # (item_coords: 1200-2700 cycles a tile at hd128 1k on the H100, phase trace) and hands
        # them, up to info_stages tiles ahead, to the TMA warp and the consumers through shared
        # memory; the TMA warp then goes from a tile's last K / V straight to the next tile's Q
        assert not tile_decoder or tile_info
        self.tile_decoder = tile_decoder
        # O staged in shared memory by stmatrix (four 8 x 8 matrices per warp instruction)
        # rather than 32-bit stores (FastSm90Forward.stmatrix_o)
        assert not stmatrix_o or dtype.width == 16
        self.stmatrix_o = stmatrix_o
        # each consumer warp stages and TMA-stores its own 16 rows of O (the rows its
        # accumulator holds), so the epilogue syncs warps instead of its warpgroup's 128 threads
        # at two named barriers (FastSm90Forward.warp_store_o); batched per-warpgroup epilogues
        # with a slot per warpgroup
        assert not warp_store_o or (wg_epilogue and not shared_o_slot and not varlen
                                    and 16 % pack_gqa == 0)
        self.warp_store_o = warp_store_o
        # L2 eviction priorities on the TMA copies (FastSm90Forward.l2_hints): K / V, which every
        # query tile of the head reads again, evict-last; Q (read once per tile) and O (written
        # once) evict-first, so the streams that pass through L2 once do not push K / V out
        self.l2_hints = l2_hints
        self.info_stages = TILE_INFO_STAGES_DECODER if tile_decoder else TILE_INFO_STAGES
        self.info_fields = len(TILE_INFO_FIELDS) + (1 if tile_decoder else 0)  # + offset_k
        # each thread's shared-memory addresses for O's staging computed in the epilogue of
        # every tile (fast/common/codegen.per_use_i32) instead of once, before the tile loop
        self.staging_per_tile = staging_per_tile
        # Q K^T with Q from registers (RS wgmma; Q copied from shared memory by ldmatrix once
        # per tile) instead of from shared memory (SS): each Q K^T then reads only K from shared
        # memory
        self.q_regs = q_regs
        # the producer warp decodes every tile's coordinates (item_coords: a few integer
        # divisions by run-time values, ~300 SASS instructions per tile at causal hd64 with the
        # paired order) and passes them to the consumers through shared memory, off their path
        # from one tile's epilogue to the next tile's first Q K^T
        self.tile_info = tile_info
        # element masks from a bit set per row (mask_by_row_bits) instead of compares per element
        self.bit_mask = bit_mask
        # independent partial results per row in the softmax's max and sum (online_softmax)
        assert reduce_chains in (1, 2, 4, 8)
        self.reduce_chains = reduce_chains
        # intra-warpgroup overlap: O rescaled by the previous block's corrections while this
        # block's Q K^T runs, before its P V is issued, instead of after the P V wait
        assert not (rescale_before_pv and (rescale_threshold > 0.0 or not overlap))
        self.rescale_before_pv = rescale_before_pv
        # the online softmax keeps a row's running max until a new one exceeds it by more than
        # this (base-2 logit units; 0: always moves it): most key blocks then skip O's rescale
        self.rescale_threshold = float(rescale_threshold)
        # pack_gqa = g > 1: the g query heads of one KV head share the M tile, row r of the tile
        # being query (m_block * tile_m + r) // g of head r % g (see tensors_from_pointers); the
        # causal / window bounds then take each row's query position (q_pos)
        self.pack_gqa = pack_gqa
        # consumer warpgroups, 64 query rows each: 2 (tile_m 128) or 3 (tile_m 192: more rows
        # per K/V tile loaded, for small head dims where the loads and the per-tile overheads weigh
        # most). Ping-pong generalises to a round robin: warpgroup w issues its GEMMs after w - 1
        assert num_mma_wg in self.REGS
        self.num_mma_wg = num_mma_wg
        self.tile_m = 64 * num_mma_wg
        self.num_producer_regs, self.num_mma_regs = self.REGS[num_mma_wg]
        # a call that neither returns the LSE nor needs it for a backward skips its store (the
        # launch then passes no LSE buffer: one allocation less per call)
        self.write_lse = write_lse
        self.lse_after_o = lse_after_o
        # key ranges: R per-row key intervals (registers); block-sparse: the key tiles come from
        # the q->k CSR. Both decide per key block at run time whether it needs the element mask
        # (dense configs keep the static masked/unmasked split and compile none of this)
        self.num_key_ranges = num_key_ranges
        self.block_sparse = block_sparse
        self.dynamic_mask = num_key_ranges > 0 or block_sparse
        assert 0 <= num_key_ranges <= 4
        # varlen: packed (total, H, D) tensors, per-sequence bounds from cu_seqlens (see __call__)
        self.varlen = varlen
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        # element mask bounds, measured from the bottom-right diagonal (values are runtime args):
        # right: j <= i + Sk - Sq + win_right (causal is win_right = 0); left: j >= i + Sk - Sq - win_left
        self.mask_right = causal or window_right
        self.mask_left = window_left
        self.has_softcap = softcap
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.pingpong = pingpong
        self.overlap = overlap
        self.persistent = persistent
        # causal / right-bounded tiles on the persistent grid in pairs of equal work
        # (tile_order.paired_tile; FastSm90Forward.paired decides)
        assert not paired or (persistent and self.mask_right and not self.dynamic_mask)
        self.paired = paired
        # the paired order's last units as single tiles, heaviest first, each to the least loaded
        # CTA (tile_order.split_tail_tile / split_tail_table): the partly filled last round of
        # pairs too short for stream-K (FastSm90Forward.split_tail compiles it in; the launch
        # passes sk = (groups of heads, 0 for none; the table of tail tiles; its rounds))
        assert not split_tail or (paired and not (varlen or stream_k))
        self.split_tail = split_tail
        # block-sparse tiles on the persistent grid dealt by a launch table of (batch x head,
        # query block) units, longest-processing-time first within L2 sections of heads
        # (FastSm90Forward.csr_unit_table; the launch passes sk = (table, rounds), rounds 0 for
        # the kernel's own order): a CSR's query blocks differ in their key-block counts
        assert not csr_table or (block_sparse and persistent and not (paired or varlen or stream_k
                                                                       or pack_gqa > 1))
        self.csr_table = csr_table
        # varlen causal / right-bounded tiles heaviest first within L2 sections of (sequence,
        # head) pairs, as batched calls (FastSm90Forward.varlen_sections decides); off: heaviest
        # first across all sequences and heads at once
        assert not varlen_sections or (varlen and self.mask_right)
        self.varlen_sections = varlen_sections
        # sliding windows (left bound; causal or a right bound) on the persistent grid: the full
        # tiles in L2 sections, then the light ones (clipped at key 0), dealt in a snake
        # (tile_order.window_order_tile; FastSm90Forward.window_order decides)
        assert not window_order or (persistent and self.mask_right and self.mask_left and not paired
                                    and not (varlen or self.dynamic_mask) and pack_gqa == 1)
        self.window_order = window_order
        # O staged in its own buffer: Q's buffer is handed back before the epilogue, so the next
        # tile's Q load overlaps this tile's epilogue (where shared memory allows it)
        self.separate_o = separate_o
        # Q buffers: 2 lets a persistent CTA load the next tile's Q (and, no longer blocked on
        # it, the next tile's first K/V) while this tile runs; O must then have its own buffer
        assert q_stages in (1, 2) and (q_stages == 1 or (separate_o and persistent))
        self.q_stages = q_stages
        # each consumer warpgroup stages and stores its own 64 rows of O (its own named barrier,
        # its own TMA store) instead of all of them together: the first warpgroup to finish a
        # tile no longer waits at the epilogue for the one whose GEMMs trail it by half a key
        # block, and its epilogue and next tile's first Q K^T run beside the others' last P V.
        # Needs O's own buffer (an aliased one is Q's, which both warpgroups read until the end)
        assert not wg_epilogue or (separate_o and 64 % pack_gqa == 0)
        self.wg_epilogue = wg_epilogue
        # wg_epilogue where shared memory holds one warpgroup's 64 rows of O but not the tile's
        # (hd256: Q 64 KB + two stages of K / V 128 KB + 32 KB): the two warpgroups stage their
        # rows in that one slot in turn, each handing it on once its TMA store has read it
        # (named barriers _BAR_O_SLOT + w). What it buys is Q's buffer back before the epilogue,
        # so the next tile's Q loads under this tile's last blocks
        assert not shared_o_slot or (wg_epilogue and self.num_mma_wg == 2)
        self.shared_o_slot = shared_o_slot
        self.o_slots = 1 if shared_o_slot else self.num_mma_wg
        # stream-K tail (fast/common/tile_order.stream_k_tiles): the persistent grid's last two
        # rounds cut along the keys, a cut tile's two pieces merged by the one finishing second
        # (stream_k_merge). Needs units of (nearly) equal work: the tiles of calls without causal /
        # window bounds, or the paired order's pairs (paired_item_coords), or short causal tiles
        # whose causal limit hides fewer keys than a piece holds, cut whole into pieces (the
        # host's _causal_split_grid); not key ranges, CSR or varlen. The launch passes how many tiles
        # (units) are cut, 0 for none
        assert not stream_k or (persistent and not (varlen or self.dynamic_mask or self.mask_left))
        self.stream_k = stream_k
        # each consumer warpgroup stops at its own rows' last visible key block: with a right
        # bound the tile's top key blocks can be hidden from the first warpgroup's 64 rows (at
        # tile_n 64, the whole diagonal block of the second one's; with 3 warpgroups of 192
        # rows on 128-key tiles, three warpgroup blocks in two tiles), and it consumes their pipeline
        # stages without a GEMM. With ping-pong it still takes one turn of the ring of named
        # barriers per passed block (the ring counts one GEMM issue per warpgroup and block)
        assert not wg_key_bound or (self.mask_right and not self.dynamic_mask and overlap)
        self.wg_key_bound = wg_key_bound
        # a consumer warpgroup whose 64 rows all lie past the sequence's end (in a last query
        # tile: hd64's 192-row tiles at 1k queries leave two of three warpgroups so) passes the
        # tile's key blocks instead of computing rows nobody stores, taking its turns of the ring
        # as wg_key_bound does. Non-causal batched tiles are then not of equal work, so where
        # the last query block is lighter their order turns the query block by one every
        # lcm(grid, blocks) tiles (rotate_m_blocks; tile_order.rotated_m_block): with the plain
        # order a grid sharing a factor with the block count pins the last block to some CTAs
        assert not pass_empty_wg or (overlap and not self.dynamic_mask)
        self.pass_empty_wg = pass_empty_wg
        self.rotate_m_blocks = pass_empty_wg and rotate_m_blocks
        # a query tile whose rows all lie in the first warpgroup's 64 (a sequence's last tile
        # when its length leaves at most 64 rows there: hd64's 192-row tiles at 1k and 4k
        # queries) is computed by every consumer warpgroup on those same rows, warpgroup w on
        # visits w, w + W, ... of the key blocks (the producer loads the rows into every
        # warpgroup's slice of Q), the partial states merged in shared memory (key_split_merge)
        # and stored by the first. Otherwise two of three warpgroups pass the tile's blocks
        # while the first computes alone: such a tile cost 0.57-0.72 of a full one, split 0.48-0.51
        # (H200, hd64, 1024 / 4096 keys, queries 960 / 1024 / 1152: docs section 46)
        assert not key_split or (pass_empty_wg and wg_epilogue and not (causal or window_left or window_right)
                                 and not varlen and pack_gqa == 1 and not q_regs and overlap)
        self.key_split = key_split
        # query tiles aligned to the sequence's end, not its start: with a right bound the tile
        # that holds the rows left over (Sq % tile_m) is then the first, which sees the fewest
        # keys, not the last, which sees them all while its empty warpgroups wait. The tiles
        # cover rows [-shift, Sq) of a sequence, shift = (-Sq) % tile_m in whole 64-row slices:
        # the kernel reasons in those shifted rows (Sq + shift, q_rows; the causal offset
        # Sk - Sq is kept), and only Q's load, O's store and the LSE map them back (q_tile_gmem,
        # real_rows; TMA fills Q's rows before the start with zeros). Batched only (packed
        # varlen rows before a sequence's start are another sequence's). A TMA store with a
        # negative coordinate is an illegal instruction, so O must leave by 64-row slices or
        # 16-row bands (wg_epilogue; warp_store_o implies it), those before row 0 skipped, never
        # by store_O_tma's whole tile. key_split's band loads and the phase trace's LSE stamps
        # use unshifted rows: excluded
        assert not end_aligned or (self.mask_right and wg_epilogue
                                   and not (window_left or varlen or self.dynamic_mask
                                            or pack_gqa > 1 or key_split or trace_phases))
        self.end_aligned = end_aligned
        # stream-K merges: a warp whose 16 rows of the tile all lie past the sequence's end (a
        # last query tile; packed GQA decode: 4 live rows of 128) neither writes its state to
        # the workspace nor reads the others' (those rows are never stored), so a merge moves the
        # tile's live rows, not all 128
        self.merge_live_rows = merge_live_rows and stream_k
        # the last piece of a tile cut into more than two reads the others' states this many at a
        # time (merge_states_in_order's unrolled loops: a memory round trip a batch, not a state)
        self.merge_batch = merge_batch if stream_k else 1
        # where the turned order can apply: the non-causal batched order of the persistent grid
        self.turned_order = self.rotate_m_blocks and persistent and not (self.mask_right or varlen)
        self.num_threads = self.num_threads_per_wg * (1 + self.num_mma_wg)
        # trace-time checks of the static configuration (raise before any code is generated)
        assert head_dim % 16 == 0 and head_dim_v % 16 == 0 and tile_n % 16 == 0
        self.smem_bytes = check_smem_budget(
            {
                "Q": q_stages * self.tile_m * head_dim * dtype.width // 8,
                "O": (64 * self.o_slots if wg_epilogue else self.tile_m) * head_dim_v * dtype.width // 8
                if separate_o else 0,
                "K": num_stages * tile_n * head_dim * dtype.width // 8,
                "V": num_stages * tile_n * head_dim_v * dtype.width // 8,
                "key_split": self.key_split_values() * 128 * 4,
            },
            num_mbarriers=2 * (q_stages + 2 * num_stages) + (2 * self.info_stages if tile_info else 0),
            arch=self.arch,
        )
        # setmaxnreg only moves registers within the CTA's launch allocation (the 64K file split
        # evenly over its threads, in steps of 8): an increase that the producer's decrease does
        # not pay for waits forever (a 4-warpgroup build at 96 -> 24 / 120 hung on an H100)
        launch_regs = self.launch_registers(self.num_threads)
        assert (self.num_mma_regs - launch_regs) * self.num_mma_wg <= launch_regs - self.num_producer_regs, \
            (self.num_mma_regs, self.num_producer_regs, launch_regs)
        assert pack_gqa == 1 or (self.tile_m % pack_gqa == 0 and not varlen and not self.dynamic_mask)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32, win_left: Int32,
                 win_right: Int32, softcap_scale: Float32, softcap_val: Float32, num_sms: Int32,
                 stream, vl=None, kr=None, bs=None, sk=None):
        """mQ/mO (B, Sq, Hq, D[v]), mK/mV (B, Sk, Hkv, D[v]), mLSE (B, Hq, Sq) fp32.

        varlen: vl = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, num_batch); mQ/mO are
        (1, total_q, Hq, D[v]), mK/mV (1, total_k, Hkv, D[v]), mLSE (1, Hq, total_q).
        key ranges: kr = (flat int32 key_ranges, batch stride, head stride);
        block-sparse: bs = (full rowptr, full col, mask rowptr, mask col (flat int32), ratio_m,
        ratio_n, then batch / head strides of full rowptr, full col, mask rowptr, mask col);
        a stride of 0 broadcasts. stream-K: sk = (fp32 workspace, int32 counters (zero, and left
        zero), number of cut tiles), see stream_k_merge."""
        if const_expr(mQ.element_type != self.dtype or mK.element_type != self.dtype
                      or mV.element_type != self.dtype or mO.element_type != self.dtype):
            raise TypeError("q, k, v, o must all have the kernel's dtype")
        # (S, D, H, B) views: the sequence is the TMA row mode, the head dim is contiguous
        mQ, mK, mV, mO = [_select(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE = _select(mLSE, [2, 1, 0])  # (Sq, Hq, B)

        D, Dv, BM, BN = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(BM // 64, 1, 1), tiler_mn=(64, BN),
            a_source=warpgroup.OperandSource.RMEM if const_expr(self.q_regs) else warpgroup.OperandSource.SMEM)
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(BM // 64, 1, 1), tiler_mn=(64, Dv),
            a_source=warpgroup.OperandSource.RMEM)

        # key_split: Q in 64-row bands, each one TMA box (a warpgroup's rows, or another's copy)
        sQ_layout = self._smem_layout((BM, D), self.q_stages if const_expr(self.q_stages > 1) else None,
                                      band_rows=64 if const_expr(self.key_split) else 0)
        sK_layout = self._smem_layout((BN, D), self.num_stages)
        sV_layout = self._smem_layout((BN, Dv), self.num_stages)
        # wg_epilogue: O as (64, Dv, slot), each warpgroup's rows one TMA box of their own (in
        # its own slot, or with shared_o_slot in the one slot in turn)
        # warp_store_o: each warp's 16 rows one contiguous band (a 16-row TMA box)
        sO_layout = (self._smem_layout((64, Dv), self.o_slots, band_rows=16 if self.warp_store_o else 0)
                     if const_expr(self.wg_epilogue) else self._smem_layout((BM, Dv), None))

        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        sQ_one = cute.select(sQ_layout, mode=[0, 1]) if const_expr(self.q_stages > 1) else sQ_layout
        if const_expr(self.key_split):
            tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
                tma_load, mQ, self._smem_layout((64, D), None), (64, D))
        else:
            tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_load, mQ, sQ_one, (BM, D))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_load, mK, cute.select(sK_layout, mode=[0, 1]), (BN, D), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_load, mV, cute.select(sV_layout, mode=[0, 1]), (BN, Dv), 1)
        if const_expr(self.warp_store_o):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO,
                self._smem_layout((16, Dv), None), (16, Dv))
        elif const_expr(self.wg_epilogue):
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), (64, Dv))
        else:
            tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (BM, Dv))

        self.tx_bytes_q = cute.size_in_bytes(self.dtype, sQ_one)
        self.tx_bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.tx_bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))
        check_pipeline_config(
            "Q", self.tx_bytes_q, (BM, D), self.dtype.width, self.q_stages, producer_arrivals=1,
            consumer_arrivals=self.num_mma_wg * 4)
        check_pipeline_config(
            "K", self.tx_bytes_k, (BN, D), self.dtype.width, self.num_stages,
            producer_arrivals=1, consumer_arrivals=self.num_mma_wg * 4)
        check_pipeline_config(
            "V", self.tx_bytes_v, (BN, Dv), self.dtype.width, self.num_stages,
            producer_arrivals=1, consumer_arrivals=self.num_mma_wg * 4)

        cosize_qo = cute.cosize(sQ_layout)
        cosize_o = cute.cosize(sO_layout) if const_expr(self.separate_o) else 0
        if const_expr(not self.separate_o):
            cosize_qo = max(cute.cosize(sQ_layout), cute.cosize(sO_layout))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            sk_flag: cute.struct.MemRange[Int32, 4 if self.stream_k else 0]  # stream_k_merge
            s_split: cute.struct.Align[cute.struct.MemRange[Float32, self.key_split_values() * 128], 16]
            mbar_info: cute.struct.MemRange[cutlass.Int64, 2 * self.info_stages if self.tile_info else 0]
            tile_info: cute.struct.MemRange[Int32, self.info_stages * self.info_fields
                                            if self.tile_info else 0]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_qo], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cosize_o], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage
        check_smem_budget({"total": SharedStorage.size_in_bytes()}, 0, self.arch)

        if const_expr(self.varlen):
            num_m_blocks = cute.ceil_div(vl[2], BM)
            grid = (num_m_blocks, cute.size(mQ.shape[2]), vl[3])
        else:
            num_m_blocks = cute.ceil_div(cute.size(mQ.shape[0]), BM)
            grid = (num_m_blocks, cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        if const_expr(self.persistent):
            # one CTA per SM (shared memory allows one), each walking tiles with a stride
            units = self.num_tiles(mQ, vl)
            if const_expr(self.paired and not self.varlen):  # (varlen: its units are counted in the kernel)
                units = paired_units(num_m_blocks, cute.size(mQ.shape[2]) * cute.size(mQ.shape[3]))
            grid_x = cutlass.min(units, num_sms)
            if const_expr(self.stream_k):
                # every unit cut (tile_order.split_pieces): the launch passes num_sms = CTAs of
                # the grid, pieces x units (stream_k_grid)
                if (sk[2] == units) & (2 * units <= num_sms):
                    grid_x = num_sms
            grid = (grid_x, 1, 1)
        # varlen stores a sequence's last, partial tile with row-predicated stores (a TMA store
        # writes whole tiles, past the sequence's end into the next one): it also gets the plain
        # gmem O, as vl[4] (the paired order's unit table, its rounds and the unit count it was
        # planned for follow: vl[5], vl[6], vl[7])
        if const_expr(self.varlen):
            vl = (*vl[:4], mO, *vl[4:])
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V, tma_atom_O, tma_O, mLSE,
            softmax_scale_log2, win_left, win_right, softcap_scale, softcap_val,
            sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma_qk, tiled_mma_pv,
            *((vl,) if const_expr(self.varlen) else ()),
            **({"kr": kr} if const_expr(self.num_key_ranges > 0) else {}),
            **({"bs": bs} if const_expr(self.block_sparse) else {}),
            **({"sk": sk} if const_expr(self.stream_k or self.split_tail or self.csr_table) else {}),
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                 smem=SharedStorage.size_in_bytes())

    def tensors_from_pointers(self, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, batch, seqlen_q,
                              seqlen_k, heads_q, heads_kv, q_stride_b, q_stride_s, q_stride_h,
                              k_stride_b, k_stride_s, k_stride_h, v_stride_b, v_stride_s,
                              v_stride_h):
        """(mQ, mK, mV, mO, mLSE) as ``__call__`` takes them, from raw pointers, shapes and q/k/v
        strides (called while tracing). O (B, Sq, Hq, Dv) and LSE (B, Hq, Sq) are contiguous.

        With pack_gqa = g > 1 the g query heads of each KV head fold into the rows: Q and O become
        (B, (g, Sq), Hkv, D) (row r = (r % g, r // g): head kv * g + r % g, query r // g) and LSE
        (B, Hkv, (g, Sq)). To the kernel this is MQA with g * Sq rows per KV head: one tile carries
        g heads' queries against one K/V tile stream, and the TMA boxes of Q and O gain one
        dimension (the g heads of a query are adjacent in memory)."""
        D, Dv, g = self.head_dim, self.head_dim_v, self.pack_gqa
        o_stride_s = cutlass.Int64(heads_q) * Dv
        lse_stride_h = cutlass.Int64(seqlen_q)
        # (row mode, its Q, O, LSE strides) and (heads, their Q, O, LSE strides)
        rows, q_rs, o_rs, lse_rs = seqlen_q, q_stride_s, o_stride_s, 1
        heads, q_hs, o_hs, lse_hs = heads_q, q_stride_h, Dv, lse_stride_h
        if const_expr(g > 1):
            rows, q_rs, o_rs, lse_rs = (g, seqlen_q), (q_stride_h, q_stride_s), (Dv, o_stride_s), (lse_stride_h, 1)
            heads, q_hs, o_hs, lse_hs = heads_kv, q_stride_h * g, Dv * g, lse_stride_h * g
        mQ = cute.make_tensor(q_ptr, cute.make_layout(
            (batch, rows, heads, D), stride=(q_stride_b, q_rs, q_hs, 1)))
        mK = cute.make_tensor(k_ptr, cute.make_layout(
            (batch, seqlen_k, heads_kv, D), stride=(k_stride_b, k_stride_s, k_stride_h, 1)))
        mV = cute.make_tensor(v_ptr, cute.make_layout(
            (batch, seqlen_k, heads_kv, Dv), stride=(v_stride_b, v_stride_s, v_stride_h, 1)))
        mO = cute.make_tensor(o_ptr, cute.make_layout(
            (batch, rows, heads, Dv), stride=(o_stride_s * seqlen_q, o_rs, o_hs, 1)))
        mLSE = cute.make_tensor(lse_ptr, cute.make_layout(
            (batch, heads, rows), stride=(lse_stride_h * heads_q, lse_hs, lse_rs)))
        return mQ, mK, mV, mO, mLSE

    @cute.jit
    def from_packed(self, args, stream):
        """Host entry for the cached-call fast path: ``args`` is a
        ``fast.common.launch_args.PackedArgs`` (fields: FastSm90Forward.arg_schema) holding
        pointers, shapes, strides and the scalars; no DLPack conversion per call."""
        vals = args.values
        mQ, mK, mV, mO, mLSE = self.tensors_from_pointers(*vals[:19])
        if const_expr(self.split_tail):  # the tail's groups of heads, table and rounds follow num_sms
            sk = (vals[25], cute.make_tensor(vals[26], cute.make_layout(1 << 30)), vals[27])
            self.__call__(mQ, mK, mV, mO, mLSE, *vals[19:25], stream, None, sk=sk)
        elif const_expr(self.csr_table):  # the unit table and its rounds follow num_sms
            kr, bs, _ = self.feature_args(vals[27:])
            sk = (cute.make_tensor(vals[25], cute.make_layout(1 << 30)), vals[26])
            self.__call__(mQ, mK, mV, mO, mLSE, *vals[19:25], stream, None, kr, bs, sk)
        else:
            self.__call__(mQ, mK, mV, mO, mLSE, *vals[19:25], stream, None,
                          *self.feature_args(vals[25:]))

    def feature_args(self, vals):
        """(kr, bs, sk) of ``__call__`` from the packed fields after the scalars (see
        FastSm90Forward.arg_schema): key-range pointer + 2 strides, then the 4 CSR pointers,
        ratio_m, ratio_n and 8 strides, then the stream-K workspace and counter pointers and the
        number of cut tiles."""
        flat = cute.make_layout(1 << 30)
        kr = bs = sk = None
        i = 0
        if const_expr(self.num_key_ranges > 0):
            kr = (cute.make_tensor(vals[0], flat), vals[1], vals[2])
            i = 3
        if const_expr(self.block_sparse):
            bs = (*[cute.make_tensor(p, flat) for p in vals[i:i + 4]], *vals[i + 4:i + 14])
            i += 14
        if const_expr(self.stream_k):
            # paired: + the length every unit is given (paired_item_coords)
            sk = (cute.make_tensor(vals[i], flat), cute.make_tensor(vals[i + 1], flat),
                  *vals[i + 2:i + (4 if self.paired else 3)])
        return kr, bs, sk

    @cute.jit
    def from_packed_varlen(self, args, stream):
        """Varlen host entry. ``args`` fields: q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k
        pointers; total_q, total_k, heads_q, heads_kv, batch, max_seqlen_q; q/k/v token and head
        strides; then the scalars of ``__call__``. Packed q (total_q, Hq, D), k/v (total_k, Hkv,
        D[v]); O (total_q, Hq, Dv) and LSE (Hq, total_q) contiguous."""
        (q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cuq_ptr, cuk_ptr, total_q, total_k, heads_q,
         heads_kv, batch, max_seqlen_q, q_ss, q_sh, k_ss, k_sh, v_ss, v_sh) = args.values[:19]
        D, Dv = self.head_dim, self.head_dim_v
        # a leading batch mode of size 1 keeps __call__'s 4-D (B, S, H, D) convention
        mQ = cute.make_tensor(q_ptr, cute.make_layout(
            (1, total_q, heads_q, D), stride=(q_ss * total_q, q_ss, q_sh, 1)))
        mK = cute.make_tensor(k_ptr, cute.make_layout(
            (1, total_k, heads_kv, D), stride=(k_ss * total_k, k_ss, k_sh, 1)))
        mV = cute.make_tensor(v_ptr, cute.make_layout(
            (1, total_k, heads_kv, Dv), stride=(v_ss * total_k, v_ss, v_sh, 1)))
        # the row stride is a multiple of Dv (16 bytes at least): stated so that the varlen
        # epilogue's 16-byte stores at any row offset type-check
        o_ss = cute.assume(cutlass.Int64(heads_q) * Dv, divby=Dv)
        mO = cute.make_tensor(o_ptr, cute.make_layout(
            (1, total_q, heads_q, Dv), stride=(o_ss * total_q, o_ss, Dv, 1)))
        lse_sh = cutlass.Int64(total_q)
        mLSE = cute.make_tensor(lse_ptr, cute.make_layout(
            (1, heads_q, total_q), stride=(lse_sh * heads_q, lse_sh, 1)))
        mCuQ = cute.make_tensor(cuq_ptr, cute.make_layout(batch + 1))
        mCuK = cute.make_tensor(cuk_ptr, cute.make_layout(batch + 1))
        vl = (mCuQ, mCuK, max_seqlen_q, batch)
        feat = args.values[25:]
        if const_expr(self.paired):
            # the launch's unit table, its rounds (0: the static stride; varlen_paired_tile) and
            # the unit count it was planned for (checked in the kernel: count_units)
            vl = (*vl, cute.make_tensor(feat[0], cute.make_layout(1 << 30)), feat[1], feat[2])
            feat = feat[3:]
        self.__call__(mQ, mK, mV, mO, mLSE, *args.values[19:25], stream, vl, *self.feature_args(feat))

    def _smem_layout(self, shape, stages, band_rows: int = 0):
        """Swizzle atoms tiled down the rows, then across the columns; with band_rows, first
        within bands of that many rows and then band after band, so each band is one contiguous
        piece of shared memory (what a TMA box of band_rows rows reads)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, shape[1]), self.dtype)
        if band_rows:
            atom = cute.tile_to_shape(atom, (band_rows, shape[1]), order=(0, 1))
        if stages is None:
            return cute.tile_to_shape(atom, shape, order=(0, 1))
        return cute.tile_to_shape(atom, (*shape, stages), order=(0, 1, 2))

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tma_atom_Q: cute.CopyAtom, mQ: cute.Tensor, tma_atom_K: cute.CopyAtom,
               mK: cute.Tensor, tma_atom_V: cute.CopyAtom, mV: cute.Tensor,
               tma_atom_O: cute.CopyAtom, mO: cute.Tensor, mLSE: cute.Tensor,
               softmax_scale_log2: Float32, win_left: Int32, win_right: Int32,
               softcap_scale: Float32, softcap_val: Float32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, tiled_mma_qk: cute.TiledMma,
               tiled_mma_pv: cute.TiledMma, vl=None, kr=None, bs=None, sk=None):
        BM, BN, D, Dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(self.paired and self.varlen):
            vl = self.count_units(mQ, vl)

        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # PipelineTmaAsync releases with one elected thread per warp: count consumer warps
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, producer_group=producer_group,
            consumer_group=consumer_group, tx_count=self.tx_bytes_q, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=self.tx_bytes_k, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages,
            producer_group=producer_group, consumer_group=consumer_group,
            tx_count=self.tx_bytes_v, defer_sync=True)
        pipe_info = None
        s_info = None
        if const_expr(self.tile_info):
            # written by the producer warp (its 32 lanes arrive), read by every consumer thread;
            # with the decoder warp written by it and read by the consumers and the TMA warp
            readers = 128 * self.num_mma_wg + (32 if const_expr(self.tile_decoder) else 0)
            pipe_info = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_info.data_ptr(), num_stages=self.info_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, readers),
                defer_sync=True)
            s_info = storage.tile_info.get_tensor(
                cute.make_layout((self.info_fields, self.info_stages)))
        # barrier init must be visible to every thread (and to the async proxy) before use
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        if const_expr(self.separate_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sk_flag = storage.sk_flag.get_tensor(cute.make_layout(4)) if const_expr(self.stream_k) else None
        s_split = None
        if const_expr(self.key_split):
            s_split = storage.s_split.get_tensor(cute.make_layout(self.key_split_values() * 128))
        # V^T view (Dv, BN, stages) for the B operand of O += P V
        sVt = cute.composition(
            sV, cute.make_ordered_layout((Dv, BN, self.num_stages), order=(1, 0, 2)))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.num_producer_regs)
            if warp_idx == 0:
                self.produce(tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                             pipe_q, pipe_k, pipe_v, win_left, win_right, vl, kr, bs, sk,
                             pipe_info, s_info, mLSE)
            if const_expr(self.tile_decoder):
                if warp_idx == 1:
                    self.walk_tiles(mQ, mK, win_left, win_right, vl, sk, pipe_info, s_info,
                                    pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                                 self.info_stages))
        else:
            cute.arch.setmaxregister_increase(self.num_mma_regs)
            self.consume(tma_atom_O, mO, mLSE, mQ, mK, sQ, sK, sVt, sO, pipe_q, pipe_k, pipe_v,
                         tiled_mma_qk, tiled_mma_pv, softmax_scale_log2, tidx - 128, win_left,
                         win_right, softcap_scale, softcap_val, vl, kr, bs, sk, sk_flag,
                         pipe_info, s_info, s_split)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def num_tiles(self, mQ, vl=None):
        if const_expr(self.varlen):
            return cute.ceil_div(vl[2], self.tile_m) * cute.size(mQ.shape[2]) * vl[3]
        return cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m) * cute.size(mQ.shape[2]) * cute.size(mQ.shape[3])

    @cute.jit
    def num_slots(self, mQ, vl=None, sk=None):
        """Bound of the tile loop: the tiles, or with the paired order its slots (two per unit,
        whole rounds of the grid; tile_order.paired_tile), or with cut tiles (stream-K) the
        uncut ones and then STREAM_K_PIECES_PER_CTA slots per CTA (item_coords)."""
        n = self.num_tiles(mQ, vl)
        if const_expr(self.stream_k and not self.paired):
            if sk[2] > 0:
                n = n - sk[2] + STREAM_K_PIECES_PER_CTA * cute.arch.grid_dim()[0]
        if const_expr(self.paired and self.varlen):
            gx = cute.arch.grid_dim()[0]
            # the launch's unit table: its rounds; else the static stride over the units
            # (count_units counted them at the kernel's start)
            n = 2 * gx * vl[6]
            if vl[6] == 0:
                n = 2 * gx * cute.ceil_div(vl[7], gx)
        elif const_expr(self.paired and self.split_tail):
            n = split_tail_slots(cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m),
                                 cute.size(mQ.shape[2]) * cute.size(mQ.shape[3]),
                                 cute.arch.grid_dim()[0], sk[0], sk[2], cutlass.min)
        elif const_expr(self.window_order):
            n = window_order_slots(n, cute.arch.grid_dim()[0])
        elif const_expr(self.csr_table):
            if sk[1] > 0:  # the launch's unit table: its rounds of the grid
                n = cute.arch.grid_dim()[0] * sk[1]
        elif const_expr(self.paired):
            gx = cute.arch.grid_dim()[0]
            units = paired_units(cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m),
                                 cute.size(mQ.shape[2]) * cute.size(mQ.shape[3]))
            n = 2 * gx * cute.ceil_div(units, gx)
            if const_expr(self.stream_k):
                if sk[2] > 0:  # the uncut units' slots, then two per piece of a CTA's share
                    n = 2 * (units - sk[2]) + 2 * STREAM_K_PIECES_PER_CTA * gx
        return n

    @cute.jit
    def item_coords(self, tile, mQ, mK, win_left, win_right, vl=None, sk=None, window=None):
        """tile_coords of loop slot ``tile``, then (cut, cut-tile number). Without
        stream-K a slot is a tile (never cut). With it, the slots past the uncut tiles (a multiple
        of the grid: they end one round before the last) are this CTA's pieces of the cut tiles
        (tile_order.stream_k_piece): its key-block range [start, end) narrows the tile's; a piece
        past the CTA's share is inactive."""
        if const_expr(not self.stream_k):
            return (*self.tile_coords(tile, mQ, mK, win_left, win_right, vl, split=sk, window=window),
                    Boolean(False), Int32(0))
        if const_expr(self.paired):
            return self.paired_item_coords(tile, mQ, mK, win_left, win_right, sk)
        sk_tiles = sk[2]
        gx = cute.arch.grid_dim()[0]
        dp_end = self.num_tiles(mQ, vl) - sk_tiles
        n_blocks = cute.ceil_div(mK.shape[0], self.tile_n)
        lin = tile
        start = Int32(0)
        end = n_blocks
        valid = Boolean(True)
        slot = Int32(0)
        if sk_tiles > 0 and tile >= dp_end:
            piece = (tile - dp_end) // gx
            slot, start, end, valid = stream_k_piece(cute.arch.block_idx()[0], piece, gx, sk_tiles,
                                                     n_blocks, cutlass.max, cutlass.min)
            lin = dp_end + slot
        (m_block, head, head_kv, batch, n_block_min, n_block_max, seqlen_q, seqlen_k, offset_q,
         offset_k, active) = self.tile_coords(lin, mQ, mK, win_left, win_right, vl, window=window)
        cut = (start > 0) | (end < n_blocks)
        if const_expr(self.mask_right):
            if sk_tiles > 0 and gx > sk_tiles and valid:
                # every tile cut into P = gx / sk_tiles pieces (tile_order.split_pieces; a tail
                # cut has sk_tiles >= gx): piece p of a causal tile is its share of the key
                # blocks the tile itself visits, so none is empty (the launch gives every tile
                # P blocks at least, FastSm90Forward.stream_k_plan) and the tiles' unequal
                # lengths are shared out evenly within each tile
                pieces = gx // sk_tiles
                p = cute.arch.block_idx()[0] - slot * pieces
                visible = n_block_max - n_block_min
                start = n_block_min + p * visible // pieces
                end = n_block_min + (p + 1) * visible // pieces
                cut = Boolean(True)
        n_block_min = cutlass.max(n_block_min, start)
        n_block_max = cutlass.min(n_block_max, end)
        return (m_block, head, head_kv, batch, n_block_min, n_block_max, seqlen_q, seqlen_k,
                offset_q, offset_k, active & valid, cut, slot)

    @cute.jit
    def paired_item_coords(self, tile, mQ, mK, win_left, win_right, sk):
        """item_coords of the paired order with a stream-K tail (tile_order.tile_share): the
        slots past the uncut units' (2 * (units - cut units), whole rounds) are this CTA's
        pieces of the cut units, two slots per piece (the unit's heavier tile, then its lighter
        one); sk[3] is the length every unit is given (FastSm90Forward.stream_k_plan). The
        merge record of a cut tile is its unit's number among the cut units (at most one of a
        unit's tiles is cut)."""
        sk_units, unit_blocks = sk[2], sk[3]
        gx = cute.arch.grid_dim()[0]
        num_m_blocks = cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m)
        hb = cute.size(mQ.shape[2]) * cute.size(mQ.shape[3])
        units = paired_units(num_m_blocks, hb)
        dp_end = 2 * (units - sk_units)
        in_tail = (sk_units > 0) & (tile >= dp_end)
        m_block, rest, active = paired_tile(tile, gx, num_m_blocks, hb)
        first = Int32(0)
        unit_start = Int32(0)
        unit_end = Int32(1 << 30)
        slot = Int32(0)
        if in_tail:
            piece = (tile - dp_end) // gx
            second = piece % 2
            slot, unit_start, unit_end, valid = stream_k_piece(
                cute.arch.block_idx()[0], piece // 2, gx, sk_units, unit_blocks, cutlass.max, cutlass.min)
            unit = units - sk_units + slot
            m_block, rest, active = pair_of_unit(unit, second, num_m_blocks, hb)
            active = active & valid
            # the lighter tile's key blocks follow the heavier one's in the unit
            m_heavy = pair_of_unit(unit, 0, num_m_blocks, hb)[0]
            lo_h, hi_h = self.key_block_bounds(m_heavy, self.q_rows(mQ), mK.shape[0],
                                               win_left, win_right)
            first = second * cutlass.max(hi_h - lo_h, 0)
        (m_block, head, head_kv, batch, n_block_min, n_block_max, seqlen_q, seqlen_k, offset_q,
         offset_k, active) = self.tile_coords(tile, mQ, mK, win_left, win_right, None,
                                              placed=(m_block, rest, active))
        blocks = cutlass.max(n_block_max - n_block_min, 0)
        start, end = tile_share(unit_start, unit_end, first, blocks, cutlass.max, cutlass.min)
        cut = in_tail & ((start > 0) | (end < blocks))
        if in_tail:
            active = active & (start < end)
            n_block_max = n_block_min + end
            n_block_min = n_block_min + start
        return (m_block, head, head_kv, batch, n_block_min, n_block_max, seqlen_q, seqlen_k,
                offset_q, offset_k, active, cut, slot)

    @cute.jit
    def key_block_bounds(self, m_block, seqlen_q, seqlen_k, win_left, win_right):
        """[n_block_min, n_block_max) of the key blocks query block ``m_block`` visits (before
        key ranges / a CSR narrow them; ``seqlen_q`` in rows)."""
        BN = self.tile_n
        n_block_max = cute.ceil_div(seqlen_k, BN)
        # (query positions: the rows themselves unless pack_gqa, see q_pos)
        if const_expr(self.mask_right):
            # keys visible to the tile's last row i: j < i + 1 + Sk - Sq + win_right
            n_block_max = cutlass.min(
                n_block_max,
                cute.ceil_div(cutlass.max(self.q_end(m_block) + seqlen_k - self.q_count(seqlen_q) + win_right, 0),
                              BN))
        n_block_min = Int32(0)
        if const_expr(self.mask_left):
            # first key visible to the tile's first row: i + Sk - Sq - win_left
            n_block_min = cutlass.max(self.q_pos(m_block * self.tile_m) + seqlen_k - self.q_count(seqlen_q) - win_left,
                                      0) // BN
        return n_block_min, n_block_max

    @cute.jit
    def wg_key_block_end(self, m_block, wg, seqlen_q, seqlen_k, win_right):
        """One past the last key block that a row of warpgroup ``wg``'s 64 rows of query block
        ``m_block`` sees through the right bound (``seqlen_q`` in rows; rows past it only make
        the bound larger, never hide a visible block)."""
        wg_end = self.q_pos(m_block * self.tile_m + 64 * wg + 63) + 1
        return cute.ceil_div(cutlass.max(wg_end + seqlen_k - self.q_count(seqlen_q) + win_right, 0),
                             self.tile_n)

    @cute.jit
    def pass_block(self, ctx, kv_state, turn):
        """Consume a key block's K and V stages without using them (a block hidden from this
        warpgroup's rows), taking a turn of the ping-pong ring between them where ``turn``. The
        waits are needed: a release before the stage's fill could be counted into the previous
        use of that stage while another warpgroup still reads it."""
        ctx.pipe_k.consumer_wait(kv_state)
        ctx.pipe_k.consumer_release(kv_state)
        if const_expr(self.pingpong):
            if turn:
                self.sched_sync(ctx)
                self.sched_arrive(ctx)
        ctx.pipe_v.consumer_wait(kv_state)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def tile_coords(self, tile, mQ, mK, win_left, win_right, vl=None, placed=None, split=None,
                    window=None):
        """(m_block, head, head_kv, batch, n_block_min, n_block_max, seqlen_q, seqlen_k, offset_q,
        offset_k, active) of a linear tile index; the offsets are the sequence's first row in the
        packed tensors (varlen; 0 otherwise). ``active``: the tile has rows to compute, which
        producer and consumers both test (no Q load, no epilogue otherwise): false for varlen
        tiles past their sequence's end (the grid covers max_seqlen_q) and the paired order's
        empty slots.

        Non-causal: m_block varies fastest, so CTAs running together share a head's K/V in L2.
        Causal: the heaviest query blocks come first (longest-processing-time first), which the
        launch order then balances; not across all heads at once but within sections of heads
        whose K/V fit in L2 (fast/common/tile_order; varlen too, with ``varlen_sections``: a
        section is then consecutive heads of one sequence, then the next). Causal on the persistent grid (``paired``): pairs of query blocks of equal
        total work, one pair per CTA at a time (tile_order.paired_tile). ``placed``: the
        (m_block, batch * heads + head, active) of the tile when the caller has placed it
        (paired_item_coords) instead of a linear index. ``split``: (tail groups, tail table, tail
        rounds) of the paired order with its tail split (split_tail), or (unit table, rounds) of a
        block-sparse call's units (csr_table; rounds 0: the kernel's own order).
        """
        BM, BN = self.tile_m, self.tile_n
        seqlen_q = self.q_rows(mQ)  # g * Sq rows with pack_gqa
        seqlen_k = mK.shape[0]
        num_batch = cute.size(mQ.shape[3])
        if const_expr(self.varlen):
            num_m_blocks = cute.ceil_div(vl[2], BM)
            num_batch = vl[3]
        else:
            num_m_blocks = cute.ceil_div(seqlen_q, BM)
        num_heads = cute.size(mQ.shape[2])
        m_block = tile % num_m_blocks
        rest = tile // num_m_blocks
        if const_expr(self.turned_order):
            # the decoder computes the window once per CTA and passes it
            assert window is not None, "the turned order needs its window (rotation_window)"
            # only where the last query block leaves a warpgroup empty (lighter): elsewhere the
            # turned order measured 1.5-2 % slower (hd128 1k, H200)
            if seqlen_q <= num_m_blocks * BM - 64:
                m_block = rotated_m_block(tile, num_m_blocks, window)
        active = Boolean(True)
        if const_expr(self.mask_right):
            hb = num_heads * num_batch
            if const_expr(placed is not None):
                m_block, rest, active = placed
            elif const_expr(self.paired and self.varlen):
                # pairs within each sequence, numbered across sequences (a warp scan of cu_seqlens
                # per tile; FastSm90Forward.paired keeps it to calls of few, long sequences)
                m_block, rest, active = self.varlen_paired_tile(tile, vl, num_heads)
            elif const_expr(self.paired and self.split_tail):
                gx = cute.arch.grid_dim()[0]
                pair_slots = split_tail_pair_slots(num_m_blocks, hb, gx, split[0], cutlass.min)
                tail_j = Int32(-1)
                if tile >= pair_slots:  # a tail slot: the launch's table says which tile
                    tail_j = split[1][tile - pair_slots]
                m_block, rest, active = split_tail_tile(tile, gx, num_m_blocks, hb, split[0], tail_j,
                                                        cutlass.max, cutlass.min)
            elif const_expr(self.paired):
                m_block, rest, active = paired_tile(tile, cute.arch.grid_dim()[0], num_m_blocks, hb)
            elif const_expr(self.window_order):
                light = light_query_blocks(win_left, seqlen_q, seqlen_k, BM, num_m_blocks,
                                           cutlass.min, cutlass.max)
                m_block, rest, active = window_order_tile(
                    tile, cute.arch.grid_dim()[0], num_m_blocks, hb, light,
                    self.l2_section_heads(hb, num_heads, seqlen_k, mK, vl),
                    self.l2_section_heads(hb, num_heads, (light + 1) * BN, mK, vl), cutlass.min, cutlass.max)
            elif const_expr(self.varlen and not self.varlen_sections):
                m_block = num_m_blocks - 1 - tile // hb
                rest = tile % hb
            else:
                m_block, rest = self.heavy_first_in_l2_sections(tile, num_m_blocks, hb, num_heads,
                                                                seqlen_k, mK, vl)
        if const_expr(self.csr_table):
            # (after the order's own decode, which it replaces where the launch planned a table)
            # the launch's table names slot ``tile``'s unit, bh * num_m_blocks + m_block; -1:
            # past this CTA's last unit (tile_order.lpt_unit_table)
            if split[1] > 0:
                unit = split[0][tile]
                active = unit >= 0
                unit = cutlass.max(unit, 0)
                m_block = unit % num_m_blocks
                rest = unit // num_m_blocks
        head = rest % num_heads
        batch = rest // num_heads
        offset_q = Int32(0)
        offset_k = Int32(0)
        if const_expr(self.varlen):
            offset_q = vl[0][batch]
            offset_k = vl[1][batch]
            seqlen_q = vl[0][batch + 1] - offset_q
            seqlen_k = vl[1][batch + 1] - offset_k
        head_kv = head // (num_heads // cute.size(mK.shape[2]))
        n_block_min, n_block_max = self.key_block_bounds(m_block, seqlen_q, seqlen_k, win_left, win_right)
        if const_expr(self.varlen):
            # the grid covers max_seqlen_q: a tile past this sequence's end loads Q (harmless),
            # visits no key block and stores nothing (row predicates)
            # (and the paired order's empty slots)
            active = active & (m_block * BM < seqlen_q)
            if not active:
                n_block_max = n_block_min
        return (m_block, head, head_kv, batch, n_block_min, n_block_max, seqlen_q, seqlen_k,
                offset_q, offset_k, active)

    @cute.jit
    def rotation_window(self, num_m_blocks):
        """lcm(grid, num_m_blocks) by Euclid's algorithm (tile_order.rotation_window is the
        host's), once per CTA by each decoder of tiles: the producer, and the consumers where
        they decode (tile_info off)."""
        gx = cute.arch.grid_dim()[0]
        a = Int32(gx)
        b = Int32(num_m_blocks)
        while b > 0:
            r = a % b
            a = b
            b = r
        return gx // a * num_m_blocks

    @cute.jit
    def heavy_first_in_l2_sections(self, tile, num_m_blocks, hb, num_heads, seqlen_k, mK, vl):
        """(m_block, batch * heads + head) of a causal tile: heaviest first within sections of
        heads whose K/V fit in L2 (fast/common/tile_order); query heads of one KV head (GQA) share
        its K/V, so a section holds that many more. Varlen: mK holds every sequence's keys; the
        longest query sequence stands in for a sequence's key count (exact for self-attention;
        only the order depends on it)."""
        return heavy_first_in_sections(tile, num_m_blocks, hb,
                                       self.l2_section_heads(hb, num_heads, seqlen_k, mK, vl), cutlass.min)

    @cute.jit
    def l2_section_heads(self, hb, num_heads, seqlen_k, mK, vl):
        """(batch, head) pairs of a heaviest-first L2 section (heavy_first_in_l2_sections)."""
        kv_rows = vl[2] if const_expr(self.varlen) else seqlen_k
        section = heads_per_section(kv_rows, (self.head_dim + self.head_dim_v) * self.dtype.width // 8,
                                    cutlass.max) * (num_heads // cute.size(mK.shape[2]))
        return cutlass.min(section, hb)

    @cute.jit
    def varlen_unit_doc(self, unit, vl, num_heads):
        """(sequence, its first unit, its query blocks, units counted) of unit ``unit`` of the
        varlen paired order (fast/common/tile_order.varlen_paired_tile is the CPU model): each
        sequence holds paired_units(n, heads) units for its n query blocks. Warp-cooperative (every
        lane of the calling warp, converged): 32 sequences per step, each lane one sequence, an
        inclusive scan by shuffles, then a ballot finds the sequence whose units hold ``unit``.
        Past the last unit: sequence = batch, and "units counted" is the total."""
        mCuQ, num_batch = vl[0], vl[3]
        BM = self.tile_m
        lane = cute.arch.lane_idx()
        base = Int32(0)
        b0 = Int32(0)
        stop = num_batch
        seq = num_batch
        first = Int32(0)
        blocks = Int32(0)
        while b0 < stop:
            idx = b0 + lane
            n = Int32(0)
            if idx < num_batch:
                n = (mCuQ[idx + 1] - mCuQ[idx] + (BM - 1)) // BM
            u = paired_units(n, num_heads)
            incl = u
            for s in cutlass.range_constexpr(5):
                t = cute.arch.shuffle_sync_up(incl, 1 << s)
                if lane >= (1 << s):
                    incl = incl + t
            before = cute.arch.popc(cute.arch.vote_ballot_sync(incl <= unit - base))
            if before < 32:  # lane `before` is the first whose units reach past `unit`
                seq = b0 + before
                first = base + cute.arch.shuffle_sync(incl - u, before)
                blocks = cute.arch.shuffle_sync(n, before)
                stop = Int32(0)
            base = base + cute.arch.shuffle_sync(incl, 31)
            b0 = b0 + 32
        return seq, first, blocks, base

    @cute.jit
    def count_units(self, mQ, vl):
        """``vl`` with vl[7] the units cu_seqlens holds now (the static stride's slot bound,
        num_slots) and the unit table's rounds (vl[6]) set to 0, the static stride, unless the
        table was planned for that many units. The table is a permutation of the units it was
        planned for, so with the same count every unit still runs once whatever the lengths
        are; with another count (cu_seqlens written since the plan: a CUDA graph replayed after
        an in-place update, a write that bypassed torch's version counter) units would be lost
        or visited twice. Once per thread at the kernel's start, every warp converged (the scan
        is warp-cooperative)."""
        units = self.varlen_unit_doc(Int32(1 << 30), vl, cute.size(mQ.shape[2]))[3]
        rounds = vl[6]
        if units != vl[7]:
            rounds = Int32(0)
        return (*vl[:6], rounds, units)

    @cute.jit
    def varlen_paired_tile(self, tile, vl, num_heads):
        """(m_block, sequence * heads + head, valid) of slot ``tile`` of the varlen paired order:
        units numbered across sequences without gaps (so the static stride stays balanced up to
        one unit, as in the batched paired order), each pairing query blocks p and n - 1 - p of
        one head of its sequence (equal work within a sequence). With the launch's unit table
        (vl[5], vl[6] rounds; FastSm90Forward.varlen_unit_table) CTA c's k-th unit is the table's
        entry k * grid + c instead of unit k * grid + c, -1 for none (tile_order
        .varlen_paired_tile_from_table is the CPU model)."""
        unit, second = paired_slot(tile, cute.arch.grid_dim()[0])
        if vl[6] > 0:
            unit = vl[5][unit]
            if unit < 0:
                unit = Int32(1 << 30)  # past every sequence's units: an empty slot
        seq, first, blocks, _ = self.varlen_unit_doc(unit, vl, num_heads)
        m_block, head, valid = pair_of_unit(unit - first, second, cutlass.max(blocks, 1), num_heads)
        m_out = Int32(0)
        rest = Int32(0)
        found = seq < vl[3]
        if found:
            m_out = m_block
            rest = seq * num_heads + head
        return m_out, rest, valid & found

    @cute.jit
    def masked_block_counts(self, m_block, n_block_min, n_block_max, seqlen_q, seqlen_k, win_left,
                            win_right):
        """(right, left): how many of a dense tile's key blocks [n_block_min, n_block_max) need
        the element mask, at the top and at the bottom. The top ones: the key tail's block (one
        running past seqlen_k; with seqlen_k a multiple of the key tile every block of a
        non-causal tile runs unmasked: at 1k, hd128, the masked first block was one of a tile's
        8) and, with a right bound, every block from the one holding the tile's first row's
        last visible key + 1. The bottom ones (a left bound): the blocks that cross the window's
        lower edge."""
        BN = self.tile_n
        n_blocks = cutlass.max(n_block_max - n_block_min, 0)
        n_masked = Int32(0)
        if n_block_max * BN > seqlen_k:
            n_masked = Int32(1)
        if const_expr(self.mask_right):
            # blocks left of the one holding key (first row's last visible key + 1) are full
            first_row_limit = self.q_pos(m_block * self.tile_m) + seqlen_k - self.q_count(seqlen_q) + win_right + 1
            n_block_unmasked_end = cutlass.max(first_row_limit, 0) // BN
            n_masked = cutlass.max(n_block_max - n_block_unmasked_end, n_masked)
        n_masked = cutlass.min(n_masked, n_blocks)
        n_masked_left = Int32(0)
        if const_expr(self.mask_left):
            # block n is clear of the lower edge for every row iff n * BN >= the first
            # visible key of the tile's last row
            last_row_lo = self.q_pos(m_block * self.tile_m + self.tile_m - 1) + seqlen_k - self.q_count(seqlen_q) - win_left
            n_left_clear = cute.ceil_div(cutlass.max(last_row_lo, 0), BN)
            n_masked_left = cutlass.max(cutlass.min(n_left_clear, n_block_max) - n_block_min, 0)
            n_masked_left = cutlass.min(n_masked_left, n_blocks - n_masked)
        return n_masked, n_masked_left

    @cute.jit
    def first_tile_and_step(self):
        bx, by, bz = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        tile = bx
        step = gx
        if const_expr(not self.persistent):
            tile = bx + gx * (by + gy * bz)
            step = gx * gy * cute.arch.grid_dim()[2]
        return tile, step

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def produce(self, tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV,
                pipe_q, pipe_k, pipe_v, win_left, win_right, vl=None, kr=None, bs=None, sk=None,
                pipe_info=None, s_info=None, mLSE=None):
        loads = (tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v,
                 kr, bs, mLSE, win_left, win_right)
        # (the tile-info ring: this warp writes it, or with the decoder warp reads it)
        info_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer if const_expr(self.tile_decoder) else pipeline.PipelineUserType.Producer,
            self.info_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        if const_expr(self.tile_decoder):
            # the decoder warp's tiles, in order, until its m_block < 0
            (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, seqlen_k,
             offset_q, _, _, offset_k, info_state) = self.get_tile_info(pipe_info, s_info, info_state,
                                                                        self.info_fields)
            while m_block >= 0:
                q_state, kv_state = self.load_tile(
                    loads, (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q,
                            offset_q, offset_k, seqlen_k), q_state, kv_state)
                (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, seqlen_k,
                 offset_q, _, _, offset_k, info_state) = self.get_tile_info(pipe_info, s_info, info_state,
                                                                            self.info_fields)
        else:
            self.walk_tiles(mQ, mK, win_left, win_right, vl, sk, pipe_info, s_info, info_state,
                            (loads, q_state, kv_state))

    @cute.jit
    def load_tile(self, loads, coords, q_state, kv_state):
        """The TMA warp's loads of one tile: its Q, then its key blocks' K and V in visiting order
        (the diagonal / tail first; key ranges and CSRs by their plan)."""
        (tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, pipe_q, pipe_k, pipe_v, kr, bs,
         mLSE, win_left, win_right) = loads
        (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, offset_q, offset_k,
         seqlen_k) = coords
        BN, D, Dv = self.tile_n, self.head_dim, self.head_dim_v
        gQ = self.q_tile_gmem(mQ, m_block, head_idx, batch_idx, offset_q, seqlen_q)
        if const_expr(self.varlen):
            # packed tensors: the sequence starts at row offset_*; loads that run past its
            # end read the next sequence's rows (keys masked, rows never stored) or zeros
            gK = cute.local_tile(cute.domain_offset((offset_k, 0), mK[None, None, head_kv, 0]),
                                 (BN, D), (None, 0))
            gV = cute.local_tile(cute.domain_offset((offset_k, 0), mV[None, None, head_kv, 0]),
                                 (BN, Dv), (None, 0))
        else:
            gK = cute.local_tile(mK[None, None, head_kv, batch_idx], (BN, D), (None, 0))
            gV = cute.local_tile(mV[None, None, head_kv, batch_idx], (BN, Dv), (None, 0))
        tQsQ, tQgQ = None, None
        if const_expr(not self.key_split):
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1),
                                               cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1),
                                           cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        trace_at = (mLSE, cute.arch.thread_idx()[0], m_block, head_idx, batch_idx, 0, seqlen_q)
        self.trace_phase(trace_at, TRACE_SLOTS["p_start"])
        # Q's buffer is free once the previous tile's O store has read it (see consume)
        pipe_q.producer_acquire(q_state)
        self.trace_phase(trace_at, TRACE_SLOTS["p_q_issued"])
        if const_expr(self.key_split):
            self.load_q_bands(tma_atom_Q, mQ, sQ, pipe_q, q_state, m_block, head_idx, batch_idx, seqlen_q)
        else:
            if const_expr(self.q_stages > 1):
                tQsQ = tQsQ[None, q_state.index]
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state),
                      **self.l2_policy(L2_EVICT_FIRST))
        q_state.advance()
        n_iters = cutlass.max(n_block_max - n_block_min, 0)
        visit = (n_block_max,)
        if const_expr(self.dynamic_mask):
            # the same plan the consumers compute (this warp alone: every lane agrees)
            n_iters, visit, _ = self.visit_plan(m_block, head_idx, batch_idx, n_block_min,
                                                n_block_max, seqlen_q, offset_q, kr, bs)
        if const_expr(self.narrow_last):
            # the consumers' order (blocks_after_first_narrow_last)
            n_masked, n_masked_left = self.masked_block_counts(
                m_block, n_block_min, n_block_max, seqlen_q, seqlen_k, win_left, win_right)
        if const_expr(self.key_split):
            if seqlen_q - m_block * self.tile_m <= 64:
                # a split tile: each warpgroup holds one stage of the ring at a time, so K runs
                # a whole ring ahead of V (a block's V is read a step after its K)
                S = self.num_stages
                k_state = kv_state.clone()
                for i in cutlass.range(cutlass.min(S, n_iters), unroll=1):
                    pipe_k.producer_acquire(k_state)
                    cute.copy(tma_atom_K, tKgK[None, n_block_max - 1 - i], tKsK[None, k_state.index],
                              tma_bar_ptr=pipe_k.producer_get_barrier(k_state), **self.l2_policy(L2_EVICT_LAST))
                    k_state.advance()
                for i in cutlass.range(n_iters, unroll=1):
                    pipe_v.producer_acquire(kv_state)
                    cute.copy(tma_atom_V, tVgV[None, n_block_max - 1 - i], tVsV[None, kv_state.index],
                              tma_bar_ptr=pipe_v.producer_get_barrier(kv_state), **self.l2_policy(L2_EVICT_LAST))
                    kv_state.advance()
                    if i + S < n_iters:
                        pipe_k.producer_acquire(k_state)
                        cute.copy(tma_atom_K, tKgK[None, n_block_max - 1 - i - S], tKsK[None, k_state.index],
                                  tma_bar_ptr=pipe_k.producer_get_barrier(k_state), **self.l2_policy(L2_EVICT_LAST))
                        k_state.advance()
                n_iters = Int32(0)
        for i in cutlass.range(n_iters, unroll=1):
            n_block = n_block_max - 1 - i
            if const_expr(self.narrow_last):
                n_block = n_block_max - 1 - masked_last_visit(i, n_iters, n_masked, n_masked_left,
                                                              cutlass.max, cutlass.select_)
            if const_expr(self.dynamic_mask):
                n_block = self.block_at(i, visit)[0]
            pipe_k.producer_acquire(kv_state)
            cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, kv_state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(kv_state), **self.l2_policy(L2_EVICT_LAST))
            pipe_v.producer_acquire(kv_state)
            cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, kv_state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(kv_state), **self.l2_policy(L2_EVICT_LAST))
            kv_state.advance()
        self.trace_phase(trace_at, TRACE_SLOTS["p_kv_issued"])
        return q_state, kv_state

    @cute.jit
    def load_q_bands(self, tma_atom_Q, mQ, sQ, pipe_q, q_state, m_block, head_idx, batch_idx, seqlen_q):
        """key_split: a tile's Q as one 64-row TMA box per warpgroup band, each band its own
        rows, or in a tile whose rows all lie in the first band (key_split_tile) the first
        band's rows in every band (one transaction count either way: the tile's bytes)."""
        W, D = self.num_mma_wg, self.head_dim
        sQ_stage = sQ[None, None, q_state.index] if const_expr(self.q_stages > 1) else sQ
        first_only = seqlen_q - m_block * self.tile_m <= 64
        for w in cutlass.range_constexpr(W):
            band = m_block * W + cutlass.select_(first_only, 0, w)
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, 0, cute.make_layout(1),
                cute.group_modes(cute.local_tile(sQ_stage, (64, D), (w, 0)), 0, 2),
                cute.group_modes(cute.local_tile(mQ[None, None, head_idx, batch_idx], (64, D), (band, 0)), 0, 2))
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state),
                      **self.l2_policy(L2_EVICT_FIRST))

    @cute.jit
    def tile_walk(self, mQ, vl, sk):
        """(first slot, stride, slot bound, the turned order's window or None) of this CTA's walk
        over the tile order (item_coords decodes each slot); the window once per CTA rather than
        once per tile."""
        tile, step = self.first_tile_and_step()
        total = self.num_slots(mQ, vl, sk)
        window = None
        if const_expr(self.turned_order):
            window = self.rotation_window(cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m))
        return tile, step, total, window

    @cute.jit
    def walk_tiles(self, mQ, mK, win_left, win_right, vl, sk, pipe_info, s_info, info_state,
                   loading=None):
        """This CTA's walk over the tile order: every active tile's coordinates (item_coords) into
        the tile-info ring (with tile_info; m_block < 0 ends the readers' loops), and with
        ``loading`` = (loads, q_state, kv_state) the tile's loads. The decoder warp (tile_decoder)
        walks without loading, for the TMA warp and the consumers; otherwise the TMA warp walks
        and loads. (A TMA prefetch of each tile's Q into L2 in the decoder warp, up to four tiles
        ahead, measured 1-9 % slower: docs section 34.)"""
        tile, step, total, window = self.tile_walk(mQ, vl, sk)
        q_state, kv_state = None, None
        if const_expr(loading is not None):
            loads, q_state, kv_state = loading
        while tile < total:
            (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, seqlen_k,
             offset_q, offset_k, active, cut, sk_slot) = self.item_coords(tile, mQ, mK, win_left,
                                                                          win_right, vl, sk, window)
            if active:
                if const_expr(self.tile_info):
                    fields = (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q,
                              seqlen_k, offset_q, Int32(cut), sk_slot, offset_k)
                    self.put_tile_info(pipe_info, s_info, info_state, fields[:self.info_fields])
                    info_state.advance()
                if const_expr(loading is not None):
                    q_state, kv_state = self.load_tile(
                        loads, (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q,
                                offset_q, offset_k, seqlen_k), q_state, kv_state)
            tile += step
        if const_expr(self.tile_info):
            # the end of the readers' loops
            self.put_tile_info(pipe_info, s_info, info_state,
                               (Int32(-1),) + (Int32(0),) * (self.info_fields - 1))

    @cute.jit
    def q_tile_gmem(self, mQ, m_block, head_idx, batch_idx, offset_q, seqlen_q):
        """The (tile_m, D) tile of Q that query block ``m_block`` loads (varlen: of the packed
        tensor, from the sequence's first row; end_aligned: ``seqlen_q`` in the tiles' rows)."""
        if const_expr(self.varlen):
            return cute.local_tile(cute.domain_offset((offset_q, 0), mQ[None, None, head_idx, 0]),
                                   (self.tile_m, self.head_dim), (m_block, 0))
        return cute.local_tile(self.real_rows(mQ[None, None, head_idx, batch_idx], seqlen_q),
                               (self.tile_m, self.head_dim), (m_block, 0))

    @cute.jit
    def q_rows(self, mQ):
        """The rows a (head, batch) slice's query tiles cover: Q's rows, or with end_aligned
        shift more, the first tile starting that many rows before row 0: the rows the last tile
        leaves over, (-Sq) % tile_m, in whole 64-row slices (FastSm90Forward.row_shift)."""
        rows = cute.size(mQ.shape[0])
        if const_expr(self.end_aligned):
            rows = rows + (cute.ceil_div(rows, self.tile_m) * self.tile_m - rows) // 64 * 64
        return rows

    @cute.jit
    def row_shift(self, seqlen_q, m):
        """end_aligned: how many of the tiles' rows lie before row 0 (``seqlen_q`` from q_rows,
        ``m`` a tensor of the call's real rows in mode 0); 0 otherwise."""
        shift = Int32(0)
        if const_expr(self.end_aligned):
            shift = seqlen_q - cute.size(m.shape[0])
        return shift

    @cute.jit
    def real_rows(self, m, seqlen_q):
        """A (rows, D) slice of Q or O (or a TMA coordinate view of one) indexed by the tiles'
        rows: with end_aligned, row r of the tiles is row r - shift of the tensor."""
        if const_expr(self.end_aligned):
            m = cute.domain_offset((-self.row_shift(seqlen_q, m), 0), m)
        return m

    @cute.jit
    def put_tile_info(self, pipe_info, s_info, info_state, fields):
        """The producer warp publishes one tile's coordinates: lane 0 writes them, then every
        lane arrives (release) on the stage's full barrier."""
        pipe_info.producer_acquire(info_state)
        if cute.arch.lane_idx() == 0:
            for f in cutlass.range_constexpr(len(fields)):
                s_info[f, info_state.index] = fields[f]
        pipe_info.producer_commit(info_state)

    @cute.jit
    def get_tile_info(self, pipe_info, s_info, info_state, n_fields: cutlass.Constexpr = len(TILE_INFO_FIELDS)):
        """A consumer thread (or the TMA warp's, with the decoder: n_fields with offset_k) reads
        one tile's coordinates (acquire), then frees the stage."""
        pipe_info.consumer_wait(info_state)
        fields = [s_info[f, info_state.index] for f in range(n_fields)]
        pipe_info.consumer_release(info_state)
        info_state.advance()
        return (*fields, info_state)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consume(self, tma_atom_O, mO, mLSE, mQ, mK, sQ, sK, sVt, sO, pipe_q, pipe_k, pipe_v,
                tiled_mma_qk, tiled_mma_pv, softmax_scale_log2, tidx, win_left, win_right,
                softcap_scale, softcap_val, vl=None, kr=None, bs=None, sk=None, sk_flag=None,
                pipe_info=None, s_info=None, s_split=None):
        BM, BN, D, Dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_slice_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_slice_pv = tiled_mma_pv.get_slice(wg * 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)

        if const_expr(self.q_regs):
            # this thread's share of Q in registers, filled from shared memory once per tile
            sQ0 = sQ[None, None, 0] if const_expr(self.q_stages > 1) else sQ
            tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ0))       # (MMA, 1, D/16)
            ld_q = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype),
                tiled_mma_qk).get_slice(tidx)
            tQsQ, tQrQ = ld_q.partition_S(sQ), ld_q.retile(tSrQ)
        else:
            tSrQ = wg_slice_qk.make_fragment_A(wg_slice_qk.partition_A(sQ))    # (MMA, 1, D/16[, st])
        tSrK = wg_slice_qk.make_fragment_B(wg_slice_qk.partition_B(sK))        # (MMA, 1, D/16, st)
        tOrVt = wg_slice_pv.make_fragment_B(wg_slice_pv.partition_B(sVt))      # (MMA, 1, BN/16, st)
        tiled_mma_qk_narrow, tSrK_narrow, narrow_acc_layout = None, None, None
        tSrK_upper = None
        if const_expr(self.narrow_first or self.narrow_last):
            # the first BN / 2 keys of every K stage, as an N = BN / 2 wgmma's B operand
            tiled_mma_qk_narrow = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
                Float32, atom_layout_mnk=(BM // 64, 1, 1), tiler_mn=(64, BN // 2),
                a_source=warpgroup.OperandSource.RMEM if const_expr(self.q_regs) else warpgroup.OperandSource.SMEM)
            sK_lower = cute.composition(
                sK, cute.make_layout((BN // 2, D, self.num_stages), stride=(1, BN, BN * D)))
            wg_slice_narrow = tiled_mma_qk_narrow.get_slice(wg * 128)
            tSrK_narrow = wg_slice_narrow.make_fragment_B(wg_slice_narrow.partition_B(sK_lower))
            if const_expr(self.narrow_last):
                # and the last BN / 2 (narrow_last): the stage's second half along the keys
                sK_upper = cute.flat_divide(sK, (BN // 2,))[None, 1, None, None]
                tSrK_upper = wg_slice_narrow.make_fragment_B(wg_slice_narrow.partition_B(sK_upper))
            # its accumulator is the first half of the full one's registers (column blocks of 8
            # in order: wgmma's register layout), so the softmax runs on a prefix view
            narrow_acc_layout = cute.make_layout(
                tiled_mma_qk_narrow.get_slice(tidx).partition_shape_C((BM, BN // 2)))
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((BM, Dv)), Float32)
        acc_O_mn = cute.make_tensor(acc_O.iterator, _acc_mn_layout(acc_O.layout))
        tOrP = cute.make_rmem_tensor(_frg_a_shape(thr_mma_qk.partition_shape_C((BM, BN))),
                                     self.dtype)

        # element coordinates of this thread's accumulator entries, (row, col) within the tile
        cS = cute.make_identity_tensor((BM, BN))
        tScS = thr_mma_qk.partition_C(cS)
        tScS_mn = cute.make_tensor(tScS.iterator, _acc_mn_layout(tScS.layout))
        num_rows = cute.size(tScS_mn, mode=[0])

        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        lse = cute.make_rmem_tensor((num_rows,), Float32)
        corr_prev = cute.make_rmem_tensor((num_rows,), Float32)  # rescale_before_pv
        if const_expr(self.stmatrix_o):
            copy_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                            self.dtype)
        else:
            copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                            num_bits_per_copy=2 * self.dtype.width)
        # O's register -> shared copy: each thread's slice is taken in the epilogue (see there)
        tiled_copy_O = cute.make_tiled_copy_C(copy_atom, tiled_mma_pv)
        sO_mn = sO
        if const_expr(self.wg_epilogue):
            # the (tile_m, Dv) view of the (64, Dv, slot) buffer: row r is row r % 64 of
            # warpgroup r // 64's slice, which holds exactly that warpgroup's accumulator rows
            # (shared_o_slot: every warpgroup's rows map onto the one slot)
            wg_stride = 64 * Dv if const_expr(not self.shared_o_slot) else 0
            sO_mn = cute.composition(
                sO, cute.make_layout(((64, self.num_mma_wg), Dv), stride=((1, wg_stride), 64)))
        # the threads that share O's staging: all consumers, or (wg_epilogue) this warpgroup
        epi_bar = _BAR_EPILOGUE
        epi_threads = 128 * self.num_mma_wg
        if const_expr(self.wg_epilogue):
            epi_bar = _BAR_EPILOGUE_WG + wg
            epi_threads = 128

        # ping-pong: warpgroup 0 goes first. Each later Q K^T issue of one warpgroup waits for the
        # other's; the last arrive of a tile is the first "go" of the next one.
        if const_expr(self.pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=_BAR_WG_SCHED, number_of_threads=256)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        info_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.info_stages)
        tile, step, total = Int32(0), Int32(0), Int32(0)
        window = None
        if const_expr(not self.tile_info):
            # (the bound can cost a warp scan of cu_seqlens: varlen paired order)
            tile, step = self.first_tile_and_step()
            total = self.num_slots(mQ, vl, sk)
            if const_expr(self.turned_order):
                # the turned order's window, once (as the producer does)
                window = self.rotation_window(cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m))
        # the loop runs over the slots of the tile order (item_coords decodes each), or with
        # tile_info over the producer's active tiles until its m_block < 0
        (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, seqlen_k,
         offset_q, cut_i, sk_slot) = (Int32(0),) * len(TILE_INFO_FIELDS)
        active = Boolean(True)
        o_turns = Int32(0)  # shared_o_slot: this warpgroup's epilogues so far
        # pieces of a cut tile: 2, or on a grid of that many CTAs a tile (tile_order.split_pieces:
        # every tile cut, more CTAs than tiles) gx / tiles
        sk_pieces = Int32(2)
        if const_expr(self.stream_k and not self.paired):
            if sk[2] > 0:
                sk_pieces = cutlass.max(cute.arch.grid_dim()[0] // sk[2], 2)
        more = tile < total
        if const_expr(self.tile_info):
            (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, seqlen_k,
             offset_q, cut_i, sk_slot, info_state) = self.get_tile_info(pipe_info, s_info, info_state)
            more = m_block >= 0
        while more:
            cut = cut_i != 0
            if const_expr(not self.tile_info):
                (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, seqlen_k,
                 offset_q, _, active, cut, sk_slot) = self.item_coords(
                     tile, mQ, mK, win_left, win_right, vl, sk, window)
            if active:
                n_blocks = cutlass.max(n_block_max - n_block_min, 0)
                trace_at = (mLSE, tidx, m_block, head_idx, batch_idx, wg, seqlen_q)
                self.trace_phase(trace_at, TRACE_SLOTS["start"], n_blocks)
                acc_O.fill(0.0)
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                # blocks that need the element mask (masked_block_counts): the top ones (the key
                # tail, the diagonal) are visited first, the left window edge's last; the ones in
                # between run unmasked
                n_masked, n_masked_left = self.masked_block_counts(
                    m_block, n_block_min, n_block_max, seqlen_q, seqlen_k, win_left, win_right)
                tSrQ_tile = tSrQ
                if const_expr(self.q_stages > 1 and not self.q_regs):
                    tSrQ_tile = tSrQ[None, None, None, q_state.index]
                ctx = _Ctx(pipe_k=pipe_k, pipe_v=pipe_v, tiled_mma_qk=tiled_mma_qk,
                           tiled_mma_pv=tiled_mma_pv, thr_mma_qk=thr_mma_qk, tSrQ=tSrQ_tile, tSrK=tSrK,
                           tOrVt=tOrVt, acc_O=acc_O, acc_O_mn=acc_O_mn, tScS_mn=tScS_mn,
                           row_max=row_max, row_sum=row_sum, scale_log2=softmax_scale_log2,
                           m_block=m_block, seqlen_q=seqlen_q, seqlen_k=seqlen_k, wg=wg,
                           win_left=win_left, win_right=win_right, softcap_scale=softcap_scale,
                           softcap_val=softcap_val, kr=None, inter=None, corr_prev=corr_prev,
                           tiled_mma_qk_narrow=tiled_mma_qk_narrow, tSrK_narrow=tSrK_narrow,
                           narrow_acc_layout=narrow_acc_layout, tSrK_upper=tSrK_upper)
                if const_expr(self.dynamic_mask):
                    n_blocks, visit, ctx.inter = self.visit_plan(
                        m_block, head_idx, batch_idx, n_block_min, n_block_max, seqlen_q, offset_q,
                        kr, bs)
                    if const_expr(self.num_key_ranges > 0):
                        # this thread's rows' intervals, for the element mask
                        kr_row0 = offset_q if const_expr(self.varlen) else Int32(0)
                        ctx.kr = load_key_ranges(kr[0], kr[1] * batch_idx + kr[2] * head_idx,
                                                 kr_row0, tScS_mn, m_block * BM, seqlen_q,
                                                 self.num_key_ranges)[0]
                pipe_q.consumer_wait(q_state)
                if const_expr(self.q_regs):
                    tQsQ_tile = tQsQ[None, None, None, q_state.index] if const_expr(self.q_stages > 1) else tQsQ
                    cute.copy(ld_q, tQsQ_tile, tQrQ)
                self.trace_phase(trace_at, TRACE_SLOTS["q_ready"])
                if const_expr(self.block_sparse):
                    # CSR visits in three runs, each with its mask decided at trace time
                    if n_blocks > 0:
                        n_mask, n_clear, n_tail = self.csr_visit_groups(ctx, visit, n_blocks)
                        kv_state = self.csr_visits(visit, n_mask, n_clear, n_tail, kv_state,
                                                   _CsrBlockSteps(self, ctx, tOrP))
                        if const_expr(self.overlap):
                            kv_state = self.last_half_block(ctx, kv_state, tOrP)
                elif const_expr(self.dynamic_mask):
                    # key ranges: key blocks in the plan's order, the mask decided per block at
                    # run time
                    if n_blocks > 0:
                        if const_expr(self.overlap):
                            n_block0 = self.block_at(0, visit)[0]
                            self.first_half_block(ctx, n_block0, kv_state, tOrP,
                                                  self.block_need_mask(ctx, n_block0))
                        for i in cutlass.range(n_blocks - 1 if const_expr(self.overlap) else n_blocks,
                                               unroll=1):
                            it = i + 1 if const_expr(self.overlap) else i
                            n_block = self.block_at(it, visit)[0]
                            need = self.block_need_mask(ctx, n_block)
                            if const_expr(self.overlap):
                                kv_state = self.overlapped_block(ctx, need, n_block, kv_state, tOrP)
                            else:
                                kv_state = self.one_block(ctx, need, n_block, kv_state)
                        if const_expr(self.overlap):
                            kv_state = self.last_half_block(ctx, kv_state, tOrP)
                elif const_expr(not self.overlap):
                    for i in cutlass.range(n_masked, unroll=1):
                        kv_state = self.one_block(ctx, True, n_block_max - 1 - i, kv_state)
                    for i in cutlass.range(n_blocks - n_masked - n_masked_left, unroll=1):
                        kv_state = self.one_block(ctx, False, n_block_max - n_masked - 1 - i, kv_state)
                    if const_expr(self.mask_left):
                        for i in cutlass.range(n_masked_left, unroll=1):
                            kv_state = self.one_block(ctx, True, n_block_min + n_masked_left - 1 - i,
                                                      kv_state)
                else:
                    # intra-warpgroup overlap: S_{j+1} = Q K_{j+1}^T and O += P_j V_j are in flight
                    # together while the softmax of S_{j+1} runs on the CUDA cores
                    if const_expr(self.key_split):
                        split = self.key_split_tile(m_block, seqlen_q, n_blocks, cut)
                        if split:
                            kv_state = self.key_split_blocks(ctx, kv_state, tOrP, n_block_max, n_blocks,
                                                             n_masked)
                            n_blocks = Int32(0)  # nothing left for the path below
                    if const_expr(self.pass_empty_wg):
                        if m_block * BM + 64 * wg >= seqlen_q:  # no row of it is stored
                            # the ring's n_blocks - 1 turns: one per passed block past the first
                            for i in cutlass.range(n_blocks, unroll=1):
                                kv_state = self.pass_block(ctx, kv_state, i > 0)
                            n_blocks = Int32(0)
                            n_masked = Int32(0)
                    if const_expr(self.wg_key_bound):
                        # the top blocks hidden from this warpgroup's rows are right-masked
                        # blocks of the tile (hidden from its first row too): passed, not computed
                        n_hidden = cutlass.min(cutlass.max(
                            n_block_max - self.wg_key_block_end(m_block, wg, seqlen_q, seqlen_k,
                                                                win_right), 0), n_masked)
                        # every warpgroup takes n_blocks - 1 turns of the ring per tile (one per
                        # overlapped block): one per passed block, past the first where it passes
                        # them all. Each turn right after its block's K, as a computed block takes
                        # it: the others release a stage only in their turns, so a warpgroup that
                        # waited for more stages before taking its turns would deadlock the ring
                        first_turn = n_hidden - cutlass.min(n_hidden, cutlass.max(n_blocks - 1, 0))
                        for i in cutlass.range(n_hidden, unroll=1):
                            kv_state = self.pass_block(ctx, kv_state, i >= first_turn)
                        n_block_max = n_block_max - n_hidden
                        n_blocks = n_blocks - n_hidden
                        n_masked = n_masked - n_hidden
                    if n_blocks > 0:
                        # the first block (n_block_max - 1) is taken from the group it belongs to:
                        # the right-masked ones, else the unmasked ones, else the left-masked ones
                        n_right, n_unmasked, n_left, _, first_masked = self.take_first_visit(
                            n_masked, n_blocks - n_masked - n_masked_left, n_masked_left)
                        narrow = None
                        if const_expr(self.narrow_first):
                            narrow = self.first_block_is_narrow(ctx, n_block_max - 1)
                        self.first_half_block(ctx, n_block_max - 1, kv_state, tOrP, first_masked,
                                              narrow=narrow)
                        self.trace_phase(trace_at, TRACE_SLOTS["first_block"])
                        if const_expr(self.narrow_last):
                            kv_state = self.blocks_after_first_narrow_last(
                                ctx, kv_state, tOrP, n_block_max, n_blocks, n_masked, n_masked_left)
                        else:
                            if const_expr(self.mask_right):
                                # (without a right bound only the key tail's block is masked at
                                # the top, and the first visit takes it: no copy of the step here)
                                for i in cutlass.range(n_right, unroll=1):
                                    kv_state = self.overlapped_block(ctx, True, n_block_max - 2 - i,
                                                                     kv_state, tOrP)
                            for i in cutlass.range(n_unmasked, unroll=1):
                                kv_state = self.overlapped_block(
                                    ctx, False, n_block_max - 2 - n_right - i, kv_state, tOrP)
                            if const_expr(self.mask_left):
                                for i in cutlass.range(n_left, unroll=1):
                                    kv_state = self.overlapped_block(
                                        ctx, True, n_block_min + n_left - 1 - i, kv_state, tOrP)
                        kv_state = self.last_half_block(ctx, kv_state, tOrP)
                        self.trace_phase(trace_at, TRACE_SLOTS["last_pv"])

                if const_expr(self.separate_o):
                    # every GEMM reading Q has completed (wait_group(0) in the last step)
                    pipe_q.consumer_release(q_state)
                    q_state.advance()

                if const_expr(self.shared_o_slot):
                    # the slot is this warpgroup's once the other one's store has read it:
                    # warpgroup 1 waits for warpgroup 0's store of this tile, warpgroup 0 for
                    # warpgroup 1's of the previous tile (none before its first)
                    if wg == 1 or o_turns > 0:
                        cute.arch.barrier(barrier_id=_BAR_O_SLOT + wg, number_of_threads=256)
                stores = Boolean(True)
                if const_expr(self.key_split):
                    if split:  # only the first warpgroup stores: the others' rows are its rows
                        stores = self.key_split_merge(s_split, acc_O, acc_O_mn, row_max, row_sum,
                                                      softmax_scale_log2, tidx, wg)
                if const_expr(self.stream_k):
                    # a cut tile's piece: the one finishing second merges both and stores the tile
                    finish = stores
                    if cut:
                        live = self.warp_rows_live(m_block, wg, tidx, seqlen_q)
                        if sk_pieces > 2:  # CTA pieces * slot + p holds piece p of tile slot
                            finish = self.stream_k_merge_pieces(
                                sk, sk_slot, cute.arch.block_idx()[0] - sk_pieces * sk_slot, sk_pieces,
                                acc_O, acc_O_mn, row_max, row_sum, softmax_scale_log2, tidx, wg, epi_bar,
                                epi_threads, sk_flag, live)
                        else:
                            finish = self.stream_k_merge(sk, sk_slot, acc_O, acc_O_mn, row_max, row_sum,
                                                         softmax_scale_log2, tidx, wg, epi_bar, epi_threads,
                                                         sk_flag, live)
                    if finish:
                        self.epilogue(tma_atom_O, mO, mLSE, sO, acc_O, acc_O_mn, row_max, row_sum, lse,
                                      tScS_mn, tiled_copy_O, sO_mn, softmax_scale_log2, m_block,
                                      head_idx, batch_idx, seqlen_q, offset_q, tidx, wg, epi_bar,
                                      epi_threads, vl)
                        self.trace_phase(trace_at, TRACE_SLOTS["end"])
                elif const_expr(self.key_split):
                    if stores:
                        self.epilogue(tma_atom_O, mO, mLSE, sO, acc_O, acc_O_mn, row_max, row_sum, lse,
                                      tScS_mn, tiled_copy_O, sO_mn, softmax_scale_log2, m_block,
                                      head_idx, batch_idx, seqlen_q, offset_q, tidx, wg, epi_bar,
                                      epi_threads, vl)
                else:
                    self.epilogue(tma_atom_O, mO, mLSE, sO, acc_O, acc_O_mn, row_max, row_sum, lse,
                                  tScS_mn, tiled_copy_O, sO_mn, softmax_scale_log2, m_block,
                                  head_idx, batch_idx, seqlen_q, offset_q, tidx, wg, epi_bar,
                                  epi_threads, vl)
                    self.trace_phase(trace_at, TRACE_SLOTS["end"])
                if const_expr(self.shared_o_slot):
                    # hand the slot on (a piece that did not store hands it on all the same): the
                    # warp that issued the store waits until the store has read it
                    if tidx % 128 < 32:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.barrier_arrive(barrier_id=_BAR_O_SLOT + 1 - wg, number_of_threads=256)
                    o_turns += 1
                if const_expr(not self.separate_o):
                    # the store has read Q/O's buffer: hand it back to the producer for the next Q
                    cute.arch.barrier(barrier_id=_BAR_EPILOGUE, number_of_threads=128 * self.num_mma_wg)
                    pipe_q.consumer_release(q_state)
                    q_state.advance()
            if const_expr(self.tile_info):
                (m_block, head_idx, head_kv, batch_idx, n_block_min, n_block_max, seqlen_q, seqlen_k,
                 offset_q, cut_i, sk_slot, info_state) = self.get_tile_info(pipe_info, s_info, info_state)
                more = m_block >= 0
            else:
                tile += step
                more = tile < total
        if const_expr(self.shared_o_slot):
            if wg == 0 and o_turns > 0:  # warpgroup 1's last hand-over
                cute.arch.barrier(barrier_id=_BAR_O_SLOT, number_of_threads=256)
        # shared memory must outlive the last store's reads (each issuing warp waits for its own)
        if const_expr(self.warp_store_o):
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        elif tidx % epi_threads < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    def merge_record(self, sk, slot, acc_O, row_max, tidx, wg, epi_threads):
        """(workspace, counter pointer, record, epilogue group, thread in the group, values of a
        record) of cut tile ``slot`` for this thread's epilogue group (this warpgroup with
        wg_epilogue, else all consumers): record ``slot * groups + group``, a record holding
        write_state's values of every thread of the group, value-major (a warp's 32 values of
        one index are 128 contiguous bytes). Traced inline (no control flow)."""
        groups = self.num_mma_wg if const_expr(self.wg_epilogue) else 1
        group = wg if const_expr(self.wg_epilogue) else 0
        record = slot * groups + group
        state_stride = (2 * cute.size(row_max) + cute.size(acc_O)) * epi_threads
        return sk[0], sk[1].iterator + record, record, group, tidx % epi_threads, state_stride

    @cute.jit
    def warp_rows_live(self, m_block, wg, tidx, seqlen_q):
        """Whether this thread's warp holds a row of the tile inside the sequence (its 16 rows of
        the warpgroup's 64 start at 16 x warp); always True without merge_live_rows. Warp-uniform."""
        live = Boolean(True)
        if const_expr(self.merge_live_rows):
            live = m_block * self.tile_m + 64 * wg + 16 * ((tidx % 128) // 32) < seqlen_q
        return live  # (unread without merge_live_rows: the merges test the flag first)

    @cute.jit
    def stream_k_merge(self, sk, slot, acc_O, acc_O_mn, row_max, row_sum, scale_log2, tidx, wg,
                       epi_bar, epi_threads, sk_flag, live):
        """One piece of a cut tile (stream-K) meets the other; True for the one that finishes
        second, which then holds the whole tile's online-softmax state and stores it.

        Per epilogue group (this warpgroup with wg_epilogue, else all consumers: the threads that
        store O together), counter ``slot * groups + group`` (zero before, zero again after):
        the group's first thread adds 1 and shares the old value through shared memory.
        - First (old 0): every thread writes its unnormalised O, row maxima and partial row sums
          to the group's workspace record, value-major (a warp's 32 values of one index are 128
          contiguous bytes), fences, the group syncs, and its first thread adds 2 with release
          (data ready). It stores nothing. Nothing it waits for can wait on it: no deadlock.
        - Second (old 1 or 3): the first thread waits for 4 = both arrivals + ready (acquire; the
          first piece is running, so this ends), zeroes the counter for the next call (no one
          touches it after that), the group syncs, and each thread
          reads the record its twin (same thread of the other piece: same rows and columns)
          wrote, and merges: max, then the two states scaled and added with products rounded
          apart (mul_rn), which is symmetric in the two pieces, so the result is bitwise the
          same whichever finished first.
        A warp with no ``live`` row (merge_live_rows) skips its writes and reads; it still takes
        part in the group's barriers and counter."""
        ws, counter, record, group, gt, state_stride = self.merge_record(sk, slot, acc_O, row_max, tidx, wg,
                                                                        epi_threads)
        base = record * state_stride + gt
        if gt == 0:
            sk_flag[group] = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
        cute.arch.barrier(barrier_id=epi_bar, number_of_threads=epi_threads)
        second = sk_flag[group] != 0
        if not second:
            if const_expr(self.merge_live_rows):
                if live:
                    write_state(lambda i, x: ws.__setitem__(base + i * epi_threads, x), acc_O, row_max, row_sum)
            else:
                write_state(lambda i, x: ws.__setitem__(base + i * epi_threads, x), acc_O, row_max, row_sum)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=epi_bar, number_of_threads=epi_threads)
            if gt == 0:
                cute.arch.atomic_add(counter, Int32(2), sem="release", scope="gpu")
        else:
            if gt == 0:
                seen = Int32(0)
                while seen != 4:
                    seen = cute.arch.atomic_add(counter, Int32(0), sem="acquire", scope="gpu")
                cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")
            cute.arch.barrier(barrier_id=epi_bar, number_of_threads=epi_threads)
            cute.arch.fence_acq_rel_gpu()
            if const_expr(self.merge_live_rows):
                if live:
                    merge_twin_state(lambda i: ws[base + i * epi_threads], acc_O_mn, row_max, row_sum, scale_log2)
            else:
                merge_twin_state(lambda i: ws[base + i * epi_threads], acc_O_mn, row_max, row_sum, scale_log2)
        return second

    @cute.jit
    def stream_k_merge_pieces(self, sk, slot, piece, pieces, acc_O, acc_O_mn, row_max, row_sum,
                              scale_log2, tidx, wg, epi_bar, epi_threads, sk_flag, live):
        """Piece ``piece`` of the ``pieces`` (> 2) of a cut tile meets the others (a grid of
        ``pieces`` CTAs a tile, tile_order.split_pieces); True for the last to arrive, which then
        holds the whole tile's online-softmax state and stores it.

        Per epilogue group (as stream_k_merge), ``pieces`` records and the counter
        ``slot * groups + group`` (zero before, zero again after). Every piece writes its state
        to its own record (write_state), fences, the group syncs, and its first thread adds 1
        (acq_rel) and shares the old value through shared memory. The piece that read
        ``pieces - 1`` came last: every other record was written before its writer's add, so
        it zeroes the counter (no one touches it after), fences, and merges the records in
        piece order (merge_states_in_order: the same bits whichever piece came last). No piece
        waits for another: no deadlock, whatever the order the CTAs run in. A warp with no
        ``live`` row (merge_live_rows) skips its writes and reads, not the barriers or the counter."""
        ws, counter, record, group, gt, state_stride = self.merge_record(sk, slot, acc_O, row_max, tidx, wg,
                                                                        epi_threads)
        base = record * pieces * state_stride + gt
        own = base + piece * state_stride
        if const_expr(self.merge_live_rows):
            if live:
                write_state(lambda i, x: ws.__setitem__(own + i * epi_threads, x), acc_O, row_max, row_sum)
        else:
            write_state(lambda i, x: ws.__setitem__(own + i * epi_threads, x), acc_O, row_max, row_sum)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=epi_bar, number_of_threads=epi_threads)
        if gt == 0:
            sk_flag[group] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.barrier(barrier_id=epi_bar, number_of_threads=epi_threads)
        last = sk_flag[group] == pieces - 1
        if last:
            if gt == 0:
                cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
            if const_expr(self.merge_live_rows):
                if live:
                    merge_states_in_order(ws, base, state_stride, epi_threads, pieces, acc_O_mn, row_max,
                                          row_sum, scale_log2, self.merge_batch)
            else:
                merge_states_in_order(ws, base, state_stride, epi_threads, pieces, acc_O_mn, row_max,
                                      row_sum, scale_log2, self.merge_batch)
        return last

    @cute.jit
    def key_split_tile(self, m_block, seqlen_q, n_blocks, cut):
        """Whether this tile runs split over the warpgroups (key_split): its rows all lie in the
        first warpgroup's 64, it has at least two key blocks, and it is not a stream-K piece."""
        split = seqlen_q - m_block * self.tile_m <= 64 and n_blocks >= 2
        if const_expr(self.stream_k):
            split = split and not cut
        return split

    @cute.jit
    def key_split_blocks(self, ctx, kv_state, tOrP, n_block_max, n_blocks, n_masked):
        """key_split: this warpgroup's share of a split tile's key blocks, visits w, w + W, ...
        (visit i is block n_block_max - 1 - i; non-causal, no window: only the first visit can
        need the element mask) with the intra-warpgroup overlap; the others' stages are passed
        (every warpgroup consumes every stage of the ring, in order). The ring of named barriers
        orders the GEMM issue as ever: each warpgroup takes as many turns as the first (the one
        with the most visits), the missing ones after its last block. Each stage is read and
        released (for every warpgroup: _ReleaseForAll) by its own warpgroup; the others step
        their pipeline state past it without waiting (passing it as pass_block does, waiting
        for its K and V, chained the warpgroups into a convoy: the split tile cost 0.65-0.84 of
        a full one). Its own copy of the overlapped step: one loop for plain and split tiles
        (stride at run time) ran plain tiles 1-4 % slower, and the split tiles without the
        overlap (one_block) gained nothing (docs section 46)."""
        first, stride = ctx.wg, self.num_mma_wg
        n_mine = cutlass.max(n_blocks - first + stride - 1, 0) // stride
        # each stage is read and released by its warpgroup alone (for all of them): the others
        # only step their pipeline state past it, waiting for nothing
        pipe_k, pipe_v = ctx.pipe_k, ctx.pipe_v
        ctx.pipe_k, ctx.pipe_v = _ReleaseForAll(pipe_k, stride), _ReleaseForAll(pipe_v, stride)
        for i in cutlass.range(cutlass.min(first, n_blocks), unroll=1):
            kv_state = _advanced(kv_state)
        if n_mine > 0:
            self.first_half_block(ctx, n_block_max - 1 - first, kv_state, tOrP, first < n_masked)
            kv_state_v = kv_state.clone()  # V of the block whose P V is next
            kv_state = _advanced(kv_state)
            for t in cutlass.range(n_mine - 1, unroll=1):
                for _ in cutlass.range_constexpr(stride - 1):
                    kv_state = _advanced(kv_state)
                self.overlapped_step(ctx, False, n_block_max - 1 - first - stride * (t + 1), kv_state,
                                     kv_state_v, tOrP)
                kv_state_v = kv_state.clone()
                kv_state = _advanced(kv_state)
            self.last_half_block(ctx, kv_state_v, tOrP)
        used = cutlass.min(first, n_blocks) + cutlass.max(stride * n_mine - stride + 1, 0)
        for i in cutlass.range(n_blocks - used, unroll=1):
            kv_state = _advanced(kv_state)
        ctx.pipe_k, ctx.pipe_v = pipe_k, pipe_v
        if const_expr(self.pingpong):
            for i in cutlass.range((n_blocks + stride - 1) // stride - cutlass.max(n_mine, 1), unroll=1):
                self.sched_sync(ctx)
                self.sched_arrive(ctx)
        return kv_state

    @cute.jit
    def key_split_merge(self, s_split, acc_O, acc_O_mn, row_max, row_sum, scale_log2, tidx, wg):
        """key_split: the warpgroups' states of the tile's rows merged into the first one's, down a
        chain through one shared record (value-major: value i of thread t at i * 128 + t). The
        last warpgroup writes its state; each one before it waits for the record, merges it into
        its own (merge_twin_state: the same bits in every run) and, but the first, writes the
        result back over it, thread by thread in its own slots. The last waits until the first
        has read the record, so the next split tile cannot overwrite it early. True for the
        first warpgroup, which stores the tile."""
        W = self.num_mma_wg
        t = tidx % 128
        if wg < W - 1:
            cute.arch.barrier(barrier_id=_BAR_SPLIT + wg, number_of_threads=256)
            merge_twin_state(lambda i: s_split[i * 128 + t], acc_O_mn, row_max, row_sum, scale_log2)
        if wg > 0:
            write_state(lambda i, x: s_split.__setitem__(i * 128 + t, x), acc_O, row_max, row_sum)
            cute.arch.barrier_arrive(barrier_id=_BAR_SPLIT + wg - 1, number_of_threads=256)
        if wg == W - 1:
            cute.arch.barrier(barrier_id=_BAR_SPLIT_FREE, number_of_threads=256)
        if wg == 0:
            cute.arch.barrier_arrive(barrier_id=_BAR_SPLIT_FREE, number_of_threads=256)
        return wg == 0

    @cute.jit
    def epilogue(self, tma_atom_O, mO, mLSE, sO, acc_O, acc_O_mn, row_max, row_sum, lse, tScS_mn,
                 tiled_copy_O, sO_mn, softmax_scale_log2, m_block, head_idx, batch_idx, seqlen_q,
                 offset_q, tidx, wg, epi_bar, epi_threads, vl=None):
        """Normalise O, write LSE, stage O in shared memory and store it (one tile, or with
        wg_epilogue this warpgroup's 64 rows of it)."""
        BM = self.tile_m
        num_rows = cute.size(row_max)
        # ---- finalize: O /= rowsum, LSE = (max * scale_log2 + log2(sum)) * ln 2
        for r in cutlass.range_constexpr(num_rows):
            sm = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            inv = Float32(0.0)
            lse[r] = -Float32.inf
            if sm > 0.0:
                inv = cute.arch.rcp_approx(sm)
                lse[r] = (row_max[r] * softmax_scale_log2
                          + cute.math.log2(sm, fastmath=True)) * LN_2
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * inv
        if const_expr(not self.lse_after_o):
            self.store_lse(mLSE, lse, tScS_mn, m_block, head_idx, batch_idx, seqlen_q, offset_q, tidx)

        # ---- O: registers -> shared. Aliased with Q: free once both warpgroups' GEMMs are
        # done. Separate: free once the previous tile's store has read it; the warp that
        # issued that store (warp 0 of the consumers, or with wg_epilogue of this
        # warpgroup) waits for it here, a whole tile after issuing it (varlen partial
        # tiles: every thread's own shared-memory reads are complete already). A slot the
        # warpgroups share (shared_o_slot) was handed over in consume, after the other
        # warpgroup's store had read it.
        if const_expr(self.warp_store_o):
            # this warp's rows: the warp's own previous store has read them
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
        else:
            if const_expr(self.separate_o):
                if tidx % epi_threads < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=epi_bar, number_of_threads=epi_threads)
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # this thread's staging addresses, computed here for each tile: computed once before
        # the tile loop, they held 16 registers (hd128) through every key block, and ptxas then
        # took P's registers for the softmax's temporaries, so the P V wait came before the
        # exponentials (staging_per_tile)
        thr_copy_O = tiled_copy_O.get_slice(
            per_use_i32(tidx) if const_expr(self.staging_per_tile) else tidx)
        cute.copy(thr_copy_O, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO_mn))
        cute.arch.fence_proxy("async.shared", space="cta")
        if const_expr(self.warp_store_o):
            cute.arch.sync_warp()
        else:
            cute.arch.barrier(barrier_id=epi_bar, number_of_threads=epi_threads)
        # varlen: a tile that ends inside its sequence goes out by TMA like a batched one
        # (warp 0 issues it, the others go on); a sequence's last, partial tile by
        # row-predicated 16-byte stores (a TMA store would write the next sequence's rows)
        if const_expr(self.warp_store_o):
            self.store_O_warp(tma_atom_O, mO, sO, head_idx, batch_idx, m_block, seqlen_q, tidx, wg)
        elif const_expr(self.wg_epilogue):
            self.store_O_wg(tma_atom_O, mO, sO, head_idx, batch_idx, m_block, offset_q,
                            seqlen_q, tidx, wg, vl)
        elif const_expr(self.varlen):
            rows_left = seqlen_q - m_block * BM
            if rows_left >= BM:
                self.store_O_tma(tma_atom_O, mO, sO, head_idx, batch_idx, m_block, offset_q, tidx)
            else:
                self.store_O_rows(sO, vl[4], offset_q, head_idx, m_block, rows_left, tidx)
        else:  # batched: the TMA store clips a tail tile at the tensor's end
            self.store_O_tma(tma_atom_O, mO, sO, head_idx, batch_idx, m_block, offset_q, tidx)

        if const_expr(self.lse_after_o):
            self.store_lse(mLSE, lse, tScS_mn, m_block, head_idx, batch_idx, seqlen_q, offset_q, tidx)

    @cute.jit
    def store_lse(self, mLSE, lse, tScS_mn, m_block, head_idx, batch_idx, seqlen_q, offset_q, tidx):
        """A tile's LSE: the first thread of each quad owns its two rows. With lse_after_o it
        is written after O's store is issued: before it, the proxy fence that hands O's staging
        to the TMA (MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S in the SASS) also ordered these global
        stores, inside the tile's serial epilogue."""
        BM = self.tile_m
        if const_expr(self.write_lse and not self.trace_phases) and tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * BM + tScS_mn[r, 0][0]
                if row < seqlen_q:
                    if const_expr(self.varlen):
                        mLSE[offset_q + row, head_idx, 0] = lse[r]
                    elif const_expr(self.end_aligned):
                        row = row - self.row_shift(seqlen_q, mLSE)
                        if row >= 0:
                            mLSE[row, head_idx, batch_idx] = lse[r]
                    else:
                        mLSE[row, head_idx, batch_idx] = lse[r]

    @cute.jit
    def visit_plan(self, m_block, head, batch, n_block_min, n_block_max, seqlen_q, offset_q, kr,
                   bs):
        """(number of key tiles to visit, ``block_at`` state, tile-wide key-range intersections)
        of one query tile, for the key-range / block-sparse configs. Computed independently by
        the producer warp and by every consumer warp, from the same inputs, so all agree.

        Block-sparse: the CSR row of this query tile (mask entries, then full ones).
        Key ranges: the causal/window range narrowed to the union of the tile's intervals."""
        BM, BN = self.tile_m, self.tile_n
        n_iters = cutlass.max(n_block_max - n_block_min, 0)
        visit = (n_block_max,)
        inter = None
        if const_expr(self.block_sparse):
            (mFR, mFC, mMR, mMC, ratio_m, ratio_n, f_rp_sb, f_rp_sh, f_col_sb, f_col_sh, m_rp_sb,
             m_rp_sh, m_col_sb, m_col_sh) = bs
            f_col0, f_cnt = csr_row(mFR, f_rp_sb * batch + f_rp_sh * head, m_block // ratio_m)
            m_col0, m_cnt = csr_row(mMR, m_rp_sb * batch + m_rp_sh * head, m_block // ratio_m)
            f_col0 = f_col0 + f_col_sb * batch + f_col_sh * head
            m_col0 = m_col0 + m_col_sb * batch + m_col_sh * head
            n_iters = (f_cnt + m_cnt) * ratio_n
            if m_block * BM >= seqlen_q:  # varlen tile past its sequence's end
                n_iters = Int32(0)
            visit = (n_block_max, mFC, mMC, f_col0, m_col0, m_cnt, ratio_n)
        elif const_expr(self.num_key_ranges > 0):
            kr_row0 = offset_q if const_expr(self.varlen) else Int32(0)
            lo_min, hi_max, inter = key_range_span_warp(
                kr[0], kr[1] * batch + kr[2] * head, kr_row0, m_block * BM, BM, seqlen_q,
                self.num_key_ranges)
            n_lo = cutlass.max(n_block_min, lo_min // BN)
            # (the span is a warp reduction by shuffles, which ptxas cannot prove uniform: with the
            # loop's trip count per thread the pipeline state was too, and every wgmma descriptor
            # of the loop went through an R2UR, 32 a key block; SASS of hd128 causal with one
            # range 3016 -> 2440 instructions once marked)
            n_hi = cute.arch.make_warp_uniform(cutlass.min(n_block_max, cute.ceil_div(hi_max, BN)))
            n_iters = cute.arch.make_warp_uniform(cutlass.max(n_hi - n_lo, 0))
            visit = (n_hi,)
        return n_iters, visit, inter

    @cute.jit
    def csr_visit_groups(self, ctx, visit, n_blocks):
        """(mask visits, clear visits, tail visits) of a block-sparse tile's plan, in visiting
        order. The CSR mask entries come first; the full entries follow in increasing key order
        (validated: sorted), so the full visits that hold keys at or past seqlen_k (the key
        tail; in varlen, blocks past a shorter sequence's end) are a suffix, found by walking
        back from the end (usually one read). The clear ones before it need no mask at all:
        their loop is traced without any mask code (a run-time mask decision per block cost
        9-14 % on the H100 with every block full)."""
        m_vis = cutlass.min(visit[5] * visit[6], n_blocks)  # m_cnt entries x ratio_n tiles
        tail_start = ctx.seqlen_k // self.tile_n  # first key tile with (n + 1) * BN > seqlen_k
        n_tail = Int32(0)
        more = n_blocks > m_vis
        while more:
            if self.block_at(n_blocks - 1 - n_tail, visit)[0] >= tail_start:
                n_tail = n_tail + 1
                more = n_tail < n_blocks - m_vis
            else:
                more = Boolean(False)
        return m_vis, n_blocks - m_vis - n_tail, n_tail

    @cute.jit
    def take_first_visit(self, n_a, n_b, n_c):
        """A tile's first visit (S and softmax only, with overlap) comes from the first non-empty
        of its three visit groups, in visiting order: (the counts left in each group, was it from
        the first group?, was it not from the second?). (Run-time Booleans: a Python ``not`` of
        one would be evaluated at trace time.)"""
        in_a = n_a > 0
        not_in_b = n_a > 0 or n_b == 0
        if n_a > 0:
            n_a = n_a - 1
        elif n_b > 0:
            n_b = n_b - 1
        else:
            n_c = n_c - 1
        return n_a, n_b, n_c, in_a, not_in_b

    @cute.jit
    def csr_visits(self, visit, n_mask, n_clear, n_tail, state, steps):
        """Walk a block-sparse tile's key blocks: mask entries with the element predicate,
        clear full entries unmasked, tail full entries with the key-tail mask alone. ``steps``
        does the work (the kernel's _CsrBlockSteps; tests/test_sm90_visit_plan.py's CPU probe
        passes its own): ``steps.first(n_block, masked, mask_entry)`` takes the first visit
        with run-time flags (from its group) where ``steps.split_first``, ``steps.step(masked,
        mask_entry, n_block, state) -> state`` every other with trace-time flags."""
        base = 0
        if const_expr(steps.split_first):
            n_mask, n_clear, n_tail, in_mask, first_masked = self.take_first_visit(n_mask, n_clear, n_tail)
            steps.first(self.block_at(0, visit)[0], first_masked, in_mask, state)
            base = 1
        # a method called inside a run-time loop would make the DSL carry its object through
        # the loop (it assumes a call may mutate it): call a local instead
        step = steps.step
        for i in cutlass.range(n_mask, unroll=1):
            state = step(True, True, self.block_at(base + i, visit)[0], state)
        for i in cutlass.range(n_clear, unroll=1):
            state = step(False, False, self.block_at(base + n_mask + i, visit)[0], state)
        for i in cutlass.range(n_tail, unroll=1):
            state = step(True, False, self.block_at(base + n_mask + n_clear + i, visit)[0], state)
        return state

    @cute.jit
    def block_at(self, it, visit):
        """(key tile, from a CSR mask entry?) of visit number ``it``: dense and key ranges walk
        backwards from the plan's end (the diagonal / tail first), block-sparse the CSR row."""
        if const_expr(self.block_sparse):
            return csr_block_at(it, *visit[1:])
        return visit[0] - 1 - it, Boolean(True)

    @cute.jit
    def block_need_mask(self, ctx, n_block):
        """Does key tile ``n_block`` of a key-range plan need the element mask? The tail, a
        causal/window boundary, or a tile not inside one of the tile-wide interval
        intersections. (Block-sparse plans decide by group: csr_visit_groups.)"""
        BN = self.tile_n
        need = block_needs_mask(ctx.m_block, n_block, self.tile_m, BN, ctx.seqlen_q, ctx.seqlen_k,
                                ctx.win_left, ctx.win_right, self.mask_left, self.mask_right)
        return need or not block_inside_ranges(ctx.inter, n_block * BN, n_block * BN + BN,
                                               self.num_key_ranges)

    def o_store_tiled_copy(self, per_wg: bool = False):
        """The varlen epilogue's shared -> global copy: the consumer threads (per_wg: one
        warpgroup's 128) as (rows, tpr), row-major, 16 bytes (one vector) per thread and step; the
        copy repeats over the rest of the (tile_m, Dv) tile (per_wg: (64, Dv)). Called while
        tracing (also by the CPU test of the mapping)."""
        wgs = 1 if per_wg else self.num_mma_wg
        rows, tpr = o_store_threads(self.head_dim_v, self.dtype.width, 64 * wgs,
                                    self.num_threads_per_wg * wgs)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(
            atom, cute.make_ordered_layout((rows, tpr), order=(1, 0)),
            cute.make_layout((1, 128 // self.dtype.width)))

    @cute.jit
    def store_O_tma(self, tma_atom_O, mO, sO, head_idx, batch_idx, m_block, offset_q, tidx):
        """Epilogue: warp 0 issues the TMA store of O's tile from shared memory (one bulk group;
        without a separate O buffer it also waits for the store's reads, as Q's buffer is next)."""
        BM, Dv = self.tile_m, self.head_dim_v
        if tidx < 32:
            if const_expr(self.varlen):
                gO = cute.local_tile(cute.domain_offset((offset_q, 0), mO[None, None, head_idx, 0]),
                                     (BM, Dv), (m_block, 0))
            else:  # (never end_aligned: a whole tile's store cannot start before row 0)
                gO = cute.local_tile(mO[None, None, head_idx, batch_idx], (BM, Dv), (m_block, 0))
            self.tma_store_slice(tma_atom_O, sO, gO)
            if const_expr(not self.separate_o):
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_O_wg(self, tma_atom_O, mO, sO, head_idx, batch_idx, m_block, offset_q, seqlen_q,
                   tidx, wg, vl=None):
        """wg_epilogue: warpgroup wg stores its own 64 rows of the tile, slice wg of the (64, Dv,
        warpgroup) buffer: by TMA (warp 0 of the warpgroup issues it, one bulk group; batched
        calls' TMA clips rows past the tensor's end), or for a varlen slice that runs past its
        sequence's end by row-predicated stores of the warpgroup's 128 threads (a TMA store
        would write the next sequence's rows). A slice wholly past the end stores nothing."""
        Dv = self.head_dim_v
        slot = m_block * self.num_mma_wg + wg  # 64-row block of the (head, batch) slice
        sO_wg = sO[None, None, wg if const_expr(not self.shared_o_slot) else 0]
        rows_left = seqlen_q - slot * 64
        if const_expr(self.varlen):
            if rows_left >= 64:
                if tidx % 128 < 32:
                    gO = cute.local_tile(cute.domain_offset((offset_q, 0), mO[None, None, head_idx, 0]),
                                         (64, Dv), (slot, 0))
                    self.tma_store_slice(tma_atom_O, sO_wg, gO)
            elif rows_left > 0:
                tiled = self.o_store_tiled_copy(per_wg=True)
                thr = tiled.get_slice(tidx % 128)
                gO = cute.local_tile(cute.domain_offset((offset_q, 0), vl[4][None, None, head_idx, 0]),
                                     (64, Dv), (slot, 0))
                self.copy_rows(tiled, thr, sO_wg, gO, rows_left, 64)
        elif rows_left > 0:
            # (end_aligned: a slice wholly before row 0 stores nothing)
            if (tidx % 128 < 32) & (slot * 64 >= self.row_shift(seqlen_q, mO)):
                gO = cute.local_tile(self.real_rows(mO[None, None, head_idx, batch_idx], seqlen_q),
                                     (64, Dv), (slot, 0))
                self.tma_store_slice(tma_atom_O, sO_wg, gO)

    @cute.jit
    def store_O_warp(self, tma_atom_O, mO, sO, head_idx, batch_idx, m_block, seqlen_q, tidx, wg):
        """warp_store_o: each consumer warp stores the 16 rows of O its accumulator holds (rows
        16 w.. of its warpgroup's 64) from its band of the warpgroup's slot, one TMA store (one
        bulk group) issued by the warp; batched calls' TMA clips rows past the tensor's end. A
        band wholly past the end, or (end_aligned) before row 0, stores nothing."""
        Dv = self.head_dim_v
        band = (m_block * self.num_mma_wg + wg) * 4 + (tidx % 128) // 32  # 16-row band of the slice
        if (seqlen_q - band * 16 > 0) & (band * 16 >= self.row_shift(seqlen_q, mO)):
            s_band = cute.local_tile(sO[None, None, wg], (16, Dv), (band % 4, 0))
            gO = cute.local_tile(self.real_rows(mO[None, None, head_idx, batch_idx], seqlen_q),
                                 (16, Dv), (band, 0))
            self.tma_store_slice(tma_atom_O, s_band, gO)

    @cute.jit
    def tma_store_slice(self, tma_atom_O, s, g):
        tOsO, tOgO = cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1),
                                           cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))
        cute.copy(tma_atom_O, tOsO, tOgO, **self.l2_policy(L2_EVICT_FIRST))
        cute.arch.cp_async_bulk_commit_group()

    def l2_policy(self, policy: int) -> dict:
        """The cache_policy argument of a TMA copy (l2_hints), or none (the default priority)."""
        return {"cache_policy": Int64(policy)} if self.l2_hints else {}

    @cute.jit
    def copy_rows(self, tiled, thr, s, g, rows_left, rows: cutlass.Constexpr):
        """Rows [0, rows_left) of the (rows, Dv) shared-memory tile s to g, 16 bytes per thread
        and vector."""
        tOsO = thr.partition_S(s)
        tOgO = thr.partition_D(g)
        tOcO = thr.partition_S(cute.make_identity_tensor((rows, self.head_dim_v)))
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOrO, mode=[1])):
            if tOcO[0, m, 0][0] < rows_left:
                cute.copy(tiled, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def store_O_rows(self, sO, mO, offset_q, head_idx, m_block, rows_left, tidx):
        """Varlen epilogue: the 256 consumer threads copy O's first ``rows_left`` rows from shared
        memory to the packed output, 16 bytes per thread and vector; each element of the
        (tile_m, Dv) tile belongs to exactly one thread and step (see ``o_store_threads``)."""
        BM, Dv = self.tile_m, self.head_dim_v
        tiled = self.o_store_tiled_copy()
        thr = tiled.get_slice(tidx)
        gO = cute.local_tile(cute.domain_offset((offset_q, 0), mO[None, None, head_idx, 0]),
                             (BM, Dv), (m_block, 0))
        self.copy_rows(tiled, thr, sO, gO, rows_left, BM)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mask_scores(self, ctx, acc_S_mn, n_block, tail_only: cutlass.Constexpr = False,
                    col_offset: cutlass.Constexpr = 0):
        """key j visible to query i iff j < Sk, (right bound) j <= i + Sk - Sq + win_right and
        (left bound) j >= i + Sk - Sq - win_left, and j in one of the row's key ranges; column
        indices relative to the block. ``tail_only``: j < Sk alone (a block-sparse full entry,
        where the caller promises the predicate, can still hold the key tail)."""
        BM, BN = self.tile_m, self.tile_n
        # (col_offset: acc_S_mn holds the block's columns from there, narrow_last's upper half)
        col0 = n_block * BN + col_offset
        if const_expr(tail_only):
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                in_seq = ctx.tScS_mn[0, c][1] < ctx.seqlen_k - col0
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    acc_S_mn[r, c] = score_or_neg_inf(in_seq, acc_S_mn[r, c])
        else:
            self.mask_predicate(ctx, acc_S_mn, col0)

    @cute.jit
    def q_count(self, rows):
        """Query positions of a slice of ``rows`` rows (rows // g with pack_gqa = g)."""
        n = rows
        if const_expr(self.pack_gqa > 1):
            n = rows // self.pack_gqa
        return n

    @cute.jit
    def q_end(self, m_block):
        """One past the query position of tile ``m_block``'s last row."""
        end = (m_block + 1) * self.tile_m
        if const_expr(self.pack_gqa > 1):
            end = self.q_pos(m_block * self.tile_m + self.tile_m - 1) + 1
        return end

    @cute.jit
    def q_pos(self, row):
        """Query position of a row of the (head, batch) slice: the row itself, or with pack_gqa = g
        the row's query, row // g (g a power of two)."""
        pos = row
        if const_expr(self.pack_gqa > 1):
            pos = row // self.pack_gqa
        return pos

    @cute.jit
    def mask_predicate(self, ctx, acc_S_mn, col0):
        if const_expr(self.bit_mask):
            self.mask_by_row_bits(ctx, acc_S_mn, col0)
        else:
            self.mask_by_compares(ctx, acc_S_mn, col0)
            if const_expr(self.num_key_ranges > 0):
                apply_key_ranges(acc_S_mn, ctx.tScS_mn, col0, ctx.kr, self.num_key_ranges)

    @cute.jit
    def mask_by_row_bits(self, ctx, acc_S_mn, col0):
        """A row's visible keys are an interval [lo, limit), and with key ranges its union of
        the row's R intervals intersected with it: the fragment elements inside as a bit set
        (fast/common/mask.py), then one bit test and select per element."""
        BM = self.tile_m
        assert cute.size(acc_S_mn, mode=[1]) <= 32, "a row's fragment must fit one 32-bit set"
        base = ctx.tScS_mn[0, 0][1] + col0   # key of this thread's first column
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            row = self.q_pos(ctx.m_block * BM + ctx.tScS_mn[r, 0][0])
            limit = ctx.seqlen_k
            if const_expr(self.mask_right):
                limit = cutlass.min(limit, row + 1 + ctx.seqlen_k - self.q_count(ctx.seqlen_q) + ctx.win_right)
            keep = low_bits(frag_cols_below(limit - base))
            if const_expr(self.mask_left):
                lo = row + ctx.seqlen_k - self.q_count(ctx.seqlen_q) - ctx.win_left
                keep = keep & ~low_bits(frag_cols_below(lo - base))
            if const_expr(self.num_key_ranges > 0):
                # row r's intervals [lo, hi) (load_key_ranges: the fragment's rows, in order)
                inside = Uint32(0)
                for q in cutlass.range_constexpr(self.num_key_ranges):
                    inside = inside | (low_bits(frag_cols_below(ctx.kr[r, q, 1] - base))
                                       & ~low_bits(frag_cols_below(ctx.kr[r, q, 0] - base)))
                keep = keep & inside
            mask_row_by_bits(acc_S_mn, r, keep)

    @cute.jit
    def mask_by_compares(self, ctx, acc_S_mn, col0):
        BM = self.tile_m
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            row = self.q_pos(ctx.m_block * BM + ctx.tScS_mn[r, 0][0])
            limit = ctx.seqlen_k - col0
            if const_expr(self.mask_right):
                limit = cutlass.min(limit, row + 1 + ctx.seqlen_k - self.q_count(ctx.seqlen_q) + ctx.win_right - col0)
            lo = Int32(0)
            if const_expr(self.mask_left):
                lo = row + ctx.seqlen_k - self.q_count(ctx.seqlen_q) - ctx.win_left - col0
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                col = ctx.tScS_mn[0, c][1]
                visible = col < limit
                if const_expr(self.mask_left):
                    visible = visible & (col >= lo)
                acc_S_mn[r, c] = score_or_neg_inf(visible, acc_S_mn[r, c])

    @cute.jit
    def maybe_mask(self, ctx, acc_S_mn, n_block, masked, csr_mask_entry=True,
                   col_offset: cutlass.Constexpr = 0):
        """Mask if ``masked``: a Python bool (dense configs: decided at trace time) or a run-time
        Boolean (key ranges / block-sparse). Block-sparse: ``csr_mask_entry`` (run time: the
        block is a CSR mask entry) selects the element predicate, else only the key tail (full
        entries).

        Never name a variable ``pred`` in code that a run-time ``if`` reads: the DSL's AST
        preprocessor (nvidia-cutlass-dsl 4.8.1) turns ``if c:`` into ``def if_region(pred):``
        and only renames that parameter away from names the body *assigns*, so a ``pred`` the
        body merely reads is shadowed by the outer condition. That is how this selector, once
        called ``pred``, became ``masked`` and full CSR entries holding the key tail got the
        causal/window predicate (the H100 failures of bs-*-causal; test_sm90_visit_plan.py
        runs this code on the CPU and checks the names)."""
        if const_expr(isinstance(masked, bool)):
            if const_expr(masked):
                # a trace-time False selector: a block-sparse full entry holding the key tail
                self.mask_scores(ctx, acc_S_mn, n_block,
                                 const_expr(self.block_sparse and csr_mask_entry is False), col_offset)
        else:
            if masked:
                if const_expr(self.block_sparse):
                    if csr_mask_entry:
                        self.mask_scores(ctx, acc_S_mn, n_block)
                    else:
                        self.mask_scores(ctx, acc_S_mn, n_block, True)
                else:
                    self.mask_scores(ctx, acc_S_mn, n_block, False, col_offset)

    @cute.jit
    def apply_softcap(self, ctx, acc_S):
        """s <- cap * tanh(s * scale / cap); the softmax then runs with scale 1 (log2 e)."""
        if const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * ctx.softcap_scale) * ctx.softcap_val

    @cute.jit
    def online_softmax(self, ctx, acc_S_mn, corr):
        """S -> P = exp2(S * scale_log2 - rowmax * scale_log2) in place; corr = exp2(old - new max).

        One pass per row; the quad of threads sharing a row reduces its max by shuffle (the sum
        stays per-thread until the end, since corr is uniform over the quad). Returns whether a
        row of this thread moved its max (with a rescale threshold; else True).
        """
        moved = Boolean(self.rescale_threshold <= 0.0)
        ncols = cute.size(acc_S_mn, mode=[1])
        # row max and row sum over `chains` independent partial results, combined at the end:
        # one serial chain of ncols dependent FMNMX / FADD is latency, not throughput
        chains = self.reduce_chains if ncols % self.reduce_chains == 0 else 1
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            m_old = ctx.row_max[r]
            part = [acc_S_mn[r, i] for i in range(chains)]
            part[0] = cute.arch.fmax(m_old, part[0])
            for c in cutlass.range_constexpr(chains, ncols):
                part[c % chains] = cute.arch.fmax(part[c % chains], acc_S_mn[r, c])
            m = tree_reduce(part, cute.arch.fmax)
            m = cute.arch.warp_reduction_max(m, threads_in_group=4)
            if const_expr(self.rescale_threshold > 0.0):
                # keep the running max while the new one exceeds it by at most the threshold
                # (base-2 units): P <= 2^threshold, and O needs no rescale. A row's first finite max
                # always moves it (-inf + threshold); an all -inf row gives NaN and keeps -inf.
                if (m - m_old) * ctx.scale_log2 <= self.rescale_threshold:
                    m = m_old
            ctx.row_max[r] = m
            # a row that has seen no key keeps max -inf; use 0 so exp2 gives 0, not NaN
            m_scaled = m * ctx.scale_log2
            if m == -Float32.inf:
                m_scaled = Float32(0.0)
            c_r = cute.math.exp2(m_old * ctx.scale_log2 - m_scaled, fastmath=True)
            if const_expr(self.rescale_threshold > 0.0):
                c_r = cutlass.select_(m == m_old, Float32(1.0), c_r)
                moved = moved | (m != m_old)
            sums = [Float32(0.0)] * chains
            for c in cutlass.range_constexpr(ncols):
                p = cute.math.exp2(acc_S_mn[r, c] * ctx.scale_log2 - m_scaled, fastmath=True)
                acc_S_mn[r, c] = p
                sums[c % chains] = p if c < chains else sums[c % chains] + p
            ctx.row_sum[r] = ctx.row_sum[r] * c_r + tree_reduce(sums, lambda a, b: a + b)
            corr[r] = c_r
        return moved

    @cute.jit
    def rescale_O(self, ctx, corr, moved):
        """O *= corr per row; with a rescale threshold only when a row of this thread moved its max
        (a warp runs the multiplies when any of its threads needs them)."""
        if const_expr(self.rescale_threshold > 0.0):
            if moved:
                self.scale_O_rows(ctx, corr)
        else:
            self.scale_O_rows(ctx, corr)

    @cute.jit
    def scale_O_rows(self, ctx, corr):
        for r in cutlass.range_constexpr(cute.size(ctx.acc_O_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(ctx.acc_O_mn, mode=[1])):
                ctx.acc_O_mn[r, c] = ctx.acc_O_mn[r, c] * corr[r]

    @cute.jit
    def trace_phase(self, at, slot: cutlass.Constexpr, n_blocks=None):
        """(trace_phases) The warpgroup's first thread (the producer warp's: thread 0, as
        warpgroup 0) stamps the SM clock's low 24 bits (exact in fp32) into LSE row 64 * wg + slot
        of the tile; at the tile's start also the SM id, the
        global timer in 32 ns units (the clock's rate) and the tile's key-block count. Only where
        the warpgroup's len(TRACE_SLOTS) stamp rows lie inside the sequence."""
        if const_expr(self.trace_phases):
            mLSE, tidx, m_block, head_idx, batch_idx, wg, seqlen_q = at
            row0 = m_block * self.tile_m + 64 * wg
            if tidx % 128 == 0 and row0 + len(TRACE_SLOTS) <= seqlen_q:
                clock, smid, gtime = trace_registers()
                mLSE[row0 + slot, head_idx, batch_idx] = Float32(clock & 0xFFFFFF)
                if const_expr(n_blocks is not None):
                    mLSE[row0 + TRACE_SLOTS["smid"], head_idx, batch_idx] = Float32(smid)
                    mLSE[row0 + TRACE_SLOTS["gtime"], head_idx, batch_idx] = Float32((gtime >> 5) & 0xFFFFFF)
                    mLSE[row0 + TRACE_SLOTS["n_blocks"], head_idx, batch_idx] = Float32(n_blocks)

    @cute.jit
    def sched_sync(self, ctx):
        """Ping-pong (round robin): wait until the previous warpgroup has issued its GEMMs.
        Barrier _BAR_WG_SCHED + w counts warpgroup w's sync and its predecessor's arrive."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_BAR_WG_SCHED + ctx.wg, number_of_threads=256)

    @cute.jit
    def sched_arrive(self, ctx):
        if const_expr(self.pingpong):
            nxt = (ctx.wg + 1) % self.num_mma_wg  # the next warpgroup in the ring
            cute.arch.barrier_arrive(barrier_id=_BAR_WG_SCHED + nxt, number_of_threads=256)

    @cute.jit
    def qk(self, ctx, kv_state):
        acc_S = cute.make_rmem_tensor(ctx.thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
                                      Float32)
        self.gemm(ctx.tiled_mma_qk, acc_S, ctx.tSrQ, ctx.tSrK[None, None, None, kv_state.index],
                  True)
        return acc_S

    @cute.jit
    def convert_P(self, acc_S, tOrP):
        tOrP.store(cute.make_tensor(acc_S.iterator, _acc_as_frg_a_layout(acc_S.layout))
                   .load().to(self.dtype))

    # ---- without intra-warpgroup overlap -------------------------------------------------------
    @cute.jit
    def one_block(self, ctx, masked, n_block, kv_state, csr_mask_entry=True):
        ctx.pipe_k.consumer_wait(kv_state)
        self.sched_sync(ctx)
        acc_S = self.qk(ctx, kv_state)
        self.sched_arrive(ctx)
        warpgroup.wait_group(0)
        ctx.pipe_k.consumer_release(kv_state)
        self.apply_softcap(ctx, acc_S)
        acc_S_mn = cute.make_tensor(acc_S.iterator, _acc_mn_layout(acc_S.layout))
        self.maybe_mask(ctx, acc_S_mn, n_block, masked, csr_mask_entry)
        corr = cute.make_rmem_tensor_like(ctx.row_max, Float32)
        moved = self.online_softmax(ctx, acc_S_mn, corr)
        self.rescale_O(ctx, corr, moved)
        tOrP = cute.make_rmem_tensor(_frg_a_shape(acc_S.shape), self.dtype)
        self.convert_P(acc_S, tOrP)
        ctx.pipe_v.consumer_wait(kv_state)
        self.gemm(ctx.tiled_mma_pv, ctx.acc_O, tOrP, ctx.tOrVt[None, None, None, kv_state.index],
                  False, a_in_registers=True)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    # ---- with intra-warpgroup overlap ----------------------------------------------------------
    @cute.jit
    def first_half_block(self, ctx, n_block, kv_state, tOrP, masked=True,
                         csr_mask_entry=True, narrow=None):
        """S, mask and softmax of the first block (``masked``: a Python bool, or a run-time
        Boolean for dense tiles, which mask it only when it holds the key tail or a mask
        boundary); its P V runs in the next step. ``narrow`` (narrow_first; run time): the
        warpgroup's rows see none of the block's upper half keys, so only the lower half is
        computed (the wgmma's issue, wait and reads of S stay inside one branch)."""
        if const_expr(narrow is None):
            self.first_block_scores(ctx, n_block, kv_state, tOrP, masked, csr_mask_entry, False)
        else:
            if narrow:
                self.first_block_scores(ctx, n_block, kv_state, tOrP, True, csr_mask_entry, True)
            else:
                self.first_block_scores(ctx, n_block, kv_state, tOrP, masked, csr_mask_entry, False)

    @cute.jit
    def first_block_is_narrow(self, ctx, n_block):
        """Whether this warpgroup's rows see no key in the upper half of block ``n_block``: one
        past its last row's last visible key is at most the half's first key."""
        last_row = self.q_pos(ctx.m_block * self.tile_m + 64 * ctx.wg + 63)
        key_end = cutlass.min(ctx.seqlen_k, last_row + 1 + ctx.seqlen_k - self.q_count(ctx.seqlen_q)
                              + ctx.win_right)
        return key_end <= n_block * self.tile_n + self.tile_n // 2

    @cute.jit
    def first_block_scores(self, ctx, n_block, kv_state, tOrP, masked, csr_mask_entry,
                           narrow: cutlass.Constexpr):
        ctx.pipe_k.consumer_wait(kv_state)
        if const_expr(narrow):
            acc_S = cute.make_rmem_tensor(ctx.thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
                                          Float32)
            acc_S_lo = cute.make_tensor(acc_S.iterator, ctx.narrow_acc_layout)
            self.gemm(ctx.tiled_mma_qk_narrow, acc_S_lo, ctx.tSrQ,
                      ctx.tSrK_narrow[None, None, None, kv_state.index], True)
        else:
            acc_S = self.qk(ctx, kv_state)
        warpgroup.wait_group(0)
        ctx.pipe_k.consumer_release(kv_state)
        acc_S_mn = cute.make_tensor(acc_S.iterator, _acc_mn_layout(acc_S.layout))
        acc_S_sm = acc_S_mn
        if const_expr(narrow):
            self.apply_softcap(ctx, acc_S_lo)
            acc_S_sm = cute.make_tensor(acc_S.iterator, _acc_mn_layout(ctx.narrow_acc_layout))
        else:
            self.apply_softcap(ctx, acc_S)
        self.maybe_mask(ctx, acc_S_sm, n_block, masked, csr_mask_entry)
        corr = cute.make_rmem_tensor_like(ctx.row_max, Float32)
        self.online_softmax(ctx, acc_S_sm, corr)  # O is still zero: no rescale needed
        if const_expr(narrow):
            # P of the upper half's keys, which no row of this warpgroup sees
            for c in cutlass.range_constexpr(cute.size(acc_S_sm, mode=[1]),
                                             cute.size(acc_S_mn, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    acc_S_mn[r, c] = Float32(0.0)
        if const_expr(self.rescale_before_pv):
            ctx.corr_prev.store(corr.load())  # applied to the zero O before the first P V: harmless
        self.convert_P(acc_S, tOrP)

    @cute.jit
    def blocks_after_first_narrow_last(self, ctx, kv_state, tOrP, n_block_max, n_blocks, n_masked,
                                       n_masked_left):
        """(narrow_last) The tile's blocks after its first in the narrow_last order
        (block_info.masked_last_groups; the TMA warp loads them so): the unmasked ones in their
        loop, then every masked one in one loop whose steps each run whole, masked or, where
        this warpgroup's rows see none of the block's lower half keys, narrow. So the kernel
        holds three copies of the step, as other configs' three loops do. (A run-time mask
        branch inside one step, beside the P V in flight, made ptxas serialize every wgmma:
        C7514; docs section 42.)"""
        u0, n_unmasked, n_right, l0 = masked_last_groups(n_blocks, n_masked, n_masked_left,
                                                         cutlass.max)
        for i in cutlass.range(n_unmasked, unroll=1):
            kv_state = self.overlapped_block(ctx, False, n_block_max - 1 - u0 - i, kv_state, tOrP)
        for i in cutlass.range(n_right + cutlass.max(n_blocks - l0, 0), unroll=1):
            visit = cutlass.select_(i < n_right, 1 + i, l0 + i - n_right)
            n_block = n_block_max - 1 - visit
            # the pipeline states advance outside the branch: advanced in both paths, they met
            # at its join as values ptxas no longer held warp-uniform, and every wgmma
            # descriptor after it moved from uniform registers (244 R2UR; 2-6 % slower)
            kv_state_v = kv_state.clone()
            kv_state.advance()
            if self.last_block_is_narrow(ctx, n_block):
                self.overlapped_step(ctx, True, n_block, kv_state, kv_state_v, tOrP, narrow_upper=True)
            else:
                self.overlapped_step(ctx, True, n_block, kv_state, kv_state_v, tOrP)
        return kv_state

    @cute.jit
    def last_block_is_narrow(self, ctx, n_block):
        """Whether this warpgroup's rows see no key in the lower half of block ``n_block``: its
        first row's first visible key (left bound) is at least the upper half's first key."""
        first_row = self.q_pos(ctx.m_block * self.tile_m + 64 * ctx.wg)
        key_lo = first_row + ctx.seqlen_k - self.q_count(ctx.seqlen_q) - ctx.win_left
        return key_lo >= n_block * self.tile_n + self.tile_n // 2

    @cute.jit
    def overlapped_block(self, ctx, masked, n_block, kv_state, tOrP, csr_mask_entry=True):
        """S = Q K^T of block ``n_block`` beside the previous block's P V, then its mask and
        softmax (overlapped_step), the pipeline state advanced to this block."""
        kv_state_v = kv_state.clone()   # V of the previous block
        kv_state.advance()              # K of this block
        self.overlapped_step(ctx, masked, n_block, kv_state, kv_state_v, tOrP, csr_mask_entry)
        return kv_state

    @cute.jit
    def overlapped_step(self, ctx, masked, n_block, kv_state, kv_state_v, tOrP, csr_mask_entry=True,
                        narrow_upper: cutlass.Constexpr = False):
        """overlapped_block's work with the pipeline states given: K of this block at
        ``kv_state``, V of the previous one at ``kv_state_v``. ``narrow_upper`` (narrow_last):
        the Q K^T, mask and softmax of the block's upper half keys only (this warpgroup's rows
        see none of the lower half), P's lower half zero."""
        ctx.pipe_k.consumer_wait(kv_state)
        self.sched_sync(ctx)
        acc_S_hi = None
        if const_expr(narrow_upper):
            acc_S = cute.make_rmem_tensor(ctx.thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
                                          Float32)
            # the upper half's columns are the second half of the full accumulator's registers
            # (column blocks of 8 in order), where P's upper half must be for the P V
            acc_S_hi = cute.make_tensor(acc_S.iterator + cute.cosize(ctx.narrow_acc_layout),
                                        ctx.narrow_acc_layout)
            self.gemm(ctx.tiled_mma_qk_narrow, acc_S_hi, ctx.tSrQ,
                      ctx.tSrK_upper[None, None, None, kv_state.index], True)
        else:
            acc_S = self.qk(ctx, kv_state)
        if const_expr(self.rescale_before_pv):
            self.scale_O_rows(ctx, ctx.corr_prev)  # beside the Q K^T in flight
        ctx.pipe_v.consumer_wait(kv_state_v)
        self.gemm(ctx.tiled_mma_pv, ctx.acc_O, tOrP, ctx.tOrVt[None, None, None, kv_state_v.index],
                  False, a_in_registers=True)
        self.sched_arrive(ctx)
        warpgroup.wait_group(1)         # S is ready, P V may still run
        ctx.pipe_k.consumer_release(kv_state)
        acc_S_mn = cute.make_tensor(acc_S.iterator, _acc_mn_layout(acc_S.layout))
        corr = cute.make_rmem_tensor_like(ctx.row_max, Float32)
        if const_expr(narrow_upper):
            self.apply_softcap(ctx, acc_S_hi)
            acc_S_hi_mn = cute.make_tensor(acc_S_hi.iterator, _acc_mn_layout(ctx.narrow_acc_layout))
            self.maybe_mask(ctx, acc_S_hi_mn, n_block, True, csr_mask_entry,
                            col_offset=self.tile_n // 2)
            moved = self.online_softmax(ctx, acc_S_hi_mn, corr)
            # P of the lower half's keys, which no row of this warpgroup sees
            for c in cutlass.range_constexpr(cute.size(acc_S_hi_mn, mode=[1])):
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    acc_S_mn[r, c] = Float32(0.0)
        else:
            self.apply_softcap(ctx, acc_S)
            self.maybe_mask(ctx, acc_S_mn, n_block, masked, csr_mask_entry)
            moved = self.online_softmax(ctx, acc_S_mn, corr)
        warpgroup.wait_group(0)         # P V done: tOrP and O may be touched again
        ctx.pipe_v.consumer_release(kv_state_v)
        self.convert_P(acc_S, tOrP)
        if const_expr(self.rescale_before_pv):
            ctx.corr_prev.store(corr.load())
        else:
            self.rescale_O(ctx, corr, moved)

    @cute.jit
    def last_half_block(self, ctx, kv_state, tOrP):
        if const_expr(self.rescale_before_pv):
            self.scale_O_rows(ctx, ctx.corr_prev)
        ctx.pipe_v.consumer_wait(kv_state)
        self.gemm(ctx.tiled_mma_pv, ctx.acc_O, tOrP, ctx.tOrVt[None, None, None, kv_state.index],
                  False, a_in_registers=True)
        warpgroup.wait_group(0)
        ctx.pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def gemm(self, tiled_mma, acc, tCrA, tCrB, zero_init: cutlass.Constexpr,
             a_in_registers: cutlass.Constexpr = False):
        if const_expr(a_in_registers):
            # P V: pack P's 16-bit halves into the 32-bit operand registers before the fence.
            # Packed inside the k loop (where LLVM put them at hd192 / hd256's narrow key tiles),
            # they define wgmma operands after the fence, and ptxas injects a warpgroup.arrive
            # before each wgmma (warning C7519)
            words = cute.recast_tensor(tCrA, Uint32)
            packed = cute.make_rmem_tensor_like(words)
            packed.store(words.load())
            tCrA = cute.recast_tensor(packed, tCrA.element_type)
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
            cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
