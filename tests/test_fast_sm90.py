"""GPU tests of the Hopper forward kernel (fast-sm90) against the torch oracle.

Every case runs in one worker subprocess under a wall-clock timeout, so a deadlocked kernel fails
the tests instead of stalling the run. For each case the worker:

* fills the output and LSE buffers with NaN before the launch (poisoned outputs: a tile that is
  never written shows up as NaN),
* checks O and LSE with the accuracy rule (dualattn.accuracy.check_outputs),
* runs the kernel a second time and requires bitwise-identical O and LSE.

The tests are marked ``gpu`` and skip with "needs CUDA" on machines without a GPU (CI), and with
"needs an sm_90 GPU" on other GPUs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import pytest
import torch

# one worker subprocess per group of GROUP_SIZE cases (pytest -n runs groups side by side); a
# hung kernel fails its group's cases after WORKER_TIMEOUT_S
WORKER_TIMEOUT_S = int(os.environ.get("DUALATTN_SM90_TEST_TIMEOUT", "200"))
GROUP_SIZE = 12

# (name, B, Sq, Sk, Hq, Hkv, D, dtype, causal, persistent) ; persistent None = the default
# choice of FastSm90Forward.config, "0"/"1" forces the grid kind (both code paths stay tested)
CASES = []


def _case(name, B, Sq, Sk, Hq, Hkv, D, dtype="bfloat16", causal=False, persistent=None, **kw):
    tag = "" if persistent is None else f"-persistent{persistent}"
    tag += "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
    CASES.append((f"{name}-{B}x{Sq}x{Sk}-{dtype}-d{D}{'-causal' if causal else ''}{tag}", B, Sq, Sk, Hq, Hkv, D,
                  dtype, causal, persistent, kw))


for _d in (64, 128, 96, 192, 256):
    for _c in (False, True):
        _case("dense", 2, 1024, 1024, 4, 4, _d, "bfloat16", _c)
        _case("odd", 2, 113, 203, 4, 2, _d, "bfloat16", _c)
for _c in (False, True):
    for _d in (64, 128):
        _case("dense", 1, 512, 512, 4, 4, _d, "float16", _c)
        _case("len1", 1, 1, 1, 2, 2, _d, "bfloat16", _c)
        _case("q239k1", 1, 239, 1, 2, 1, _d, "bfloat16", _c)    # causal: most rows see no key
        _case("q1k239", 1, 1, 239, 2, 1, _d, "bfloat16", _c)
        _case("q203k113", 2, 203, 113, 4, 4, _d, "bfloat16", _c)  # causal: fully masked rows
    _case("long", 1, 4224, 4224, 2, 2, 128, "bfloat16", _c)
    # hd64 from 4k queries: 3 consumer warpgroups (causal: 4 stages, paired persistent order,
    # where the pairs fill the grid: on 132 SMs these few heads keep 2, on 16 they take 3)
    _case("long", 1, 4224, 4224, 2, 2, 64, "bfloat16", _c)
    _case("long-odd", 1, 4301, 4157, 4, 2, 64, "bfloat16", _c)
    for _hkv in (1, 2, 4, 8):  # GQA ratios 8, 4, 2, 1
        _case(f"gqa8to{_hkv}", 2, 300, 300, 8, _hkv, 128, "bfloat16", _c)
    _case("gqa6to2", 1, 257, 129, 6, 2, 64, "bfloat16", _c)   # ratio 3
    _case("gqa7to1", 1, 130, 400, 7, 1, 128, "bfloat16", _c)  # ratio 7
    for _p in ("0", "1"):
        for _d in (64, 128, 256):
            _case("dense", 2, 1000, 1000, 4, 2, _d, "bfloat16", _c, _p)
        _case("q203k113", 2, 203, 113, 4, 4, 128, "bfloat16", _c, _p)
# hd64 non-causal: shapes whose 128-row tiles fit one round run 2 warpgroups
# (sm90._two_wg_tiles_fit_one_round), so the cases above test that; the same shapes on the
# 3 warpgroups larger grids get, with the rule's SM count at 1 (the launch's grid unchanged)
for _args in ((2, 1024, 1024, 4, 4), (2, 113, 203, 4, 2), (1, 1, 1, 2, 2), (1, 239, 1, 2, 1),
              (1, 1, 239, 2, 1), (2, 203, 113, 4, 4), (1, 4224, 4224, 2, 2), (1, 257, 129, 6, 2)):
    _case("wg3", *_args, 64, "bfloat16", False, model_sms=1)
_case("wg3", 1, 512, 512, 4, 4, 64, "float16", False, model_sms=1)
_case("wg3", 2, 1000, 1000, 4, 2, 64, "bfloat16", False, "0", model_sms=1)
_case("wg3", 1, 113, 203, 2, 2, 64, "float16", False, softcap=5.0, model_sms=1)
_case("long", 1, 4224, 4224, 2, 2, 64, "bfloat16", True, num_sms=16)
# batched causal hd64 from 16k queries: the persistent paired order (varlen: one CTA a tile)
_case("long16k", 1, 16500, 16500, 2, 1, 64, "bfloat16", True)
_case("long-odd", 1, 4301, 4157, 4, 2, 64, "bfloat16", True, num_sms=16)
# sliding windows (bottom-right diagonal) and softcap
for _w, _c in (((64, 0), False), ((-1, 32), False), ((100, -1), False), ((33, 7), True),
               ((200, 50), False), ((0, 0), False)):
    _case("win", 2, 1000, 1000, 4, 2, 128, "bfloat16", _c, window=_w)
    _case("win", 1, 300, 700, 4, 1, 64, "bfloat16", _c, window=_w)
    _case("win", 2, 203, 113, 2, 2, 128, "bfloat16", _c, window=_w)  # rows with no key
_case("win", 2, 1000, 1000, 4, 2, 256, "bfloat16", False, window=(128, 128))
_case("win", 2, 1000, 1000, 4, 2, 128, "float16", False, "1", window=(77, 0))
_case("win", 2, 1000, 1000, 4, 2, 128, "bfloat16", True, "1", window=(300, -1))
# the window order (FastSm90Forward.window_order; tile_order.window_order_tile; on by default
# from 4096 query rows, forced on below) on grids of a few CTAs, so that the snake turns and the
# full tiles' L2 sections and the light tiles (clipped at key 0) spread over several rounds:
# light 3 of 8 blocks; none (Sk - Sq past the window); 9 of 11 (Sq > Sk) with a right bound and
# GQA; the bench's W = 1024 in fp16; and one by default on the real SM count
_case("winorder", 2, 1000, 1000, 4, 2, 128, "bfloat16", True, num_sms=5, window_order="1", window=(300, 0))
_case("winorder", 1, 700, 1300, 4, 4, 64, "bfloat16", True, num_sms=7, window_order="1", window=(500, 0))
_case("winorder", 2, 1300, 700, 6, 2, 96, "bfloat16", False, num_sms=6, window_order="1", window=(500, 20))
_case("winorder", 2, 2000, 2000, 2, 2, 128, "float16", True, num_sms=11, window_order="1", window=(1024, 0))
_case("winorder", 1, 4224, 4224, 4, 2, 128, "bfloat16", True, window=(1000, 0))
# the left edge's key block on its upper half (FastSm90Forward.narrow_last; on by default with a
# left bound at D <= 128, so the window cases above run it too): aligned windows, where the second
# warpgroup's rows of every full tile run it, with the old three loops beside ("0"); 3 warpgroups
# (192-row tiles); a two-sided window; softcap; fp16 with Sq < Sk; the persistent window order
for _nl in ("", "0"):
    _case("narrowlast", 2, 2048, 2048, 4, 2, 128, "bfloat16", True, narrow_last=_nl, window=(1024, 0))
_case("narrowlast", 1, 5000, 5000, 4, 4, 64, "bfloat16", True, window=(1024, 0))
_case("narrowlast", 2, 1000, 1100, 4, 2, 96, "bfloat16", False, window=(77, 200))
_case("narrowlast", 2, 777, 777, 4, 2, 128, "bfloat16", True, window=(300, 0), softcap=20.0)
_case("narrowlast", 1, 700, 1300, 4, 1, 64, "float16", True, window=(256, 0))
_case("narrowlast", 1, 4224, 4224, 4, 2, 128, "bfloat16", True, "1", num_sms=9, window_order="1",
      window=(512, 0))
for _c in (False, True):
    _case("softcap", 2, 777, 777, 4, 2, 128, "bfloat16", _c, softcap=20.0)
    _case("softcap", 1, 113, 203, 4, 4, 64, "float16", _c, softcap=5.0)
_case("softcap", 1, 500, 500, 2, 1, 256, "bfloat16", False, window=(50, 0), softcap=10.0)
# head dims (192, 128): Dv != D
for _c in (False, True):
    _case("dv128", 2, 1000, 1000, 4, 2, 192, "bfloat16", _c, dv=128)
    _case("dv128", 2, 113, 203, 4, 1, 192, "bfloat16", _c, dv=128)
    _case("dv128", 1, 239, 1, 2, 2, 192, "float16", _c, dv=128)
    _case("dv128", 1, 1, 1, 2, 2, 192, "bfloat16", _c, dv=128)
_case("dv128", 2, 1000, 1000, 4, 2, 192, "bfloat16", True, "1", dv=128, window=(100, 0))
# GQA heads packed into the M tile (FastSm90Forward.pack_gqa: short queries, no position mask)
_case("packgqa", 2, 16, 1000, 32, 8, 128)
_case("packgqa", 2, 16, 1000, 32, 8, 128, "bfloat16", False, "0")
_case("packgqa", 3, 1, 517, 16, 2, 128, "bfloat16", True)   # g = 8
_case("packgqa", 2, 37, 300, 16, 4, 128, "bfloat16", True)  # causal: each row's mask at row // g
_case("packgqa", 2, 50, 40, 8, 2, 128, "bfloat16", True)    # Sq > Sk: rows that see no key
_case("packgqa", 1, 64, 64, 8, 1, 64, "bfloat16", True)
_case("packgqa", 2, 64, 129, 16, 2, 96, "float16", True, "1")
_case("packgqa", 2, 33, 500, 8, 2, 128, window=(40, 0))
_case("packgqa", 1, 20, 700, 8, 4, 256, "bfloat16", False, "0", window=(100, 10))
_case("packgqa", 1, 33, 203, 8, 2, 64, model_sms=1)                      # 3 warpgroups, 192-row tile
_case("packgqa", 2, 64, 300, 8, 1, 256, "float16")
_case("packgqa", 1, 7, 1, 4, 2, 96, "float16")
_case("packgqa", 2, 20, 400, 8, 2, 128, softcap=10.0)
_case("packgqa", 1, 40, 300, 8, 2, 192, dv=128)
# stream-K tail (tile_order.stream_k_tiles): the last two rounds of the persistent grid cut along
# the keys and merged. num_sms sizes the grid (DUALATTN_SM90_NUM_SMS), and the minimum of keys per
# cut tile is lifted for those cases, so that small shapes cut tiles: tails masked inside a piece, GQA, packed GQA, 3 warpgroups, one epilogue group (D > 128),
# a grid of one round and a half (every tile cut), and one case cut on the real SM count (H100).
_case("streamk", 2, 1000, 1000, 4, 4, 128, num_sms=40)
_case("streamk", 2, 203, 517, 6, 2, 128, num_sms=5)
_case("streamk", 1, 1000, 700, 4, 2, 64, num_sms=20)        # 3 warpgroups
_case("streamk", 2, 1000, 1000, 4, 2, 256, num_sms=24)      # one epilogue for both warpgroups
_case("streamk", 2, 300, 999, 4, 2, 192, num_sms=7, dv=128)
_case("streamk", 2, 333, 1111, 4, 4, 96, "float16", num_sms=5)
_case("streamk", 2, 16, 1000, 32, 8, 128, num_sms=6)        # packed GQA rows
_case("streamk", 1, 500, 640, 6, 3, 128, num_sms=16, softcap=15.0)
_case("streamk", 1, 4096, 4096, 5, 5, 128)                  # 160 tiles on 132 SMs
_case("streamk-off", 2, 1000, 1000, 4, 4, 128, num_sms=40, stream_k="0")
# the paired causal order's tail (tile_order.tile_share): pairs cut anywhere in either tile
_case("streamk", 2, 1000, 1000, 4, 4, 128, "bfloat16", True, num_sms=5)
_case("streamk", 2, 203, 517, 6, 2, 128, "bfloat16", True, num_sms=5)  # more keys than queries
_case("streamk", 2, 1000, 1000, 4, 4, 64, "bfloat16", True, num_sms=5)
_case("streamk", 1, 4224, 4224, 2, 2, 64, "bfloat16", True, num_sms=7)  # 3 warpgroups, 192-row tiles
_case("streamk", 2, 1000, 1000, 4, 2, 256, "bfloat16", True, num_sms=6)  # one epilogue group
_case("streamk", 2, 700, 700, 8, 2, 128, "float16", True, num_sms=9)
_case("streamk", 2, 16, 1000, 32, 8, 128, "bfloat16", True, num_sms=6)  # packed GQA rows
_case("streamk", 2, 1000, 1000, 4, 2, 128, "bfloat16", False, num_sms=5, window=(-1, 50))
_case("streamk", 1, 500, 640, 6, 3, 96, "bfloat16", True, num_sms=5, softcap=15.0)
_case("streamk", 1, 4096, 4096, 9, 9, 128, "bfloat16", True)  # 144 pairs on 132 SMs
_case("streamk-off", 2, 1000, 1000, 4, 4, 128, "bfloat16", True, num_sms=5, stream_k="0")
# a grid of at most half the SMs: every unit (tile, or causal pair) cut into P pieces on P x units
# CTAs (tile_order.split_pieces; ``pieces``: the P the case must get): two pieces (stream_k_merge)
# with odd key-block counts, key tails inside a piece, GQA and packed GQA, hd64 on 2 and 3
# warpgroups, one epilogue group (D > 128), causal pairs (square, and fewer queries than keys),
# softcap, fp16; more pieces (stream_k_merge_pieces) likewise; cases on the real SM count; one off
_case("split", 1, 500, 2100, 4, 2, 128, num_sms=40, pieces=2)
_case("split", 2, 300, 1500, 4, 4, 128, "float16", num_sms=48, pieces=2)
_case("split", 1, 700, 1500, 4, 4, 64, num_sms=64, pieces=2)                 # 2 warpgroups, 128-row tiles
_case("split", 1, 700, 1500, 4, 2, 64, num_sms=64, model_sms=1, pieces=3)    # 3 warpgroups, 192-row tiles
_case("split", 1, 300, 999, 4, 2, 256, num_sms=30, pieces=2)                 # one epilogue group
_case("split", 1, 300, 999, 4, 2, 192, num_sms=30, dv=128, pieces=2)
_case("split", 2, 16, 1000, 32, 8, 128, num_sms=32, pieces=2)                # packed GQA rows
_case("split", 1, 500, 640, 6, 3, 96, num_sms=48, softcap=15.0, pieces=2)
_case("split", 1, 1000, 1000, 4, 4, 128, "bfloat16", True, num_sms=40, pieces=2)  # 16 pairs
_case("split", 1, 300, 2000, 4, 2, 128, "bfloat16", True, num_sms=30, pieces=2)   # bottom-right, odd blocks
_case("split", 1, 1000, 1000, 4, 4, 64, "float16", True, num_sms=64, pieces=2)
_case("split", 1, 128, 4000, 2, 2, 128, num_sms=40, piece_keys=1024, pieces=4)                # key tail in the last piece
_case("split", 1, 128, 4000, 2, 2, 128, num_sms=40, pieces=8)                # 512-key pieces (the default)
_case("split", 1, 100, 9000, 4, 1, 128, num_sms=64, pieces=8)                # packed GQA rows
_case("split", 1, 150, 5000, 2, 1, 64, num_sms=40, model_sms=1, piece_keys=1024, pieces=5)    # 3 warpgroups
_case("split", 1, 200, 6000, 2, 2, 64, "float16", num_sms=40, piece_keys=1024, pieces=5)      # 2 warpgroups
_case("split", 1, 200, 6000, 4, 2, 256, num_sms=30, pieces=3)                # one epilogue group
_case("split", 1, 60, 3000, 3, 3, 96, "float16", num_sms=48, softcap=15.0, piece_keys=1024, pieces=3)
_case("split", 1, 60, 3000, 3, 3, 96, "float16", num_sms=48, softcap=15.0, pieces=6)
_case("split", 1, 70, 4000, 2, 2, 192, num_sms=40, dv=128, piece_keys=1024, pieces=4)
_case("split", 1, 512, 4096, 8, 8, 128, pieces=4)                            # the real SM count
_case("split", 1, 128, 32768, 32, 8, 128, pieces=4)
_case("split", 1, 1, 16384, 32, 8, 128, pieces=8)
# more than 8 pieces where the grid stays within half the SMs (tile_order.deep_pieces): the last
# piece merges 9-32 records, read 4 at a time (FlashFwdSm90.merge_batch; 9: a remainder)
_case("split", 1, 1, 130000, 8, 1, 64, num_sms=132, pieces=32)             # one packed tile
_case("split", 1, 1, 33000, 16, 2, 256, "float16", num_sms=132, pieces=16)
_case("split", 1, 3, 70000, 16, 4, 128, "bfloat16", True, num_sms=132, pieces=16)
_case("split", 1, 1, 20000, 4, 1, 128, num_sms=64, pieces=9)
# causal chunks (sm90._causal_split_grid): the plain order's tiles, each cut along the key blocks it sees
_case("split", 1, 64, 5000, 32, 8, 128, "bfloat16", True, pieces=5)      # packed: 2 query blocks a head
_case("split", 1, 1, 9000, 32, 8, 128, "bfloat16", True, pieces=8)       # one query (decoding)
_case("split", 2, 33, 3000, 8, 2, 64, "bfloat16", True, pieces=3)
_case("split", 1, 50, 4100, 4, 4, 256, "float16", True, pieces=4)
_case("split", 1, 64, 2500, 6, 2, 96, "bfloat16", True, softcap=12.0, pieces=2)
_case("split", 1, 20, 2100, 4, 1, 128, "bfloat16", True, num_sms=40, pieces=2)
_case("split", 1, 300, 4000, 4, 2, 128, "bfloat16", True, num_sms=64, pieces=4)   # 3 query blocks a head
_case("split", 1, 512, 2048, 4, 4, 64, "bfloat16", True, num_sms=48, pieces=2)    # 512 queries, 2k keys
_case("split", 1, 1024, 8192, 4, 4, 128, "bfloat16", True, pieces=4)     # 1k chunk: tiles of 57-64 blocks
_case("split", 1, 2048, 4096, 2, 2, 64, "bfloat16", True, pieces=4)      # 17-32 blocks, P from the first
_case("split", 1, 700, 3000, 3, 1, 96, "float16", True, num_sms=40, softcap=8.0, pieces=2)
_case("split", 2, 1000, 2500, 2, 2, 256, "bfloat16", True, num_sms=64, piece_keys=256, pieces=2)
_case("split", 1, 1500, 2900, 2, 2, 128, "bfloat16", True, num_sms=120, piece_keys=128, pieces=5)  # 12-23 blocks
# more than half the SMs: pieces over several rounds of CTAs where the wave model says they pay
# (tile_order.wave_pieces; sm90._causal_wave_pieces): causal chunks instead of pairs, and a
# single partly filled round of non-causal tiles
_case("waves", 1, 300, 8192, 8, 8, 128, "bfloat16", True, num_sms=16, pieces=2)    # 24 tiles, 48 CTAs
_case("waves", 1, 640, 8192, 2, 2, 128, num_sms=16, pieces=3)                      # 10 tiles, 30 CTAs
_case("waves", 1, 256, 8000, 6, 6, 96, "float16", True, num_sms=8, softcap=10.0, pieces=2)
_case("waves", 1, 300, 6000, 2, 2, 256, num_sms=10, pieces=5)                      # one epilogue group
_case("waves", 1, 300, 8192, 8, 8, 64, "bfloat16", True, num_sms=16, pieces=2)
_case("waves", 1, 32, 9000, 32, 8, 128, "bfloat16", True, num_sms=6, pieces=3)     # packed GQA rows
_case("waves", 1, 48, 12000, 32, 8, 128, "bfloat16", True, num_sms=11, pieces=2)   # half-live second tiles
_case("waves", 1, 640, 32768, 32, 8, 128, "bfloat16", True, pieces=4)              # 160 tiles, 640 CTAs
_case("waves", 1, 300, 8200, 4, 4, 256, "float16", True, num_sms=8, pieces=2)     # hd256 past 2k keys: one CTA a tile without
_case("chunk", 1, 64, 64, 4, 4, 128, "bfloat16", True)                  # too few keys to cut
_case("chunk", 1, 40, 1500, 8, 2, 64, "float16", True)
_case("split-off", 1, 500, 2100, 4, 2, 128, num_sms=40, split_units="0")
# non-contiguous q / k / v (strides reach the kernel as runtime values)
_case("strided", 2, 300, 517, 4, 2, 128, "bfloat16", False, strided=True)
_case("strided", 2, 517, 300, 6, 3, 64, "bfloat16", True, "1", strided=True)
# each warpgroup's own key bound (FastSm90Forward.wg_key_bound), forced on or off where the
# default rule says otherwise: ping-pong configs (a passed block still takes its turn of the
# ring), 3 warpgroups' 192-row tiles, bottom-right offsets, packed GQA rows, hd256's 80-key tiles
_case("wgkb", 1, 4224, 4224, 2, 2, 64, "bfloat16", True, stream_k="0", wg_key_bound="1", num_sms=16)
_case("wgkb", 1, 4100, 4400, 3, 1, 64, "bfloat16", True, "0", wg_key_bound="1", num_sms=16)
_case("wgkb", 2, 300, 364, 4, 2, 128, "bfloat16", True, wg_key_bound="1")
_case("wgkb", 2, 1000, 1100, 4, 4, 64, "bfloat16", True, "1", wg_key_bound="1")
_case("wgkb", 2, 700, 650, 4, 2, 128, "float16", False, "0", wg_key_bound="1", window=(90, 30))
_case("wgkb", 2, 37, 300, 16, 4, 128, "bfloat16", True, wg_key_bound="1")  # packed GQA rows
_case("wgkb", 1, 8200, 8200, 2, 2, 256, "bfloat16", True, wg_key_bound="1")  # 80-key tiles
_case("wgkb", 2, 1000, 1000, 4, 2, 256, "bfloat16", True, wg_key_bound="0")
# the key bound in stream-K pieces (a warpgroup may pass every block of its piece and merge an
# empty state): hd64's 192-row pairs cut on 9 SMs (its default), a bottom-right offset on 128-row
# tiles (forced on), a causal chunk's 128-row tiles cut into pieces along their own blocks
# (forced on: its 7192-key offset hides blocks from the first warpgroup)
_case("wgkbsk", 1, 4224, 4224, 3, 3, 64, "bfloat16", True, num_sms=9)
_case("wgkbsk", 1, 4096, 4160, 4, 2, 128, "bfloat16", True, wg_key_bound="1", num_sms=9)
_case("wgkbsk", 1, 1000, 8192, 2, 1, 64, "bfloat16", True, wg_key_bound="1")
# warpgroups with no row in the sequence pass their key blocks (FastSm90Forward.pass_empty_wg):
# 192-row tiles with one or two empty warpgroups, with the query blocks rotated by round (grids
# that are a multiple of the block count), with stream-K cuts, 128-row tiles whose second
# warpgroup is empty (ping-pong, causal pairs, hd256 without ping-pong, packed GQA rows), and the
# same shapes computed in full for comparison
_case("emptywg", 2, 1024, 1024, 4, 4, 64, num_sms=6)               # 6 blocks, last 64 rows
_case("emptywg", 1, 2048, 2048, 5, 5, 64, num_sms=22)              # 11 blocks, stream-K tail
_case("emptywg", 2, 1090, 1000, 4, 2, 128, num_sms=9)              # 9 blocks, last 66 rows
_case("emptywg", 2, 1050, 1050, 4, 4, 128, "bfloat16", True)
_case("emptywg", 2, 1050, 1000, 4, 4, 64, "float16", True, "1", num_sms=5)
_case("emptywg", 2, 1090, 1090, 4, 4, 128, num_sms=6)               # gcd(6, 9) = 3: turns every 3 rounds
_case("emptywg", 1, 1090, 1090, 4, 4, 256)
_case("emptywg", 2, 1090, 1090, 2, 2, 256, "bfloat16", True, window=(300, 0))
_case("emptywg", 2, 8, 700, 32, 8, 128, "bfloat16", False, num_sms=4)  # 32 packed rows of 128
_case("emptywg-off", 2, 1024, 1024, 4, 4, 64, num_sms=6, pass_empty_wg="0")
_case("emptywg-off", 2, 1050, 1050, 4, 4, 128, "bfloat16", True, pass_empty_wg="0")
# a last 192-row tile with at most 64 rows computed by all three warpgroups, each on every third
# key block, merged in shared memory (FastSm90Forward.key_split): one row on 8 key blocks; 8 rows
# on 3 blocks (one each, the key tail in the first's); 2 blocks (the third warpgroup has none);
# fp16 with one key past a block; GQA on a grid of 3 CTAs (split tiles back to back in a CTA);
# softcap; one CTA per tile; stream-K cuts among the split tiles; and one case with it off
_case("keysplit", 1, 1, 1000, 4, 4, 64, model_sms=1)
_case("keysplit", 2, 200, 300, 4, 2, 64, model_sms=1)
_case("keysplit", 1, 1025, 129, 4, 4, 64, "float16", model_sms=1)
_case("keysplit", 2, 1000, 4001, 4, 1, 64, num_sms=3)
_case("keysplit", 1, 250, 777, 6, 3, 64, softcap=10.0, model_sms=1)
_case("keysplit", 2, 4096, 1500, 3, 3, 64, "bfloat16", False, "0")
_case("keysplit", 1, 4096, 4096, 5, 5, 64, num_sms=9)
_case("keysplit-off", 2, 200, 300, 4, 2, 64, key_split="0", model_sms=1)
# batched causal hd64 below 4k queries on 3 warpgroups where the 192-row pairs fill the grid
# (sm90._causal_3wg_fills_grid; num_sms sizes the grid the rule and the launch see): an odd
# block count with a 64-row last tile; GQA fp16 with an 80-row last tile; more keys than queries;
# the bench's rule on the real SM count; and shapes the rule keeps on 2 warpgroups (too few
# pairs: below 4k and from 4k)
_case("causal3wg", 2, 1600, 1600, 4, 4, 64, "bfloat16", True, num_sms=5)
_case("causal3wg", 3, 2000, 2000, 4, 2, 64, "float16", True, num_sms=8)
_case("causal3wg", 1, 1536, 1700, 8, 8, 64, "bfloat16", True, num_sms=4)
_case("causal3wg", 4, 2048, 2048, 16, 16, 64, "bfloat16", True)
_case("causal3wg", 2, 1280, 1280, 4, 4, 64, "bfloat16", True, model_sms=1)  # end-aligned
_case("causal3wg", 2, 1000, 1000, 4, 4, 64, "bfloat16", True, model_sms=1)  # from 768 queries
_case("causal2wg", 2, 700, 700, 4, 4, 64, "bfloat16", True, model_sms=1)
_case("causal2wg", 2, 2048, 2048, 8, 8, 64, "bfloat16", True)
_case("causal2wg", 1, 4096, 4096, 8, 8, 64, "bfloat16", True)
# one O slot that the two warpgroups stage their rows in by turns (FastSm90Forward.shared_o_slot:
# hd256 at 64-key tiles, (192, 128), hd192 under 4k keys): small grids so every CTA hands the slot on over many
# tiles (one CTA runs them all), causal pairs, a warpgroup with no row, stream-K pieces that do
# not store, fp16, and the same shape with O staged in Q's buffer
_case("oslot", 2, 1000, 1000, 4, 2, 256, num_sms=3)
_case("oslot", 1, 600, 700, 3, 3, 256, "float16", num_sms=1)
_case("oslot", 2, 1500, 1500, 4, 4, 256, "bfloat16", True, num_sms=4)
_case("oslot", 2, 1090, 1090, 2, 2, 256, num_sms=7)
_case("oslot", 2, 1000, 1000, 4, 2, 256, num_sms=10, stream_k="1")
_case("oslot", 2, 700, 900, 4, 2, 192, num_sms=5, dv=128)
_case("oslot", 2, 1000, 900, 4, 2, 192, "float16", num_sms=3)  # hd192 under 4k keys: 96-key tiles
_case("oslot", 2, 700, 700, 4, 4, 192, "bfloat16", True, "1", num_sms=5, dv=128)
_case("oslot-off", 2, 1000, 1000, 4, 2, 256, num_sms=3, o_slot="0")
# the paired order's tail as single tiles (tile_order.split_tail_tile; FastSm90Forward.split_tail):
# stream-K off, small grids (num_sms) so small shapes have a partly filled last round; odd query
# block counts (two heads' middle blocks make a unit; a lone last head's middle alone), bottom-right
# offsets, tiles with no key, a right window bound, packed GQA rows (one query block: every unit
# two heads'), 3 warpgroups, one epilogue group (D > 128), and the real SM count. The launch
# splits only where its model gains (FastSm90Forward.split_tail_schedule), so the small grids force
# it (split_tail="1"); the two cases on the real SM count split by the model's choice
_case("splittail", 2, 1000, 1000, 4, 4, 128, "bfloat16", True, num_sms=5, stream_k="0", split_tail="1")
_case("splittail", 1, 896, 896, 3, 3, 128, "bfloat16", True, num_sms=4, stream_k="0", split_tail="1")
_case("splittail", 2, 700, 700, 6, 2, 64, "float16", True, num_sms=7, stream_k="0", split_tail="1")
_case("splittail", 1, 1000, 1000, 3, 1, 256, "bfloat16", True, num_sms=5, stream_k="0", split_tail="1")
_case("splittail", 2, 203, 517, 6, 2, 128, "bfloat16", True, num_sms=5, stream_k="0", split_tail="1")
_case("splittail", 2, 517, 203, 5, 5, 128, "bfloat16", True, num_sms=4, stream_k="0", split_tail="1")
_case("splittail", 2, 1000, 1000, 4, 2, 128, "bfloat16", False, num_sms=5, stream_k="0", split_tail="1", window=(-1, 50))
_case("splittail", 2, 700, 900, 5, 5, 64, "bfloat16", True, num_sms=7, stream_k="0", split_tail="1")
_case("splittail", 3, 16, 1000, 12, 3, 128, "bfloat16", True, num_sms=3, stream_k="0", split_tail="1")  # packed GQA
_case("splittail", 1, 4224, 4224, 3, 3, 64, "bfloat16", True, num_sms=7, stream_k="0", split_tail="1")  # 3 WGs
_case("splittail", 1, 1024, 1024, 140, 140, 128, "bfloat16", True)  # 560 pairs on 132 SMs
_case("splittail", 3, 1408, 1408, 21, 21, 128, "bfloat16", True)    # odd block count, odd head count
# (these three and the two above split by the plan on 132 SMs, as H100 and H200 SXM have)
_case("splittail", 3, 1500, 1500, 24, 24, 128, "bfloat16", True)    # 432 pairs: 4.2 rounds, LPT deal
_case("splittail", 1, 2500, 2500, 40, 8, 128, "bfloat16", True)     # GQA: 5 heads share a tail's K/V
_case("splittail", 8, 2048, 2048, 8, 8, 256, "bfloat16", True)      # hd256: the tail sized to fit L2
_case("splittail-off", 2, 1000, 1000, 4, 4, 128, "bfloat16", True, num_sms=5, stream_k="0",
      split_tail="0")
# query tiles aligned to the sequence's end (FastSm90Forward.end_aligned): the first tile starts
# before row 0 (Q's rows there zero-filled, none of its O or LSE rows stored: the guard rows
# around the outputs stay NaN). hd64's 192-row tiles in pairs (a split tail; stream-K pieces on 9
# SMs), alone (the plain order from 16k), bottom-right offsets both ways, hd256, fp16
# and softcap, GQA, and forced on where tile_m == tile_n (causal, and a right window bound alone)
_case("endaligned", 2, 2048, 2048, 4, 4, 64, "bfloat16", True, model_sms=1)
_case("endaligned", 1, 4096, 4096, 3, 3, 64, "bfloat16", True, num_sms=9)
_case("endaligned", 1, 3900, 3900, 2, 2, 64, "bfloat16", True, "0", model_sms=1)
_case("endaligned", 2, 2000, 2300, 4, 2, 64, "float16", True, model_sms=1)
_case("endaligned", 2, 2200, 2000, 4, 4, 64, "bfloat16", True, model_sms=1)
_case("endaligned", 2, 700, 700, 3, 1, 256, "bfloat16", True)
_case("endaligned", 2, 300, 500, 4, 4, 256, "float16", True, softcap=20.0)
_case("endaligned", 2, 900, 1000, 4, 2, 128, "bfloat16", False, window=(-1, 37), end_aligned="1")
_case("endaligned", 2, 900, 777, 4, 4, 128, "bfloat16", True, end_aligned="1")
_case("endaligned-off", 2, 2048, 2048, 4, 4, 64, "bfloat16", True, model_sms=1, end_aligned="0")


# varlen: (name, seqlens_q, seqlens_k, Hq, Hkv, D, causal, kw); lengths include 0 and 1
VARLEN_CASES = []
for _c in (False, True):
    for _d in (64, 128, 256):
        VARLEN_CASES.append((f"varlen-odd-d{_d}{'-causal' if _c else ''}", [113, 0, 1, 300, 129],
                             [203, 5, 1, 300, 0], 4, 2, _d, _c, {}))
    VARLEN_CASES.append((f"varlen-long-d128{'-causal' if _c else ''}", [1000, 2049, 7],
                         [1500, 2049, 300], 8, 1, 128, _c, {}))
    VARLEN_CASES.append((f"varlen-gqa3-d96{'-causal' if _c else ''}", [257, 64, 128],
                         [129, 640, 128], 6, 2, 96, _c, {}))
VARLEN_CASES.append(("varlen-win-d128", [300, 17, 450], [700, 33, 450], 4, 2, 128, True,
                     {"window": (40, 0)}))
VARLEN_CASES.append(("varlen-softcap-d64", [77, 333], [333, 77], 2, 2, 64, False, {"softcap": 8.0}))
for _c in (False, True):
    # rows with no visible key (causal, Sq > Sk), single-row / single-key sequences, all-empty K
    VARLEN_CASES.append((f"varlen-q239k1-d128{'-causal' if _c else ''}", [239, 1, 0], [1, 239, 0],
                         2, 1, 128, _c, {}))
    VARLEN_CASES.append((f"varlen-d192{'-causal' if _c else ''}", [130, 1, 257], [129, 2, 256],
                         4, 2, 192, _c, {}))
VARLEN_CASES.append(("varlen-dv128-d192-causal", [130, 0, 1, 257], [129, 3, 1, 256], 4, 2, 192,
                     True, {"dv": 128}))
# several 128-row query tiles per sequence at the head dims whose O store used to overwrite the
# next tile's first rows (a race: the tile that stores last wins), and the props gpu profile's find
for _d, _dv in ((96, 96), (192, 192), (192, 128)):
    VARLEN_CASES.append((f"varlen-multitile-d{_d}-dv{_dv}", [517, 300, 129, 1000], [600, 300, 200, 64],
                         4, 2, _d, False, {"dv": _dv}))
VARLEN_CASES.append(("varlen-props-d96-fp16", [0, 182, 0, 31], [0, 182, 0, 31], 4, 1, 96, False,
                     {"dtype": "float16"}))
VARLEN_CASES.append(("varlen-nokeys-d64", [5, 17], [0, 0], 2, 2, 64, False, {}))
VARLEN_CASES.append(("varlen-10docs-d128-causal", [409] * 9 + [415], [409] * 9 + [415], 4, 4, 128,
                     True, {}))
VARLEN_CASES.append(("varlen-fp16-d128", [333, 129], [129, 333], 4, 2, 128, False,
                     {"dtype": "float16"}))
# the paired causal order across sequences of uneven lengths (a warp scan of cu_seqlens finds a
# unit's sequence: one and two 32-sequence steps, empty and one-row sequences among them) and the
# calls that keep heaviest first (fast/sm90._paired_varlen): short sequences, too many
for _name, _n, _d, _base, _mod in (("paired", 10, 128, 500, 1200), ("paired", 45, 64, 1500, 1100),
                                   ("short", 10, 128, 13, 400), ("many", 70, 128, 13, 400)):
    _lens = [0 if i % 9 == 0 else 1 if i % 11 == 0 else _base + (i * 397) % _mod for i in range(_n)]
    VARLEN_CASES.append((f"varlen-{_name}{_n}-d{_d}-causal", _lens,
                         [n + (i % 3) * 40 for i, n in enumerate(_lens)], 4, 4, _d, True, {}))
# the paired order with a left window bound too (tiles whose key ranges start past 0)
VARLEN_CASES.append(("varlen-paired-win-d128", [0, 900, 1, 1300, 777], [0, 900, 41, 1380, 777], 4, 4, 128,
                     True, {"window": (300, 0)}))
# the paired order's units dealt by the launch's table (FastSm90Forward.varlen_unit_table,
# "varlen_lpt": the knob's value for the call; "1": the case fails unless the host planned a
# table: the outputs are the same either way, the table being a permutation of the units) and by
# the static stride ("0"), on uneven documents with empty and one-row sequences
for _lpt in ("1", "0"):
    VARLEN_CASES.append((f"varlen-paired-lpt{_lpt}-d128-causal", [871, 0, 2312, 1, 1500, 969, 1760],
                         [871, 0, 2312, 1, 1500, 1009, 1760], 4, 4, 128, True, {"varlen_lpt": _lpt}))
# GQA pairs (K/V head = query head // group in every unit), dealt by the table and by the stride
for _lpt in ("1", "0"):
    VARLEN_CASES.append((f"varlen-paired-gqa-lpt{_lpt}-d128-causal", [871, 0, 2312, 1, 1500, 969, 1760],
                         [871, 0, 2312, 1, 1500, 1009, 1760], 8, 2, 128, True, {"varlen_lpt": _lpt}))
VARLEN_CASES.append(("varlen-paired-gqa-d64-causal", [1600, 1, 0, 2100, 333], [1600, 1, 0, 2140, 333],
                     6, 2, 64, True, {}))
VARLEN_CASES.append(("varlen-paired-lpt1-win-d128", [0, 900, 1, 1300, 777], [0, 900, 41, 1380, 777], 4, 4,
                     128, True, {"window": (300, 0), "varlen_lpt": "1"}))


# key ranges and block-sparse: (name, builder(seed) -> (AttentionCall, reference AttentionCall
# or None)). With a reference call (the same attention without the CSR), the kernel's outputs
# with and without the CSR must agree closely as well (an exact CSR changes nothing).
FEATURE_CASES = []
DEVICE = "cuda"  # the builders' device (a CPU dry run of the builders sets "cpu")


def _qkv(B, Sq, Sk, H, Hkv, D, dtype="bfloat16", varlen=False, dv=None):
    dt = getattr(torch, dtype)
    lead_q, lead_k = ((Sq,), (Sk,)) if varlen else ((B, Sq), (B, Sk))
    return (torch.randn(*lead_q, H, D, device=DEVICE, dtype=dt),
            torch.randn(*lead_k, Hkv, D, device=DEVICE, dtype=dt),
            torch.randn(*lead_k, Hkv, dv or D, device=DEVICE, dtype=dt))


def _random_kr(shape, Sk, seed, empty_row=None):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, Sk + 1, shape, generator=g)
    kr = torch.stack([a.min(-1).values, a.max(-1).values], -1).to(torch.int32)
    if empty_row is not None and shape[2] > empty_row:
        kr[:, :, empty_row] = 0  # a row whose intervals are all empty: out 0, LSE -inf
    return kr.to(DEVICE)


def _kr_case(name, B, Sq, Sk, H, Hkv, D, R, causal=False, dtype="bfloat16", heads=True, dv=None,
             **kw):
    def make(seed):
        from dualattn.spec import build_dense
        kr = _random_kr((1 if heads else B, H if heads else 1, Sq, R, 2), Sk, seed, empty_row=5)
        return build_dense(*_qkv(B, Sq, Sk, H, Hkv, D, dtype, dv=dv), causal=causal, key_ranges=kr,
                           return_lse=True, **kw), None
    FEATURE_CASES.append((f"kr-{name}-R{R}-d{D}{f'-dv{dv}' if dv else ''}{'-causal' if causal else ''}",
                          make))


for _c in (False, True):
    for _r in (1, 2, 4):
        _kr_case("random", 2, 260, 333, 4, 2, 128, _r, _c)
    _kr_case("random", 2, 260, 333, 4, 2, 64, 2, _c, dtype="float16", heads=False)
    _kr_case("odd", 2, 113, 203, 4, 2, 256, 1, _c)
    _kr_case("odd", 1, 203, 113, 2, 1, 192, 3, _c)
    _kr_case("q239k1", 1, 239, 1, 2, 1, 128, 1, _c)
    _kr_case("len1", 1, 1, 1, 2, 2, 64, 1, _c)
    _kr_case("win", 2, 500, 700, 4, 2, 96, 2, _c, window=(100, 20))
_kr_case("softcap", 1, 300, 300, 2, 2, 128, 2, False, softcap=10.0)
_kr_case("odd", 2, 113, 203, 4, 2, 192, 2, True, dv=128)


def _docs_case(name, segs, S, H, D, causal, dtype="bfloat16", with_csr=False, block=(128, 128)):
    def make(seed):
        from dualattn import segments_to_key_ranges
        from dualattn.sparse import BlockSparse
        from dualattn.spec import build_dense
        kr = segments_to_key_ranges(segs, S, causal=causal, device=DEVICE)
        q, k, v = _qkv(len(segs), S, S, H, H, D, dtype)
        ref = build_dense(q, k, v, key_ranges=kr, return_lse=True)
        if not with_csr:
            return ref, None
        bs = BlockSparse.from_key_ranges(kr, S, S, *block).to(DEVICE)
        return build_dense(q, k, v, key_ranges=kr, block_sparse=bs, return_lse=True), ref
    FEATURE_CASES.append((f"{name}-d{D}{'-causal' if causal else ''}", make))


for _c in (False, True):
    # packed documents as key ranges (broadcast over heads): interior blocks run unmasked
    _docs_case("kr-docs", [[100, 250, 300], [700]], 700, 4, 64, _c, "float16")
    _docs_case("kr-docs-long", [[600, 1000, 400, 48]], 2048, 2, 128, _c)
    _docs_case("bs-kr-docs", [[600, 1000, 400, 48]], 2048, 2, 128, _c, with_csr=True)
_docs_case("bs-kr-docs-s900", [[300, 129, 400]], 900, 2, 256, True, with_csr=True)


def _bs_case(name, B, Sq, Sk, H, Hkv, D, block, causal=False, dtype="bfloat16", dv=None, **kw):
    def make(seed):
        from dualattn.sparse import BlockSparse
        from dualattn.spec import build_dense
        nq, nk = -(-Sq // block[0]), -(-Sk // block[1])
        g = torch.Generator().manual_seed(seed)
        # per (batch, head) random ABSENT/MASK/FULL states; one query block lists nothing
        states = torch.randint(0, 3, (B, H, nq, nk), generator=g, dtype=torch.int8)
        states[0, min(1, H - 1), 0, :] = 0
        bs = BlockSparse.from_block_states(states.to(DEVICE), block[0], block[1], Sq, Sk)
        return build_dense(*_qkv(B, Sq, Sk, H, Hkv, D, dtype, dv=dv), causal=causal, block_sparse=bs,
                           return_lse=True, **kw), None
    FEATURE_CASES.append((f"bs-{name}-{block[0]}x{block[1]}-d{D}{f'-dv{dv}' if dv else ''}"
                          f"{'-causal' if causal else ''}", make))


for _c in (False, True):
    for _d in (64, 128, 192, 256):
        _bs_case("random", 2, 300, 517, 4, 2, _d, (128, 128), _c)
    _bs_case("random", 2, 300, 517, 4, 2, 128, (256, 64), _c)
    _bs_case("random", 1, 700, 300, 2, 1, 96, (128, 256), _c, dtype="float16")
    _bs_case("odd", 1, 1, 1, 2, 2, 128, (128, 128), _c)
    _bs_case("q239k1", 1, 239, 1, 2, 1, 64, (128, 128), _c)
_bs_case("win", 2, 600, 600, 4, 2, 128, (128, 128), True, window=(200, 0))
# both window bounds, no causal (full entries on the key tail: tests/test_sm90_visit_plan.py)
_bs_case("win2", 2, 600, 450, 2, 2, 64, (128, 128), False, window=(150, 40))
_bs_case("softcap", 1, 400, 400, 2, 2, 64, (128, 128), False, softcap=15.0)
_bs_case("random", 2, 300, 517, 4, 2, 192, (128, 128), True, dv=128)


def _bs_exact_case(window, D, causal=True):
    def make(seed):
        from dualattn.sparse import BlockSparse
        from dualattn.spec import build_dense
        q, k, v = _qkv(1, 1000, 1000, 2, 2, D)
        bs = BlockSparse.from_key_ranges(None, 1000, 1000, 128, 128, causal=causal,
                                         window=window).to(DEVICE)
        return (build_dense(q, k, v, causal=causal, window=window, block_sparse=bs,
                            return_lse=True),
                build_dense(q, k, v, causal=causal, window=window, return_lse=True))
    FEATURE_CASES.append((f"bs-exact-win{window[0]}_{window[1]}-d{D}", make))


def _bs_table_case(name, B, Sq, Sk, H, Hkv, D, causal, num_sms, per_head=True):
    """A block-sparse call dealt by the launch's unit table (FastSm90Forward.csr_unit_table),
    forced on (DUALATTN_SM90_CSR_LPT=1) on a grid of ``num_sms`` CTAs, so that CTAs run several
    units and the table has empty slots (-1). Query blocks of very uneven counts (row m keeps
    about m / nq of its key blocks); the case fails unless the host planned a table."""
    def make(seed):
        from dualattn.sparse import BlockSparse
        from dualattn.spec import build_dense
        nq, nk = -(-Sq // 128), -(-Sk // 128)
        g = torch.Generator().manual_seed(seed)
        keep = torch.rand((B, H, nq, nk) if per_head else (1, 1, nq, nk), generator=g)
        keep = keep < (torch.arange(nq) + 1).view(-1, 1) / nq
        states = keep.to(torch.int8) * torch.randint(1, 3, keep.shape, generator=g, dtype=torch.int8)
        bs = BlockSparse.from_block_states(states.to(DEVICE), 128, 128, Sq, Sk)
        return build_dense(*_qkv(B, Sq, Sk, H, Hkv, D), causal=causal, block_sparse=bs,
                           return_lse=True), None
    make.knobs = {"_CSR_LPT_ENV": "1", "_NUM_SMS_ENV": str(num_sms)}
    FEATURE_CASES.append((f"bstable-{name}-sms{num_sms}-d{D}{'-causal' if causal else ''}", make))


for _c in (False, True):
    _bs_table_case("random", 2, 1000, 1100, 4, 2, 128, _c, 9)
_bs_table_case("shared", 1, 2000, 777, 3, 3, 64, False, 7, per_head=False)


_bs_exact_case((-1, -1), 128)
_bs_exact_case((256, 0), 128)
_bs_exact_case((100, 50), 64, causal=False)


def _varlen_feature_case(name, lens_q, lens_k, H, Hkv, D, causal, kr_R=0, block=None):
    def make(seed):
        from dualattn.sparse import BlockSparse
        from dualattn.spec import build_varlen
        cq = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).to(torch.int32)
        ck = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).to(torch.int32)
        q, k, v = _qkv(None, sum(lens_q), sum(lens_k), H, Hkv, D, varlen=True)
        kw = {}
        if kr_R:  # indices local to each sequence, within its own key length
            kr = torch.zeros(1, H, sum(lens_q), kr_R, 2, dtype=torch.int32)
            for b, (a, n) in enumerate(zip(lens_q, lens_k)):
                s = int(cq[b])
                kr[:, :, s:s + a] = _random_kr((1, H, a, kr_R, 2), n, seed + b).cpu()
            kw["key_ranges"] = kr.to(DEVICE)
        if block:
            nq, nk = -(-max(lens_q) // block[0]), -(-max(lens_k) // block[1])
            g = torch.Generator().manual_seed(seed)
            states = torch.randint(0, 3, (len(lens_q), 1, nq, nk), generator=g, dtype=torch.int8)
            kw["block_sparse"] = BlockSparse.from_block_states(states.to(DEVICE), *block, max(lens_q),
                                                                max(lens_k))
        return build_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal,
                            return_lse=True, **kw), None
    FEATURE_CASES.append((f"varlen-{name}-d{D}{'-causal' if causal else ''}", make))


for _c in (False, True):
    _varlen_feature_case("kr2", [50, 0, 1, 300, 129], [60, 5, 1, 300, 0], 4, 2, 128, _c, kr_R=2)
    _varlen_feature_case("bs", [300, 0, 1, 517, 129], [517, 5, 1, 300, 0], 4, 2, 128, _c,
                         block=(128, 128))
    _varlen_feature_case("bs", [300, 1, 129], [517, 1, 400], 2, 1, 256, _c, block=(128, 128))


def _run_feature_case(f, name, make):
    from dualattn.accuracy import check_outputs
    from dualattn.dispatch import select

    import dualattn.fast.sm90 as sm90

    rec = {"name": name}
    # module knobs the case sets for its run (_bs_table_case), restored after; the launch memo
    # (per spec and device) would otherwise hand it another case's SM count and plan
    knobs = getattr(make, "knobs", {})
    saved = {k: getattr(sm90, k) for k in knobs}
    for k, v in knobs.items():
        setattr(sm90, k, v)
    sm90.FORWARD._entries.clear()
    try:
        call, ref_call = make(sum(map(ord, name)))
        impl = select(call.spec, "fast")
        rec["impl"] = impl.name
        if impl.name == "fast-sm90" and impl.csr_table(call.spec):
            rec["csr_rounds"] = impl.csr_unit_table(call.spec, call.block_sparse, call.q.device,
                                                    sm90._num_sms(call.q.device))[1]
        outs = []
        for _ in range(2):
            call.extra["out"] = torch.full_like(call.q[..., :call.spec.head_dim_v], float("nan"))
            call.extra["out"] = call.extra["out"].contiguous()
            lse_shape = ((call.spec.num_heads_q, call.q.shape[0]) if call.spec.mode == "varlen"
                         else (call.q.shape[0], call.spec.num_heads_q, call.q.shape[1]))
            call.extra["lse"] = torch.full(lse_shape, float("nan"), device="cuda")
            o, lse = impl.forward(call)
            torch.cuda.synchronize()
            outs.append((o.clone(), lse.clone()))
        checks = check_outputs(call, outs[0][0], outs[0][1])
        rec["checks"] = [str(c) for c in checks]
        rec["ok"] = all(c.ok for c in checks)
        if ref_call is not None:  # same attention without the CSR, same kernel family
            o2, lse2 = select(ref_call.spec, "fast").forward(ref_call)
            torch.cuda.synchronize()
            d_o = float((o2.float() - outs[0][0].float()).abs().max()) if o2.numel() else 0.0
            same_inf = bool(torch.equal(lse2.isinf(), outs[0][1].isinf()))
            d_l = float((lse2 - outs[0][1]).nan_to_num(posinf=0, neginf=0).abs().max()) \
                if lse2.numel() else 0.0
            rec["checks"].append(f"vs without CSR: max|dO| {d_o:.2e}, max|dLSE| {d_l:.2e}")
            rec["ok"] = rec["ok"] and d_o < 2e-2 and d_l < 1e-3 and same_inf
        rec["bitwise"] = bool(torch.equal(outs[0][0], outs[1][0])
                              and torch.equal(outs[0][1].nan_to_num(), outs[1][1].nan_to_num()))
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        for k, v in saved.items():
            setattr(sm90, k, v)
        sm90.FORWARD._entries.clear()
    f.write(json.dumps(rec) + "\n")
    f.flush()


def _run_varlen_case(f, name, lq, lk, Hq, Hkv, D, causal, kw):
    from dualattn.accuracy import check_outputs
    from dualattn.dispatch import select
    from dualattn.spec import build_varlen

    import dualattn.fast.sm90 as sm90

    kw = dict(kw)
    dt = getattr(torch, kw.pop("dtype", "bfloat16"))
    Dv = kw.pop("dv", D)
    lpt = kw.pop("varlen_lpt", None)
    rec = {"name": name}
    knob = sm90._VARLEN_LPT_ENV
    if lpt is not None:
        sm90._VARLEN_LPT_ENV = lpt
    try:
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device="cuda")
        Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
        q = torch.randn(Tq, Hq, D, device="cuda", dtype=dt)
        k = torch.randn(Tk, Hkv, D, device="cuda", dtype=dt)
        v = torch.randn(Tk, Hkv, Dv, device="cuda", dtype=dt)
        call = build_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True,
                            **kw)
        impl = select(call.spec, "fast")
        rec["impl"] = impl.name
        outs, guard_ok = [], True
        for _ in range(2):
            # NaN-poisoned outputs with poisoned guard rows after the end: a store past the last
            # sequence's end would overwrite them
            buf = torch.full((Tq + 160, Hq, Dv), float("nan"), device="cuda", dtype=dt)
            call.extra["out"] = buf[:Tq]
            call.extra["lse"] = torch.full((Hq, Tq), float("nan"), device="cuda")
            o, lse = impl.forward(call)
            torch.cuda.synchronize()
            guard_ok = guard_ok and bool(buf[Tq:].isnan().all())
            outs.append((o.clone(), lse.clone()))
        checks = check_outputs(call, outs[0][0], outs[0][1])
        rec["checks"] = [str(c) for c in checks]
        rec["ok"] = all(c.ok for c in checks) and guard_ok
        if not guard_ok:
            rec["checks"].append("guard rows after the last sequence were written")
        rec["bitwise"] = bool(torch.equal(outs[0][0], outs[1][0])
                              and torch.equal(outs[0][1].nan_to_num(), outs[1][1].nan_to_num()))
        if impl.name == "fast-sm90" and impl.paired(call.spec):
            rec["unit_rounds"] = impl.varlen_unit_table(call.spec, call.cu_seqlens_q, call.cu_seqlens_k, q.device,
                                                        sm90._num_sms(q.device))[1]
        if lpt == "1" and not rec.get("unit_rounds"):
            rec["ok"] = False
            rec["checks"].append("the host planned no unit table")
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        sm90._VARLEN_LPT_ENV = knob
    f.write(json.dumps(rec) + "\n")
    f.flush()


def _in_group(name: str, group: str) -> bool:
    """Does case ``name`` belong to worker group ``group``? Groups are "<list><i>" (see
    _group_of) or, for running a selection by hand, "sel:<k>:<n>:<regex>": every n-th case (from
    the k-th) of those whose name matches the regex, e.g. ``--worker out.jsonl sel:0:4:varlen``."""
    if group.startswith("sel:"):
        import re
        _, k, n, pattern = group.split(":", 3)
        names = [c[0] for c in CASES + VARLEN_CASES + FEATURE_CASES if re.search(pattern, c[0])]
        return name in names[int(k)::int(n)]
    return _group_of(name) == group


def _group_of(name: str) -> str:
    """Worker group of a case: its list and its index // GROUP_SIZE."""
    for kind, cases in (("dense", CASES), ("varlen", VARLEN_CASES), ("feature", FEATURE_CASES)):
        for i, c in enumerate(cases):
            if c[0] == name:
                return f"{kind}{i // GROUP_SIZE}"
    raise KeyError(name)


def _run_worker(out_path: str, group: str) -> None:
    """Run the cases of ``group``, one JSON line per case (flushed, so a hang keeps earlier lines)."""
    import dualattn.fast.sm90 as sm90
    from dualattn.accuracy import check_outputs
    from dualattn.dispatch import select
    from dualattn.spec import build_dense

    torch.manual_seed(0)
    with open(out_path, "w") as f:
        for name, B, Sq, Sk, Hq, Hkv, D, dtype, causal, persistent, kw in CASES:
            if not _in_group(name, group):
                continue
            kw = dict(kw)
            sm90._PERSISTENT_ENV = persistent or ""
            sm90._NUM_SMS_ENV = str(kw.pop("num_sms", ""))
            sm90._MODEL_SMS_ENV = str(kw.pop("model_sms", ""))
            sm90._STREAM_K_MIN_KEYS_ENV = "0" if sm90._NUM_SMS_ENV else ""
            sm90._STREAM_K_ENV = kw.pop("stream_k", "")
            sm90._WG_KEY_BOUND_ENV = kw.pop("wg_key_bound", "")
            sm90._SPLIT_TAIL_ENV = kw.pop("split_tail", "")
            sm90._PASS_EMPTY_WG_ENV = kw.pop("pass_empty_wg", "")
            sm90._KEY_SPLIT_ENV = kw.pop("key_split", "")
            sm90._END_ALIGNED_ENV = kw.pop("end_aligned", "")
            sm90._O_SLOT_ENV = kw.pop("o_slot", "")
            sm90._WINDOW_ORDER_ENV = kw.pop("window_order", "")
            sm90._NARROW_LAST_ENV = kw.pop("narrow_last", "")
            sm90._SPLIT_UNITS_ENV = kw.pop("split_units", "")
            sm90._SPLIT_PIECE_KEYS_ENV = str(kw.pop("piece_keys", ""))
            kw.pop("pieces", None)  # (the test checks the name's)
            # the per-(spec, device) launch memo would hand a case the kernel (and SM count) of
            # an earlier case with the same spec but other knobs
            sm90.FORWARD._entries.clear()
            dt = getattr(torch, dtype)
            rec = {"name": name}
            try:
                Dv = kw.pop("dv", D)
                if kw.pop("strided", False):
                    # strided views (a slice of a wider q, k and v interleaved in one buffer):
                    # the launch passes q/k/v strides, not just shapes
                    q = torch.randn(B, Sq, Hq + 3, D, device="cuda", dtype=dt)[:, :, 2:Hq + 2]
                    kv = torch.randn(B, Sk, Hkv, 2, D, device="cuda", dtype=dt)
                    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
                else:
                    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt)
                    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
                    v = torch.randn(B, Sk, Hkv, Dv, device="cuda", dtype=dt)
                call = build_dense(q, k, v, causal=causal, return_lse=True, **kw)
                impl = select(call.spec, "fast")
                rec["impl"] = impl.name
                # tiles the launch cuts along the keys (stream-K); the streamk cases must cut some
                rec["sk_tiles"] = (impl.stream_k_count(call.spec, q.device)
                                   if impl.name == "fast-sm90" and impl.stream_k(call.spec) else 0)
                sk_on = impl.name == "fast-sm90" and impl.stream_k(call.spec)
                rec["sk_units"] = impl.stream_k_units(call.spec)[0] if sk_on else 0
                rec["sk_pieces"] = impl.stream_k_plan(call.spec, q.device)[2] if sk_on else 0
                rec["wg_key_bound"] = impl.name == "fast-sm90" and impl.wg_key_bound(call.spec)
                rec["split_tail"] = impl.name == "fast-sm90" and impl.split_tail(call.spec)
                rec["o_slot"] = impl.name == "fast-sm90" and impl.shared_o_slot(call.spec)
                rec["narrow_last"] = impl.name == "fast-sm90" and impl.narrow_last(call.spec)
                rec["key_split"] = impl.name == "fast-sm90" and impl.key_split(call.spec)
                rec["row_shift"] = impl.row_shift(call.spec) if impl.name == "fast-sm90" else 0
                rec["tile_m"] = impl.config(call.spec)[0] if impl.name == "fast-sm90" else 0
                rec["split_groups"] = (impl.scalar_fields(call.spec, sm90._num_sms(q.device), q.device)[-3]
                                       if rec["split_tail"] else 0)
                outs, guard_ok = [], True
                # NaN-poisoned outputs inside NaN guards of a 192-row tile's size before and after
                # (contiguous views of one buffer): a store outside the output would write them
                n_o, g_o = B * Sq * Hq * Dv, 192 * Hq * Dv
                n_l, g_l = B * Hq * Sq, 192 * 4
                # stream-K: which of a cut tile's two pieces merges is a race, decided anew each
                # run: more runs, all bitwise equal
                for _ in range(8 if rec["sk_tiles"] else 2):
                    buf_o = torch.full((g_o + n_o + g_o,), float("nan"), device="cuda", dtype=dt)
                    buf_l = torch.full((g_l + n_l + g_l,), float("nan"), device="cuda")
                    call.extra["out"] = buf_o[g_o:g_o + n_o].view(B, Sq, Hq, Dv)
                    call.extra["lse"] = buf_l[g_l:g_l + n_l].view(B, Hq, Sq)
                    o, lse = impl.forward(call)
                    torch.cuda.synchronize()
                    guard_ok = guard_ok and all(bool(t.isnan().all()) for t in (
                        buf_o[:g_o], buf_o[g_o + n_o:], buf_l[:g_l], buf_l[g_l + n_l:]))
                    outs.append((o.clone(), lse.clone()))
                checks = check_outputs(call, outs[0][0], outs[0][1])
                rec["checks"] = [str(c) for c in checks]
                rec["ok"] = all(c.ok for c in checks) and guard_ok
                if not guard_ok:
                    rec["checks"].append("guard rows around the outputs were written")
                rec["bitwise"] = all(torch.equal(outs[0][0], o) and torch.equal(outs[0][1].nan_to_num(), lse.nan_to_num())
                                     for o, lse in outs[1:])
            except Exception as e:  # reported per case; the next case still runs
                rec["error"] = f"{type(e).__name__}: {e}"
            f.write(json.dumps(rec) + "\n")
            f.flush()
        sm90._PERSISTENT_ENV = sm90._NUM_SMS_ENV = sm90._STREAM_K_ENV = sm90._STREAM_K_MIN_KEYS_ENV = ""
        sm90._WG_KEY_BOUND_ENV = sm90._SPLIT_TAIL_ENV = sm90._PASS_EMPTY_WG_ENV = sm90._O_SLOT_ENV = ""
        sm90._KEY_SPLIT_ENV = sm90._SPLIT_UNITS_ENV = sm90._SPLIT_PIECE_KEYS_ENV = ""
        sm90._END_ALIGNED_ENV = ""
        sm90._MODEL_SMS_ENV = ""
        sm90.FORWARD._entries.clear()
        for case in VARLEN_CASES:
            if _in_group(case[0], group):
                _run_varlen_case(f, *case)
        for name, make in FEATURE_CASES:
            if _in_group(name, group):
                _run_feature_case(f, name, make)


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "needs CUDA"
    major, minor = torch.cuda.get_device_capability()
    if major * 10 + minor != 90:
        return f"needs an sm_90 GPU (found sm_{major}{minor})"
    return None


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    """get(name) -> (record or None, timed out?, output tail). The first pytest process (of the
    -n workers) that needs a group runs its worker subprocess under a file lock; the others
    read the saved result."""
    import fcntl

    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the xdist workers of this run
    folder = base / "sm90-results"
    folder.mkdir(exist_ok=True)
    memo = {}

    def get(name):
        group = _group_of(name)
        if group not in memo:
            path, done = folder / f"{group}.jsonl", folder / f"{group}.done"
            with open(folder / f"{group}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not done.exists():
                    timed_out, tail = False, ""
                    try:
                        proc = subprocess.run([sys.executable, __file__, "--worker", str(path), group],
                                              timeout=WORKER_TIMEOUT_S, capture_output=True, text=True)
                        tail = (proc.stdout + proc.stderr)[-3000:]
                    except subprocess.TimeoutExpired:
                        timed_out = True
                    done.write_text(json.dumps({"timed_out": timed_out, "tail": tail}))
            info = json.loads(done.read_text())
            res = {}
            if path.exists():
                for line in open(path):
                    r = json.loads(line)
                    res[r["name"]] = r
            memo[group] = (res, info["timed_out"], info["tail"])
        res, timed_out, tail = memo[group]
        return res.get(name), timed_out, tail

    return get


def _check_case_record(name: str, r: dict) -> None:
    """What a case's name promises about the path it ran (AssertionError otherwise): tiles cut
    by stream-K, a forced knob that reached the kernel, the warpgroup rule's choice... Both the
    pytest cases and the worker summary (ci/gpu verify, by hand) apply it."""
    if name.startswith("streamk-") != name.startswith("streamk-off"):
        assert r["sk_tiles"] > 0, "no tile was cut: the stream-K path did not run"
    if name.startswith("streamk-off"):
        assert r["sk_tiles"] == 0
    if name.startswith("split-"):  # every unit cut into the case's pieces (or, off, none)
        assert r["sk_units"] > 0
        assert r["sk_tiles"] == (0 if name.startswith("split-off") else r["sk_units"])
        if not name.startswith("split-off"):
            assert f"-pieces{r['sk_pieces']}" in name, f"cut into {r['sk_pieces']} pieces"
    if name.startswith("wgkb-"):  # the forced key bound reached the kernel
        assert r["wg_key_bound"] is ("-wg_key_bound1" in name)  # (tags are sorted: window(...) follows)
    if name.startswith("wgkbsk-"):  # the key bound ran in cut tiles
        assert r["wg_key_bound"] and r["sk_tiles"] > 0, (r["wg_key_bound"], r["sk_tiles"])
    if name.startswith("oslot"):  # the shared O slot reached the kernel (or, off, did not)
        assert r["o_slot"] is not name.startswith("oslot-off")
    if name.startswith("oslot-") and not name.startswith("oslot-off") and "stream_k1" in name:
        assert r["sk_tiles"] > 0, "no tile was cut: the pieces' hand-over did not run"
    if name.startswith("keysplit"):  # the split of light last tiles reached the kernel (or, off, did not)
        assert r["key_split"] is not name.startswith("keysplit-off")
    if name.startswith("endaligned"):  # the first tile starts before row 0 (or, off, at it)
        assert (r["row_shift"] > 0) is not name.startswith("endaligned-off")
    if name.startswith("endaligned-") and "-num_sms9" in name:
        assert r["sk_tiles"] > 0, "no pair was cut: the stream-K pieces did not run shifted"
    if name.startswith(("causal3wg-", "causal2wg-")):  # the warpgroup rule's choice reached the kernel
        assert r["tile_m"] == (192 if name.startswith("causal3wg-") else 128)
    if name.startswith("wg3-"):
        assert r["tile_m"] == 192
    if name.startswith(("dense-", "odd-")) and "-d64-" in name + "-" and "-causal" not in name:
        assert r["tile_m"] == 128, "hd64 non-causal tiles that fit one round: 2 warpgroups"
    if name.startswith("narrowlast-"):  # the left edge's narrow step reached the kernel (or not)
        assert r["narrow_last"] is ("-narrow_last0-" not in name)
    if name.startswith("bstable-"):  # the launch dealt the tiles by its table
        assert r.get("csr_rounds", 0) > 0, "the host planned no block-sparse unit table"
    if name.startswith("splittail-"):  # the tail order the case names reached the kernel
        assert r["split_tail"] is not name.startswith("splittail-off")
        assert (r["split_groups"] > 0) is not name.startswith("splittail-off")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_oracle(results, case):
    name = case[0]
    r, timed_out, tail = results(name)
    if r is None:
        pytest.fail(f"{name}: no result ({'worker timed out: hang?' if timed_out else 'worker died'}) {tail}")
    assert "error" not in r, r["error"]
    assert r["impl"] == "fast-sm90", f"dispatcher picked {r['impl']}"
    assert r["ok"], "; ".join(r["checks"])
    assert r["bitwise"], "two runs gave different bits"
    _check_case_record(name, r)


def _run_overhead_worker(out_path: str) -> None:
    """Host overhead of a cached call: N back-to-back forward calls on a tiny problem without
    synchronising (the GPU queue absorbs the launches), wall time / N, through impl.forward and
    through the public call. Then the outputs are checked against the oracle, and the call
    without LSE (its own kernel, no LSE store) must give the same bits of O."""
    import time

    from dualattn.accuracy import check_outputs
    from dualattn.spec import build_dense

    q, k, v, call, impl = _seeded_call(1, 128, 2, 64)
    rec = {"impl": impl.name}
    impl.forward(call)  # compile + first launch
    torch.cuda.synchronize()
    n, per_call = 200, []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            o, lse = impl.forward(call)
        per_call.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    rec["us_per_call"] = per_call
    checks = check_outputs(call, o, lse)
    # the public inference call (no LSE asked for, no grad): the kernel without the LSE store
    import dualattn
    o_public = dualattn.attention(q, k, v, impl="fast")
    torch.cuda.synchronize()
    rec["public_us_per_call"] = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            dualattn.attention(q, k, v, impl="fast")
        rec["public_us_per_call"].append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    call_nolse = build_dense(q, k, v)
    o2, lse2 = impl.forward(call_nolse)
    checks += check_outputs(call_nolse, o2, None)
    rec["checks"] = [str(c) for c in checks]
    rec["ok"] = all(c.ok for c in checks) and lse2 is None and torch.equal(o2, o) and torch.equal(o_public, o)
    with open(out_path, "w") as f:
        f.write(json.dumps(rec))


def _subprocess_record(flag: str, tmp_path) -> dict:
    """Run this file with ``flag`` in a fresh process (a hang fails after 300 s instead of
    stalling pytest) and return the JSON record it writes; skips without an sm_90 GPU."""
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    path = str(tmp_path / "record.json")
    proc = subprocess.run([sys.executable, __file__, flag, path], timeout=300, capture_output=True, text=True)
    assert os.path.exists(path), (proc.stdout + proc.stderr)[-3000:]
    return json.load(open(path))


@pytest.mark.gpu
def test_cached_call_host_overhead(tmp_path):
    """Prints the host time of a cached call (the issue's target is < 15 us); asserts only that
    the results are right (timings vary with the host)."""
    r = _subprocess_record("--overhead", tmp_path)
    assert r["impl"] == "fast-sm90", f"dispatcher picked {r['impl']}"
    print(f"\nfast-sm90 cached-call host overhead (us/call, 5 rounds of 200 calls): "
          f"{', '.join(f'{x:.1f}' for x in r['us_per_call'])}; min {min(r['us_per_call']):.1f}")
    print(f"dualattn.attention(q, k, v, impl='fast') (no LSE): "
          f"{', '.join(f'{x:.1f}' for x in r['public_us_per_call'])}; min {min(r['public_us_per_call']):.1f}")
    assert r["ok"], "; ".join(r["checks"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_forward_matches_oracle(results, case):
    test_forward_matches_oracle(results, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", FEATURE_CASES, ids=[c[0] for c in FEATURE_CASES])
def test_key_ranges_and_block_sparse_match_oracle(results, case):
    test_forward_matches_oracle(results, case)


def _summary(paths) -> None:
    """Print a compact summary of worker JSONL files (for runs of the workers by hand). With a
    first argument ``--expect=REGEX``, every case whose name matches REGEX must have a record: a
    worker stopped by its timeout writes no line for the cases it did not reach, and those count
    as failed (MISSING)."""
    import re

    expect = None
    if paths and paths[0].startswith("--expect="):
        expect, paths = paths[0].split("=", 1)[1], paths[1:]
    n_ok, bad, seen = 0, [], set()
    for p in paths:
        for line in open(p):
            r = json.loads(line)
            seen.add(r["name"])
            good = (r.get("ok") and r.get("bitwise") and "error" not in r
                    and r.get("impl") == "fast-sm90")
            if good:
                try:
                    _check_case_record(r["name"], r)
                except AssertionError as e:  # the case ran, but not the path its name promises
                    good = False
                    r = dict(r, error=f"path check: {e}"[:300])
            n_ok += bool(good)
            if not good:
                bad.append(r)
    if expect is not None:
        bad += [{"name": c[0], "error": "MISSING: no record (its worker stopped before it, e.g. its timeout)",
                 "bitwise": True} for c in CASES + VARLEN_CASES + FEATURE_CASES
                if re.search(expect, c[0]) and c[0] not in seen]
    print(f"sm90 worker cases: {n_ok} ok, {len(bad)} failed")
    for r in bad:
        print("FAIL", r["name"], r.get("impl"), r.get("error", ""), "bitwise" if not r.get("bitwise") else "",
              "; ".join(c for c in r.get("checks", []) if "FAIL" in c.upper() or "vs without" in c)[:600])


def _seeded_call(B, S, H, D, causal=False):
    """(q, k, v, call, impl): seeded bf16 self-attention on cuda and the fast implementation
    the dispatcher picks for it (the subprocess workers below)."""
    from dualattn.dispatch import select
    from dualattn.spec import build_dense

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = build_dense(q, k, v, causal=causal, return_lse=True)
    return q, k, v, call, select(call.spec, "fast")


def _write_bitwise_record(out_path, rec, checks, outs, o_ref, lse_ref) -> None:
    """The graph workers' JSON record: the oracle checks of the reference run and whether every
    other run's (out, lse) equals it bit for bit."""
    rec["checks"] = [str(c) for c in checks]
    rec["ok"] = all(c.ok for c in checks)
    rec["bitwise"] = all(torch.equal(o, o_ref) and torch.equal(lse, lse_ref) for o, lse in outs)
    with open(out_path, "w") as f:
        f.write(json.dumps(rec))


def _run_stream_k_graph_worker(out_path: str, causal: bool = False) -> None:
    """A call that cuts tiles (stream-K) captured in a CUDA graph and replayed, beside eager calls
    on two streams: the counters the kernel leaves at zero (per stream when eager, zeroed by a
    memset node in the graph) must not leak between them. Every result bitwise equal to the
    first eager one, which passes the oracle. ``causal``: the paired order's cut units (32 pairs
    on 20 CTAs: every one cut)."""
    import dualattn.fast.sm90 as sm90
    from dualattn.accuracy import check_outputs

    # 64 tiles on 20 CTAs: 24 cut; causal: 32 pairs on 20 CTAs, every one cut
    sm90._NUM_SMS_ENV, sm90._STREAM_K_MIN_KEYS_ENV = "20", "0"
    q, k, v, call, impl = _seeded_call(2, 1000, 4, 128, causal)
    rec = {"impl": impl.name, "sk_tiles": impl.stream_k_count(call.spec, q.device)}
    o_ref, lse_ref = impl.forward(call)
    torch.cuda.synchronize()
    checks = check_outputs(call, o_ref, lse_ref)
    outs = []
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # eager on a second stream: its own counters
        outs.append(impl.forward(call))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = impl.forward(call)
    for _ in range(4):
        graph.replay()
        torch.cuda.synchronize()
        outs.append((o_g.clone(), lse_g.clone()))
        outs.append(impl.forward(call))  # eager between replays, on the default stream
    torch.cuda.synchronize()
    _write_bitwise_record(out_path, rec, checks, outs, o_ref, lse_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("flag", ["--stream-k-graph", "--stream-k-graph-causal"])
def test_stream_k_in_cuda_graphs_and_on_two_streams(tmp_path, flag):
    r = _subprocess_record(flag, tmp_path)
    assert r["impl"] == "fast-sm90" and r["sk_tiles"] > 0, r
    assert r["ok"], "; ".join(r["checks"])
    assert r["bitwise"], "graph replays / other streams gave other bits"


def _run_split_tail_graph_worker(out_path: str) -> None:
    """A split-tail call (32 causal pairs on 5 CTAs, the split forced) first launched inside a
    CUDA graph capture, where its launch cannot copy the tail's table to the GPU and runs whole
    pairs (and is not memoised), then eagerly (the planned tail, its table made), then captured
    again (the table). The orders move whole tiles, so every result is bitwise equal to the
    eager one, which passes the oracle."""
    import dualattn.fast.sm90 as sm90
    from dualattn.accuracy import check_outputs

    sm90._NUM_SMS_ENV, sm90._SPLIT_TAIL_ENV, sm90._STREAM_K_ENV = "5", "1", "0"
    import dualattn
    from dualattn import dispatch

    qw, kw, vw, warm, impl = _seeded_call(3, 1000, 4, 128, True)
    # the same kernels (with and without the LSE), another shape: compiled and loaded outside
    # the captures
    impl.forward(warm)
    dualattn.attention(qw, kw, vw, causal=True, impl="fast")
    q, k, v, call, impl = _seeded_call(2, 1000, 4, 128, True)
    key = (call.spec, q.device.index)
    torch.cuda.synchronize()
    graphs, outs = [], []
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        o_1, lse_1 = impl.forward(call)
        groups_in_capture = impl._entry(call.spec, q.device)[2][-3]
    rec = {"impl": impl.name, "memo_after_capture": key in impl._entries, "groups_in_capture": groups_in_capture}
    o_ref, lse_ref = impl.forward(call)
    torch.cuda.synchronize()
    rec["groups"] = impl._entries[key][2][-3]
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second):
        o_2, lse_2 = impl.forward(call)
    for graph, o, lse in ((first, o_1, lse_1), (second, o_2, lse_2)):
        graph.replay()
        torch.cuda.synchronize()
        outs.append((o.clone(), lse.clone()))
    # the public call: nothing remembered for its arguments inside the capture, the eager one does
    third = torch.cuda.CUDAGraph()
    with torch.cuda.graph(third):
        o_3 = dualattn.attention(q, k, v, causal=True, impl="fast")
    remembered = len(dispatch.LAUNCH_MEMO)
    o_4 = dualattn.attention(q, k, v, causal=True, impl="fast")
    rec["memo_grew"] = (remembered, len(dispatch.LAUNCH_MEMO))
    third.replay()
    torch.cuda.synchronize()
    outs.append((o_3.clone(), lse_ref))
    outs.append((o_4, lse_ref))
    _write_bitwise_record(out_path, rec, check_outputs(call, o_ref, lse_ref), outs, o_ref, lse_ref)


@pytest.mark.gpu
def test_split_tail_first_launched_inside_a_cuda_graph_capture(tmp_path):
    r = _subprocess_record("--split-tail-graph", tmp_path)
    assert r["impl"] == "fast-sm90" and r["groups"] > 0, r
    assert not r["memo_after_capture"], "a launch planned inside a capture was memoised"
    assert r["groups_in_capture"] == 0, "a launch inside a capture planned a tail"
    assert r["memo_grew"][1] == r["memo_grew"][0] + 1, r["memo_grew"]
    assert r["ok"], "; ".join(r["checks"])
    assert r["bitwise"], "whole pairs / the split tail gave other bits"


def _replay_against_eager(name, fresh, impl, o_g, lse_g):
    """(failed checks, bitwise) of a graph replay's outputs ``o_g`` / ``lse_g``: the oracle of the
    call ``fresh`` describes, and an eager forward of it bit for bit."""
    from dualattn.accuracy import check_outputs

    o_eager, lse_eager = impl.forward(fresh)
    torch.cuda.synchronize()
    failed = [f"{name}: {c}" for c in check_outputs(fresh, o_g, lse_g) if not c.ok]
    same = torch.equal(o_g, o_eager) and torch.equal(lse_g.nan_to_num(), lse_eager.nan_to_num())
    if not same:
        failed.append(f"{name}: the replay's bits differ from an eager call's")
    return failed, same


def _rows_left_nan_without_a_unit(tables: dict, table_ptr: int, replay, o_g, head_dims) -> Optional[int]:
    """The graph tests' control that replays read the launch table at all: the table at
    ``table_ptr`` (one of the launch's device tables) gets its first unit replaced by -1 (an empty
    slot) for one replay; returns how many rows of O that leaves NaN (None: no such table)."""
    table = next((t for t in tables.values() if t.data_ptr() == table_ptr), None)
    if table is None:
        return None
    slot = int((table >= 0).nonzero()[0])
    kept = table[slot].clone()
    table[slot] = -1
    replay()
    left = int(o_g.isnan().any(dim=head_dims).sum())
    table[slot] = kept
    torch.cuda.synchronize()
    return left


def _run_varlen_table_graph_worker(out_path: str) -> None:
    """A varlen paired call whose launch deals units by a table (FastSm90Forward
    .varlen_unit_table, forced; two rounds of the grid), captured in a CUDA graph and replayed
    after its cu_seqlens were rewritten in place: once to lengths with more units than planned
    (the kernel's count_units must see the table no longer fits and run the static stride; the
    stale table would leave the extra units unrun), once to the same lengths reordered (the same
    count: the table is still a permutation of the units). O and the LSE are NaN-poisoned before
    every replay; each replay must pass the oracle for the lengths it ran and equal an eager call
    on them bit for bit. Last, a control that the replays read the table at all: with one entry
    set to -1 (an empty slot) and the planned lengths back, that unit's rows stay NaN."""
    import dualattn.fast.sm90 as sm90
    from dualattn.dispatch import select
    from dualattn.fast.common.tile_order import paired_units
    from dualattn.spec import build_varlen

    sm90._VARLEN_LPT_ENV = "1"
    H, D = 8, 128
    planned = [871, 0, 2312, 1, 1500, 969, 1760]
    rewrites = {"more-units": [129, 129, 2312, 129, 1500, 1454, 1760],
                "same-count": [1760, 0, 969, 1, 1500, 2312, 871]}

    def cu(lens):
        return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")

    torch.manual_seed(0)
    total = sum(planned)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu_q, cu_k = cu(planned), cu(planned)
    call = build_varlen(q, k, v, cu_q, cu_k, max(planned), max(planned), causal=True, return_lse=True)
    impl = select(call.spec, "fast")
    tile_m = impl.config(call.spec)[0]

    def units(lens):
        return sum(paired_units(-(-n // tile_m), H) for n in lens)

    rec = {"impl": impl.name, "paired": impl.name == "fast-sm90" and impl.paired(call.spec),
           "units": {"planned": units(planned), **{n: units(l) for n, l in rewrites.items()}}}
    o_planned, lse_planned = impl.forward(call)  # eager: plans the table, loads the kernel
    torch.cuda.synchronize()
    table_ptr, rec["unit_rounds"], _ = impl.varlen_unit_table(call.spec, cu_q, cu_k, q.device,
                                                              sm90._num_sms(q.device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = impl.forward(call)

    def replay(lens):
        cu_q.copy_(cu(lens))
        cu_k.copy_(cu(lens))
        o_g.fill_(float("nan"))
        lse_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()

    checks, bitwise = [], True
    for name, lens in [("planned", planned), *rewrites.items()]:
        replay(lens)
        fresh = build_varlen(q, k, v, cu(lens), cu(lens), max(lens), max(lens), causal=True, return_lse=True)
        failed, same = _replay_against_eager(name, fresh, impl, o_g, lse_g)
        checks += failed
        bitwise = bitwise and same
    # the control, last (the table is shared with every launch of these lengths)
    rec["control_rows_left_nan"] = _rows_left_nan_without_a_unit(
        type(impl)._varlen_tables, table_ptr, lambda: replay(planned), o_g, (1, 2))
    rec["checks"], rec["ok"], rec["bitwise"] = checks, not checks, bitwise
    with open(out_path, "w") as f:
        f.write(json.dumps(rec))


def _run_csr_table_graph_worker(out_path: str) -> None:
    """A block-sparse call dealt by the launch's unit table (FastSm90Forward.csr_unit_table,
    forced, on 9 CTAs: several rounds), captured in a CUDA graph and replayed after the CSR was
    rewritten in place to another pattern with the same number of entries per head (the query
    blocks' rows reversed: every tile's cost moves, so the captured table is stale). A table only
    permutes the spec's units, so the replay must still pass the oracle for the new pattern and
    equal an eager call on it (which plans afresh) bit for bit. O and the LSE are NaN-poisoned
    before every replay. Last, a control that the replays read the table at all: with one entry
    set to -1 (an empty slot), that unit's rows stay NaN."""
    import dualattn.fast.sm90 as sm90
    from dualattn.dispatch import select
    from dualattn.sparse import BlockSparse
    from dualattn.spec import build_dense

    sm90._CSR_LPT_ENV, sm90._NUM_SMS_ENV = "1", "9"
    B, S, H, D = 2, 1000, 4, 128
    nq = -(-S // 128)
    g = torch.Generator().manual_seed(5)
    keep = torch.rand((B, H, nq, nq), generator=g) < (torch.arange(nq) + 1).view(-1, 1) / nq
    states = keep.to(torch.int8) * torch.randint(1, 3, keep.shape, generator=g, dtype=torch.int8)
    bs = BlockSparse.from_block_states(states.cuda(), 128, 128, S, S)
    reversed_bs = BlockSparse.from_block_states(states.flip(2).cuda(), 128, 128, S, S)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = build_dense(q, k, v, block_sparse=bs, return_lse=True)
    impl = select(call.spec, "fast")
    rec = {"impl": impl.name, "csr_table": impl.name == "fast-sm90" and impl.csr_table(call.spec)}
    impl.forward(call)  # eager: plans the table, loads the kernel
    torch.cuda.synchronize()
    table_ptr, rec["csr_rounds"] = impl.csr_unit_table(call.spec, bs, q.device, sm90._num_sms(q.device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = impl.forward(call)

    def replay():
        o_g.fill_(float("nan"))
        lse_g.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()

    checks, bitwise = [], True
    same_shapes = all(a.shape == b.shape for a, b in (
        (bs.q2k_full.rowptr, reversed_bs.q2k_full.rowptr), (bs.q2k_full.col, reversed_bs.q2k_full.col),
        (bs.q2k_mask.rowptr, reversed_bs.q2k_mask.rowptr), (bs.q2k_mask.col, reversed_bs.q2k_mask.col)))
    if not same_shapes:
        checks.append("the reversed pattern's CSR arrays differ in shape: no in-place rewrite")
    for name in ("planned", "rewritten"):
        if name == "rewritten" and same_shapes:
            for mine, theirs in ((bs.q2k_full, reversed_bs.q2k_full), (bs.q2k_mask, reversed_bs.q2k_mask)):
                mine.rowptr.copy_(theirs.rowptr)
                mine.col.copy_(theirs.col)
        replay()
        fresh = build_dense(q, k, v, block_sparse=bs, return_lse=True)  # checks the values again
        failed, same = _replay_against_eager(name, fresh, impl, o_g, lse_g)
        checks += failed
        bitwise = bitwise and same
    rec["replanned"] = impl.csr_unit_table(call.spec, bs, q.device, sm90._num_sms(q.device))[0] != table_ptr
    rec["control_rows_left_nan"] = _rows_left_nan_without_a_unit(type(impl)._csr_tables, table_ptr, replay,
                                                                 o_g, (2, 3))
    rec["checks"], rec["ok"], rec["bitwise"] = checks, not checks, bitwise
    with open(out_path, "w") as f:
        f.write(json.dumps(rec))


@pytest.mark.gpu
def test_csr_unit_table_graph_replayed_after_the_pattern_rewritten(tmp_path):
    r = _subprocess_record("--csr-table-graph", tmp_path)
    assert r["impl"] == "fast-sm90" and r["csr_table"], r
    assert r["csr_rounds"] >= 2, "the host planned no unit table of two rounds"
    assert r["replanned"], "the eager call on the rewritten pattern reused the stale plan"
    # a table entry turned into an empty slot left rows unwritten: the replays read the table
    assert r["control_rows_left_nan"], r["control_rows_left_nan"]
    assert r["ok"], "; ".join(r["checks"])
    assert r["bitwise"]


@pytest.mark.gpu
def test_varlen_unit_table_graph_replayed_after_cu_seqlens_rewritten(tmp_path):
    r = _subprocess_record("--varlen-table-graph", tmp_path)
    assert r["impl"] == "fast-sm90" and r["paired"], r
    assert r["unit_rounds"] >= 2, "the host planned no unit table of two rounds"
    assert r["units"]["more-units"] > r["units"]["planned"] == r["units"]["same-count"], r["units"]
    # a table entry turned into an empty slot left rows unwritten: the replays read the table
    assert r["control_rows_left_nan"], r["control_rows_left_nan"]
    assert r["ok"], "; ".join(r["checks"])
    assert r["bitwise"]


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--summary":
    _summary(sys.argv[2:])
if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _run_worker(sys.argv[2], sys.argv[3])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--overhead":
    _run_overhead_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1].startswith("--stream-k-graph"):
    _run_stream_k_graph_worker(sys.argv[2], causal=sys.argv[1].endswith("-causal"))
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--split-tail-graph":
    _run_split_tail_graph_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--varlen-table-graph":
    _run_varlen_table_graph_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--csr-table-graph":
    _run_csr_table_graph_worker(sys.argv[2])
