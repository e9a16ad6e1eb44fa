"""Trace-time checks for TMA + mbarrier pipelines and the shared-memory budget.

These run in Python while a kernel is traced, so a configuration that would hang (an mbarrier
whose expected transaction bytes differ from what TMA delivers, an arrive count that no group of
threads can reach) or not launch (shared memory over the arch limit) fails at compile time with a
message naming the pipeline, instead of deadlocking on the GPU.
"""
from __future__ import annotations

from typing import Dict, Sequence

# Dynamic shared memory a CTA may opt into (bytes), per arch.
SMEM_LIMIT = {"sm_90a": 227 * 1024, "sm_100a": 227 * 1024, "sm_120a": 99 * 1024, "sm_80": 163 * 1024}
MBARRIER_MAX_ARRIVALS = (1 << 20) - 1   # PTX: arrival count fits 20 bits
MBARRIER_MAX_TX_BYTES = (1 << 20) - 1   # PTX: tx-count range
TMA_BOX_MAX = 256                       # elements per box dimension


class PipelineConfigError(ValueError):
    pass


def check_pipeline_config(name: str, tx_bytes: int, tile_shape: Sequence[int], elem_bits: int,
                          num_stages: int, producer_arrivals: int, consumer_arrivals: int) -> None:
    """Check one TMA-fed pipeline stage.

    ``tx_bytes`` is what the full barrier will expect (what the kernel passes as tx_count);
    it must equal the bytes the TMA box of ``tile_shape`` delivers, or the barrier never flips.
    """
    tx_bytes = int(tx_bytes)
    expect = elem_bits // 8
    for s in tile_shape:
        expect *= int(s)
        if not 0 < int(s) <= TMA_BOX_MAX:
            raise PipelineConfigError(f"pipeline {name}: TMA box dimension {s} outside [1, {TMA_BOX_MAX}]")
    if tx_bytes != expect:
        raise PipelineConfigError(
            f"pipeline {name}: full barrier expects {tx_bytes} transaction bytes but one TMA load of "
            f"{tuple(tile_shape)} x {elem_bits} bits delivers {expect}")
    if not 0 < tx_bytes <= MBARRIER_MAX_TX_BYTES:
        raise PipelineConfigError(f"pipeline {name}: {tx_bytes} transaction bytes exceed the mbarrier range")
    if (tile_shape[-1] * elem_bits // 8) % 16:
        raise PipelineConfigError(f"pipeline {name}: TMA inner box {tile_shape[-1]} elements is not a multiple of 16 bytes")
    if num_stages < 1:
        raise PipelineConfigError(f"pipeline {name}: needs at least one stage")
    for who, n in (("producer", producer_arrivals), ("consumer", consumer_arrivals)):
        if not 0 < n <= MBARRIER_MAX_ARRIVALS:
            raise PipelineConfigError(f"pipeline {name}: {who} arrive count {n} outside [1, {MBARRIER_MAX_ARRIVALS}]")


def check_smem_budget(buffers: Dict[str, int], num_mbarriers: int, arch: str) -> int:
    """Sum the shared-memory buffers (bytes) plus 8 bytes per mbarrier; raise if over the arch limit."""
    total = sum(int(v) for v in buffers.values()) + 8 * int(num_mbarriers)
    limit = SMEM_LIMIT[arch]
    if total > limit:
        parts = ", ".join(f"{k}={int(v)}" for k, v in buffers.items())
        raise PipelineConfigError(f"shared memory {total} B exceeds the {arch} limit {limit} B ({parts})")
    return total
