"""Hopper (SM90) fast kernels; registers "fast-sm90" (forward) with dualattn.dispatch.

``FastSm90Forward`` serves batched and varlen forward calls on sm_90: bf16/fp16, head dims 64, 96, 128,
192, 256 (D == Dv) and (192, 128), GQA/MQA, bottom-right causal, sliding windows, softcap, key
ranges (R <= 4), block-sparse CSR, any sequence lengths (see README.md).
Everything else is refused in ``can_implement`` with the reason, so impl="auto" falls back.

Compile cache: one compiled kernel per ``compile_key(spec)`` = (kernel name, dtype, D, Dv, causal,
window-left?, window-right?, softcap?, tile_m, tile_n, stages, pingpong, overlap, persistent,
separate O, Q buffers, paired causal order, varlen L2 sections, rescale threshold, rescale before
P V, L2 section bytes of the causal tile order, arch), plus "_nolse" in the name for calls that neither return the LSE nor need it. Batch, sequence lengths, head counts, window sizes, cap and scale are runtime
values, so they never recompile.

Launch: a cached call passes one packed argument (fast/common/launch_args.py: pointers, shapes,
q/k/v strides, scalars in one ctypes struct) plus the stream to the compiled
``FlashFwdSm90.from_packed``; no DLPack conversion per call (host overhead ~115 us -> ~10 us).
"""
from __future__ import annotations

import atexit
import math
import os
import shutil
import tempfile
from typing import Optional, Tuple

import torch

from dualattn import dispatch
from dualattn.spec import VALUE_CHECK_MEMO
from dualattn.fast.common.compile_cache import CompileCache, arch_string, target_arch
from dualattn.fast.common.sm90_pipeline import SMEM_LIMIT
from dualattn.fast.common.tile_order import (L2_SECTION_BYTES, SPLIT_MIN_PIECE_KEYS, SPLIT_MIN_PIECE_KEYS_CAUSAL, SPLIT_TAIL_MIN_GAIN, STREAM_K_MIN_KEYS,
                                              STREAM_K_MIN_KEYS_NARROW, heads_per_section,
                                              paired_unit_blocks, paired_units, split_tail_plan, split_tail_table,
                                              stream_k_tiles, split_pieces, stream_k_grid,
                                              SPLIT_MAX_PIECES, WAVE_CALL_BLOCKS, WAVE_PIECE_BLOCKS,
                                              WAVE_TILE_BLOCKS, lpt_unit_table, static_stride_loads,
                                              varlen_paired_unit_costs, heavy_first_in_sections)
from dualattn.fast.common.launch_args import (BoundLaunch, DirectLauncher, current_device_index,
                                              current_stream_handle, empty_f32, empty_output)

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)

# (tile_n, stages) per head dim; tile_m is 128 (two consumer warpgroups x 64 rows).
# Sized so Q + stages * (K + V) fits the 227 KB of shared memory (see FlashFwdSm90.__init__).
# Persistent grid (one CTA per SM walking tiles; overlaps a tile's epilogue with the next tile's
# loads) for non-causal calls. Measured on an H200 (bf16, 16k tokens): +2..10% for non-causal;
# causal is faster with one CTA per tile (the hardware hands the heavy-first tiles to whichever
# SM frees up, a better balance than a static stride: hd128 16k causal 615 vs 579 TFLOP/s).
# DUALATTN_SM90_PERSISTENT=0/1 forces the choice (for comparisons and tests).
_PERSISTENT_ENV = os.environ.get("DUALATTN_SM90_PERSISTENT", "")
_PACK_GQA_ENV = os.environ.get("DUALATTN_SM90_PACK_GQA", "")  # see FastSm90Forward.pack_gqa
_Q_STAGES_ENV = os.environ.get("DUALATTN_SM90_Q_STAGES", "")  # see FastSm90Forward.q_stages
_PAIRED_ENV = os.environ.get("DUALATTN_SM90_PAIRED", "")  # see FastSm90Forward.paired
_WINDOW_ORDER_ENV = os.environ.get("DUALATTN_SM90_WINDOW_ORDER", "")  # see FastSm90Forward.window_order
_VARLEN_SECTIONS_ENV = os.environ.get("DUALATTN_SM90_VARLEN_SECTIONS", "")  # see .varlen_sections
_RESCALE_THRESHOLD_ENV = os.environ.get("DUALATTN_SM90_RESCALE_THRESHOLD", "")  # see .rescale_threshold
_RESCALE_BEFORE_PV_ENV = os.environ.get("DUALATTN_SM90_RESCALE_BEFORE_PV", "")  # see .rescale_before_pv
_WG_EPILOGUE_ENV = os.environ.get("DUALATTN_SM90_WG_EPILOGUE", "")  # see FastSm90Forward.wg_epilogue
_WG_KEY_BOUND_ENV = os.environ.get("DUALATTN_SM90_WG_KEY_BOUND", "")  # see FastSm90Forward.wg_key_bound
_STREAM_K_ENV = os.environ.get("DUALATTN_SM90_STREAM_K", "")  # see FastSm90Forward.stream_k
_SPLIT_TAIL_ENV = os.environ.get("DUALATTN_SM90_SPLIT_TAIL", "")  # see FastSm90Forward.split_tail
_VARLEN_LPT_ENV = os.environ.get("DUALATTN_SM90_VARLEN_LPT", "")  # see .varlen_unit_table
_CSR_LPT_ENV = os.environ.get("DUALATTN_SM90_CSR_LPT", "")  # see FastSm90Forward.csr_table
# the K + V bytes of a section of the block-sparse unit table (comparisons; csr_unit_plan)
_CSR_LPT_SECTION_ENV = os.environ.get("DUALATTN_SM90_CSR_LPT_SECTION_BYTES", "")
# the modelled tile overhead of the varlen unit table (comparisons; VARLEN_LPT_TILE_OVERHEAD)
_VARLEN_LPT_OVERHEAD_ENV = os.environ.get("DUALATTN_SM90_VARLEN_LPT_OVERHEAD", "")
# a fixed count of tail groups (comparisons; see FastSm90Forward.split_tail_schedule)
_SPLIT_TAIL_GROUPS_ENV = os.environ.get("DUALATTN_SM90_SPLIT_TAIL_GROUPS", "")  # (split_tail)
# the modelled tile overhead in key blocks (comparisons; default SPLIT_TAIL_TILE_OVERHEAD)
_SPLIT_TAIL_OVERHEAD_ENV = os.environ.get("DUALATTN_SM90_SPLIT_TAIL_OVERHEAD", "")
# units cut into pieces on P CTAs each (FastSm90Forward.stream_k_plan): "0" keeps one CTA per
# unit, a number caps the pieces a unit is cut into (tile_order.SPLIT_MAX_PIECES by default)
_SPLIT_UNITS_ENV = os.environ.get("DUALATTN_SM90_SPLIT_UNITS", "")
# keys a piece keeps at least (tile_order.SPLIT_MIN_PIECE_KEYS by default; tests: fewer keys
# reach more pieces, see _split_piece_keys)
_SPLIT_PIECE_KEYS_ENV = os.environ.get("DUALATTN_SM90_SPLIT_PIECE_KEYS", "")
_BIT_MASK_ENV = os.environ.get("DUALATTN_SM90_BIT_MASK", "")  # see FastSm90Forward.bit_mask
_TILE_INFO_ENV = os.environ.get("DUALATTN_SM90_TILE_INFO", "")  # see FastSm90Forward.tile_info
_Q_REGS_ENV = os.environ.get("DUALATTN_SM90_Q_REGS", "")  # see FastSm90Forward.q_regs
_PASS_EMPTY_WG_ENV = os.environ.get("DUALATTN_SM90_PASS_EMPTY_WG", "")  # see .pass_empty_wg
_KEY_SPLIT_ENV = os.environ.get("DUALATTN_SM90_KEY_SPLIT", "")  # see FastSm90Forward.key_split
_END_ALIGNED_ENV = os.environ.get("DUALATTN_SM90_END_ALIGNED", "")  # see FastSm90Forward.end_aligned
_LSE_AFTER_O_ENV = os.environ.get("DUALATTN_SM90_LSE_AFTER_O", "")  # see FastSm90Forward.lse_after_o
_O_SLOT_ENV = os.environ.get("DUALATTN_SM90_O_SLOT", "")  # see FastSm90Forward.shared_o_slot
_STAGING_PER_TILE_ENV = os.environ.get("DUALATTN_SM90_STAGING_PER_TILE", "")  # see .staging_per_tile
_NARROW_FIRST_ENV = os.environ.get("DUALATTN_SM90_NARROW_FIRST", "")  # see .narrow_first
_NARROW_LAST_ENV = os.environ.get("DUALATTN_SM90_NARROW_LAST", "")  # see .narrow_last
_TILE_DECODER_ENV = os.environ.get("DUALATTN_SM90_TILE_DECODER", "")  # see .tile_decoder
_STMATRIX_O_ENV = os.environ.get("DUALATTN_SM90_STMATRIX_O", "")  # see .stmatrix_o
_MERGE_LIVE_ROWS_ENV = os.environ.get("DUALATTN_SM90_MERGE_LIVE_ROWS", "")  # see .merge_live_rows
_MERGE_BATCH_ENV = os.environ.get("DUALATTN_SM90_MERGE_BATCH", "")  # see .merge_batch
MERGE_BATCH = 4
_WARP_STORE_O_ENV = os.environ.get("DUALATTN_SM90_WARP_STORE_O", "")  # see .warp_store_o
_L2_HINTS_ENV = os.environ.get("DUALATTN_SM90_L2_HINTS", "")  # see .l2_hints
# diagnostics only, set by ci/phase_trace.py (never an environment variable: a traced kernel
# returns phase stamps in place of the LSE); see FastSm90Forward.trace_phases
TRACE_PHASES = False
# keys a tile must visit to be cut (tile_order.STREAM_K_MIN_KEYS; tests: 0 cuts small shapes)
_STREAM_K_MIN_KEYS_ENV = os.environ.get("DUALATTN_SM90_STREAM_K_MIN_KEYS", "")


def _stream_k_min_keys(narrow: bool) -> int:
    """Keys a unit must visit to be cut (read at call time: tests set the override); ``narrow``:
    a unit is one tile at D <= 128 (tile_order.STREAM_K_MIN_KEYS_NARROW)."""
    if _STREAM_K_MIN_KEYS_ENV:
        return int(_STREAM_K_MIN_KEYS_ENV)
    return STREAM_K_MIN_KEYS_NARROW if narrow else STREAM_K_MIN_KEYS


# partial results per row in the softmax's reductions (FastSm90Forward.reduce_chains), comparisons
_REDUCE_CHAINS_ENV = os.environ.get("DUALATTN_SM90_REDUCE_CHAINS", "")
# the SM count the persistent grid is sized by (tests: a small grid makes cut tiles at small shapes)
_NUM_SMS_ENV = os.environ.get("DUALATTN_SM90_NUM_SMS", "")
# the SM count only the config's grid rules assume, the launch's grid unchanged (tests: "1" gives
# small shapes the configs large ones get; see _model_sm_count)
_MODEL_SMS_ENV = os.environ.get("DUALATTN_SM90_MODEL_SMS", "")

TILE_CONFIG = {64: (128, 3), 96: (128, 2), 128: (128, 2), 192: (112, 2), 256: (80, 2)}
# head dims (D, Dv) with Dv != D: (192, 128) (DeepSeek-style MLA prefill). Q 48 KB + 2 stages of
# K (48 KB) + V (32 KB) at tile_n 128 = 208 KB: the wider key tile of hd128 fits.
TILE_CONFIG_DV = {(192, 128): (128, 2)}



# Tuning hook (for sweeps against the peers, not for users): DUALATTN_SM90_TILES="128:176,2,0;64:..."
# overrides, per head dim (D == Dv), tile_n, stages and optionally separate O (0/1), ping-pong
# (0/1), the number of consumer warpgroups (2 or 3: tile_m 128 or 192) and the intra-warpgroup
# overlap (0/1; 0 waits for each GEMM before the softmax, docs section 39). Every field is in the
# compile key, so an override never reuses another config's kernel.
def _tile_override(head_dim: int, head_dim_v: int) -> Optional[Tuple[int, ...]]:
    if head_dim != head_dim_v:
        return None
    for entry in os.environ.get("DUALATTN_SM90_TILES", "").split(";"):
        if entry.strip():
            hd, cfg = entry.split(":")
            if int(hd) == head_dim:
                return tuple(int(x) for x in cfg.split(","))
    return None


def _tile_config(head_dim: int, head_dim_v: int):
    override = _tile_override(head_dim, head_dim_v)
    if override is not None:
        return override[0], override[1]
    return TILE_CONFIG_DV.get((head_dim, head_dim_v)) or TILE_CONFIG[head_dim]

MAX_KEY_RANGES = 4  # per-row intervals held in registers


def _plain_hd64(spec) -> bool:
    """hd64 (D == Dv) with no window, key ranges or block-sparse CSR: the calls whose grid and
    tile differ from the other head dims' (see config)."""
    return (spec.head_dim == 64 and spec.head_dim_v == 64 and spec.window == (-1, -1)
            and not spec.has_key_ranges and not spec.has_block_sparse)


PERSISTENT_MAX_TILE_KEYS = 4096  # see _short_masked_tiles
# plain causal (no window) keys up to which hd128 / hd256 tiles run on the persistent grid
PERSISTENT_MAX_CAUSAL_KEYS = {128: 16384, 256: 2048}


def _short_masked_tiles(spec) -> bool:
    """Plain causal calls at D = 128 up to 16k keys and at D = 256 up to 2k keys (see
    PERSISTENT_MAX_CAUSAL_KEYS), and other causal / windowed calls at D <= 128, without key
    ranges or a CSR, whose longest query
    tile visits at most PERSISTENT_MAX_TILE_KEYS keys (Sk, or the window's span): their tiles
    are short, so the persistent grid's overlap of one tile's epilogue with the next one's loads
    is worth more than the balance one CTA per tile gives uneven tiles. H100, bf16, one process,
    one-CTA-per-tile -> persistent, medians of 3 interleaved runs (ci/sm90_grid_ab.py persistent):
    hd128 causal 512 / 1k / 2k: 182 -> 212, 297 -> 325, 438 -> 444 TFLOP/s, but 4k / 8k / 16k
    0.86-0.90x; GQA 32/8 causal 2k 419 -> 467; window 1024 at 16k 452 -> 476; 10 packed causal
    documents (varlen, longest 2312) 328 -> 359. hd256 causal lost at every length (0.69-0.88x)
    and CSR calls did not gain (block-sparse 1.01x, documents as a CSR 0.90x). With the causal
    tiles in pairs of equal work (FastSm90Forward.paired; 2026-11-24, H100, same script, per-tile
    -> persistent): hd128 causal 4k 612 -> 641, 8k 611 -> 614, 16k 656 -> 638; GQA causal 8k
    610 -> 625; hd256 causal 8k / 16k 0.92 / 0.95x: the bound moved from 2560 to 4096 keys."""
    if spec.has_key_ranges or spec.has_block_sparse:
        return False
    if spec.causal and spec.window == (-1, -1) and spec.head_dim == spec.head_dim_v \
            and spec.head_dim in PERSISTENT_MAX_CAUSAL_KEYS:
        # 2026-11-25 (second session; pairs, two Q buffers and one epilogue per warpgroup at
        # hd128), H100, bf16, ci/sm90_grid_ab.py persistent, two runs, time ratio one CTA per
        # tile / persistent: hd128 causal 8k 1.001 / 1.005, 16k 1.010 / 1.017, GQA 32/8 causal
        # 8k 1.037 / 1.050; hd256 causal 512 1.047 / 1.051, 1k 1.029 / 1.028, 2k 1.009 / 1.008,
        # but 4k 0.988 / 1.022, 8k 1.017 / 0.991, 16k 0.977 / 1.001
        return spec.seqlen_k <= PERSISTENT_MAX_CAUSAL_KEYS[spec.head_dim]
    if spec.head_dim > 128:
        return False
    left, right = spec.window
    if not (spec.causal or right >= 0 or left >= 0):
        return False  # non-causal unbounded: persistent anyway
    keys = spec.seqlen_k  # varlen: the longest sequence
    if left >= 0 and (spec.causal or right >= 0):  # both bounds: the window's span over a tile
        keys = min(keys, left + (0 if spec.causal else right) + 2 * 128)
    return keys <= PERSISTENT_MAX_TILE_KEYS


# query rows from which sliding windows run the window order (FastSm90Forward.window_order).
# H100, bf16, causal windows, CUDA-graph replays interleaved (ci/sm90_env_ab.py
# "_WINDOW_ORDER_ENV=0" "" window:b,s,h,d,left), time window order / pairs, (batch x seqlen x
# heads): hd128 1 x 16k x 16 W = 1024 (the bench's cell) 0.965 / 0.966 / 0.985, W = 2048 0.918 /
# 0.922; 2 x 8k x 16 W = 1024 0.975 / 0.981; 4 x 4k x 16 W = 1024 0.977, W = 512 0.981; hd64
# 1 x 16k x 32 W = 1024 0.984 / 0.976, 4 x 4k x 32 W = 256 0.978. Below 4k mixed: 8 x 2k x 16
# W = 1024 0.988 and hd64 16 x 1k x 32 W = 512 0.926, but 8 x 2k x 16 W = 512 1.040, 16 x 1k x
# 16 W = 512 1.027-1.039 and 32 x 512 x 16 W = 256 1.251. There the light tiles are a large share
# of a call with many heads: run last, each reads its head's first key blocks again from memory,
# long after the full tiles did, where the pairs read a head's blocks together.
WINDOW_ORDER_MIN_SEQLEN = 4096
CAUSAL_3WG_MIN_SEQLEN = 4096  # causal hd64 from this many queries runs 3 warpgroups (below)
RESCALE_THRESHOLD = 8.0  # see FastSm90Forward.rescale_threshold: P <= 2^8 between rescales
RESCALE_THRESHOLD_MIN_DV = 192
# varlen causal hd64 from this many queries runs one CTA per tile (_hd64_persistent)
CAUSAL_PER_TILE_MIN_SEQLEN = 16384
SPLIT_TAIL_TILE_OVERHEAD = 1.2  # key blocks' worth of a tile's start and epilogue (split_tail_schedule)
# the same for the varlen unit table (varlen_unit_plan): with 1.2 the table lost where documents
# are short (H100, 40 documents in 32k tokens: time 1.101 against the static stride); with 3 the
# model's time ratios match the measured ones within 0.001-0.016 over ten documents cells
VARLEN_LPT_TILE_OVERHEAD = 3.0
# units up to which the launch plans the varlen unit table (host time: about 1-2 us a unit,
# once per new set of sequence lengths; 1048 units at the bench's documents cell); beyond, the
# static stride
VARLEN_LPT_MAX_UNITS = 16384
# the block-sparse unit table (csr_unit_plan): a tile's start and epilogue in key blocks (the
# persistent grid's per-tile cost, docs section 35: 1.4-1.7), and the units up to which the
# launch plans it (once per pattern; beyond, the kernel's own order)
CSR_LPT_TILE_OVERHEAD = 1.5
# K + V bytes of the heads whose units the table deals together: a quarter of the causal order's
# L2 section. H100, the bench's 25 % pattern (hd128 8k, 4 MB of K and V a head), graph A/B (docs
# section 59): 8 MB (2 heads, about one round of the grid) against 32 MB time 0.973, 4 MB 1.013
# and 16 MB 1.007 against 8 MB
CSR_LPT_SECTION_BYTES = 8 * 1024 * 1024
CSR_LPT_MAX_UNITS = 32768
PACK_GQA_MAX_SEQLEN_Q = 64  # query rows per head up to which GQA heads share the M tile (FastSm90Forward.pack_gqa)


def _hd64_persistent(spec) -> bool:
    """Plain hd64 runs the persistent grid: batched at any length, varlen below
    CAUSAL_PER_TILE_MIN_SEQLEN queries. Batched causal from 16k queries ran one CTA per tile
    until each warpgroup's own key bound reached the paired order's stream-K pieces
    (FastSm90Forward.wg_key_bound); H100, graph A/B, time persistent / one CTA a tile (docs
    section 54): 1 x 16k x 32 0.969, 2 x 16k x 16 0.956, 1 x 16k x 8 0.991, 1 x 32k x 32
    0.958, 1 x 32k x 16 0.989."""
    return _plain_hd64(spec) and (spec.mode == "batched" or spec.seqlen_q < CAUSAL_PER_TILE_MIN_SEQLEN)


def _three_warpgroups(spec) -> bool:
    """Plain hd64 (causal: from CAUSAL_3WG_MIN_SEQLEN queries, or batched from
    CAUSAL_3WG_MIN_SEQLEN_FILLED where the pairs fill the grid, below; non-causal: unless its
    128-row tiles fit one round, _two_wg_tiles_fit_one_round): 3 consumer warpgroups (tile_m
    192) instead of 2.
    H100, bf16, 16k tokens, one lease (TFLOP/s, 2 -> 3 warpgroups; FA4 / cuDNN in the same run):
    1k 335 -> 324, 2k 368 -> 422, 4k 428 -> 475, 8k 442 -> 535, 16k 461 -> 522 (FA4 364-585,
    cuDNN 366-487): more query rows per K/V tile loaded, where hd64's short GEMMs leave the loads
    and per-block overheads exposed. Causal hd64 lost at 1k-4k (201 -> 137-182 TFLOP/s at 1k;
    192-row tiles straddle the diagonal longer), so causal below 16k queries, windows, key ranges
    and block-sparse keep 2. With the round-robin GEMM order (2026-11-24, H100, one lease, causal,
    2 -> 3 warpgroups, TFLOP/s): 1k 236 -> 157, 2k 312 -> 262, 4k 401 -> 351, 8k 446 -> 447-450,
    16k 441-480 -> 505 (persistent) / 517 (one CTA per tile, which causal 3-warpgroup calls run).
    After the mask became one select per element (the 192-row causal tile no longer spills) and
    with the paired causal order, 3 warpgroups with 4 stages on the persistent grid against the
    2-warpgroup default (2026-11-24, H100, one process: ci/sm90_grid_ab.py tiles
    64:128,4,1,1,3): causal 4k 405 -> 416, 8k 422 -> 468, but 512-2k 0.87-0.92x and 16k 0.98x
    (where the default already is 3 warpgroups, 3 stages, one CTA per tile): so causal hd64 runs
    3 warpgroups from 4k queries (FastSm90Forward.config gives them 4 stages below 16k)."""
    if not _plain_hd64(spec):
        return False
    if not spec.causal:
        return not _two_wg_tiles_fit_one_round(spec)
    if spec.mode != "batched" or spec.seqlen_q >= CAUSAL_PER_TILE_MIN_SEQLEN:
        return spec.seqlen_q >= CAUSAL_3WG_MIN_SEQLEN
    return spec.seqlen_q >= CAUSAL_3WG_MIN_SEQLEN_FILLED and _causal_3wg_fills_grid(spec)


# Batched causal hd64 on the persistent grid (paired order) from this many queries runs 3
# warpgroups where its 192-row pairs fill the grid (_causal_3wg_fills_grid). H200, CUDA-graph
# replays interleaved, time 3 / 2 warpgroups (ci/sm90_env_ab.py "" "DUALATTN_SM90_TILES=
# 64:128,4,1,1,3" b,s,h,64,1; docs section 47), by batch x queries x heads (pairs of 192-row
# tiles): 8 x 2k x 32 (1408) 0.966-0.972, 32 x 2k x 32 0.975, 4 x 2k x 16 (352) 0.993, 2 x 2k x 32
# (352) 0.989, 12 x 1536 x 32 0.944, 10 x 1792 x 32 0.976, 6 x 3k x 32 0.901, 6 x 3k x 8 (384)
# 0.925; but 16 x 1k x 32 1.188 (the last tile holds 64 of 192 rows: a sixth of the tiles are
# light, and in the paired order the heaviest), 2 x 2k x 16 (176 pairs) 1.018, 2 x 2k x 8 (88)
# 1.276, and at 4k 1 x 4k x 8 (88 pairs: a third of the SMs idle, nothing for stream-K to cut)
# 1.264, where 1 x 4k x 16 (176) 0.978 and 1 x 8k x 8 (172) 0.912 gain (stream-K cuts pairs of
# 4k keys). Queries below it (1k: the light last tile above) stay on 2 warpgroups. With the
# tiles aligned to the sequence's end (FastSm90Forward.end_aligned: the light tile is the first,
# the cheapest), H100, time 3 / 2 warpgroups (docs section 53): 14 x 1100 x 32 0.975, 14 x 1152 x
# 32 0.973, 12 x 1280 x 32 0.963-0.964, 10 x 1408 x 32 0.969, 4 x 1280 x 32 (448 pairs) 0.997;
# 1k level (16 x 1k x 32 1.003, 32 x 1k x 32 0.981, 16 x 1k x 16 1.006): from 1088 queries.
# (1100 and 1152 have no shift, nor a light tile: section 47 had measured none between 1k and
# 1536, so the old threshold was set by 1k's light tile, which the shift now moves.) With each
# warpgroup's own key bound in these tiles (FastSm90Forward.wg_key_bound: three warpgroup
# blocks in every two tiles passed, not computed), H100, time 3 / 2 warpgroups (docs section 54): 16 x
# 1k x 32 0.941, 32 x 1k x 32 0.939, 16 x 1k x 16 0.950, 8 x 1k x 32 0.956, 16 x 896 x 32
# 0.952, 16 x 768 x 32 0.959; 24 x 640 x 32 1.007, 32 x 512 x 32 1.032: from 768 queries.
# The grid rule holds: 2 x 2k x 16 (176 pairs) 0.989, 2 x 2k x 8 (88) 1.189, 1 x 4k x 8 1.175.
CAUSAL_3WG_MIN_SEQLEN_FILLED = 768
# rounds of 192-row pairs on the SMs that 3 warpgroups need: two below STREAM_K_MIN_KEYS queries
# (no stream-K cut for pairs there), one from it
CAUSAL_3WG_MIN_ROUNDS = 2


def _model_sm_count() -> int:
    """SMs the config's grid rules assume (_causal_3wg_fills_grid, _two_wg_tiles_fit_one_round):
    the current CUDA device's, else an H100's 132 (the CPU compile tests)."""
    if _MODEL_SMS_ENV:
        return int(_MODEL_SMS_ENV)
    if _NUM_SMS_ENV:
        return int(_NUM_SMS_ENV)
    if torch.cuda.is_available():
        return _num_sms(torch.device("cuda"))
    return 132


def _causal_3wg_fills_grid(spec) -> bool:
    """The 192-row tiles' pairs (tile_order.paired_units) run at least CAUSAL_3WG_MIN_ROUNDS
    rounds on the SMs (one round from STREAM_K_MIN_KEYS queries, where stream-K cuts a partial
    last round along the keys): few, coarse pairs leave SMs idle that 128-row pairs fill."""
    pairs = paired_units(-(-spec.seqlen_q // 192), spec.batch * spec.num_heads_q)
    rounds = 1 if spec.seqlen_q >= STREAM_K_MIN_KEYS else CAUSAL_3WG_MIN_ROUNDS
    return pairs >= rounds * _model_sm_count()


def _split_piece_keys(causal: bool, head_dim_v: int = 128) -> int:
    """Keys a piece of a split unit keeps at least (tile_order.split_pieces): causal chunks
    SPLIT_MIN_PIECE_KEYS_CAUSAL, and so Dv > 128, whose merge reads wider records (H200, docs
    section 49: hd256 200 x 4k x 4 heads on 8 pieces, not 4, time 1.017-1.019); the rest
    SPLIT_MIN_PIECE_KEYS. Read at call time: the property campaign draws it to reach many pieces
    at small shapes."""
    if _SPLIT_PIECE_KEYS_ENV:
        return int(_SPLIT_PIECE_KEYS_ENV)
    return SPLIT_MIN_PIECE_KEYS_CAUSAL if causal or head_dim_v > 128 else SPLIT_MIN_PIECE_KEYS


# "0": short causal chunks keep the pairs / one CTA per tile (_causal_split_grid; comparisons)
_CAUSAL_SPLIT_ENV = os.environ.get("DUALATTN_SM90_CAUSAL_SPLIT", "")


def _gqa_pack(spec, tile_m: int) -> int:
    """FastSm90Forward.pack_gqa's rule for a tile of ``tile_m`` rows (the config's; a rule that
    the config itself reads passes 128, the tile of the calls it concerns)."""
    g = spec.num_heads_q // max(spec.num_heads_kv, 1)
    if (g < 2 or g & (g - 1) or spec.mode != "batched" or spec.has_key_ranges or spec.has_block_sparse
            or tile_m % g or _PACK_GQA_ENV == "0"):
        return 1
    return g if _PACK_GQA_ENV == "1" or spec.seqlen_q <= PACK_GQA_MAX_SEQLEN_Q else 1


def _causal_first_tile_keys(spec) -> int:
    """Keys the first 128-row query tile of a batched causal call sees (its last row's; GQA heads
    packed as _gqa_pack packs them): the fewest of any tile. FastSm90Forward.paired_key_blocks(0)
    in keys, without the config, which reads _causal_split_grid."""
    g = _gqa_pack(spec, 128)
    q_end = min(128 // g, spec.seqlen_q)  # the first tile's last row, as a query position, plus 1
    return max(spec.seqlen_k - spec.seqlen_q + q_end, 0)


def _causal_split_grid(spec) -> bool:
    """Batched causal calls (no window, key ranges or CSR) against at least twice
    SPLIT_MIN_PIECE_KEYS_CAUSAL keys (and stream-K's minimum for a tile) whose 128-row tiles (GQA
    heads packed) fit at most half the SMs, and whose first tile sees two key blocks or more and
    half the keys: a chunk of a long prompt, or decoding through attention(). They run on the
    persistent grid in the plain order (not pairs), every tile cut into P pieces along the key
    blocks it sees itself (FlashFwdSm90.item_coords; P at most the first tile's blocks,
    FastSm90Forward.stream_k_plan), so no piece is empty (a piece that never arrived would leave
    its tile unmerged) and each tile's work is shared out evenly. Pairs cut in two give a CTA
    half a pair, (heaviest + lightest) / 2 blocks; this gives heaviest / P, with P >= 2 and twice
    the CTAs (a merge each): from lightest >= heaviest / 2 (half the keys) the tiles are even
    enough. So do such chunks whose tiles fill more than half the SMs (and at most twice them),
    where the wave model finds that tiles cut into P pieces on P x tiles CTAs, taken in rounds,
    beat the order the config would run otherwise (_causal_wave_pieces; H200, docs section 50:
    640 x 32k GQA 32/8, 160 tiles, time 0.658). props/test_schedules.py checks the plans on drawn shapes."""
    first_keys = _causal_first_tile_keys(spec)
    if not (_CAUSAL_SPLIT_ENV != "0" and spec.mode == "batched" and spec.causal and spec.window == (-1, -1)
            and not spec.has_key_ranges and not spec.has_block_sparse
            and spec.seqlen_k >= max(2 * _split_piece_keys(True), _stream_k_min_keys(spec.head_dim <= 128))
            and first_keys > _tile_config(spec.head_dim, spec.head_dim_v)[0] and 2 * first_keys >= spec.seqlen_k):
        return False
    g = _gqa_pack(spec, 128)
    units = spec.batch * (spec.num_heads_q // g) * -(-g * spec.seqlen_q // 128)
    num_sms = _model_sm_count()
    return 2 * units <= num_sms or _causal_wave_pieces(spec, num_sms) >= 2


# with this many live rows a tile at least (query rows x packed heads), a split's pieces are
# tiles whose blocks cost what the wave model's were fitted on; fewer (packed decode: 4 rows) make
# a block cheap next to a piece's own cost, which the model does not know
WAVE_MIN_ROWS = 64
# "0": no pieces in rounds (tile_order.wave_pieces) for grids of more than half the SMs
_SPLIT_WAVES_ENV = os.environ.get("DUALATTN_SM90_SPLIT_WAVES", "")


def _split_max_pieces() -> int:
    return int(_SPLIT_UNITS_ENV) if _SPLIT_UNITS_ENV else SPLIT_MAX_PIECES


def _causal_wave_pieces(spec, num_sms: int) -> int:
    """Pieces a tile of a causal chunk whose 128-row tiles fill more than half of ``num_sms``
    SMs (and at most twice them) is cut into along the blocks it sees, on P x tiles CTAs in
    rounds (tile_order.wave_pieces), where the wave model says they beat the order the config
    would give them otherwise (_causal_order_time: pairs, or one CTA a tile) by its margin;
    else 0. P is at most the first tile's blocks (no empty piece). Called with the same spec by
    _causal_split_grid (the config: plain order or not) and stream_k_plan (the pieces), so the
    two agree."""
    g = _gqa_pack(spec, 128)
    units = spec.batch * (spec.num_heads_q // g) * -(-g * spec.seqlen_q // 128)
    if (_SPLIT_WAVES_ENV == "0" or _SPLIT_UNITS_ENV == "0" or 2 * units <= num_sms
            or units > 2 * num_sms or g * spec.seqlen_q < WAVE_MIN_ROWS):
        return 0
    tile_n = _tile_config(spec.head_dim, spec.head_dim_v)[0]
    first, last = -(-_causal_first_tile_keys(spec) // tile_n), -(-spec.seqlen_k // tile_n)
    return split_pieces(units, num_sms, last, tile_n, _stream_k_min_keys(spec.head_dim <= 128),
                        max_pieces=min(_split_max_pieces(), first), waves=True,
                        whole=_causal_order_time(spec, units, first, last, num_sms),
                        min_piece_keys=_split_piece_keys(True, spec.head_dim_v))


def _causal_order_time(spec, units: int, first: int, last: int, num_sms: int) -> float:
    """The wave model's time (tile_order.wave_makespan's units) of a causal chunk's tiles in the
    order the config gives them without the split: pairs on the persistent grid (each about the
    first tile's blocks plus the last's; cut in two where the pairs fit half the SMs), else one
    CTA a tile (hd128 past 16k keys, hd256 past 2k: _short_masked_tiles)."""
    persistent = _hd64_persistent(spec) or _short_masked_tiles(spec)
    if _PERSISTENT_ENV:
        persistent = _PERSISTENT_ENV != "0"
    if not persistent:
        return WAVE_CALL_BLOCKS + -(-units // num_sms) * (last + WAVE_TILE_BLOCKS)
    pairs = -(-units // 2)
    if 2 * pairs <= num_sms:  # (split_pieces with pairs: two pieces a pair)
        return WAVE_CALL_BLOCKS + (first + last) / 2 + WAVE_PIECE_BLOCKS
    return WAVE_CALL_BLOCKS + -(-pairs // num_sms) * (first + last + 2 * WAVE_TILE_BLOCKS)


def _two_wg_tiles_fit_one_round(spec) -> bool:
    """Batched non-causal hd64 whose 128-row tiles (query heads unpacked) all run at once on the
    SMs: 192-row tiles then only make every CTA's one tile longer (no round is saved, and a
    single round leaves stream-K nothing to cut), so 2 warpgroups run it. H200, CUDA-graph
    replays interleaved, time 2 / 3 warpgroups (ci/sm90_env_ab.py ""
    "DUALATTN_SM90_TILES=64:128,3,1,1,2" b,s,h,64,0; docs section 47), batch x queries x heads
    (128-row tiles): 1 x 1k x 8 (64) 0.836, 1 x 1k x 16 (128) 0.838, 1 x 2k x 8 (128) 0.825, 1 x
    512 x 32 (128) 0.863, 1 x 4k x 4 (128) 0.812; 1 x 2k x 16 (256, two rounds) 0.984 stays on 3."""
    return (spec.mode == "batched"
            and spec.batch * spec.num_heads_q * -(-spec.seqlen_q // 128) <= _model_sm_count())


def _persistent_csr(spec) -> bool:
    """Block-sparse calls without key ranges at D <= 128 run on the persistent grid (static
    stride; with two Q buffers the next tile's Q and first K/V load during this tile): H100,
    bf16, ci/sm90_grid_ab.py persistent, two rounds, one CTA per tile -> persistent, TFLOP/s:
    window 1024 as a CSR 384 -> 433 / 421 -> 468, block-sparse 25 % 8k 521 -> 547 / 606 -> 628;
    the documents' CSR (with key ranges) 315 -> 320 / 370 -> 364 stays one CTA per tile."""
    return spec.has_block_sparse and not spec.has_key_ranges and spec.head_dim <= 128 \
        and spec.head_dim_v <= 128


PAIRED_VARLEN_MAX_SEQUENCES = 64  # see _paired_varlen
PAIRED_VARLEN_MIN_SEQLEN = {64: 1536, 96: 768, 128: 768}


def _paired_varlen(spec) -> bool:
    """Varlen causal calls whose pairs (FastSm90Forward.paired) pay for the warp scan of
    cu_seqlens that finds each tile's sequence: at most PAIRED_VARLEN_MAX_SEQUENCES sequences (one
    or two 32-sequence steps per tile), the longest of at least PAIRED_VARLEN_MIN_SEQLEN rows, GQA
    or not. H100, bf16, 16k tokens, causal, paired against heaviest first in L2 sections (7
    interleaved rounds, medians; repros of 2026-11-25): hd128 10 uneven documents (871-2312 rows)
    1.03-1.04x, 16 x 1k 1.07x, 8 x 2k 1.08-1.12x (two runs), but 40 documents (mean 410) 0.94x;
    hd64 10 documents 1.07x, 16 x 1k 0.96x, 40 documents 0.87x. GQA was left out then (16/4, 10
    documents 0.96x); with the units dealt by the launch's table (varlen_unit_table) it gains:
    H100, 2026-12-07, ci/sm90_env_ab.py "" "_PAIRED_ENV=varlen", hd128 causal 10 documents 16k
    16/4 1.11x (513 -> 572 TFLOP/s), 32/8 1.20x (474 -> 569), 20 documents 32k 16/4 1.14x; hd64
    (2026-12-08, "_PAIRED_ENV=0" ""): 10 documents 16k 32/8 1.06x (367 -> 389), 16/4 1.20x."""
    return (spec.batch <= PAIRED_VARLEN_MAX_SEQUENCES
            and spec.seqlen_q >= PAIRED_VARLEN_MIN_SEQLEN.get(spec.head_dim, 1 << 30))


HD256_NARROW_TILE_N = 64
HD256_WIDE_TILE_MIN_CAUSAL_SEQLEN = 8192


def _narrow_hd256_tile(spec) -> bool:
    """hd256 runs 64-wide key tiles instead of 80 (a causal diagonal cuts fewer columns; more
    key blocks in flight per byte of shared memory), except causal calls from 8k queries.
    H100, bf16, one process, 64 against 80 (ci/sm90_grid_ab.py tiles 256:64,2,0,0), TFLOP/s:
    non-causal 512-16k +0.6-2.8 % (1k 641 -> 645, 16k 757 -> 762), causal 512 / 1k / 2k / 4k
    250 -> 263 / 414 -> 432 / 577 -> 588 / 690 -> 698, causal 8k / 16k 0.98 / 0.99x."""
    if (spec.head_dim, spec.head_dim_v) != (256, 256):
        return False
    return not (spec.causal or spec.window[1] >= 0) or spec.seqlen_q < HD256_WIDE_TILE_MIN_CAUSAL_SEQLEN


HD192_SHORT_TILE_N = 96
HD192_SHORT_MAX_KEYS = 4096


def _short_hd192_tile(spec) -> bool:
    """Plain non-causal hd192 (no window, key ranges or CSR: the persistent grid) under
    HD192_SHORT_MAX_KEYS keys runs 96-wide key tiles instead of 112, which leave room for the
    shared O slot (FastSm90Forward.shared_o_slot: Q 48 KB, two stages of K / V 144 KB, the slot
    24 KB). H200, graph replays (repros of docs section 31), time 96 + slot / 112 with O in Q's
    buffer: 512 / 1k / 2k / 3k 0.931 / 0.903 / 0.943 / 0.950, but 4k / 8k 1.021 / 1.034 (the
    slot alone, both at 96: 0.927-0.977 below 4k, 1.028-1.038 from 4k)."""
    return ((spec.head_dim, spec.head_dim_v) == (192, 192) and not spec.causal
            and spec.window == (-1, -1) and not (spec.has_key_ranges or spec.has_block_sparse)
            and spec.seqlen_k < HD192_SHORT_MAX_KEYS)


def _smem_need(spec, tile_m: int, tile_n: int, stages: int, o_rows: int, q_stages: int = 1) -> int:
    """Shared-memory bytes of a forward config: q_stages Q tiles, o_rows rows of O, stages of K
    and V, and 1024 for the barriers that come first (the buffers are 1024-byte aligned; the
    kernel checks the struct's real size at trace time)."""
    esize = 2  # fp16 / bf16
    return 1024 + esize * (q_stages * tile_m * spec.head_dim + o_rows * spec.head_dim_v
                           + stages * tile_n * (spec.head_dim + spec.head_dim_v))


def _sparse_tile_n(head_dim: int, block_n: int, head_dim_v: Optional[int] = None) -> Optional[int]:
    """Key tile for a block-sparse call: the largest multiple of 16 up to the head dim's default
    tile that divides the CSR's block_n (a CSR key block must cover whole kernel tiles)."""
    default = _tile_config(head_dim, head_dim if head_dim_v is None else head_dim_v)[0]
    for t in range(default, 15, -16):
        if block_n % t == 0:
            return t
    return None


_TORCH_TO_CUTLASS = None


def _cutlass_dtype(dtype: torch.dtype):
    global _TORCH_TO_CUTLASS
    if _TORCH_TO_CUTLASS is None:
        import cutlass
        _TORCH_TO_CUTLASS = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}
    return _TORCH_TO_CUTLASS[dtype]


_NUM_SMS = {}


def _num_sms(device) -> int:
    if _NUM_SMS_ENV:
        return int(_NUM_SMS_ENV)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


class FastSm90Forward:
    name = "fast-sm90"
    family = "fast"

    def __init__(self) -> None:
        self.cache = CompileCache()
        self._entries = {}
        self._sk_counters = {}  # (device, stream) -> int32 zeros (stream_k_fields)

    # -- what it serves ------------------------------------------------------------------------
    def can_implement(self, spec) -> Optional[str]:
        arch = dispatch.device_arch()
        if arch != 90:
            return f"needs an sm_90 GPU (found {'no CUDA GPU' if arch is None else f'sm_{arch}'})"
        return self.can_implement_static(spec)

    @staticmethod
    def can_implement_static(spec) -> Optional[str]:
        """The arch-independent part of can_implement (also used by the compile-only tests)."""
        if spec.device_type != "cuda":
            return "tensors are not on a CUDA device"
        if spec.mode not in ("batched", "varlen"):
            return f"mode {spec.mode!r} not supported (batched and varlen only; kvcache falls back)"
        if spec.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {spec.dtype} not supported (float16, bfloat16)"
        if spec.head_dim != spec.head_dim_v and (spec.head_dim, spec.head_dim_v) not in TILE_CONFIG_DV:
            return (f"head dims q/k {spec.head_dim} != v {spec.head_dim_v} not supported (equal "
                    f"head dims, or (D, Dv) in {sorted(TILE_CONFIG_DV)})")
        if spec.head_dim not in SUPPORTED_HEAD_DIMS:
            return f"head dim {spec.head_dim} not supported (one of {SUPPORTED_HEAD_DIMS})"
        if spec.needs_grad:
            return "no SM90 backward kernel yet (forward only)"
        if spec.num_key_ranges > MAX_KEY_RANGES:
            return (f"at most {MAX_KEY_RANGES} key ranges per row (intervals are held in "
                    f"registers), got {spec.num_key_ranges}")
        if spec.wide_index_tensors:
            return "key_ranges or CSR column arrays of 2**31 elements or more (32-bit indexing)"
        if spec.has_block_sparse:
            bm, bn = spec.block_size
            if bm % 128:
                return (f"block-sparse block_m {bm} must be a multiple of the kernel's 128-row "
                        f"query tile")
            if _sparse_tile_n(spec.head_dim, bn, spec.head_dim_v) is None:
                return (f"block-sparse block_n {bn} must be a multiple of 16 (the kernel's key "
                        f"tile divides it)")
        return None

    # -- compile -------------------------------------------------------------------------------
    @staticmethod
    def config(spec) -> Tuple[int, int, int, bool, bool, bool, bool]:
        """(tile_m, tile_n, stages, pingpong, intra-warpgroup overlap, persistent, separate O)."""
        tile_n, stages = _tile_config(spec.head_dim, spec.head_dim_v)
        if spec.has_block_sparse:  # the key tile must divide the CSR's key block
            tile_n = _sparse_tile_n(spec.head_dim, spec.block_size[1], spec.head_dim_v)
        elif _narrow_hd256_tile(spec) and _tile_override(spec.head_dim, spec.head_dim_v) is None:
            tile_n = HD256_NARROW_TILE_N
        elif _short_hd192_tile(spec) and _tile_override(spec.head_dim, spec.head_dim_v) is None \
                and _O_SLOT_ENV != "0":
            tile_n = HD192_SHORT_TILE_N
        # ping-pong pays off where the softmax is a large share of the work (D <= 128); at larger
        # D the GEMMs dominate and the extra barrier only serialises (FA3 makes the same choice)
        # key ranges / block-sparse: uneven work per tile, which the hardware's assignment of
        # one CTA per tile balances better than a static stride (as for causal)
        # plain causal hd64 is the exception: short tiles, so the persistent grid's overlap of one
        # tile's epilogue with the next one's loads wins (H100, 1k-16k causal, TFLOP/s: 196 /
        # 291 / 368 / 406 / 445 per-tile grid -> 237 / 321 / 391 / 439 / 465 persistent); so do
        # causal / windowed calls at D <= 128 whose tiles visit few keys (_short_masked_tiles;
        # hd128 causal past 4k keys and hd256 lose with it)
        # a right window bound alone is causal-like (uneven tiles, heaviest first)
        masked_right = spec.causal or spec.window[1] >= 0
        persistent = (not (masked_right or spec.has_key_ranges or spec.has_block_sparse)
                      or _hd64_persistent(spec)
                      or _short_masked_tiles(spec) or _persistent_csr(spec)
                      or _causal_split_grid(spec)) \
            if _PERSISTENT_ENV == "" else _PERSISTENT_ENV != "0"
        separate_o = spec.head_dim <= 128  # Q + O + stages * (K + V) fits up to D = 128
        pingpong = spec.head_dim <= 128
        override = _tile_override(spec.head_dim, spec.head_dim_v) or ()
        if len(override) > 2:
            separate_o = bool(override[2])
        if len(override) > 3:
            pingpong = bool(override[3])
        # consumer warpgroups (64 query rows each); 3 needs no block-sparse CSR (whose query
        # blocks are multiples of the 128-row tile). With 3 the ping-pong is a round robin of
        # the three warpgroups' GEMM issue (FA4 orders its 3 warpgroups the same way at D <= 128)
        wgs = 3 if _three_warpgroups(spec) else 2
        if wgs == 3 and masked_right and persistent and not override:
            stages = 4  # causal 192-row tiles on the persistent grid (see _three_warpgroups)
        if len(override) > 4 and not spec.has_block_sparse:
            wgs = override[4]
        if (not separate_o and len(override) <= 2 and wgs == 2 and persistent and _O_SLOT_ENV != "0"
                and _smem_need(spec, 128, tile_n, stages, 64) <= SMEM_LIMIT["sm_90a"]):
            separate_o = True  # one warpgroup's rows of O fit: FastSm90Forward.shared_o_slot
        overlap = bool(override[5]) if len(override) > 5 else True
        return 64 * wgs, tile_n, stages, pingpong, overlap, persistent, separate_o

    @classmethod
    def shared_o_slot(cls, spec) -> bool:
        """O's own buffer holds one warpgroup's 64 rows, which the two consumer warpgroups stage
        and store in turn (FlashFwdSm90.shared_o_slot; per-warpgroup epilogues), where shared
        memory has room for that but not for the tile's O: hd256 at 64-key tiles (Q 64 KB, two
        stages of K / V 128 KB, the slot 32 KB), (192, 128), and hd192 under 4k keys at 96-key
        tiles (_short_hd192_tile), on the persistent grid. Without
        a buffer of its own O is staged in Q's, so the producer can load a tile's Q only after
        the previous tile's store has read it, and the consumers wait for it at every tile
        start. An experiment with 48-key tiles (full O buffer; DUALATTN_AB_BASE_TILES=256:48,2,0
        python ci/sm90_grid_ab.py tiles 256:48,2,1, H200, graph replays) gave hd256 1k / 2k /
        4k 1.058 / 1.036 / 1.008x, causal 1.074 / 1.022 / 1.001x. DUALATTN_SM90_O_SLOT=0 turns it
        off (comparisons)."""
        tile_m, tile_n, stages, _, _, _, separate_o = cls.config(spec)
        return separate_o and tile_m == 128 and \
            _smem_need(spec, tile_m, tile_n, stages, tile_m) > SMEM_LIMIT["sm_90a"]

    @staticmethod
    def staging_per_tile(spec) -> bool:
        """Each consumer thread computes its shared-memory addresses for O's staging in every
        tile's epilogue (FlashFwdSm90.staging_per_tile) instead of once before the tile loop,
        where the compiler hoisted them and held them in 16 registers (hd128) through every
        key block. With those registers taken, ptxas put the softmax's temporaries in P's
        registers and so the P V wait before the exponentials (sm_90a SASS, hd128 non-causal:
        the wait 40 instructions after the S wait, before all 66 exponentials; with the
        addresses per tile 114 instructions after it, behind 5 of them). H200, CUDA-graph
        replays interleaved (ci/sm90_env_ab.py, docs section 32), time per tile / hoisted:
        hd128 1k / 4k / 16k 0.994 / 0.979 / 0.986 (a second run: 1k / 4k / 8k 0.993 / 0.913 /
        0.976), hd64 4k / 16k 0.990 / 0.990, causal 0.99-1.01. DUALATTN_SM90_STAGING_PER_TILE=0
        hoists them again (comparisons)."""
        return _STAGING_PER_TILE_ENV != "0"

    @classmethod
    def narrow_first(cls, spec) -> bool:
        """A consumer warpgroup whose rows see none of the upper half of the tile's first key
        block computes only its lower half there (FlashFwdSm90.narrow_first): an N = tile_n / 2
        Q K^T and half the exponentials. With a right bound (causal, windows) the first block
        is the diagonal, and the first warpgroup's 64 rows of a 128-key diagonal see its first
        64 keys. Dense configs with the intra-warpgroup overlap; not key ranges or CSR, whose
        first block comes from a plan. CUDA-graph A/B (ci/sm90_env_ab.py, docs section 33), time
        on / off: H200 (two runs) hd128 causal 1k 0.987 / 0.987, 2k 0.993 / 0.996, 4k 0.990,
        8k 0.989; hd64 causal 1k 0.988 / 0.987, 2k 0.999 / 0.999, 4k 0.989. H100: hd128 causal
        1k / 2k / 4k 0.972 / 0.991 / 1.009, hd64 causal 1k / 2k 0.988 / 1.002. So on at
        D <= 128 (128-key tiles). At hd256 (64-key tiles, half of a 64-key block) it read
        0.995-1.004 on the H200 and 1.002 / 1.007 on the H100: off there. No spills; compile
        time level; the steady loop's GEMMs are the same (tests/test_sm90_sass.py).
        DUALATTN_SM90_NARROW_FIRST=0 turns it off, =1 on wherever it applies (comparisons)."""
        _, tile_n, _, _, overlap, _, _ = cls.config(spec)
        if _NARROW_FIRST_ENV == "0" or not (overlap and (tile_n // 2) % 8 == 0):
            return False
        if not (spec.causal or spec.window[1] >= 0) or spec.has_key_ranges or spec.has_block_sparse:
            return False
        return spec.head_dim <= 128 or _NARROW_FIRST_ENV == "1"

    @classmethod
    def narrow_last(cls, spec) -> bool:
        """The mirror image of narrow_first at a left window bound: a consumer warpgroup whose
        rows see none of the lower half of the tile's last key block (the left edge's) computes
        only its upper half there (FlashFwdSm90.narrow_last). With a window of W keys and
        128-row tiles aligned to the key blocks, the second warpgroup's 64 rows see the edge
        block's upper 64 keys in every tile. Such configs visit a tile's unmasked blocks before
        its other masked ones (block_info.masked_last_visit) and run those masked ones in one
        loop, each iteration a whole masked or narrow step, so the kernel holds no more copies
        of the step than without it. H100 graph A/B, time on / off: window 1024 at 16k 0.995,
        W = 2048 0.981, 2 x 8k 0.984, GQA 32/8 0.976 (docs section 42). D <= 128 (as
        narrow_first); not key ranges or CSR.
        DUALATTN_SM90_NARROW_LAST=0 turns it off, =1 on wherever it applies (comparisons)."""
        _, tile_n, _, _, overlap, _, _ = cls.config(spec)
        if _NARROW_LAST_ENV == "0" or not (overlap and (tile_n // 2) % 8 == 0):
            return False
        if spec.window[0] < 0 or spec.has_key_ranges or spec.has_block_sparse or cls.wg_key_bound(spec):
            return False  # (wg_key_bound passes the top visits, which this order moves)
        return spec.head_dim <= 128 or _NARROW_LAST_ENV == "1"

    @classmethod
    def tile_decoder(cls, spec) -> bool:
        """A warp of the producer warpgroup decodes the tiles' coordinates ahead of time
        (FlashFwdSm90.tile_decoder) for the TMA warp and the consumers, instead of the TMA warp
        decoding each tile between the previous tile's last K / V load and this tile's Q load:
        1200-2700 cycles a tile there at hd128 1k (phase trace, H100), while with two K / V
        stages the consumers finish a tile 1400-1900 cycles after its last K / V is issued.
        Graph A/B over every bench cell (ci/sm90_grid_ab.py tile_decoder, docs section 34), time
        on / off, H100 / H200: hd128 causal 512-8k 0.982-0.997 / 0.956-0.999, hd64 causal 512-2k
        0.977-0.989 / 0.987-0.991, 10 documents 0.947 / 0.953, window 0.989 / 0.987; long and
        non-causal cells mostly 0.984-1.011. Persistent grids with tile_info.
        DUALATTN_SM90_TILE_DECODER=0 turns it off (comparisons)."""
        persistent = cls.config(spec)[5]
        applies = persistent and cls.tile_info(spec)
        return applies and _TILE_DECODER_ENV != "0"

    @classmethod
    def merge_live_rows(cls, spec) -> bool:
        """Stream-K merges (stream_k configs) move only the warps' rows inside the sequence
        (FlashFwdSm90.warp_rows_live): a cut tile's pieces write and read the workspace for the
        live rows alone, which packed GQA decode (4 live rows of 128) and short last tiles leave
        few of. Only where a tile has rows past the end (the rows, GQA heads packed, not a
        multiple of the tile) and the units fit the SMs (split grids, whose every tile is cut):
        in the stream-K tail of a full grid the predicate cost 1-2 % (H200, graph A/B, time with
        / without: GQA 32/8 8k 1.015-1.020, hd128 16k 1.012-1.023, 4k 1.005-1.011; docs section
        50). DUALATTN_SM90_MERGE_LIVE_ROWS=0 moves every row (for comparisons)."""
        if _MERGE_LIVE_ROWS_ENV == "0" or spec.mode != "batched":
            return False
        tile_m = cls.config(spec)[0]
        return (cls.pack_gqa(spec) * spec.seqlen_q) % tile_m != 0 and \
            cls.stream_k_units(spec)[0] <= _model_sm_count()

    @classmethod
    def merge_batch(cls, spec) -> int:
        """States the last piece of a tile cut into more than two reads at a time in its merge
        (FlashFwdSm90.merge_batch): each of the merge's two passes then costs a memory round trip
        a batch, not a state. H200 graph A/B, 4 against 1 (docs section 51), time 0.955-0.998
        on split calls of 4-8 pieces (1 query x 32k GQA 0.957, 256 x 16k x 8 0.955, hd256 512 x
        16k x 4 0.963), 8 against 4 mixed (0.978-1.038); H100 on the last two: level in one
        lease (1.007 / 1.002), 0.957 / 0.964 in the next. Only where the plan can cut a tile
        into more than two pieces (stream-K configs of at most twice the model's SMs in units:
        small grids and pieces in rounds); elsewhere 1, since the unrolled merge costs compile
        time (hd256 16k 2.99 -> 3.80 s on the CPU) where no call reaches it. DUALATTN_SM90_MERGE_BATCH sets it."""
        if _MERGE_BATCH_ENV:
            return int(_MERGE_BATCH_ENV)
        if not cls.stream_k(spec) or cls.stream_k_units(spec)[0] > 2 * _model_sm_count():
            return 1
        return MERGE_BATCH

    @staticmethod
    def stmatrix_o(spec) -> bool:
        """O staged in shared memory for its TMA store by stmatrix (four 8 x 8 matrices of
        16-bit values per warp instruction) instead of 32-bit shared stores: hd128, 32 -> 8
        store instructions per thread and tile (16-bit O only: stmatrix moves 16-bit values;
        fp16 and bf16 are this kernel's dtypes). DUALATTN_SM90_STMATRIX_O=0 turns it off
        (comparisons)."""
        return _STMATRIX_O_ENV != "0" and spec.dtype.itemsize == 2

    @classmethod
    def warp_store_o(cls, spec) -> bool:
        """Each consumer warp stages its own 16 rows of O and issues their TMA store (a 16-row
        box; the staging slot laid out in 16-row bands, so a warp's rows are one contiguous piece)
        instead of its warpgroup's 128 threads meeting at two named barriers around the staging
        and one warp storing the 64 rows (FlashFwdSm90.warp_store_o). Batched calls with a
        staging slot per warpgroup (wg_epilogue without shared_o_slot), at Dv <= 64 only, where a
        key block is half hd128's work and the epilogue a larger share of a tile. H100, graph
        A/B over every bench cell (DUALATTN_AB_GRAPH=1 python ci/sm90_grid_ab.py warp_store_o,
        docs section 36), time on / off: hd64 1k 0.972 / 0.997 / 1.003 (three readings), causal 512-16k
        0.965-0.993 (a second reading 0.940-1.020; causal 1k 0.978-0.984 over five readings, 2k
        0.965-0.985 over three); hd128
        non-causal 512-16k 1.007-1.016 and GQA 1.015-1.019 (eight 2 KB stores in place of two
        8 KB ones), so off there. DUALATTN_SM90_WARP_STORE_O=0 turns it off, =1 on wherever it
        applies (comparisons)."""
        applies = (spec.mode == "batched" and cls.wg_epilogue(spec) and not cls.shared_o_slot(spec)
                   and 16 % cls.pack_gqa(spec) == 0)
        if _WARP_STORE_O_ENV == "0" or not applies:
            return False
        return spec.head_dim_v <= 64 or _WARP_STORE_O_ENV == "1"

    @staticmethod
    def l2_hints(spec) -> bool:
        """L2 eviction priorities on the kernel's TMA copies (FlashFwdSm90.l2_hints): K / V
        evict-last, Q and O evict-first, at D > 128. H100, graph A/B over every bench cell, two
        readings (DUALATTN_AB_GRAPH=1 python ci/sm90_grid_ab.py l2_hints, docs section 36), time
        on / off: hd256 causal 512-16k 0.959-0.997 / 0.962-0.988, hd256 0.974-1.007 /
        0.983-1.003; hd64 / hd128 / masks level (0.983-1.010, besides single readings of 0.950
        and 0.958 that the other reading did not repeat); GQA 32/8 non-causal 1.002-1.013; hd192
        (ci/sm90_env_ab.py) 0.980-1.006. So on at D > 128 only.
        DUALATTN_SM90_L2_HINTS=0 turns them off, =1 on at every head dim (comparisons)."""
        if _L2_HINTS_ENV == "0":
            return False
        return spec.head_dim > 128 or _L2_HINTS_ENV == "1"

    @classmethod
    def trace_phases(cls, spec) -> bool:
        """Diagnostics (ci/phase_trace.py sets TRACE_PHASES): the kernel writes each consumer
        warpgroup's phase stamps per tile (FlashFwdSm90.trace_phase) into the LSE buffer instead
        of the LSE. Dense batched calls that return the LSE, with the intra-warpgroup overlap and
        without packed GQA rows."""
        return (TRACE_PHASES and spec.mode == "batched" and cls.writes_lse(spec)
                and cls.config(spec)[4] and cls.pack_gqa(spec) == 1
                and not (spec.has_key_ranges or spec.has_block_sparse))

    @staticmethod
    def mask_flags(spec) -> Tuple[bool, bool, bool]:
        """(left window bound, right window bound, softcap): which code paths are compiled in.
        The window sizes and the cap are runtime arguments."""
        return spec.window[0] >= 0, spec.window[1] >= 0, spec.softcap > 0

    @classmethod
    def pack_gqa(cls, spec) -> int:
        """Query heads per KV head packed into one M tile (1: none). Where the query rows of one
        head leave most of the tile empty (seqlen_q <= PACK_GQA_MAX_SEQLEN_Q), packing the group's
        heads fills it and reads each K/V tile once per group instead of once per head. Needs a
        power-of-two group dividing tile_m (the rows of a tile are (head, query) pairs); causal and
        window bounds take each row's query position (FlashFwdSm90.q_pos). Not with key ranges or
        a block-sparse CSR (per-head data and per-tile visit plans), nor varlen.
        DUALATTN_SM90_PACK_GQA=0 turns it off, =1 packs wherever allowed (comparisons)."""
        return _gqa_pack(spec, cls.config(spec)[0])

    @staticmethod
    def writes_lse(spec) -> bool:
        """The LSE is stored when the caller asked for it (or a backward would need it)."""
        return spec.return_lse or spec.needs_grad

    def compile_key(self, spec, arch: int):
        name = "sm90_fwd_varlen" if spec.mode == "varlen" else "sm90_fwd"
        # key ranges (R) and block-sparse change the generated code; dense keys stay as they were
        name += f"_kr{spec.num_key_ranges}" if spec.has_key_ranges else ""
        name += "_bs" if spec.has_block_sparse else ""
        name += "_table" if self.csr_table(spec) else ""  # its tiles from a launch table (csr_table)
        name += "" if self.writes_lse(spec) else "_nolse"
        g = self.pack_gqa(spec)
        name += f"_pack{g}" if g > 1 else ""
        return (name, str(spec.dtype), spec.head_dim, spec.head_dim_v, bool(spec.causal),
                *self.mask_flags(spec), *self.config(spec), self.wg_epilogue(spec), self.stream_k(spec),
                self.split_tail(spec), self.bit_mask(spec), self.tile_info(spec), self.q_regs(spec), self.pass_empty_wg(spec) + self.rotate_m_blocks(spec),
                self.shared_o_slot(spec), self.staging_per_tile(spec), self.narrow_first(spec), self.trace_phases(spec), self.tile_decoder(spec), self.stmatrix_o(spec), self.warp_store_o(spec), self.l2_hints(spec), self.q_stages(spec), self.paired(spec), self.varlen_sections(spec),
                self.rescale_threshold(spec), self.rescale_before_pv(spec), L2_SECTION_BYTES,
                self.reduce_chains(spec), self.wg_key_bound(spec), arch_string(arch), self.window_order(spec),
                self.narrow_last(spec), self.key_split(spec), self.merge_live_rows(spec),
                self.merge_batch(spec), self.end_aligned(spec), self.lse_after_o(spec))

    @staticmethod
    def rescale_threshold(spec) -> float:
        """Base-2 units by which a row's new max must exceed the running one before the online
        softmax moves it and rescales O (0: every new max moves it). At Dv >= 192 O's rescale
        (Dv / 2 multiplies per thread and key block, on the path from the P V wait to the next
        GEMMs) costs more than the branch around it; below, the branch costs more. H100, bf16,
        one process, threshold 8 against 0 (ci/sm90_grid_ab.py rescale): hd256 1k / 8k 617 -> 634 /
        711 -> 765 TFLOP/s, causal 406 -> 410 / 695 -> 716; hd128 0.97-1.00x; hd64 0.74-1.01x.
        DUALATTN_SM90_RESCALE_THRESHOLD overrides it for comparisons."""
        if _RESCALE_THRESHOLD_ENV:
            return float(_RESCALE_THRESHOLD_ENV)
        return RESCALE_THRESHOLD if spec.head_dim_v >= RESCALE_THRESHOLD_MIN_DV else 0.0

    @staticmethod
    def reduce_chains(spec) -> int:
        """Independent partial results per row in the online softmax's max and sum
        (FlashFwdSm90.online_softmax): 4 at D = Dv = 128, else one serial chain. A thread's row
        max over its 32 scores was a chain of 32 dependent FMNMX (and the sum of 32 FADD), on
        the path from the Q K^T wait to the P V issue. H100, bf16, CUDA-graph replays
        interleaved, two runs (DUALATTN_AB_GRAPH=1 python ci/sm90_grid_ab.py reduce_chains 1),
        time with 4 chains / with 1: hd128 causal 4k / 8k / 16k 0.957-0.988 / 0.975-0.982 /
        0.982-0.983, GQA 32/8 causal 2k / 8k 0.983-0.986 / 0.939-0.982, hd128 non-causal
        0.98-1.01; hd64 lost (causal 1k-16k 1.02-1.08 slower, non-causal 0.95-1.02; 2 or 8
        chains lost too) and hd256 did not move (0.99-1.01). DUALATTN_SM90_REDUCE_CHAINS
        overrides it (comparisons)."""
        if _REDUCE_CHAINS_ENV:
            return int(_REDUCE_CHAINS_ENV)
        return 4 if spec.head_dim == spec.head_dim_v == 128 else 1

    @classmethod
    def rescale_before_pv(cls, spec) -> bool:
        """O rescaled by the previous key block's corrections while the next Q K^T runs (before
        that block's P V is issued) rather than after the P V wait, which puts its Dv / 2
        multiplies per thread beside a GEMM instead of on the way to the next one (FA4's SM90
        kernel does this for Dv > 128; there our rescale threshold measured better). On for
        D = Dv = 128 on the persistent grid. H100, bf16, ci/sm90_grid_ab.py rescale_before_pv,
        three rounds on two machines: hd128 1k-16k +0-3 % (causal 4k +2 to +7 %), GQA 32/8 +1-6 %;
        off where it lost or did not clearly win: hd128 causal 16k (one CTA per tile) 0.82-0.99x,
        hd256 against the threshold 0.97-1.01x, hd64 0.97-1.05x. Needs the intra-warpgroup
        overlap and no threshold. DUALATTN_SM90_RESCALE_BEFORE_PV=1 / 0 forces it, for comparisons."""
        if not cls.config(spec)[4] or cls.rescale_threshold(spec) > 0.0:
            return False
        if _RESCALE_BEFORE_PV_ENV:
            return _RESCALE_BEFORE_PV_ENV == "1"
        return spec.head_dim == spec.head_dim_v == 128 and cls.config(spec)[5]

    @classmethod
    def q_stages(cls, spec) -> int:
        """Q buffers: 2 where a persistent CTA with its own O buffer has the shared memory for a
        second one, else 1. With one, the producer waits for this tile's last GEMM to free Q
        before it loads the next tile's Q and then its first K/V, and the consumers wait for
        both after their epilogue; with two, both load while this tile runs. H100, bf16, one
        process, two buffers against one, medians of 3 interleaved runs (`python
        ci/sm90_grid_ab.py q_stages`): hd128 512 / 1k / 2k +7 / +5 / +3 %, causal +9 / +5 / +2 %;
        hd64 causal 1k / 2k +8 / +6 %; window 1024 +2 %, packed documents +4 %; 8k-16k within
        +-2 % (cells that run the same kernel both ways moved by up to 4 %: the noise).
        DUALATTN_SM90_Q_STAGES=1 forces one."""
        tile_m, tile_n, stages, _, _, persistent, separate_o = cls.config(spec)
        if not (persistent and separate_o) or _Q_STAGES_ENV == "1":
            return 1
        return 2 if _smem_need(spec, tile_m, tile_n, stages, tile_m, 2) <= SMEM_LIMIT["sm_90a"] else 1

    @classmethod
    def paired(cls, spec) -> bool:
        """Causal / right-bounded tiles on the persistent grid run in pairs of equal work
        (fast/common/tile_order.paired_tile) instead of heaviest first in L2 sections, which left
        11-13 % of the SM time idle at hd128 1k-4k. Varlen pairs the blocks of each sequence
        (pairs of different sequences differ in work; CTA c still runs every num_ctas-th pair;
        each tile finds its sequence by a warp scan of cu_seqlens) for calls of few, long
        sequences without GQA (_paired_varlen); other varlen calls run in varlen_sections' order. Not key ranges / block-sparse (one CTA per tile).
        DUALATTN_SM90_PAIRED=0 turns it off, =varlen pairs every varlen causal call
        (comparisons)."""
        persistent = cls.config(spec)[5]
        masked_right = spec.causal or spec.window[1] >= 0
        return (persistent and masked_right and not spec.has_key_ranges
                and not spec.has_block_sparse and _PAIRED_ENV != "0"
                and (spec.mode != "varlen" or _paired_varlen(spec) or _PAIRED_ENV == "varlen")
                and not cls.window_order(spec)
                and not _causal_split_grid(spec))

    @classmethod
    def window_order(cls, spec) -> bool:
        """Sliding windows (left bound; causal or a right bound) on the persistent
        grid run the window order (fast/common/tile_order.window_order_tile) instead of the
        pairs: every query block visits the same key blocks except the first few of each head,
        clipped at key 0, so pairs (p, n - 1 - p) differ in work wherever p is one of those, and
        the static stride of pairs left the bench's window cell at 0.944 of the mean CTA load
        (tests/test_tile_order.py's model); full tiles first, then the light ones in a snake:
        0.991. A right bound past the diagonal leaves the last ceil(right / tile_m) blocks a little
        lighter too; they come first in their sections. Batched, unpacked rows, no key ranges or
        CSR, and from WINDOW_ORDER_MIN_SEQLEN query rows (below, the pairs' head-by-head order
        won: see there). DUALATTN_SM90_WINDOW_ORDER=0 turns it off, =1 on wherever allowed
        (comparisons, tests)."""
        persistent = cls.config(spec)[5]
        allowed = (persistent and spec.mode == "batched" and spec.window[0] >= 0
                   and (spec.causal or spec.window[1] >= 0) and not spec.has_key_ranges
                   and not spec.has_block_sparse and cls.pack_gqa(spec) == 1)
        if _WINDOW_ORDER_ENV in ("0", "1"):
            return allowed and _WINDOW_ORDER_ENV == "1"
        return allowed and spec.seqlen_q >= WINDOW_ORDER_MIN_SEQLEN

    @classmethod
    def wg_epilogue(cls, spec) -> bool:
        """Each consumer warpgroup normalises, stages and stores its own 64 rows of O (its own
        named barrier and TMA store) rather than all warpgroups together behind one barrier:
        the warpgroup that runs half a key block ahead (ping-pong) then starts its next tile
        while the others finish theirs, so the tensor cores keep working across tile
        boundaries. Needs O's own shared-memory buffer (D <= 128; where shared_o_slot runs, it
        runs always, the slot being one warpgroup's).
        DUALATTN_SM90_WG_EPILOGUE=0 turns it off elsewhere (comparisons)."""
        separate_o = cls.config(spec)[6]
        if cls.shared_o_slot(spec):  # the slot is one warpgroup's
            return True
        return separate_o and 64 % cls.pack_gqa(spec) == 0 and _WG_EPILOGUE_ENV != "0"

    @classmethod
    def wg_key_bound(cls, spec) -> bool:
        """Each consumer warpgroup passes over the tile's top key blocks that none of its 64
        rows sees (FlashFwdSm90.wg_key_block_end): with a right bound and tile_n < 128 (hd192 /
        hd256) the first warpgroup's rows never see the tile's last key block, the second
        warpgroup's diagonal, so causal hd256 at tile_n 64 computes one block in 2 (p + 1) less
        per warpgroup pair. On by default in configs without ping-pong (D > 128); never with
        key ranges or a CSR. H100, bf16, CUDA-graph replays interleaved, three runs
        (DUALATTN_AB_GRAPH=1 python ci/sm90_grid_ab.py wg_key_bound), time without / with:
        causal hd256 (tile_n 64) 512 / 1k / 2k / 4k 1.030 / 1.024 / 1.020 / 1.012-1.013, hd192
        (tile_n 112) 512-8k 1.018-1.044, hd192 16k 0.994-1.009; but hd256's 80-wide tiles
        (causal from 8k queries) 0.950-0.983 at 8k, 0.994-1.004 at 16k, so those keep the
        plain bound (the SASS loop is the same length and spill-free either way: a scheduling
        effect, not code). Ping-pong configs (D <= 128) run it too (a passed block still takes
        its turn of the ring), by default only in hd64's 192-row tiles on 128-key blocks, which
        hide three warpgroup blocks in every two causal tiles (with Sq = Sk a 128-row tile hides
        none): H100 graph A/B, time with / without: hd64 causal 1280 / 2k / 3k / 16k 0.960 /
        0.962 / 0.984 / 0.990 (docs section 54; section 24 measured it neutral when 2k still ran
        128-row tiles); and not with a left window bound, where narrow_last orders the visits.
        Stream-K pieces run it as well: a piece narrows the tile's key range, the bound
        clips the piece's top, and a warpgroup left with no block in its piece merges an empty
        state (row max -inf, softmax.merge_scales). DUALATTN_SM90_WG_KEY_BOUND=0 turns it off,
        =1 on wherever it applies (comparisons; ci/sm90_grid_ab.py wg_key_bound pingpong)."""
        tile_m, tile_n, _, pingpong, overlap = cls.config(spec)[:5]
        masked_right = spec.causal or spec.window[1] >= 0
        # (the pass sits in the overlapped loop: configs without it, DUALATTN_SM90_TILES's sixth
        # field 0, keep the tile's bound)
        applies = overlap and masked_right and not (spec.has_key_ranges or spec.has_block_sparse)
        if _WG_KEY_BOUND_ENV in ("0", "1"):
            return applies and _WG_KEY_BOUND_ENV == "1"
        wide_hd256 = (spec.head_dim, spec.head_dim_v) == (256, 256) and tile_n == 80
        tall_tiles = tile_m > tile_n and spec.window[0] < 0
        return applies and not wide_hd256 and (tall_tiles or not pingpong)

    @classmethod
    def stream_k(cls, spec) -> bool:
        """The persistent grid's last, partly filled round cut along the keys (stream-K tail,
        fast/common/tile_order.stream_k_tiles; the launch decides per call how many tiles, 0
        for none): its idle SMs were 3 % of the time at the bench's 16k-token hd128 cells
        (2048 tiles on 132 SMs). Units of equal work only: the tiles of non-causal batched calls
        without windows, key ranges or a CSR, or the pairs of the paired causal order (batched,
        no left window bound: its pairs are short and not of equal work; tile_order.tile_share).
        Compiled in only where a unit reaches the key minimum (stream_k_units): the code is
        not free where it can never cut. H100, bf16, CUDA-graph replays interleaved, two runs
        (DUALATTN_AB_GRAPH=1 python ci/sm90_grid_ab.py stream_k causal), time with the uncut
        code / without it: hd64 causal 512 / 1k / 2k 1.023-1.028 / 1.021-1.027 / 1.016-1.017,
        hd128 causal 1.016-1.023 / 1.010-1.013 / 1.008, GQA 32/8 causal 2k 1.006-1.008;
        non-causal 512-2k 0.99-1.01 (GQA 32/8 2k 1.017-1.020). So a shape picks one of two
        kernels per config, never a kernel per shape.
        DUALATTN_SM90_STREAM_K=0 turns it off (comparisons)."""
        return cls._stream_k_order(spec) and cls.stream_k_units(spec)[1] > 0

    @classmethod
    def q_regs(cls, spec) -> bool:
        """Q K^T with Q from registers (FlashFwdSm90.q_regs): ldmatrix copies the tile's Q once,
        and each Q K^T reads only K from shared memory, a fifth less shared-memory traffic per key
        block at hd128. At the 700 W limit that is energy: H200, ci/power_probe.py, hd128 16k
        non-causal 653.1 / 653.0 -> 671.8 / 671.3 TFLOP/s (0.946 -> 0.972 TFLOP/J, two runs; FA4
        664.7), causal level (618.2 / 618.6 -> 620.9 / 619.3); at the full clock (graph A/B, one
        run) -2 % to +1.6 %, within that A/B's noise (docs section 29). Plain non-causal batched
        calls (no window, key ranges or CSR) in 128-row tiles at D <= 128: Q adds D / 4 registers
        per thread, which the 3-warpgroup tiles (160 registers) spill, and the varlen kernel (20
        bytes at hd128). DUALATTN_SM90_Q_REGS=0 turns it off, =1 on for every 128-row tile at
        D <= 128 (comparisons; the worker suite passes either way)."""
        if _Q_REGS_ENV == "0" or spec.head_dim > 128 or cls.config(spec)[0] != 128:
            return False
        plain = not spec.causal and spec.window == (-1, -1) and not spec.has_key_ranges \
            and not spec.has_block_sparse and spec.mode == "batched"
        return plain or _Q_REGS_ENV == "1"

    @classmethod
    def pass_empty_wg(cls, spec) -> bool:
        """A consumer warpgroup with no row inside the sequence passes the tile's key blocks
        (FlashFwdSm90.pass_empty_wg), and non-causal tiles on the persistent grid turn their query
        block by one every lcm(grid, blocks) tiles where the last block is lighter
        (tile_order.rotated_m_block), so the light tiles spread over all CTAs. hd64 at 1k
        queries runs 6 query blocks of 192 rows, the last with 64: two warpgroups of every sixth
        tile computed rows nobody stores, and on 132 SMs the same 22 CTAs ran all of them.
        CUDA-graph A/B (ci/sm90_grid_ab.py pass_empty_wg 0), time with / without: hd64 512 / 1k
        / 2k 0.952-0.959 / 0.939-0.942 / 0.988-1.004 (H200, H100), hd256 at 1088 queries
        0.946-0.975, the rest level (docs section 30). Every config with the intra-warpgroup
        overlap, except key ranges and CSRs (their own visit loops). DUALATTN_SM90_PASS_EMPTY_WG=0
        turns it off, =pass keeps the plain order (comparisons)."""
        return not (spec.has_key_ranges or spec.has_block_sparse) and _PASS_EMPTY_WG_ENV != "0" \
            and cls.config(spec)[4]

    @classmethod
    def rotate_m_blocks(cls, spec) -> bool:
        """The turned order of pass_empty_wg's non-causal tiles (off with =pass: the pass alone
        gave hd64 1k nothing, since the CTAs that ran the light tiles idled)."""
        return cls.pass_empty_wg(spec) and _PASS_EMPTY_WG_ENV != "pass"

    @classmethod
    def key_split(cls, spec) -> bool:
        """A last query tile whose rows all lie in the first warpgroup's 64 is computed by all
        three warpgroups, each on every third key block, merged in shared memory
        (FlashFwdSm90.key_split), instead of by the first alone while the others pass: hd64's
        192-row tiles at 1k and 4k queries (1024 = 5 x 192 + 64). Non-causal batched calls on
        192-row tiles without a window (the only masked block is then the first visit's key
        tail). DUALATTN_SM90_KEY_SPLIT=0 turns it off (comparisons)."""
        return (_KEY_SPLIT_ENV != "0" and cls.config(spec)[0] == 192 and cls.pass_empty_wg(spec)
                and cls.wg_epilogue(spec) and spec.mode == "batched" and not spec.causal
                and spec.window == (-1, -1) and cls.pack_gqa(spec) == 1 and not cls.q_regs(spec))

    @classmethod
    def lse_after_o(cls, spec) -> bool:
        """A tile's LSE stored after its O store is issued, not before O is staged
        (FlashFwdSm90.store_lse): the proxy fence before the store (MEMBAR.ALL.CTA) no longer
        orders those global stores inside the serial epilogue. H200 graph A/B, time after /
        before (python ci/sm90_env_ab.py "_LSE_AFTER_O_ENV=0" "" ...; one of the three runs with
        the level early_finalize of docs section 55 on its B side too): hd128 causal 1k
        0.990-0.994 (three runs), hd128 1k 0.977-0.993, hd64 1k 0.986-0.993, hd256 causal 1k / 2k
        0.990-0.995 / 0.989; but hd128 causal 4k, a stream-K config, 1.023 and 1.043, so configs
        with stream-K code keep the old order (hd64 causal 4k, hd128 8k level there). H100, six
        short / window cells: 0.981-0.996. Docs section 55. DUALATTN_SM90_LSE_AFTER_O=0 / =1 forces the old / new order (comparisons)."""
        if _LSE_AFTER_O_ENV:
            return _LSE_AFTER_O_ENV != "0"
        return not cls.stream_k(spec)

    @classmethod
    def end_aligned(cls, spec) -> bool:
        """Query tiles aligned to the end of the sequence (FlashFwdSm90.end_aligned): with a right
        bound and no left one, the tile holding the Sq % tile_m left-over rows is then the
        first, which sees the fewest keys, instead of the last, which visits every key block
        while its empty warpgroups wait. Every tile's last row moves up by the shift or stays,
        so no tile visits more blocks (tests/test_tile_order.py models it): hd64's causal
        192-row tiles at 2k / 4k queries visit 0.950 / 0.945 of the blocks, 8k / 16k 0.985,
        1280 queries 0.930; hd256's 64-key tiles at 700 queries 0.878. With tile_m == tile_n
        the count is the same either way (Sq = Sk), so only configs with tile_m > tile_n (hd64
        on 3 warpgroups, hd256 on the persistent grid's 64-key tiles) take it, and only where
        the shift is at least one whole 64-row slice (row_shift): its code is then compiled in,
        a few instructions in the decoder and the epilogue. O must leave by 64-row slices or 16-row bands (wg_epilogue: not hd192 causal).
        Batched calls without key ranges, CSR or packed GQA rows, and not the causal chunks cut
        into pieces (_causal_split_grid: the first tile's keys bound their piece count). H100,
        graph A/B, time with / without: hd64 causal 2k / 4k / 8k / 16k 0.948 / 0.967 / 0.984 /
        0.998 (docs section 53). DUALATTN_SM90_END_ALIGNED=0 turns it off, =1 on wherever it
        can apply (comparisons, tests)."""
        if _END_ALIGNED_ENV == "0":
            return False
        tile_m, tile_n = cls.config(spec)[:2]
        can = (spec.mode == "batched" and (spec.causal or spec.window[1] >= 0) and spec.window[0] < 0
               and not (spec.has_key_ranges or spec.has_block_sparse) and cls.pack_gqa(spec) == 1
               and not cls.trace_phases(spec) and not _causal_split_grid(spec))
        # (a length that leaves no whole slice over keeps the kernel without the shift's code:
        # hd256 causal at 1k / 2k and 1000 queries measured 1.004-1.007 with it, shift 0)
        return (can and cls.wg_epilogue(spec) and -spec.seqlen_q % tile_m >= 64
                and (_END_ALIGNED_ENV == "1" or tile_m > tile_n))

    @classmethod
    def row_shift(cls, spec) -> int:
        """Rows of the first query tile before row 0 with end_aligned (0 otherwise): the rows the
        last tile would leave over, (-Sq) % tile_m, in whole 64-row slices (each warpgroup's
        O slice lies wholly before row 0 or after it: a TMA store cannot start before it)."""
        return -spec.seqlen_q % cls.config(spec)[0] // 64 * 64 if cls.end_aligned(spec) else 0

    @staticmethod
    def tile_info(spec) -> bool:
        """The producer warp decodes each tile's coordinates and passes them to the consumer
        warpgroups through shared memory (FlashFwdSm90.put_tile_info / get_tile_info), instead
        of every consumer thread decoding them at the start of its tile: 200-280 fewer consumer
        instructions between a tile's start and its first Q K^T. H100, graph A/B: causal hd64
        1k-4k +2.9-4.8 %, hd128 causal +1.2-1.7 %, GQA causal 2k +2.9 %, hd256 and the masks
        level (docs section 27). DUALATTN_SM90_TILE_INFO=0 turns it off (comparisons)."""
        return _TILE_INFO_ENV != "0"

    @classmethod
    def bit_mask(cls, spec) -> bool:
        """Element masks (causal, windows, key ranges, the key tail) from one 32-bit set per
        accumulator row (FlashFwdSm90.mask_by_row_bits; ptxas moves 7 bits at a time into
        predicates with R2P) instead of comparing every element's key with the row's bounds.
        sm_90a, per masked key block: hd128 window 1024 777 / 807 -> 611 / 642 instructions
        (128 ISETP + 128 FSEL -> 64 FSEL, 8 R2P and per-row integer work); key ranges with a
        CSR 4360 -> 3808 SASS instructions in all. H100, bf16, CUDA-graph replays interleaved,
        three runs (DUALATTN_AB_GRAPH=1 python ci/sm90_grid_ab.py bit_mask), time with / without:
        window 1024 0.974-0.977 (its CSR form too), 10 documents as key ranges + CSR 0.930 (with
        the key ranges in the bit set), causal hd64 1k / 2k 0.977-0.978 / 0.983-0.984, hd128
        causal 1k 0.979-0.994, the other causal cells 0.99-1.01. Not in 3-warpgroup tiles
        (hd64 without masks or causal from 4k queries): at 160 registers per consumer thread
        ptxas spills 16 bytes in the epilogue instead of 4, and causal hd64 4k measured level
        (0.993-1.001). DUALATTN_SM90_BIT_MASK=0 turns it off, =1 on everywhere (comparisons)."""
        if _BIT_MASK_ENV in ("0", "1"):
            return _BIT_MASK_ENV == "1"
        return cls.config(spec)[0] <= 128

    @classmethod
    def split_tail(cls, spec) -> bool:
        """The paired order's last units can run as single tiles, heaviest first, each to the
        CTA with the least work so far (a table the launch computes: fast/common/tile_order
        .split_tail_table), where stream-K does not cut them: batched paired calls without a
        left window bound (whose tiles are heavier the later they come) and with pairs too short
        for stream-K (or an empty tile). The static stride of whole pairs leaves the grid's last
        round partly filled (the bench's 16k-token causal cells at 1k / 2k keys: 7.76 or 15.5
        rounds on 132 SMs); single tiles fill it, and nothing is merged. The launch decides per
        shape how many groups of heads (split_tail_schedule, 0 for none).
        DUALATTN_SM90_SPLIT_TAIL=0 turns it off, =1 splits wherever a round is partly filled,
        whatever the model says (comparisons, tests); DUALATTN_SM90_SPLIT_TAIL_GROUPS=n splits
        n groups (comparisons)."""
        return (cls.paired(spec) and spec.mode == "batched" and spec.window[0] < 0
                and not cls.stream_k(spec) and _SPLIT_TAIL_ENV != "0")

    @classmethod
    def csr_table(cls, spec) -> bool:
        """Block-sparse calls on the persistent grid take their tiles from a launch table
        (csr_unit_table): a CSR's query blocks visit different numbers of key blocks, and the
        static stride hands each CTA whatever its slots hold (the bench's 25 % pattern at 8k:
        8-26 blocks a tile, the busiest CTA modelled 9 % above the mean), where the table deals
        them longest-processing-time first within L2 sections of heads. Batched calls of one
        query head per row (no packed GQA rows, no end alignment: a tile is a CSR query block's
        128 rows). The kernel keeps its own order where the launch has no plan (no host copy of
        the row pointers, a first call inside a graph capture, or a gain under 1 %). H100, graph
        A/B (ci/sm90_env_ab.py "_CSR_LPT_ENV=0" "" sparse; docs section 59): the bench's cell
        time 0.900-0.940 with 8 MB sections (608 -> 676, 614 -> 653 TFLOP/s).
        DUALATTN_SM90_CSR_LPT=0 turns it off, =1 deals by the table whatever the gain."""
        if _CSR_LPT_ENV == "0" or spec.mode != "batched" or not spec.has_block_sparse:
            return False
        tile_m, persistent = cls.config(spec)[0], cls.config(spec)[5]
        return (persistent and tile_m == 128 and cls.pack_gqa(spec) == 1
                and not (cls.paired(spec) or cls.stream_k(spec) or cls.window_order(spec)
                         or cls.key_split(spec) or cls.end_aligned(spec)))

    @classmethod
    def split_tail_schedule(cls, spec, num_sms: int) -> Tuple[int, int, list]:
        """(groups of heads split, tail rounds, tail table) of the launch (tile_order.split_tail_plan):
        the tail's tiles go to the CTAs longest-processing-time first or in a snake, against
        each CTA's own whole pairs (a tile: its key blocks, from paired_key_blocks, plus
        SPLIT_TAIL_TILE_OVERHEAD); of the tail sizes whose heads' K/V fit an L2 section, up to the
        smallest covering the partly filled round, the smallest within 0.5 % of the best
        modelled one, if the busiest CTA's work drops by 1 %. (0, 0, []) for whole pairs."""
        tile_m = cls.config(spec)[0]
        g = cls.pack_gqa(spec)
        num_m_blocks = -(-(g * spec.seqlen_q) // tile_m)
        hb = spec.batch * (spec.num_heads_q // g)
        units = paired_units(num_m_blocks, hb)
        key_blocks = cls.paired_key_blocks(spec)
        row_bytes = (spec.head_dim + spec.head_dim_v) * spec.dtype.itemsize
        # query heads of one KV head share its K/V (packed GQA tiles already hold the group)
        share = spec.num_heads_q // max(spec.num_heads_kv, 1) // g

        def fits(heads):
            return heads <= heads_per_section(spec.seqlen_k, row_bytes, max) * share

        overhead = float(_SPLIT_TAIL_OVERHEAD_ENV or SPLIT_TAIL_TILE_OVERHEAD)

        def cost(m):
            return key_blocks(m) + overhead

        ctas = min(units, num_sms)
        if _SPLIT_TAIL_GROUPS_ENV:  # a fixed tail (comparisons), at most every group
            heads_per_group = 1 + num_m_blocks % 2
            tail = max(0, min(int(_SPLIT_TAIL_GROUPS_ENV), -(-hb // heads_per_group)))
            return (tail, *split_tail_table(num_m_blocks, hb, ctas, tail, cost)[:2]) if tail else (0, 0, [])
        forced = _SPLIT_TAIL_ENV == "1"
        return split_tail_plan(num_m_blocks, hb, ctas, cost, (lambda heads: True) if forced else fits,
                               -1.0 if forced else SPLIT_TAIL_MIN_GAIN)

    @classmethod
    def _stream_k_order(cls, spec) -> bool:
        """The call's persistent order has units of equal work (stream_k, before the keys)."""
        plain = not spec.causal and spec.window == (-1, -1)
        return bool(cls.config(spec)[5] and spec.mode == "batched" and not spec.has_key_ranges
                    and not spec.has_block_sparse and _STREAM_K_ENV != "0"
                    and (plain or (cls.paired(spec) and spec.window[0] < 0) or _causal_split_grid(spec)))

    @classmethod
    def stream_k_units(cls, spec) -> Tuple[int, int]:
        """(units, key blocks per unit) of a persistent call's order, from its shapes: a unit is
        a tile, or with the paired order a pair of tiles, given the key blocks of the pair that
        visits most (tile_order.paired_unit_blocks, from the kernel's per-tile bounds,
        FlashFwdSm90.key_block_bounds). (units, 0) where no unit can be cut: its keys are under
        the minimum (tile_order.STREAM_K_MIN_KEYS), or a paired call has a tile that visits no
        key block (that tile's piece would be empty, so no one would store it)."""
        tile_m, tile_n = cls.config(spec)[:2]
        g = cls.pack_gqa(spec)
        num_m_blocks = -(-(g * spec.seqlen_q) // tile_m)
        hb = spec.batch * (spec.num_heads_q // g)
        min_keys = _stream_k_min_keys(cls._stream_k_narrow(spec))
        if not cls.paired(spec):
            units, blocks, fewest = num_m_blocks * hb, -(-spec.seqlen_k // tile_n), 1
        else:
            units = paired_units(num_m_blocks, hb)
            blocks, fewest = paired_unit_blocks(num_m_blocks, cls.paired_key_blocks(spec))
        return units, (blocks if fewest > 0 and blocks * tile_n >= min_keys else 0)

    @classmethod
    def _stream_k_narrow(cls, spec) -> bool:
        """Units of one tile at D <= 128, which earn a cut from 2k keys
        (tile_order.STREAM_K_MIN_KEYS_NARROW); pairs and wider heads from 4k."""
        return spec.head_dim <= 128 and not cls.paired(spec)

    def stream_k_plan(self, spec, device) -> Tuple[int, int, int, int]:
        """(cut units, key blocks per unit, pieces a unit, CTAs of the grid) of a stream-K call:
        the last two rounds' units cut in two (tile_order.stream_k_tiles, pieces 0), or every
        unit cut into pieces on that many CTAs a unit (tile_order.split_pieces): where the units
        fit half this device's SMs, as many as fit; where they fill more (one partly filled
        round of non-causal tiles, or causal chunks' tiles, _causal_wave_pieces), the count
        the wave model picks, the SMs taking the CTAs in rounds (tile_order.wave_pieces; tiles
        of at least WAVE_MIN_ROWS live rows); (0, 0, 0, grid) where nothing is cut
        (stream_k_units). From the spec's shapes: the launch memo (_entry) keeps it."""
        units, blocks = self.stream_k_units(spec)
        num_sms = _num_sms(device)
        none = (0, 0, 0, min(units, num_sms))
        if not self._stream_k_order(spec) or blocks == 0:
            return none
        tile_n = self.config(spec)[1]
        min_keys = _stream_k_min_keys(self._stream_k_narrow(spec))
        # (causal chunks: only whole tiles split into pieces, split_pieces; a tail's cut could
        # put a piece among the keys the causal limit hides)
        causal_split = _causal_split_grid(spec)
        cut = 0 if causal_split else stream_k_tiles(units, min(units, num_sms), blocks, tile_n, min_keys)
        pieces = 0
        if causal_split and 2 * units > num_sms:
            pieces = _causal_wave_pieces(spec, num_sms)  # what the config's rule found
            cut = units if pieces else 0
        elif not cut and _SPLIT_UNITS_ENV != "0":
            # a partly filled single round of non-causal tiles (stream_k_tiles cuts none) may run
            # in pieces over several rounds (tile_order.wave_pieces)
            waves = (_SPLIT_WAVES_ENV != "0" and not spec.causal and not self.paired(spec)
                     and units <= num_sms and self.pack_gqa(spec) * spec.seqlen_q >= WAVE_MIN_ROWS)
            pieces = split_pieces(units, num_sms, blocks, tile_n, min_keys, pairs=self.paired(spec),
                                  min_piece_keys=_split_piece_keys(spec.causal, spec.head_dim_v),
                                  max_pieces=_split_max_pieces(), waves=waves,
                                  deep=not _SPLIT_UNITS_ENV)
            if causal_split:
                # each tile cut along the blocks it sees (FlashFwdSm90.item_coords), the first
                # tile the fewest: a piece of every tile holds one at least
                pieces = min(pieces, self.paired_key_blocks(spec)(0))
                pieces = pieces if pieces >= 2 else 0
            cut = units if pieces else 0
        if not cut:
            return none
        return cut, blocks, pieces, stream_k_grid(units, num_sms, cut, pieces)

    @classmethod
    def paired_key_blocks(cls, spec):
        """``key_blocks(m_block)``: how many key blocks query block m_block of a paired call
        without a left window bound visits; a transcription of FlashFwdSm90.key_block_bounds
        (q_end with pack_gqa = g), which tests/test_compile_sm90.py checks against the
        kernel's own code run on the host."""
        tile_m, tile_n = cls.config(spec)[:2]
        g = cls.pack_gqa(spec)
        Sq, Sk = spec.seqlen_q, spec.seqlen_k
        n_key_blocks = -(-Sk // tile_n)
        win_right = cls.runtime_scalars(spec)[2]
        shift = cls.row_shift(spec)  # (end_aligned: g = 1)

        def key_blocks(m):
            q_end = (m * tile_m + tile_m - 1) // g + 1 - shift
            return min(n_key_blocks, -(-max(q_end + Sk - Sq + win_right, 0) // tile_n))
        return key_blocks

    def stream_k_count(self, spec, device) -> int:
        """Units of a stream-K call cut along the keys, 0 for none (stream_k_plan)."""
        return self.stream_k_plan(spec, device)[0]

    @classmethod
    def no_cut_fields(cls, spec) -> tuple:
        """The packed stream-K fields of a launch that cuts nothing (arg_schema), () without them."""
        if not cls.stream_k(spec):
            return ()
        return (0, 0, 0, 0) if cls.paired(spec) else (0, 0, 0)

    def stream_k_fields(self, spec, device, plan):
        """The packed stream-K fields of a launch (arg_schema): workspace and counter pointers,
        cut units and (paired) key blocks per unit. ``plan``: the launch memo's (stream_k_plan,
        epilogue groups = tile_m / 64, paired). The workspace holds one record per cut unit
        and epilogue group (Dv / 2 + 4 values per consumer thread; FlashFwdSm90.stream_k_merge),
        from the caching allocator per call (the tensors stay alive while the launch is queued:
        the allocator is stream-ordered). The counters start at zero and the kernel leaves them
        at zero, so they are kept per (device, stream) and reused (streams never share them);
        during a CUDA graph capture they are made zero in the graph instead (a memset node)."""
        cut, unit_blocks, pieces, _, groups, paired = plan
        if cut == 0:  # (no_cut_fields, without asking the spec again)
            return (0, 0, 0) + ((0,) if paired else ())
        # a record per cut unit and group; beyond two pieces, one per piece (stream_k_merge_pieces)
        records = cut * groups * (pieces if pieces > 2 else 1)
        ws = torch.empty(records * 128 * (spec.head_dim_v // 2 + 4), dtype=torch.float32, device=device)
        n_counters = cut * groups
        if torch.cuda.is_current_stream_capturing():
            counters = torch.zeros(n_counters, dtype=torch.int32, device=device)
        else:
            key = (device.index, current_stream_handle(device))
            counters = self._sk_counters.get(key)
            if counters is None or counters.numel() < n_counters:
                counters = torch.zeros(max(n_counters, 1024), dtype=torch.int32, device=device)
                self._sk_counters[key] = counters
        return (ws.data_ptr(), counters.data_ptr(), cut) + ((unit_blocks,) if paired else ())

    @staticmethod
    def varlen_sections(spec) -> bool:
        """Varlen causal / right-bounded tiles heaviest first within L2 sections of (sequence,
        head) pairs, as batched calls are ordered (fast/common/tile_order), instead of heaviest
        first across every sequence and head at once: the CTAs running together then read a few
        heads' K/V, which stay in L2, rather than each streaming its own head's from memory.
        DUALATTN_SM90_VARLEN_SECTIONS=0 turns it off (comparisons)."""
        return (spec.mode == "varlen" and (spec.causal or spec.window[1] >= 0)
                and _VARLEN_SECTIONS_ENV != "0")

    def make_kernel(self, spec):
        from .flash_fwd import FlashFwdSm90
        tile_m, tile_n, stages, pingpong, overlap, persistent, separate_o = self.config(spec)
        wl, wr, sc = self.mask_flags(spec)
        return FlashFwdSm90(_cutlass_dtype(spec.dtype), spec.head_dim, spec.head_dim_v,
                            spec.causal, tile_n, stages, pingpong, overlap, persistent, separate_o,
                            window_left=wl, window_right=wr, softcap=sc,
                            varlen=spec.mode == "varlen", num_key_ranges=spec.num_key_ranges,
                            block_sparse=spec.has_block_sparse, write_lse=self.writes_lse(spec),
                            num_mma_wg=tile_m // 64, pack_gqa=self.pack_gqa(spec), q_stages=self.q_stages(spec),
                            paired=self.paired(spec), varlen_sections=self.varlen_sections(spec),
                            wg_epilogue=self.wg_epilogue(spec), stream_k=self.stream_k(spec),
                            rescale_threshold=self.rescale_threshold(spec),
                            rescale_before_pv=self.rescale_before_pv(spec),
                            reduce_chains=self.reduce_chains(spec),
                            wg_key_bound=self.wg_key_bound(spec), split_tail=self.split_tail(spec),
                            bit_mask=self.bit_mask(spec), tile_info=self.tile_info(spec),
                            q_regs=self.q_regs(spec), pass_empty_wg=self.pass_empty_wg(spec),
                            rotate_m_blocks=self.rotate_m_blocks(spec),
                            shared_o_slot=self.shared_o_slot(spec),
                            staging_per_tile=self.staging_per_tile(spec),
                            narrow_first=self.narrow_first(spec),
                            trace_phases=self.trace_phases(spec),
                            tile_decoder=self.tile_decoder(spec),
                            stmatrix_o=self.stmatrix_o(spec),
                            warp_store_o=self.warp_store_o(spec),
                            l2_hints=self.l2_hints(spec), window_order=self.window_order(spec),
                            narrow_last=self.narrow_last(spec), key_split=self.key_split(spec),
                            merge_live_rows=self.merge_live_rows(spec),
                            merge_batch=self.merge_batch(spec), end_aligned=self.end_aligned(spec),
                            lse_after_o=self.lse_after_o(spec), csr_table=self.csr_table(spec))

    @staticmethod
    def arg_schema(spec):
        """Fields of the packed per-call argument (the order of FlashFwdSm90.tensors_from_pointers, then the scalars of __call__).
        Pointer dtypes and alignments are compiled in; everything else is a runtime value."""
        import cutlass
        from dualattn.fast.common.launch_args import ArgSchema
        dt = _cutlass_dtype(spec.dtype)
        fields = [(n, ("ptr", dt, 16)) for n in ("q", "k", "v", "o")]
        fields += [("lse", ("ptr", cutlass.Float32, 4))]
        if spec.mode == "varlen":  # order of FlashFwdSm90.from_packed_varlen
            fields += [(n, ("ptr", cutlass.Int32, 4)) for n in ("cu_seqlens_q", "cu_seqlens_k")]
            fields += [(n, "i32") for n in ("total_q", "total_k", "heads_q", "heads_kv", "batch",
                                            "max_seqlen_q")]
            fields += [(f"{t}_stride_{m}", "i64") for t in "qkv" for m in "sh"]
        else:
            fields += [(n, "i32") for n in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv")]
            fields += [(f"{t}_stride_{m}", "i64") for t in "qkv" for m in "bsh"]
        fields += [("scale_log2", "f32"), ("win_left", "i32"), ("win_right", "i32"),
                   ("softcap_scale", "f32"), ("softcap", "f32"), ("num_sms", "i32")]
        if spec.mode == "varlen" and FastSm90Forward.paired(spec):  # (FlashFwdSm90.from_packed_varlen)
            fields += [("varlen_unit_table", ("ptr", cutlass.Int32, 4)), ("varlen_unit_rounds", "i32"),
                       ("varlen_unit_count", "i32")]
        if FastSm90Forward.split_tail(spec):  # the split tail (FlashFwdSm90.from_packed)
            fields += [("split_tail_groups", "i32"), ("split_tail_table", ("ptr", cutlass.Int32, 4)),
                       ("split_tail_rounds", "i32")]
        if FastSm90Forward.csr_table(spec):  # the block-sparse unit table (FlashFwdSm90.from_packed)
            fields += [("csr_unit_table", ("ptr", cutlass.Int32, 4)), ("csr_unit_rounds", "i32")]
        # feature fields (FlashFwdSm90.feature_args): flat int32 arrays + element strides
        if spec.has_key_ranges:
            fields += [("key_ranges", ("ptr", cutlass.Int32, 8)), ("kr_sb", "i32"), ("kr_sh", "i32")]
        if spec.has_block_sparse:
            fields += [(n, ("ptr", cutlass.Int32, 4)) for n in ("bs_full_rowptr", "bs_full_col",
                                                                 "bs_mask_rowptr", "bs_mask_col")]
            fields += [("bs_ratio_m", "i32"), ("bs_ratio_n", "i32")]
            fields += [(f"bs_{a}_s{m}", "i32") for a in ("frp", "fcol", "mrp", "mcol") for m in "bh"]
        if FastSm90Forward.stream_k(spec):
            fields += [("sk_workspace", ("ptr", cutlass.Float32, 16)), ("sk_counters", ("ptr", cutlass.Int32, 4)),
                       ("sk_tiles", "i32")]
            if FastSm90Forward.paired(spec):
                fields += [("sk_unit_blocks", "i32")]
        return ArgSchema(fields)

    def compile_for(self, spec, arch: int, keep_ptx: bool = False):
        """Compile the packed-argument entry (FlashFwdSm90.from_packed) for ``arch``."""
        import cutlass.cute as cute
        import cuda.bindings.driver as cuda
        opts = f"--gpu-arch {arch_string(arch)}"
        if keep_ptx:
            # the DSL names the PTX file after the function, not the config: a private folder per
            # call keeps parallel compiles (pytest -n) from reading each other's files, and keeps
            # the working directory clean
            dump = tempfile.mkdtemp(prefix="dualattn-sm90-ptx-")
            atexit.register(shutil.rmtree, dump, True)
            opts += f" --keep-ptx --dump-dir {dump}"
        kern = self.make_kernel(spec)
        entry = kern.from_packed_varlen if spec.mode == "varlen" else kern.from_packed
        return cute.compile(entry, self.arg_schema(spec).fake(),
                            cuda.CUstream(0), options=opts)

    def compile_only(self, spec, arch: int = 90, keep_ptx: bool = True):
        """Trace and assemble for ``arch`` without a GPU; returns the compiled object."""
        return self.compile_for(spec, arch, keep_ptx)

    @classmethod
    def scalar_fields(cls, spec, num_sms: int, device=None) -> tuple:
        """The packed fields after the q/k/v strides (arg_schema): runtime_scalars, the SM count
        the persistent grid is sized by, and with split_tail the tail's groups of heads, its
        table on ``device`` (split_tail_table; kept alive here) and its rounds. Without a device,
        or while a CUDA graph is being captured (a first call of the shape inside a capture: no
        host-to-device copy there), whole pairs."""
        if not cls.split_tail(spec):
            return (*cls.runtime_scalars(spec), num_sms)
        groups, rounds, ptr = 0, 0, 0
        if device is not None and not torch.cuda.is_current_stream_capturing():
            groups, rounds, table = cls.split_tail_schedule(spec, num_sms)
            ptr = cls._tail_table(device, table) if groups else 0
        if not ptr:
            groups, rounds = 0, 0
        return (*cls.runtime_scalars(spec), num_sms, groups, ptr, rounds)

    # split-tail tables on the GPU by (device, contents). Never freed: a captured CUDA graph and
    # the launchers remembered by dualattn.attention hold their addresses, not the tensors. At
    # most TAIL_TABLES (a table is 1-10 KB), then new shapes run whole pairs.
    _tail_tables: dict = {}
    TAIL_TABLES = 4096

    @classmethod
    def _tail_table(cls, device, table) -> int:
        """Device address of a split tail's table on ``device``, made once per table (keyed by
        its contents: knobs change the plan of one spec), 0 once TAIL_TABLES tables are made.
        Not called inside a graph capture (scalar_fields)."""
        return _table_on_device(cls._tail_tables, cls.TAIL_TABLES, device, table)

    # varlen unit tables' plans by (spec, device, SMs, sequence lengths, knobs): (table address,
    # rounds, units); the tables on the GPU by (device, contents), never freed (a captured graph
    # and a remembered launch hold their addresses), at most VARLEN_TABLES of them (a table is
    # 4 bytes a unit and empty slot: 4-70 KB), then new lengths run the static stride
    _varlen_plans: dict = {}
    _varlen_tables: dict = {}
    VARLEN_TABLES = 1024

    @classmethod
    def varlen_unit_table(cls, spec, cu_q, cu_k, device, num_sms: int) -> Tuple[int, int, int]:
        """(table address, rounds, units planned for) of a varlen paired launch (arg_schema's
        varlen fields), or (0, 0, 0) for the static stride. The static stride hands CTA c units
        c, c + G, ...; units of sequences of different lengths differ in work, and at the bench's
        documents cell (10 documents of 871-2312 rows, 16 heads, 132 CTAs) its busiest CTA
        carries 1 / 0.972 of the mean (tile_order model, tiles costed as their key blocks +
        VARLEN_LPT_TILE_OVERHEAD). The launch instead deals the units longest-processing-time
        first (tile_order.lpt_unit_table; model: 1 / 0.995), when that lowers the busiest CTA's
        work by SPLIT_TAIL_MIN_GAIN. H100, bf16, causal documents (bench.doc_lengths), graph A/B
        (ci/sm90_env_ab.py "_VARLEN_LPT_ENV=0" "" docs:...), time with / without (model):
        hd128 10 documents in 16k, 16 heads 0.980 (0.977); 5 in 16k 0.987 (0.983); 20 in 32k
        0.943 (0.953); 6 in 8k, 32 heads 0.938 (0.939); 40 in 64k, 8 heads 0.910 (0.926); 16 in
        16k 0.892 (0.905); 20 in 16k 0.968 (0.963); 40 in 32k 0.996 (0.988); 10 in 8k, 32 heads
        0.952 (0.962); 14 in 16k 1.001 (1.006: the static stride is kept); hd64 10 in 16k, 32
        heads 0.987 (docs section 56).

        It needs the sequence lengths on the host and reads them only where the value checks
        already did (spec.VALUE_CHECK_MEMO.host_values: no synchronisation of its own); with value
        checks off, or lengths first seen inside a CUDA graph capture (no host-to-device copy
        there), the launch keeps the static stride. A plan can outlive its lengths (a graph
        replayed after cu_seqlens was updated in place, a write that bypassed torch's version
        counter): the kernel then counts the units itself and runs the static stride unless the
        count is the one the table was planned for (FlashFwdSm90.count_units; with the
        same count the table is still a permutation of the units, so every unit runs once).
        DUALATTN_SM90_VARLEN_LPT=0 turns it off, =1 deals by LPT whatever the gain
        (comparisons, tests)."""
        if _VARLEN_LPT_ENV == "0":
            return 0, 0, 0
        host_q = VALUE_CHECK_MEMO.host_values(cu_q)
        host_k = host_q if cu_k is cu_q else VALUE_CHECK_MEMO.host_values(cu_k)
        if host_q is None or host_k is None:
            return 0, 0, 0
        # (the lengths and the spec decide the plan; the spec's rules are asked once, on a miss)
        key = (spec, device.index, num_sms, host_q, host_k, _VARLEN_LPT_ENV, _VARLEN_LPT_OVERHEAD_ENV)
        hit = cls._varlen_plans.get(key)
        if hit is not None:
            return hit
        if not cls.paired(spec) or torch.cuda.is_current_stream_capturing():
            return 0, 0, 0
        tile_m = cls.config(spec)[0]
        # the kernel's grid (FlashFwdSm90.__call__): min(tiles of max_seqlen_q x heads x batch, SMs)
        ctas = min(-(-max(spec.seqlen_q, 1) // tile_m) * spec.num_heads_q * spec.batch, num_sms)
        rounds, table = cls.varlen_unit_plan(spec, host_q, host_k, ctas) if ctas > 0 else (0, [])
        plan = (0, 0, 0)
        if rounds:
            ptr = _table_on_device(cls._varlen_tables, cls.VARLEN_TABLES, device, table)
            if ptr:
                plan = (ptr, rounds, max(table) + 1)  # (every unit is in the table once)
        if len(cls._varlen_plans) >= 1024:  # keys hold lengths: keep it bounded
            cls._varlen_plans.clear()
        cls._varlen_plans[key] = plan
        return plan

    @classmethod
    def varlen_unit_plan(cls, spec, host_q, host_k, ctas: int) -> Tuple[int, list]:
        """(rounds, table) of varlen_unit_table from the host's cu_seqlens, (0, []) for the
        static stride. A tile costs its key blocks (FlashFwdSm90.key_block_bounds, transcribed:
        no packed GQA rows or end alignment in varlen) plus VARLEN_LPT_TILE_OVERHEAD."""
        tile_m, tile_n = cls.config(spec)[:2]
        _, win_left, win_right, _, _ = cls.runtime_scalars(spec)
        left = spec.window[0] >= 0
        lens_q = [b - a for a, b in zip(host_q, host_q[1:])]
        lens_k = [b - a for a, b in zip(host_k, host_k[1:])]
        overhead = float(_VARLEN_LPT_OVERHEAD_ENV or VARLEN_LPT_TILE_OVERHEAD)

        def tile_cost(seq, m):
            sq, sk = lens_q[seq], lens_k[seq]
            hi = min(-(-sk // tile_n), -(-max((m + 1) * tile_m + sk - sq + win_right, 0) // tile_n))
            lo = max(m * tile_m + sk - sq - win_left, 0) // tile_n if left else 0
            return max(hi - lo, 0) + overhead

        tiles = [-(-n // tile_m) for n in lens_q]
        forced = _VARLEN_LPT_ENV == "1"
        if not forced and sum(paired_units(n, spec.num_heads_q) for n in tiles) > VARLEN_LPT_MAX_UNITS:
            return 0, []
        costs = varlen_paired_unit_costs(tiles, spec.num_heads_q, tile_cost)
        static = max(static_stride_loads(costs, ctas), default=0.0)
        # no deal carries less than the mean or the heaviest unit: where the static stride is
        # within the gain of that, the O(units log CTAs) deal is skipped
        bound = max(sum(costs) / max(ctas, 1), max(costs, default=0.0))
        if not forced and bound > (1 - SPLIT_TAIL_MIN_GAIN) * static:
            return 0, []
        rounds, table, busiest = lpt_unit_table(costs, ctas)
        if not forced and busiest > (1 - SPLIT_TAIL_MIN_GAIN) * static:
            return 0, []
        return rounds, table

    # block-sparse unit tables' plans by (spec, device, SMs, the row pointers' host copies by
    # identity, knobs): ((table address, rounds), the copies, which the entry holds so that their
    # ids stay theirs); the tables on the GPU by (device, contents), never freed, at most
    # CSR_TABLES (4 bytes a unit and empty slot), then new patterns run the kernel's own order.
    # A plan only orders the spec's units: one made for other values of the pattern is slower,
    # never wrong.
    _csr_plans: dict = {}
    _csr_tables: dict = {}
    CSR_TABLES = 1024

    @classmethod
    def csr_unit_table(cls, spec, bs, device, num_sms: int) -> Tuple[int, int]:
        """(table address, rounds) of a block-sparse call's launch (csr_table), (0, 0) for the
        kernel's own order. Planned from the host copies of the CSR's row pointers that the value
        checks keep (BlockSparse.check_compatible), once per pattern."""
        if _CSR_LPT_ENV == "0":
            return 0, 0
        full = VALUE_CHECK_MEMO.host_values(bs.q2k_full.rowptr)
        mask = VALUE_CHECK_MEMO.host_values(bs.q2k_mask.rowptr)
        if full is None or mask is None:
            return 0, 0
        key = (spec, device.index, num_sms, id(full), id(mask), bs.block_m, bs.block_n, _CSR_LPT_ENV,
               _CSR_LPT_SECTION_ENV)
        hit = cls._csr_plans.get(key)
        if hit is not None:
            return hit[0]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return 0, 0
        rows = tuple(bs.q2k_full.rowptr.shape[:2])
        rounds, table = cls.csr_unit_plan(spec, full, mask, rows, bs.block_m, bs.block_n, num_sms)
        ptr = _table_on_device(cls._csr_tables, cls.CSR_TABLES, device, table) if rounds else 0
        if len(cls._csr_plans) >= 1024:
            cls._csr_plans.clear()
        cls._csr_plans[key] = ((ptr, rounds) if ptr else (0, 0), full, mask)
        return cls._csr_plans[key][0]

    @classmethod
    def csr_unit_plan(cls, spec, full, mask, rows, block_m: int, block_n: int, num_sms: int) -> Tuple[int, list]:
        """(rounds, table) of csr_unit_table, (0, []) for the kernel's own order: the units
        (csr_unit_costs) dealt longest-processing-time first within sections of heads holding
        CSR_LPT_SECTION_BYTES of K and V (heads_per_section; DUALATTN_SM90_CSR_LPT_SECTION_BYTES
        for comparisons), where that lowers the busiest CTA by 1 % (SPLIT_TAIL_MIN_GAIN)."""
        tile_m = cls.config(spec)[0]
        nm = -(-max(spec.seqlen_q, 1) // tile_m)
        hb = spec.batch * spec.num_heads_q
        units = nm * hb
        ctas = min(units, num_sms)
        forced = _CSR_LPT_ENV == "1"
        if ctas <= 0 or (units > CSR_LPT_MAX_UNITS and not forced):
            return 0, []
        costs = cls.csr_unit_costs(spec, full, mask, rows, block_m, block_n)
        own = cls._own_order_costs(spec, costs, nm, hb, cls.section_heads(spec, L2_SECTION_BYTES))
        static = max(static_stride_loads(own, ctas))
        section = cls.section_heads(spec, int(_CSR_LPT_SECTION_ENV or CSR_LPT_SECTION_BYTES))
        rounds, table, busiest = lpt_unit_table(costs, ctas, [u // nm // section for u in range(units)])
        if not forced and busiest > (1 - SPLIT_TAIL_MIN_GAIN) * static:
            return 0, []
        return rounds, table

    @classmethod
    def csr_unit_costs(cls, spec, full, mask, rows, block_m: int, block_n: int) -> list:
        """Modelled work of each unit bh * num_m_blocks + m (FlashFwdSm90.tile_coords): its CSR
        row's entries, full and masked, times the kernel's key blocks per CSR block, plus
        CSR_LPT_TILE_OVERHEAD (causal limits and the key tail are left out). ``full`` and
        ``mask``: the flat row pointers, of shape ``rows`` (B' in (1, batch), H' in (1, heads))
        + (CSR query blocks + 1,)."""
        tile_m, tile_n = cls.config(spec)[:2]
        nm = -(-max(spec.seqlen_q, 1) // tile_m)
        nq = -(-max(spec.seqlen_q, 1) // block_m)
        ratio_m, ratio_n = block_m // tile_m, block_n // tile_n
        bp, hp = rows
        stride_b, stride_h = (hp * (nq + 1) if bp > 1 else 0), ((nq + 1) if hp > 1 else 0)
        costs = []
        for bh in range(spec.batch * spec.num_heads_q):
            base = (bh // spec.num_heads_q) * stride_b + (bh % spec.num_heads_q) * stride_h
            for m in range(nm):
                r = base + m // ratio_m
                costs.append(ratio_n * (full[r + 1] - full[r] + mask[r + 1] - mask[r]) + CSR_LPT_TILE_OVERHEAD)
        return costs

    @staticmethod
    def section_heads(spec, section_bytes: int) -> int:
        """(batch, head) pairs whose K and V fit ``section_bytes`` (a GQA group's query heads
        counted once, as FlashFwdSm90.l2_section_heads counts them), at most all of them."""
        kv_row_bytes = (spec.head_dim + spec.head_dim_v) * spec.dtype.itemsize
        return min(heads_per_section(max(spec.seqlen_k, 1), kv_row_bytes, max, section_bytes)
                   * (spec.num_heads_q // spec.num_heads_kv), spec.batch * spec.num_heads_q)

    @classmethod
    def _own_order_costs(cls, spec, costs, nm: int, hb: int, section: int) -> list:
        """``costs`` (by unit bh * nm + m) in the kernel's own slot order without a table
        (FlashFwdSm90.tile_coords): query block fastest, or causal / right-bounded heaviest
        first in L2 sections of ``section`` heads (the turned order's rotation left out)."""
        if not (spec.causal or spec.window[1] >= 0):
            return costs
        order = []
        for t in range(nm * hb):
            m, bh = heavy_first_in_sections(t, nm, hb, section, min)
            order.append(costs[bh * nm + m])
        return order

    @staticmethod
    def runtime_scalars(spec):
        """(scale_log2, win_left, win_right, softcap_scale, softcap) as kernel arguments."""
        left, right = spec.window
        if spec.causal:
            right = 0 if right < 0 else min(right, 0)  # causal AND window: the tighter bound
        if spec.softcap > 0:  # s' = cap * tanh(s * scale / cap), then softmax with scale 1
            scale_log2, sc_scale, cap = math.log2(math.e), spec.scale / spec.softcap, spec.softcap
        else:
            scale_log2, sc_scale, cap = spec.scale * math.log2(math.e), 1.0, 1.0
        return (float(scale_log2), max(left, 0), max(right, 0), float(sc_scale), float(cap))

    # -- run -----------------------------------------------------------------------------------
    @staticmethod
    def _prep(t: torch.Tensor) -> torch.Tensor:
        # TMA needs a unit-stride head dim, 16-byte aligned strides and base (a contiguous
        # tensor has them: D is a multiple of 8; checked first because it is the cheap test)
        if t.is_contiguous() and t.data_ptr() % 16 == 0:
            return t
        # a broadcast dim (stride 0, e.g. K/V expanded over heads) is not a TMA layout: copied
        ok = (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
              and all(st % 8 == 0 and (st > 0 or n == 1) for st, n in zip(t.stride()[:-1], t.shape[:-1])))
        if ok:
            return t
        # contiguous() is a no-op on a contiguous view at an odd offset (buf[1:].view(...)): the
        # TMA descriptor would silently round its base down, so such a view is cloned
        return t.contiguous() if not t.is_contiguous() else t.clone()

    def _entry(self, spec, device):
        """(compiled fn, schema.pack, runtime scalars + the grid's CTAs, stream-K plan: (cut
        units, key blocks per unit, pieces, grid, tile_m / 64, paired; stream_k_plan) or None
        without stream-K) for a spec on a device;
        memoised per (spec, device) so a repeated call does no key building, device queries or
        stream-K planning."""
        ek = (spec, device.index)
        hit = self._entries.get(ek)
        if hit is not None:
            return hit
        arch = target_arch(dispatch.device_arch(device.index or 0))
        key = self.compile_key(spec, arch)
        fn = self.cache.get(key, lambda: self.compile_for(spec, arch))
        sk_plan = ((*self.stream_k_plan(spec, device), self.config(spec)[0] // 64, self.paired(spec))
                   if self.stream_k(spec) else None)
        # the grid's CTAs: the SMs, or with every unit cut pieces x units (FlashFwdSm90.__call__)
        tail = self.scalar_fields(spec, sk_plan[3] if sk_plan is not None and sk_plan[2] else _num_sms(device),
                                  device)
        hit = (DirectLauncher(fn), self.arg_schema(spec).pack, tail, sk_plan)
        if self.split_tail(spec) and torch.cuda.is_current_stream_capturing():
            return hit  # (whole pairs in this capture; the next call outside one plans the tail)
        if len(self._entries) > 4096:  # specs carry shapes: keep the memo bounded
            self._entries.clear()
        self._entries[ek] = hit
        return hit

    @staticmethod
    def shape_values(q, k, v) -> tuple:
        """The packed fields after the five pointers (arg_schema order): shapes, q/k/v strides."""
        B, Sq, Hq, _ = q.shape
        sq, sk, sv = q.stride(), k.stride(), v.stride()
        return (B, Sq, k.shape[1], Hq, k.shape[2], sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2])

    @staticmethod
    def pack_args(pack, tail, q, k, v, out, lse, feat=()):
        """The per-call packed argument: raw pointers, shapes, q/k/v strides, scalars."""
        return pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                    *FastSm90Forward.shape_values(q, k, v), *tail, *feat)

    def feature_values(self, call):
        """Packed values of the key-range / block-sparse fields (arg_schema order). Arrays are
        made contiguous int32 and kept alive in call.extra until the call object goes away
        (the stream-ordered allocator would make that safe anyway)."""
        spec = call.spec
        vals, keep = [], []
        if spec.has_key_ranges:
            kr = call.key_ranges.to(torch.int32).contiguous()
            keep.append(kr)
            # a size-1 batch or head dimension broadcasts: stride 0
            vals += [kr.data_ptr(), kr.stride(0) if kr.shape[0] > 1 else 0,
                     kr.stride(1) if kr.shape[1] > 1 else 0]
        if spec.has_block_sparse:
            bs = call.block_sparse
            tile_n = self.config(spec)[1]
            arrays, strides = [], []
            for csr in (bs.q2k_full, bs.q2k_mask):
                rp, col = csr.rowptr.to(torch.int32).contiguous(), csr.col.to(torch.int32).contiguous()
                keep += [rp, col]
                arrays += [rp.data_ptr(), col.data_ptr()]
            for t in keep[-4:]:
                strides += [t.stride(0) if t.shape[0] > 1 else 0, t.stride(1) if t.shape[1] > 1 else 0]
            vals += arrays + [bs.block_m // 128, bs.block_n // tile_n] + strides
        if keep:
            call.extra["_sm90_keepalive"] = keep
        return tuple(vals)

    def _outputs(self, call, out_shape, lse_shape, q):
        """(out, lse): preallocated ones from call.extra (the tests pass NaN-poisoned ones), else
        fresh; lse is None when the kernel does not store it (writes_lse)."""
        extra = call.extra
        out = extra.get("out") if extra else None
        if out is None:
            out = empty_output(q, out_shape[-1])  # out_shape is q's but for the last dim
        lse = None
        if self.writes_lse(call.spec):  # else no LSE at all, not even a preallocated one left unwritten
            lse = extra.get("lse") if extra else None
            if lse is None:
                lse = empty_f32(q, lse_shape)
        # the kernel derives O's and LSE's strides from the shapes: they must be contiguous
        assert out.is_contiguous() and (lse is None or lse.is_contiguous()) and out.data_ptr() % 16 == 0
        return out, lse

    @staticmethod
    def _no_keys(out, lse, zero_out: bool):
        """Outputs of a call with nothing to attend to: O = 0 and LSE = -inf."""
        if zero_out:
            out.zero_()
        return out, (lse.fill_(-math.inf) if lse is not None else None)

    def _forward_varlen(self, call):
        spec = call.spec
        prep = self._prep
        q, k, v = prep(call.q), prep(call.k), prep(call.v)
        Tq, Hq, _ = q.shape
        out, lse = self._outputs(call, (Tq, Hq, spec.head_dim_v), (Hq, Tq), q)
        if out.numel() == 0 or spec.batch == 0:
            return self._no_keys(out, lse, False)
        if k.shape[0] == 0:  # no keys in any sequence
            return self._no_keys(out, lse, True)
        cu_q = call.cu_seqlens_q.to(torch.int32).contiguous()
        cu_k = call.cu_seqlens_k.to(torch.int32).contiguous()
        fn, pack, tail, _ = self._entry(spec, q.device)
        sq, sk, sv = q.stride(), k.stride(), v.stride()
        # the unit table's fields where the launch memo's schema has them (paired calls; asking
        # FastSm90Forward.paired again would cost 15-20 us a call)
        units = (self.varlen_unit_table(spec, cu_q, cu_k, q.device, tail[-1])
                 if "varlen_unit_table" in pack.__self__.ptr_info else ())
        args = pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                    cu_q.data_ptr(), cu_k.data_ptr(), Tq, k.shape[0], Hq, k.shape[1],
                    spec.batch, max(spec.seqlen_q, 1), sq[0], sq[1], sk[0], sk[1], sv[0], sv[1],
                    *tail, *units, *self.feature_values(call))
        _launch(fn, args, q.device)
        return out, lse

    def forward(self, call):
        """(out, lse) of a batched or varlen call; lse is None when the call neither returns it
        nor needs it (spec.return_lse / needs_grad), which skips its allocation and store."""
        spec = call.spec
        if spec.mode == "varlen":
            return self._forward_varlen(call)
        prep = self._prep
        q, k, v = prep(call.q), prep(call.k), prep(call.v)
        B, Sq, Hq, _ = q.shape
        out, lse = self._outputs(call, (B, Sq, Hq, spec.head_dim_v), (B, Hq, Sq), q)
        if out.numel() == 0:
            return self._no_keys(out, lse, False)
        if k.shape[1] == 0:  # no keys at all: every row is fully masked
            return self._no_keys(out, lse, True)
        fn, pack, tail, sk_plan = self._entry(spec, q.device)
        feat = self.feature_values(call) if (spec.has_key_ranges or spec.has_block_sparse) else ()
        if "csr_unit_table" in pack.__self__.ptr_info:  # (the launch memo's schema: csr_table)
            feat = (*self.csr_unit_table(spec, call.block_sparse, q.device, tail[-1]), *feat)
        if sk_plan is not None:
            feat = self.stream_k_fields(spec, q.device, sk_plan)
        _launch(fn, self.pack_args(pack, tail, q, k, v, out, lse, feat), q.device)
        return out, lse

    def backward(self, call, out, lse, dout):
        raise NotImplementedError("fast-sm90 has no backward kernel; can_implement refuses needs_grad")

    def direct_launcher(self, call):
        """``run(q, k, v) -> (out, lse)`` for later calls with exactly ``call``'s arguments but the
        data (api.attention keys it on shapes, strides, dtypes, devices and flags): the compiled
        entry and every packed value but the pointers are bound here, once. None where forward()
        does more than one plain launch (varlen, key ranges, CSR, empty or key-less calls, inputs
        that _prep would copy); ``run`` returns None for a misaligned pointer (forward copies)."""
        spec = call.spec
        q, k, v = call.q, call.k, call.v
        if "forward" in self.__dict__:  # forward replaced on this object (props.planted): no bypass
            return None
        if (spec.mode != "batched" or spec.has_key_ranges or spec.has_block_sparse or call.extra
                or not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())):
            return None
        B, Sq, Hq, _ = q.shape
        if B * Sq * Hq == 0 or k.shape[1] == 0:
            return None
        fn, pack, tail, sk_plan = self._entry(spec, q.device)
        if sk_plan is not None and sk_plan[0] > 0:
            return None  # its workspace is per call: forward() does that
        # every field but the five pointers is packed once (pack is the schema's bound method);
        # stream-K fields: no tile cut, no buffers
        bound = BoundLaunch(fn, pack.__self__, 5, (*self.shape_values(q, k, v), *tail,
                                                   *self.no_cut_fields(spec)))
        dv, device, lse_shape = spec.head_dim_v, q.device, ((B, Hq, Sq) if self.writes_lse(spec) else None)

        def run(q, k, v):
            qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
            if (qp | kp | vp) & 15:
                return None
            out = empty_output(q, dv)
            lse = None if lse_shape is None else empty_f32(q, lse_shape)
            _launch(bound, (qp, kp, vp, out.data_ptr(), 0 if lse is None else lse.data_ptr()), device)
            return out, lse
        return run


def _table_on_device(store: dict, capacity: int, device, table) -> int:
    """Device address of ``table`` (int32) on ``device``, made once per contents in ``store``
    (never freed: a captured CUDA graph and a remembered launch hold the address, not the
    tensor), 0 once ``store`` holds ``capacity`` tables. Not called inside a graph capture."""
    key = (device.index, tuple(table))
    t = store.get(key)
    if t is None:
        if len(store) >= capacity:
            return 0
        # (setdefault: two threads making the same table keep one, and both use it)
        t = store.setdefault(key, torch.tensor(table, dtype=torch.int32, device=device))
    return t.data_ptr()


def _launch(fn, args, device) -> None:
    """Launch on ``device``'s stream from ``device``'s context: the launch goes to the current
    device, and CUDA refuses a stream of another device (tensors on cuda:1, current device 0)."""
    if device.index is None or device.index == current_device_index():
        fn(args, current_stream_handle(device))
    else:
        with torch.cuda.device(device):
            fn(args, current_stream_handle(device))


FORWARD = dispatch.register(FastSm90Forward())
