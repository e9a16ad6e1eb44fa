"""The tile table: the whole autotuning space of the Triton kernels, written down.

One entry per (kernel, head-dim bucket): (block_m, block_n, num_warps, num_stages). The hd 64 and
128 entries were picked on an H200 (Triton 3.6) among these candidates, at seqlen 8k, bf16:
  fwd  (128,64,4,3) (128,64,8,3) (128,128,8,3) (64,64,4,3)   -> (64,64,4,3): 447 / 514 TFLOP/s
  dkdv (32,128,4,3) (32,128,8,2) (64,64,4,3)                 -> (64,64,4,3)
  dq   (128,32,4,3) (128,64,8,2) (64,64,4,3)                 -> (64,64,4,3) hd64, (128,64,8,2) hd128
  decode (16,64,4,3) (16,64,4,2) (16,128,4,2) (16,128,8,2) (16,128,4,3) (16,32,4,4)
         -> (16,128,4,3), on an H100 (bf16, GQA 32/8, hd128, batch 1/8/64 x caches 8k-64k, every
         split count 1..64, CUDA-graph replays): 86-88% of the device copy bandwidth at b8 8k,
         100-105% at b64 and long caches. Its 3 stages of 128 keys keep ~128 KB of K/V in flight
         per program (one per SM), so a few long programs saturate memory.
The hd 128 backward entries were retuned on an H100 (2026-11-23, session 13) after the masked
backward fell to 0.7-0.85x FlexAttention: bf16 hd128 bwd, dense 2k-16k and window/docs/sparse 16k,
one lease, TFLOP/s (dkdv / dq):
  (64,64,4,3)  / (128,64,8,2)  dense 228-315, window 194, docs 164, sparse 246  (the old pair)
  (64,128,8,2) / (128,64,8,2)  dense 212-355, window 218, docs 226, sparse 287
  (64,128,8,2) / (128,128,8,2) dense 257-371, window 262, docs 189, sparse 282  -> chosen
  (64,128,8,2) / (64,64,4,3)   dense 237-349, window 201, docs 213, sparse 304
  dkdv (32,128,4,3) 92-141 (spills), (32,128,8,2), (64,64,8,3), (128,64,8,2), (128,128,8,1) all
  below (64,128,8,2) on the mask cells
Those two tiles take 113 / 128 KB of shared memory (Triton's own figure), more than consumer GPUs
have (99 KB per block on sm_86/89/120): GPUs with less than SHARED_FOR_TABLE bytes per block get
the _COMPACT entries instead, each of which fits 99 KB. tests/test_triton_aot.py compiles every
entry without a GPU and checks both budgets.
The hd 256 entries are sized to fit shared memory, not tuned. An entry can
be overridden for experiments with ``DUALATTN_TRITON_TILE_<KERNEL>="bm,bn,warps,stages"``
(KERNEL: FWD, DKDV, DQ, DECODE).

Meaning of block_m / block_n per kernel:
  fwd, dq  : tile of block_m query rows, visiting key blocks of block_n
  dkdv     : tile of block_n keys, visiting query blocks of block_m
  decode   : block_m packed (token, query head) rows, key blocks of block_n (block_m is chosen
             from the number of packed rows; block_n must divide the page size)
"""
from __future__ import annotations

import os
import functools
from dataclasses import dataclass, replace

import torch

from .common import KERNELS_INTERPRETED


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


# head dim bucket -> Tile, for fp16/bf16 on the GPU
_TABLE = {
    "fwd": {64: Tile(64, 64, 4, 3), 128: Tile(64, 64, 4, 3), 256: Tile(64, 64, 4, 2)},
    "dkdv": {64: Tile(64, 64, 4, 3), 128: Tile(64, 128, 8, 2), 256: Tile(32, 64, 4, 1)},
    "dq": {64: Tile(64, 64, 4, 3), 128: Tile(128, 128, 8, 2), 256: Tile(64, 32, 4, 1)},
    "decode": {64: Tile(16, 128, 4, 3), 128: Tile(16, 128, 4, 3), 256: Tile(16, 32, 4, 2)},
}
# a GPU needs this much shared memory per block (opt-in) for every _TABLE entry: A100 (163 KB),
# H100/H200 and B200 (227 KB) have it
SHARED_FOR_TABLE = 160 * 1024
# the entries that change on GPUs with less (RTX 30xx/40xx/50xx: 99 KB): the pre-retune hd128
# backward tiles, and an hd256 dK/dV tile of 16 queries
_COMPACT = {
    "dkdv": {128: Tile(64, 64, 4, 3), 256: Tile(16, 64, 4, 1)},
    "dq": {128: Tile(128, 64, 8, 2)},
}
# fp32 inputs take exact (ieee) products and twice the bytes: small tiles, fewer stages
_TABLE_FP32 = {"fwd": Tile(64, 32, 4, 2), "dkdv": Tile(32, 32, 4, 1), "dq": Tile(32, 32, 4, 1),
               "decode": Tile(16, 32, 4, 2)}
# fp32 at head dims past 128 on GPUs with less than SHARED_FOR_TABLE (the _TABLE_FP32 tiles take
# 128-137 KB at hd256 there): 94-98 KB
_COMPACT_FP32_WIDE = {"fwd": Tile(32, 32, 4, 1), "dkdv": Tile(16, 32, 4, 1), "dq": Tile(16, 32, 4, 1)}
# the CPU interpreter: cost grows with the number of programs and loop trips, not tile size
_INTERPRETER = Tile(32, 32, 1, 1)


def _lowbit(x: int) -> int:
    return x & -x


def tile_for(kernel: str, head_dim: int, dtype: torch.dtype, block_size=None, page_size: int = 0,
             packed_rows: int = 0, max_shared: int = SHARED_FOR_TABLE) -> Tile:
    """The tile of ``kernel`` for this call; ``max_shared``: the GPU's shared memory per block."""
    env = os.environ.get(f"DUALATTN_TRITON_TILE_{kernel.upper()}")
    if env:
        t = Tile(*[int(x) for x in env.split(",")])
    elif KERNELS_INTERPRETED:
        t = _INTERPRETER
    elif dtype == torch.float32:
        t = _TABLE_FP32[kernel]
        if max_shared < SHARED_FOR_TABLE and head_dim > 128:
            t = _COMPACT_FP32_WIDE.get(kernel, t)
    else:
        bucket = 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256
        t = _TABLE[kernel][bucket]
        if max_shared < SHARED_FOR_TABLE:
            t = _COMPACT.get(kernel, {}).get(bucket, t)
    if block_size is not None:  # a block-sparse tile must divide the CSR's blocks
        t = replace(t, block_m=min(t.block_m, _lowbit(block_size[0])), block_n=min(t.block_n, _lowbit(block_size[1])))
    if kernel == "decode":
        bm = min(64, max(16, 1 << max(packed_rows - 1, 0).bit_length()))
        bn = t.block_n
        while page_size and page_size % bn:
            bn //= 2
        t = replace(t, block_m=bm, block_n=bn)
    return t


@functools.lru_cache(maxsize=None)
def device_shared_memory(device_index: int) -> int:
    """Shared memory one block may opt in to on this GPU (bytes)."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin
