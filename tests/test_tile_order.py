"""The causal tile order of fast/common/tile_order (CPU: the same arithmetic the kernels trace)."""
from __future__ import annotations

import pytest

from dualattn.fast.common.tile_order import heads_per_section, heavy_first_in_sections


@pytest.mark.parametrize("num_m_blocks, num_bh, section", [
    (16, 128, 24), (16, 128, 128), (16, 128, 1), (128, 16, 3), (1, 7, 4), (5, 7, 3), (3, 1, 8)])
def test_every_tile_once_heaviest_first_within_sections(num_m_blocks, num_bh, section):
    section = min(section, num_bh)
    order = [heavy_first_in_sections(t, num_m_blocks, num_bh, section, min)
             for t in range(num_m_blocks * num_bh)]
    assert sorted(order) == [(m, bh) for m in range(num_m_blocks) for bh in range(num_bh)]
    # sections come one after another, and inside one the query blocks never get heavier
    sections = [bh // section for _, bh in order]
    assert sections == sorted(sections)
    for s in set(sections):
        ms = [m for (m, bh), sec in zip(order, sections) if sec == s]
        assert ms == sorted(ms, reverse=True)


def test_one_section_is_heaviest_first_across_all_heads():
    """A section as large as the grid gives the plain longest-processing-time order."""
    m_blocks, bh = 6, 10
    order = [heavy_first_in_sections(t, m_blocks, bh, bh, min) for t in range(m_blocks * bh)]
    assert order == [(m_blocks - 1 - t // bh, t % bh) for t in range(m_blocks * bh)]


def test_heads_per_section_fits_the_budget():
    row = (128 + 128) * 2  # K + V bytes of one key row, hd128 bf16
    assert heads_per_section(2048, row, max, 24 << 20) == 24   # 1 MB of K/V per head
    assert heads_per_section(16384, row, max, 24 << 20) == 3
    assert heads_per_section(1 << 20, row, max, 24 << 20) == 1  # a head larger than the budget
    assert heads_per_section(0, row, max, 24 << 20) == (24 << 20) // row  # no keys: any number
    assert heads_per_section(1 << 30, 1024, max, 24 << 20) == 1  # no 32-bit overflow on the way
