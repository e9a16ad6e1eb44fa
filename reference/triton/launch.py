"""Host side shared by the launchers: strides, masks as kernel arguments, CSR arrays, tiles."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from .common import KERNELS_INTERPRETED, LOG2E, next_pow2
from .configs import SHARED_FOR_TABLE, device_shared_memory, tile_for


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass
class CSRArgs:
    ptrs: Tuple  # FullPtr, FullCol, MaskPtr, MaskCol
    strides: Tuple  # rowptr (b, h), full col (b, h), mask col (b, h); 0 where broadcast


def _bh_strides(t: torch.Tensor) -> Tuple[int, int]:
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in (0, 1))


def score_args(spec) -> Tuple[float, float]:
    """(qk_scale, softcap): scores are s2 = qk * qk_scale (log2 domain), or
    cap * tanh(qk * qk_scale) * log2(e) with a softcap."""
    softcap = float(spec.softcap)
    return (spec.scale / softcap if softcap > 0 else spec.scale * LOG2E), softcap


def window_args(spec) -> Tuple[bool, bool, int, int]:
    """(has_left, has_right, win_left, win_right): causal is the window (left, 0); -1 entries
    are unbounded and switched off by constexpr."""
    left, right = spec.window
    if spec.causal:
        right = 0 if right < 0 else min(right, 0)
    return left >= 0, right >= 0, max(left, 0), max(right, 0)


def head_constexprs(spec) -> dict:
    """Head-dim tiles and the dtype switches, shared by every kernel."""
    return dict(
        BLOCK_D=next_pow2(max(spec.head_dim, 16)), BLOCK_DV=next_pow2(max(spec.head_dim_v, 16)),
        HEAD_D=spec.head_dim, HEAD_DV=spec.head_dim_v, SOFTCAP=spec.softcap > 0,
        # the interpreter's tl.dot is wrong on bf16: upcast there
        DOT_FP32=KERNELS_INTERPRETED and spec.dtype == torch.bfloat16,
        IEEE=spec.dtype == torch.float32)


class Launch:
    """Everything a launcher passes besides its own outputs, derived once from the call."""

    def __init__(self, call, kernel: str):
        spec = call.spec
        self.call, self.spec = call, spec
        self.q = last_dim_contiguous(call.q)
        self.k = last_dim_contiguous(call.k)
        self.v = last_dim_contiguous(call.v)
        dummy = self.q
        self.varlen = spec.mode == "varlen"
        self.cu_q = call.cu_seqlens_q if self.varlen else dummy
        self.cu_k = call.cu_seqlens_k if self.varlen else dummy
        # key ranges (B|1, Hq|1, Sq_total, R, 2): broadcast dims get stride 0
        kr = call.key_ranges
        if kr is not None:
            kr = kr.contiguous()
            self.kr = kr
            self.kr_strides = (*_bh_strides(kr), kr.stride(2), kr.stride(3))
        else:
            self.kr, self.kr_strides = dummy, (0, 0, 0, 0)
        self.qk_scale, self.softcap = score_args(spec)
        self.has_left, self.has_right, self.win_left, self.win_right = window_args(spec)
        bs = call.block_sparse
        self.bs = bs.to(self.q.device) if bs is not None and bs.device != self.q.device else bs
        self.cfg = tile_for(kernel, max(spec.head_dim, spec.head_dim_v), spec.dtype,
                            block_size=spec.block_size, page_size=spec.page_size,
                            packed_rows=spec.seqlen_q * spec.gqa_ratio,
                            max_shared=(device_shared_memory(self.q.device.index or 0)
                                        if self.q.is_cuda else SHARED_FOR_TABLE))

    def wide_rows(self, q_like=(), k_like=()) -> bool:
        """Whether a row offset inside one sequence (row x row stride, plus a tile of rows and one
        row's heads) can pass 2**31 in q, k, v or the extra tensors laid out like q (``q_like``: dO,
        dQ) or like k (``k_like``: dK, dV). Then the kernels that take ``WIDE_ROWS`` compute such
        offsets in 64 bits (common._row); sequence and batch starts are 64-bit always."""
        spec = self.spec

        def worst(t, rows):
            return (rows + 256) * t.stride(-3) + t.shape[-2] * t.stride(-2) + t.shape[-1]
        w = max([worst(t, spec.seqlen_q) for t in (self.q, *q_like)]
                + [worst(t, spec.seqlen_k) for t in (self.k, self.v, *k_like)])
        return w >= 2 ** 31

    def qkv_strides(self, t: torch.Tensor) -> Tuple[int, int, int]:
        """(batch, sequence, head) strides; varlen tensors have no batch dimension."""
        if t.dim() == 3:
            return 0, t.stride(0), t.stride(1)
        return t.stride(0), t.stride(1), t.stride(2)

    def csr(self, which: str) -> CSRArgs:
        """``q2k`` (forward, dQ) or ``k2q`` (dK/dV) arrays of the block-sparse pattern."""
        if self.bs is None:
            return CSRArgs((self.q,) * 4, (0,) * 6)
        full, mask = (self.bs.q2k_full, self.bs.q2k_mask) if which == "q2k" else (self.bs.k2q_full, self.bs.k2q_mask)
        fp, fc, mp, mc = (x.contiguous() for x in (full.rowptr, full.col, mask.rowptr, mask.col))
        assert _bh_strides(fp) == _bh_strides(mp)
        return CSRArgs((fp, fc, mp, mc), (*_bh_strides(fp), *_bh_strides(fc), *_bh_strides(mc)))

    def constexprs(self) -> dict:
        spec = self.spec
        return dict(
            head_constexprs(spec),
            IS_VARLEN=self.varlen, HAS_LEFT=self.has_left, HAS_RIGHT=self.has_right,
            NUM_KR=spec.num_key_ranges, HAS_BS=self.bs is not None,
            BS_M=self.bs.block_m if self.bs is not None else 1, BS_N=self.bs.block_n if self.bs is not None else 1)
