"""fast-sm90 A/B of a grid knob (GPU only), in one process, interleaved (three rounds, medians; the
launch memo cleared between them), on the bench's mask cells and its dense / GQA cells:

    python ci/sm90_grid_ab.py persistent   # the default grid against the persistent grid
    python ci/sm90_grid_ab.py persistent 64   # the same on the dense causal cells of those head dims
    python ci/sm90_grid_ab.py q_stages     # the default Q buffers against one Q buffer
    python ci/sm90_grid_ab.py paired       # causal pairs of equal work against heaviest first
    python ci/sm90_grid_ab.py rescale 0    # the default rescale threshold against another (0: O
                                           # rescaled at every new max), on the dense cells
    python ci/sm90_grid_ab.py rescale_before_pv [64,128]   # O rescaled while the next Q K^T
                                           # runs against after the P V wait, on those head dims
    python ci/sm90_grid_ab.py reduce_chains 1   # the softmax's row max / sum in the default
                                                # partial chains against one serial chain
    python ci/sm90_grid_ab.py wg_epilogue  # per-warpgroup epilogues against one for all warpgroups
    python ci/sm90_grid_ab.py wg_key_bound # the default key bound (each warpgroup's own where it
                                           # applies) against the tile's, causal hd256 / hd192
                                           # (hd256 from 8k: both plain, ratio 1)
    python ci/sm90_grid_ab.py wg_key_bound pingpong  # forced on against the default, on the
                                           # ping-pong configs' causal cells (hd64, hd128, GQA)
    python ci/sm90_grid_ab.py stream_k     # the last rounds cut along the keys against uncut, on
                                           # the non-causal dense / GQA cells and shapes of whole rounds
    python ci/sm90_grid_ab.py stream_k causal   # the same for the paired causal order, on the
                                                # causal dense / GQA cells
    python ci/sm90_grid_ab.py varlen_sections   # varlen causal tiles in L2 sections against
                                                # heaviest first across all, on packed documents
    python ci/sm90_grid_ab.py bit_mask     # element masks from a bit set per row against a
                                           # compare per element, on the mask and causal cells
    python ci/sm90_grid_ab.py bit_mask force   # forced on (3-warpgroup tiles too) against the
                                               # default, on causal hd64 from 4k
    python ci/sm90_grid_ab.py q_regs       # Q K^T with Q from registers (default on plain non-causal
                                           # 128-row tiles) against from shared memory
    python ci/sm90_grid_ab.py pass_empty_wg [0|pass]   # warpgroups with no row in the sequence
                                              # pass their blocks, in the rotated order, against
                                              # computing them (0) or passing them in the plain
                                              # order (pass), on the dense / GQA cells, the
                                              # documents and shapes whose last query tile leaves
                                              # one empty
    python ci/sm90_grid_ab.py o_slot       # hd256's O staged in one slot the warpgroups share
                                           # against in Q's buffer
    python ci/sm90_grid_ab.py tile_info    # tile coordinates from the producer against each
                                           # consumer decoding them (branch wip/tile-info-smem)
    python ci/sm90_grid_ab.py tile_decoder # tile coordinates from a decoder warp against the TMA
                                           # warp decoding them, on every cell
    python ci/sm90_grid_ab.py stmatrix_o   # O staged by stmatrix against 32-bit shared stores
    python ci/sm90_grid_ab.py warp_store_o # each warp stores its own 16 rows of O against each
                                           # warpgroup storing its 64 behind two named barriers
    python ci/sm90_grid_ab.py l2_hints     # L2 eviction priorities on the TMA copies against none
    python ci/sm90_grid_ab.py tiles 64:128,4,1,1,3   # the default tiles against a DUALATTN_SM90_TILES
                                                     # override, on that head dim's dense cells

DUALATTN_AB_BASE_TILES=256:48,2,0 puts an override on the default side of the tiles knob too (two
overrides against each other). DUALATTN_AB_GRAPH=1 times CUDA-graph replays (each variant captured once, the replays interleaved,
five rounds): the kernels alone, without either variant's host path. DUALATTN_AB_CELLS=REGEX keeps
the cells whose label matches it (re.search).

The figures behind fast/sm90's _short_masked_tiles, FastSm90Forward.q_stages and .paired came from it.
"""
import os
import re
import statistics
import sys
from dataclasses import replace

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B

GRAPH = os.environ.get("DUALATTN_AB_GRAPH", "") == "1"
CELLS = os.environ.get("DUALATTN_AB_CELLS", "")
BASE_TILES = os.environ.get("DUALATTN_AB_BASE_TILES", "")  # tiles knob: override on the default side
KNOBS = {"persistent": ("_PERSISTENT_ENV", "1", "persistent"), "q_stages": ("_Q_STAGES_ENV", "1", "one Q buffer"),
         "paired": ("_PAIRED_ENV", "0", "heaviest first"),
         "varlen_sections": ("_VARLEN_SECTIONS_ENV", "0", "across all"),
         "rescale": ("_RESCALE_THRESHOLD_ENV", None, "threshold"),  # value: the second argument
         "rescale_before_pv": ("", "1", "rescale before P V"),
         "wg_epilogue": ("_WG_EPILOGUE_ENV", "0", "one epilogue"),
         "wg_key_bound": ("_WG_KEY_BOUND_ENV", "0", "plain key bound"),
         "stream_k": ("_STREAM_K_ENV", "0", "no cuts"),
         "split_tail": ("_SPLIT_TAIL_ENV", "0", "whole pairs"),
         "bit_mask": ("_BIT_MASK_ENV", "0", "compare masks"),
         "tile_info": ("_TILE_INFO_ENV", "0", "consumers decode"),
         "q_regs": ("_Q_REGS_ENV", "0", "Q from shared memory"),
         "stmatrix_o": ("_STMATRIX_O_ENV", "0", "32-bit staging stores"),
         "warp_store_o": ("_WARP_STORE_O_ENV", "0", "per-warpgroup stores"),
         "l2_hints": ("_L2_HINTS_ENV", "0", "no L2 hints"),
         "pass_empty_wg": ("_PASS_EMPTY_WG_ENV", None, "empty warpgroups"),  # 0 or pass
         "reduce_chains": ("_REDUCE_CHAINS_ENV", None, "chains"),
         "o_slot": ("_O_SLOT_ENV", "0", "O in Q's buffer"),
         "tile_decoder": ("_TILE_DECODER_ENV", "0", "TMA warp decodes")}  # value: the second argument


def _set_tiles(_module, _attr, value):
    """setattr stand-in for the tiles knob: the override is read from the environment per call
    (the default side: DUALATTN_AB_BASE_TILES, empty for the built-in tiles)."""
    os.environ["DUALATTN_SM90_TILES"] = value or BASE_TILES


def _set_rescale_before_pv(module, _attr, value):
    """O rescaled while the next Q K^T runs (no threshold) against after the P V wait (the
    'default' column: off everywhere, with the default threshold)."""
    module._RESCALE_BEFORE_PV_ENV = value or "0"
    module._RESCALE_THRESHOLD_ENV = "0" if value else ""


def odd_block_cells():
    """Causal cells with an odd number of 128-row query blocks (7, 5, 11), whose pairs leave a
    middle block per head (tile_order.pair_of_unit), on the bench's 16k tokens."""
    return [B.Cell("fwd", "dense", 18, 896, 896, 16, 16, 128, causal=True),
            B.Cell("fwd", "dense", 25, 640, 640, 32, 32, 64, causal=True),
            B.Cell("fwd", "dense", 11, 1408, 1408, 16, 16, 128, causal=True),
            B.Cell("fwd", "gqa", 18, 896, 896, 32, 8, 128, causal=True)]


def main(knob: str, tiles: str = ""):
    attr, value, label = KNOBS[knob] if knob != "tiles" else ("", tiles, f"tiles {tiles}")
    if knob == "rescale_before_pv":
        label = "rescale before P V"
    elif knob == "wg_key_bound" and tiles == "pingpong":
        value, label = "1", "own key bound"
    elif knob == "bit_mask" and tiles == "force":
        value, label = "1", "bit masks forced"
    elif value is None:
        value, label = tiles or "0", f"{label} {tiles or '0'}"
    set_knob = {"tiles": _set_tiles, "rescale_before_pv": _set_rescale_before_pv}.get(knob, setattr)
    impl = sm90.FORWARD
    timer = B.Timer(warmup=3, reps=10)
    fwd = B.standard_matrix(("fwd",))
    cells = B.filter_cells(fwd, groups=["window", "docs", "sparse"])
    if knob == "persistent" and tiles:  # second argument: head dims of the dense causal cells
        cells = B.filter_cells(fwd, groups=["dense"], head_dims=[int(h) for h in tiles.split(",")], causal=True)
    elif knob == "persistent":
        cells += B.filter_cells(fwd, groups=["dense"], head_dims=[128, 256], causal=True)
        cells += B.filter_cells(fwd, groups=["gqa"], causal=True)
    elif knob == "stream_k" and tiles == "causal":
        cells = B.filter_cells(fwd, groups=["dense", "gqa"], causal=True)
    elif knob == "stream_k":  # every non-causal cell; whole rounds on 132 SMs (nothing cut: noise)
        cells = B.filter_cells(fwd, groups=["dense", "gqa"], causal=False)
        cells += [B.Cell("fwd", "dense", 2, 8448, 8448, 16, 16, 128), B.Cell("fwd", "dense", 2, 7936, 7936, 8, 8, 256)]
    elif knob == "tiles":
        cells = B.filter_cells(fwd, groups=["dense"], head_dims=[int(tiles.split(":")[0])])
    elif knob == "paired":
        docs = B.filter_cells(fwd, groups=["docs"])[0]
        cells = B.filter_cells(fwd, groups=["window"]) + B.filter_cells(fwd, groups=["dense", "gqa"],
                                                                          head_dims=[64, 128], causal=True)
        cells += [docs, replace(docs, docs=40), replace(docs, head_dim=64, heads_q=32, heads_kv=32),
                  replace(docs, heads_kv=4)]
    elif knob == "varlen_sections":  # the bench's documents, and fewer / more / other head dims
        docs = B.filter_cells(fwd, groups=["docs"])[0]
        cells = [docs, replace(docs, docs=4), replace(docs, docs=40), replace(docs, docs=160),
                 replace(docs, head_dim=64, heads_q=32, heads_kv=32),
                 replace(docs, head_dim=256, heads_q=8, heads_kv=8),
                 replace(docs, heads_kv=4)]
    elif knob == "rescale_before_pv":  # second argument: head dims (default 128,256, and GQA)
        hds = [int(h) for h in (tiles or "128,256").split(",")]
        cells = B.filter_cells(fwd, groups=["dense"], head_dims=hds, seqlens=[1024, 4096, 16384])
        cells += B.filter_cells(fwd, groups=["gqa"]) if not tiles else []
    elif knob == "wg_key_bound" and tiles == "pingpong":  # forced on: causal hd64 / hd128, GQA
        cells = B.filter_cells(fwd, groups=["dense", "gqa"], head_dims=[64, 128], causal=True)
    elif knob == "wg_key_bound":  # causal hd256, and hd192 at the same shapes
        hd256 = B.filter_cells(fwd, groups=["dense"], head_dims=[256], causal=True)
        cells = hd256 + [replace(c, head_dim=192, heads_q=10, heads_kv=10) for c in hd256]
    elif knob == "split_tail":  # causal cells of short pairs, and odd query block counts
        cells = B.filter_cells(fwd, groups=["dense", "gqa"], causal=True, seqlens=[512, 1024, 2048])
        cells += odd_block_cells()
    elif knob == "bit_mask" and tiles == "force":  # 3-warpgroup tiles: causal hd64 from 4k
        cells = B.filter_cells(fwd, groups=["dense"], head_dims=[64], causal=True,
                               seqlens=[4096, 8192, 16384])
    elif knob == "bit_mask":  # the mask cells, and the causal dense / GQA cells to 4k
        cells += B.filter_cells(fwd, groups=["dense", "gqa"], causal=True, seqlens=[1024, 2048, 4096])
    elif knob == "tile_info":  # the mask cells, and the dense / GQA cells to 4k (short tiles)
        cells += B.filter_cells(fwd, groups=["dense", "gqa"], seqlens=[1024, 2048, 4096])
    elif knob in ("tile_decoder", "stmatrix_o", "warp_store_o", "l2_hints"):  # every cell: the mask cells (and CSR forms), dense, GQA
        cells += B.filter_cells(fwd, groups=["dense", "gqa"])
    elif knob in ("reduce_chains", "q_regs"):  # dense and GQA cells (DUALATTN_AB_CELLS picks)
        cells = B.filter_cells(fwd, groups=["dense", "gqa"])
    elif knob == "pass_empty_wg":  # 1088 = 8.5 tiles of 128 rows: the last one's second
        # warpgroup is empty (ping-pong at hd128, not at hd256; causal pairs)
        cells = B.filter_cells(fwd, groups=["dense", "gqa", "docs"])
        cells += [B.Cell("fwd", "dense", 16, 1088, 1088, 16, 16, 128),
                  B.Cell("fwd", "dense", 16, 1088, 1024, 16, 16, 128),  # no masked key tail
                  B.Cell("fwd", "dense", 16, 1088, 1088, 16, 16, 128, causal=True),
                  B.Cell("fwd", "dense", 16, 1088, 1088, 8, 8, 256)]
        # 64 query rows against 8k keys of one KV head (MQA, groups of 66 / 132: not a power of
        # two, so not packed): every tile has one warpgroup's rows only, and K / V come from L2
        # (what a warpgroup computing alone costs; with a KV head per tile HBM bounds it)
        cells += [B.Cell("fwd", "gqa", 8, 64, 8192, 66, 1, 128),
                  B.Cell("fwd", "gqa", 8, 64, 8192, 132, 1, 64)]
    elif knob == "o_slot":  # hd256 (64-key tiles: the dense cells but causal from 8k); hd192
        # under 4k keys (96-key tiles with the slot, 112 without), 10 heads of 192
        cells = B.filter_cells(fwd, groups=["dense"], head_dims=[256])
        cells += [B.Cell("fwd", "dense", 16, 1088, 1088, 8, 8, 256)]
        cells += [replace(c, head_dim=192, heads_q=10, heads_kv=10) for c in cells
                  if not c.causal and c.seqlen_k <= 4096 and c.seqlen_q != 1088]
    elif knob == "rescale":  # the wide head dims it is on for, hd192 too, and hd128 for scale
        wide = B.filter_cells(fwd, groups=["dense"], head_dims=[256])
        cells = wide + [replace(c, head_dim=192, heads_q=10, heads_kv=10) for c in wide]
        cells += B.filter_cells(fwd, groups=["dense"], head_dims=[128], seqlens=[1024, 8192])
    else:
        cells += B.filter_cells(fwd, groups=["dense", "gqa"], head_dims=[64, 96, 128])
    cells = [c for c in cells if re.search(CELLS, c.label())]
    for cell in cells:
        inp = B.make_inputs(cell)
        flops = B.work(cell)[0]
        for csr in ([False, True] if B.has_csr_form(cell) and knob not in ("varlen_sections", "paired") else [False]):
            ms = {"": [], value: []}
            graphs = {}
            if GRAPH:  # captured with the knob set; a replay no longer reads it
                for mode in ("", value):
                    set_knob(sm90, attr, mode)
                    impl._entries.clear()
                    r = B.dualattn_runner(impl, inp, csr)
                    r.fn()
                    graphs[mode] = B.cuda_graph_replay(r.fn)
            for _ in range(5 if GRAPH else 3):
                for mode in ("", value):
                    if GRAPH:
                        ms[mode].append(timer.time_ms(graphs[mode])[0])
                        continue
                    set_knob(sm90, attr, mode)
                    impl._entries.clear()
                    r = B.dualattn_runner(impl, inp, csr)
                    ms[mode].append(timer.time_ms(r.fn)[0])
            del graphs
            a, b = statistics.median(ms[""]), statistics.median(ms[value])
            name = f"{cell.label()}{' +csr' if csr else ''}"
            print(f"{name:60s} default {flops / a / 1e9:7.1f}  {label} {flops / b / 1e9:7.1f} TFLOP/s  "
                  f"ratio {a / b:.3f}", flush=True)
        del inp
        torch.cuda.empty_cache()
    set_knob(sm90, attr, "")


if __name__ == "__main__":
    main(*sys.argv[1:3]) if len(sys.argv) > 1 else main("persistent")
