"""Side-by-side attention benchmark: every dualattn implementation against the peers in-process.

    python -m dualattn bench [--quick] [--kind fwd,bwd,fwdbwd,decode] [--json F] [--plot F.png]
    ci/bench ...                    (the same, on a GPU machine)

The standard matrix (bf16 by default):

* dense: head dim 64/128/256, causal and not, seqlen 512..16k with batch x seqlen = 16k tokens
  and heads x head dim = 2048; GQA 32/8 (hd128);
* masks: sliding window 1024 (causal, 16k), 10 packed documents (varlen, causal, 16k),
  block-sparse (hd128, 8k, a fixed random pattern of full 128x128 blocks plus the diagonal);
* each of forward, backward, forward+backward;
* decode: 1 query token, GQA 32/8 hd128, KV cache 8k..128k, batch 1..64 (TB/s of KV read),
  timed twice: eagerly (one Python call per timed run, as every other cell) and as the replay of
  a CUDA graph that captured one call (rows ``<impl>@graph``), which is how serving runs decode;
  ``--graph`` adds the graph rows to every cell (kernels compared without their host paths).
Docs and window cells also time each dualattn implementation on the same attention expressed as
one batched call with an exact block-sparse CSR (rows ``<impl>+csr``), the form FlexAttention
runs them in.

For every cell each dualattn implementation whose ``can_implement`` accepts it runs next to
the peers available in this process: cuDNN and FlashAttention-2 through torch SDPA backends,
FlexAttention (compiled), FlashAttention-4 (``flash_attn.cute``) when it imports. Times are
medians of CUDA-event timings after warm-up, with the L2 cache flushed before each timed run; the
rows of a cell (peers, ours, graph replays) are timed in the same rounds, one run of each per
round in a rotated order, so that all of them meet the same power-limited SM clock (the row's
note and ``sm_mhz`` in the JSON: the median of NVML's reading after each round, i.e. between
runs; under short kernels it shows the clock the GPU returns to, not the one they ran at: at
hd128 1k the SM clock measured in the kernel was 1712-1760 MHz where this read 1980, docs
section 33);
TFLOP/s count only useful FLOPs (visible query/key pairs; backward = 2.5x forward FLOPs);
decode reports TB/s of KV cache read. The eager timing starts its event after the L2 flush was
queued, so host work that fits in the flush's time overlaps it: it shows the gaps between a call's
kernels but not a slow host (which serving hides behind the previous layer's kernels, or removes
with a graph); the @graph rows have no host work at all. The device-to-device copy bandwidth is
measured in the same run for scale. Each dualattn forward output is compared with a peer's (max abs diff).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

PEERS = ("cudnn", "fa2", "flex", "fa4")
KINDS = ("fwd", "bwd", "fwdbwd", "decode")
TOKENS, HEADS_X_DIM = 16384, 2048
SPARSE_BLOCK = 128


class NotApplicable(Exception):
    """This implementation cannot serve this cell (the reason is shown in the table)."""


# ---------------------------------------------------------------------------------------------
# the matrix
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    kind: str                 # fwd | bwd | fwdbwd | decode
    group: str                # dense | gqa | window | docs | sparse | chunk | decode (one plot panel per group/hd)
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    docs: int = 0             # packed documents (varlen), causal inside each
    density: float = 0.0      # block-sparse: fraction of key blocks kept per query block (plus the diagonal)
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)

    def label(self) -> str:
        s = f"{self.kind:6s} {self.group:6s} hd{self.head_dim:<3d} "
        if self.kind == "decode":
            return s + f"b{self.batch} kv{_k(self.seqlen_k)} h{self.heads_q}/{self.heads_kv}"
        s += f"b{self.batch} s{_k(self.seqlen_q)}"
        s += f" kv{_k(self.seqlen_k)}" if self.seqlen_k != self.seqlen_q else ""
        s += f" h{self.heads_q}"
        if self.heads_kv != self.heads_q:
            s += f"/{self.heads_kv}"
        if self.causal:
            s += " causal"
        if self.window != (-1, -1):
            s += f" win{self.window[0]}"
        if self.docs:
            s += f" {self.docs}docs"
        if self.density:
            s += f" sparse{self.density:g}"
        return s

    def panel(self) -> str:
        if self.kind == "decode":
            return f"decode hd{self.head_dim} (TB/s)"
        mask = {"dense": "causal" if self.causal else "no mask",
                "gqa": f"GQA {self.heads_q}/{self.heads_kv}" + (" causal" if self.causal else ""),
                "window": f"window {self.window[0]}" + (" causal" if self.causal else ""),
                "docs": f"{self.docs} packed docs", "sparse": f"block-sparse {self.density:g}",
                "chunk": f"GQA {self.heads_q}/{self.heads_kv} kv{_k(self.seqlen_k)}"
                + (" causal" if self.causal else "")}[self.group]
        return f"{self.kind} hd{self.head_dim} {mask}"

    def x_label(self) -> str:
        return f"b{self.batch} kv{_k(self.seqlen_k)}" if self.kind == "decode" else _k(self.seqlen_q)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def standard_matrix(kinds: Sequence[str] = KINDS, dtype: str = "bfloat16") -> List[Cell]:
    cells: List[Cell] = []
    train = [k for k in kinds if k != "decode"]
    for kind in train:
        for hd in (64, 128, 256):
            h = HEADS_X_DIM // hd
            for causal in (False, True):
                for s in (512, 1024, 2048, 4096, 8192, 16384):
                    cells.append(Cell(kind, "dense", TOKENS // s, s, s, h, h, hd, causal, dtype=dtype))
        for causal in (False, True):
            for s in (2048, 8192):
                cells.append(Cell(kind, "gqa", TOKENS // s, s, s, 32, 8, 128, causal, dtype=dtype))
        cells.append(Cell(kind, "window", 1, 16384, 16384, 16, 16, 128, True, (1024, 0), dtype=dtype))
        cells.append(Cell(kind, "docs", 1, 16384, 16384, 16, 16, 128, True, docs=10, dtype=dtype))
        cells.append(Cell(kind, "sparse", 2, 8192, 8192, 16, 16, 128, False, density=0.25, dtype=dtype))
    if "fwd" in kinds:
        # a chunk of a prompt against its long context (batch 1, bottom-right causal): grids of
        # fewer tiles than SMs, where a kernel must cut the keys to fill the GPU
        for sq, causal in ((16, True), (128, True), (256, True), (128, False)):
            cells.append(Cell("fwd", "chunk", 1, sq, 32768, 32, 8, 128, causal, dtype=dtype))
        # a 1k chunk of a tensor-parallel shard (8 query heads) against 16k keys: 64 tiles
        cells.append(Cell("fwd", "chunk", 1, 1024, 16384, 8, 2, 128, True, dtype=dtype))
        # a 640-query chunk against 32k keys: 160 tiles, more than the SMs and fewer than twice
        cells.append(Cell("fwd", "chunk", 1, 640, 32768, 32, 8, 128, True, dtype=dtype))
    if "decode" in kinds:
        for L in (8192, 16384, 32768, 65536, 131072):
            for b in (1, 8, 64):
                cells.append(Cell("decode", "decode", b, 1, L, 32, 8, 128, dtype=dtype))
    return cells


def quick_matrix(kinds: Sequence[str] = KINDS, dtype: str = "bfloat16") -> List[Cell]:
    """About two minutes on one H100/H200 (most of it kernel compilation)."""
    cells = [
        Cell("fwd", "dense", 2, 8192, 8192, 16, 16, 128, False, dtype=dtype),
        Cell("fwd", "dense", 2, 8192, 8192, 16, 16, 128, True, dtype=dtype),
        Cell("fwd", "dense", 8, 2048, 2048, 32, 32, 64, False, dtype=dtype),
        Cell("fwd", "gqa", 2, 8192, 8192, 32, 8, 128, True, dtype=dtype),
        Cell("fwd", "window", 1, 16384, 16384, 16, 16, 128, True, (1024, 0), dtype=dtype),
        Cell("fwd", "docs", 1, 16384, 16384, 16, 16, 128, True, docs=10, dtype=dtype),
        Cell("fwd", "sparse", 2, 8192, 8192, 16, 16, 128, False, density=0.25, dtype=dtype),
        Cell("bwd", "dense", 2, 8192, 8192, 16, 16, 128, True, dtype=dtype),
        Cell("fwdbwd", "dense", 2, 8192, 8192, 16, 16, 128, True, dtype=dtype),
        Cell("decode", "decode", 8, 1, 32768, 32, 8, 128, dtype=dtype),
        Cell("decode", "decode", 64, 1, 8192, 32, 8, 128, dtype=dtype),
    ]
    return [c for c in cells if c.kind in kinds]


def filter_cells(cells: List[Cell], *, head_dims=None, seqlens=None, groups=None, causal=None) -> List[Cell]:
    out = []
    for c in cells:
        if head_dims and c.head_dim not in head_dims:
            continue
        if seqlens and (c.seqlen_k if c.kind == "decode" else c.seqlen_q) not in seqlens:
            continue
        if groups and c.group not in groups:
            continue
        if causal is not None and c.kind != "decode" and c.causal != causal:
            continue
        out.append(c)
    return out


# ---------------------------------------------------------------------------------------------
# useful work
# ---------------------------------------------------------------------------------------------

def doc_lengths(total: int, n: int) -> List[int]:
    """n documents of uneven lengths summing to ``total`` (deterministic)."""
    w = [1.0 + 0.5 * math.sin(1.7 * i + 0.3) for i in range(n)]
    lens = [max(1, int(total * x / sum(w))) for x in w]
    lens[-1] += total - sum(lens)
    return lens


def sparse_states(cell: Cell, device="cpu") -> torch.Tensor:
    """(1, 1, nq, nk) int8 block states of the block-sparse cell: full blocks only (no element mask)."""
    from .sparse import FULL

    nq, nk = -(-cell.seqlen_q // SPARSE_BLOCK), -(-cell.seqlen_k // SPARSE_BLOCK)
    g = torch.Generator().manual_seed(1234)
    keep = torch.rand(nq, nk, generator=g) < cell.density
    keep |= torch.eye(nq, nk, dtype=torch.bool)
    return (keep.to(torch.int8) * FULL).view(1, 1, nq, nk).to(device)


def visible_pairs(cell: Cell) -> int:
    """Number of (query, key) pairs that are visible, summed over batch and query heads."""
    if cell.kind == "decode":
        return cell.batch * cell.heads_q * cell.seqlen_k
    if cell.docs:
        lens = doc_lengths(cell.seqlen_q, cell.docs)
        per = sum(n * (n + 1) // 2 for n in lens) if cell.causal else sum(n * n for n in lens)
        return per * cell.batch * cell.heads_q
    if cell.density:
        full = int((sparse_states(cell) > 0).sum())
        return full * SPARSE_BLOCK * SPARSE_BLOCK * cell.batch * cell.heads_q
    sq, sk = cell.seqlen_q, cell.seqlen_k
    i = torch.arange(sq, dtype=torch.int64)
    diag = i + sk - sq
    lo = torch.zeros_like(i)
    hi = torch.full_like(i, sk - 1)
    if cell.causal:
        hi = torch.minimum(hi, diag)
    left, right = cell.window
    if left >= 0:
        lo = torch.maximum(lo, diag - left)
    if right >= 0:
        hi = torch.minimum(hi, diag + right)
    per_row = (hi - lo + 1).clamp(min=0)
    return int(per_row.sum()) * cell.batch * cell.heads_q


def work(cell: Cell) -> Tuple[float, str]:
    """(amount, unit): FLOPs for training kinds, bytes of KV read for decode."""
    if cell.kind == "decode":
        elem = torch.tensor([], dtype=cell.torch_dtype).element_size()
        return float(cell.batch * cell.seqlen_k * cell.heads_kv * 2 * cell.head_dim * elem), "TB/s"
    fwd = 4.0 * visible_pairs(cell) * cell.head_dim
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[cell.kind], "TFLOP/s"


# ---------------------------------------------------------------------------------------------
# inputs and runners
# ---------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    cell: Cell
    q: torch.Tensor            # (B, Sq, Hq, D); docs: (1, T, Hq, D)
    k: torch.Tensor
    v: torch.Tensor
    dout: Optional[torch.Tensor] = None
    cu_seqlens: Optional[torch.Tensor] = None
    max_doc: int = 0
    doc_ids: Optional[torch.Tensor] = None
    block_sparse: Optional[object] = None
    states: Optional[torch.Tensor] = None
    cache_seqlens: Optional[torch.Tensor] = None

    def leaves(self):
        """Fresh leaf copies requiring grad, for the autograd-based peers."""
        return tuple(t.detach().clone().requires_grad_(True) for t in (self.q, self.k, self.v))


def make_inputs(cell: Cell, device="cuda") -> Inputs:
    g = torch.Generator(device=device).manual_seed(0)
    dt = cell.torch_dtype

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    if cell.kind == "decode":
        q = rnd(cell.batch, 1, cell.heads_q, cell.head_dim)
        k = rnd(cell.batch, cell.seqlen_k, cell.heads_kv, cell.head_dim)
        v = rnd(cell.batch, cell.seqlen_k, cell.heads_kv, cell.head_dim)
        lens = torch.full((cell.batch,), cell.seqlen_k, dtype=torch.int32, device=device)
        return Inputs(cell, q, k, v, cache_seqlens=lens)
    q = rnd(cell.batch, cell.seqlen_q, cell.heads_q, cell.head_dim)
    k = rnd(cell.batch, cell.seqlen_k, cell.heads_kv, cell.head_dim)
    v = rnd(cell.batch, cell.seqlen_k, cell.heads_kv, cell.head_dim)
    inp = Inputs(cell, q, k, v, dout=rnd(*q.shape) if cell.kind != "fwd" else None)
    if cell.docs:
        lens = doc_lengths(cell.seqlen_q, cell.docs)
        inp.cu_seqlens = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        inp.max_doc = max(lens)
        inp.doc_ids = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                              torch.tensor(lens, device=device))
    if cell.density:
        from .sparse import BlockSparse

        inp.states = sparse_states(cell, device)
        inp.block_sparse = BlockSparse.from_block_states(inp.states, SPARSE_BLOCK, SPARSE_BLOCK, cell.seqlen_q,
                                                         cell.seqlen_k)
    return inp


@dataclass
class Runner:
    fn: Callable[[], object]
    out: Optional[Callable[[], torch.Tensor]] = None  # forward output in dualattn layout, for the check


def _dualattn_call(inp: Inputs, needs_grad: bool):
    from . import spec as S

    c = inp.cell
    if c.kind == "decode":
        call = S.build_kvcache(inp.q, inp.k, inp.v, cache_seqlens=inp.cache_seqlens, return_lse=True)
    elif c.docs:
        T = c.seqlen_q
        call = S.build_varlen(inp.q.view(T, c.heads_q, c.head_dim), inp.k.view(T, c.heads_kv, c.head_dim),
                              inp.v.view(T, c.heads_kv, c.head_dim), inp.cu_seqlens, inp.cu_seqlens, inp.max_doc,
                              inp.max_doc, causal=c.causal, return_lse=True)
    else:
        call = S.build_dense(inp.q, inp.k, inp.v, causal=c.causal, window=c.window, block_sparse=inp.block_sparse,
                             return_lse=True)
    call.spec = replace(call.spec, needs_grad=needs_grad)
    return call


CSR = "+csr"  # suffix of the rows that run a docs / window cell through a block-sparse CSR


def has_csr_form(cell: Cell) -> bool:
    """Docs and window cells are also run as block-sparse (FlexAttention's own form of them)."""
    return cell.kind != "decode" and (bool(cell.docs) or cell.window != (-1, -1))


def _csr_call(inp: Inputs, needs_grad: bool):
    """The docs / window cell as one batched call over the whole sequence with the exact CSR of
    its predicate at 128 x 128 blocks: documents as causal key ranges, the window as causal +
    window. Full blocks skip the predicate; only the blocks it cuts apply it."""
    from . import spec as S
    from .masks import segments_to_key_ranges
    from .sparse import BlockSparse

    c = inp.cell
    n = c.seqlen_q
    if c.docs:
        kr = segments_to_key_ranges([doc_lengths(n, c.docs)], n, causal=c.causal, device=inp.q.device)
        bs = BlockSparse.from_key_ranges(kr, n, n, SPARSE_BLOCK, SPARSE_BLOCK)
        call = S.build_dense(inp.q, inp.k, inp.v, key_ranges=kr, block_sparse=bs, return_lse=True)
    else:
        bs = BlockSparse.from_key_ranges(None, n, c.seqlen_k, SPARSE_BLOCK, SPARSE_BLOCK, causal=c.causal,
                                         window=c.window).to(inp.q.device)
        call = S.build_dense(inp.q, inp.k, inp.v, causal=c.causal, window=c.window, block_sparse=bs,
                             return_lse=True)
    call.spec = replace(call.spec, needs_grad=needs_grad)
    return call


def dualattn_runner(impl, inp: Inputs, csr: bool = False) -> Runner:
    c = inp.cell
    make_call = _csr_call if csr else _dualattn_call
    call = make_call(inp, needs_grad=c.kind in ("bwd", "fwdbwd"))
    why = impl.can_implement(call.spec)
    if why is not None:
        raise NotApplicable(why)
    if c.kind in ("fwd", "decode"):
        return Runner(lambda: impl.forward(call), lambda: impl.forward(call)[0].reshape(inp.q.shape))
    dout = inp.dout.reshape(call.q.shape[:-1] + (call.v.shape[-1],))
    if c.kind == "bwd":
        out, lse = impl.forward(call)
        return Runner(lambda: impl.backward(call, out, lse, dout))

    def fwdbwd():
        o, l = impl.forward(call)
        return impl.backward(call, o, l, dout)
    return Runner(fwdbwd)


def _autograd_runner(fwd: Callable, leaves, dout, kind: str, to_fa_layout: Callable) -> Runner:
    """Runner for a peer whose forward is differentiable by autograd."""
    if kind in ("fwd", "decode"):
        def f():
            with torch.no_grad():
                return fwd(*leaves)
        return Runner(f, lambda: to_fa_layout(f()))
    if kind == "bwd":
        out = fwd(*leaves)
        d = _match(out, dout, to_fa_layout)
        return Runner(lambda: torch.autograd.grad(out, leaves, d, retain_graph=True))

    def fb():
        o = fwd(*leaves)
        return torch.autograd.grad(o, leaves, _match(o, dout, to_fa_layout))
    return Runner(fb)


def _match(out, dout_fa, to_fa_layout):
    """dout (in the FA layout) laid out like the peer's output."""
    if to_fa_layout is _bhsd_to_bshd:
        return dout_fa.transpose(1, 2)
    return dout_fa.view(out.shape)


def _bhsd_to_bshd(x):
    return x.transpose(1, 2)


def sdpa_runner(backend_name: str, inp: Inputs) -> Runner:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    c = inp.cell
    if c.window != (-1, -1):
        raise NotApplicable("SDPA has no sliding window")
    if c.docs:
        raise NotApplicable("SDPA has no packed-document (varlen) mode")
    if c.density:
        raise NotApplicable("SDPA has no block sparsity")
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION,
               "sdpa-math": SDPBackend.MATH}[backend_name]
    gqa = c.heads_q != c.heads_kv
    causal = c.causal and c.kind != "decode"
    # is_causal aligns the diagonal top-left; fewer queries than keys need the bottom-right mask
    lower_right = None
    if causal and c.seqlen_q != c.seqlen_k:
        from torch.nn.attention.bias import causal_lower_right
        lower_right, causal = causal_lower_right(c.seqlen_q, c.seqlen_k), False

    def fwd(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  attn_mask=lower_right, is_causal=causal, enable_gqa=gqa)
    leaves = inp.leaves() if c.kind in ("bwd", "fwdbwd") else (inp.q, inp.k, inp.v)
    return _autograd_runner(fwd, leaves, inp.dout, c.kind, _bhsd_to_bshd)


_FLEX = {}


def flex_runner(inp: Inputs) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    c = inp.cell
    if "fn" not in _FLEX:
        import torch._dynamo
        # one compiled specialisation per cell: keep them all (the default limit of 8 would fall
        # back to the unfused, memory-hungry eager path)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    flex = _FLEX["fn"]
    sq = 1 if c.kind == "decode" else c.seqlen_q
    sk = c.seqlen_k
    off = sk - sq  # bottom-right alignment
    left = c.window[0]
    if c.docs:
        ids = inp.doc_ids

        def mask_mod(b, h, qi, ki):
            return (ids[qi] == ids[ki]) & (qi >= ki)
    elif c.density:
        st = inp.states[0, 0]

        def mask_mod(b, h, qi, ki):
            return st[qi // SPARSE_BLOCK, ki // SPARSE_BLOCK] > 0
    elif c.causal and left >= 0:
        def mask_mod(b, h, qi, ki):
            return (qi + off >= ki) & (qi + off - ki <= left)
    elif c.causal and c.kind != "decode":
        def mask_mod(b, h, qi, ki):
            return qi + off >= ki
    else:
        mask_mod = None
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, None, None, sq, sk, device=inp.q.device)
    gqa = c.heads_q != c.heads_kv

    def fwd(q, k, v):
        return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, enable_gqa=gqa)
    leaves = inp.leaves() if c.kind in ("bwd", "fwdbwd") else (inp.q, inp.k, inp.v)
    return _autograd_runner(fwd, leaves, inp.dout, c.kind, _bhsd_to_bshd)


def fa4_available() -> Optional[str]:
    """None when FlashAttention-4 imports, else the reason."""
    try:
        import flash_attn.cute  # noqa: F401
        return None
    except Exception as e:  # any import failure means "not available", with the reason shown
        return f"{type(e).__name__}: {e}"


def fa4_runner(inp: Inputs, num_splits: int = 1) -> Runner:
    """FA4's forward; ``num_splits``: its split along the keys (1: none, its default; 0: its own
    heuristic picks, the peer fa4-split)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    c = inp.cell
    if c.density:
        raise NotApplicable("not wired: FA4 block-sparse tensors")
    causal = c.causal and c.kind != "decode"
    win = (None, None) if c.window == (-1, -1) else tuple(None if w < 0 else w for w in c.window)
    if c.docs:
        T = c.seqlen_q

        def fwd(q, k, v):
            return flash_attn_varlen_func(q.view(T, c.heads_q, c.head_dim), k.view(T, c.heads_kv, c.head_dim),
                                          v.view(T, c.heads_kv, c.head_dim), cu_seqlens_q=inp.cu_seqlens,
                                          cu_seqlens_k=inp.cu_seqlens, max_seqlen_q=inp.max_doc,
                                          max_seqlen_k=inp.max_doc, causal=causal)[0]
        to_fa = lambda o: o.view(inp.q.shape)  # noqa: E731
    else:
        split = {} if num_splits == 1 else {"num_splits": num_splits}

        def fwd(q, k, v):
            return flash_attn_func(q, k, v, causal=causal, window_size=win, **split)[0]
        to_fa = lambda o: o  # noqa: E731
    leaves = inp.leaves() if c.kind in ("bwd", "fwdbwd") else (inp.q, inp.k, inp.v)
    return _autograd_runner(fwd, leaves, inp.dout, c.kind, to_fa)


def peer_runner(name: str, inp: Inputs) -> Runner:
    if name in ("cudnn", "fa2", "sdpa-math"):  # sdpa-math: unfused, for checks (not a default peer)
        return sdpa_runner(name, inp)
    if name == "flex":
        return flex_runner(inp)
    if name in ("fa4", "fa4-split"):
        why = fa4_available()
        if why:
            raise NotApplicable(f"flash_attn.cute does not import ({why})")
        if name == "fa4-split" and (inp.cell.docs or inp.cell.kind != "fwd"):
            raise NotApplicable("fa4-split: batched forward only")
        return fa4_runner(inp, 0 if name == "fa4-split" else 1)
    raise ValueError(f"unknown peer {name!r}")


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

class Timer:
    """CUDA-event timing with an L2 flush before each timed run.

    ``time_interleaved`` times several functions in rounds, each round running every function
    once in a rotated order, so that all of them see the same GPU clock: under the power limit
    the SM clock drifts by up to 15 % within a cell (docs/bench-h100-20261124.md, section 20),
    and timing one implementation after another let that drift into the ratios between them."""

    def __init__(self, warmup: int = 3, reps: int = 20, budget_s: float = 0.5, rehearse: bool = True):
        self.warmup, self.reps, self.budget_s = warmup, reps, budget_s
        # An untimed call of the same function before each timed one, so that its host path runs
        # with the CPU caches warm, as when one function is timed rep after rep. Without it an
        # eager call whose host path follows another implementation's (cold caches) measured up
        # to 1.6x slower for FlashAttention-4 and 1.3x for cuDNN on the H100 (section 28).
        self.rehearse = rehearse
        # larger than the L2 of any current GPU (H100 50 MB, H200 60 MB, B200 126 MB)
        self.flush_buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def warm(self, fn: Callable[[], object]) -> float:
        """Run the warm-up calls; return the wall time of one more call, in seconds."""
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def timed_run(self, fn: Callable[[], object]) -> float:
        """One timed call in ms, after an L2 flush."""
        if not hasattr(self, "_events"):
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        start, end = self._events
        if self.rehearse:
            fn()
            torch.cuda.synchronize()
        self.flush_buf.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def time_ms(self, fn: Callable[[], object]) -> Tuple[float, int]:
        (ms, reps), = self.time_interleaved([fn], warm=True)
        if isinstance(ms, BaseException):
            raise ms
        return ms, reps

    def time_interleaved(self, fns: Sequence[Callable[[], object]], warm: bool = True,
                         seconds: Optional[Sequence[float]] = None) -> List[Tuple[object, int]]:
        """Median ms of each function over the same rounds, and the number of rounds. A function
        that raises is dropped from the later rounds and its exception takes its median's place.
        ``seconds``: each function's one-call time when the caller already warmed them."""
        if warm:
            seconds = [self.warm(fn) for fn in fns]
        spent = sum(max(s, 1e-6) for s in seconds) * (2 if self.rehearse else 1)
        rounds = max(3, min(self.reps, int(self.budget_s * len(fns) / spent)))
        times: List[List[float]] = [[] for _ in fns]
        failed: List[Optional[BaseException]] = [None] * len(fns)
        self.clocks_mhz = []  # the SM clock after each round (between runs), where NVML answers
        for r in range(rounds):
            for j in range(len(fns)):
                i = (j + r) % len(fns)
                if failed[i] is None:
                    try:
                        times[i].append(self.timed_run(fns[i]))
                    except Exception as e:  # reported in its row; the others go on
                        failed[i] = e
                        if torch.cuda.is_available():
                            torch.cuda.synchronize()
            mhz = sm_clock_mhz()
            if mhz is not None:
                self.clocks_mhz.append(mhz)
        return [(failed[i] if failed[i] is not None else statistics.median(times[i]), len(times[i]))
                for i in range(len(fns))]


def sm_clock_mhz() -> Optional[int]:
    """The SM clock now (NVML through torch), or None where NVML is not installed."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:
        return None


GRAPH = "@graph"  # suffix of the rows timed as a CUDA-graph replay


def cuda_graph_replay(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture one call of ``fn`` (already warmed up) in a CUDA graph; return its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm-up on a side stream before capture, as torch advises
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth_tbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del src, dst
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# running the matrix
# ---------------------------------------------------------------------------------------------

@dataclass
class Result:
    cell: Cell
    impl: str
    peer: bool
    status: str = "ok"          # ok | n/a: reason | error: message
    ms: Optional[float] = None
    rate: Optional[float] = None  # TFLOP/s or TB/s
    unit: str = ""
    reps: int = 0
    maxdiff: Optional[float] = None  # forward output vs the cell's reference peer
    sm_mhz: Optional[float] = None   # median SM clock read after each timing round (NVML)

    def to_json(self) -> dict:
        d = asdict(self)
        d["cell"] = asdict(self.cell)
        d["cell"]["label"] = self.cell.label()
        return d


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.t0 = total, 0, time.time()
        self.enabled = enabled and os.environ.get("DUALATTN_PROGRESS", "1") != "0"
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / max(1, self.total)
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        line = f"[{bar}] {self.done}/{self.total} {time.time() - self.t0:5.0f}s {what}"
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def select_impls(names: Optional[Sequence[str]]) -> List[object]:
    """dualattn implementation objects: by name or family; default every non-oracle one."""
    from . import dispatch

    all_impls = dispatch.implementations()
    if not names:
        return [i for i in all_impls if i.family != "torch"]
    out = []
    for n in names:
        hit = [i for i in all_impls if i.name == n or i.family == n]
        if not hit:
            known = sorted({i.name for i in all_impls} | {i.family for i in all_impls})
            raise SystemExit(f"--impls: unknown implementation {n!r}; known: {', '.join(known)}")
        out += [i for i in hit if i not in out]
    return out


def _error(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def run_matrix(cells: List[Cell], impls: List[object], peers: Sequence[str], timer: Timer,
               progress: Optional[Progress] = None, device: str = "cuda",
               on_result: Optional[Callable[[Result, List[Result]], None]] = None,
               graph: bool = False) -> List[Result]:
    """Measure every (cell, implementation); ``on_result(result, results_of_its_cell)`` streams them.
    Decode cells, and every cell with ``graph``, are also timed as a CUDA-graph replay (rows
    ``<impl>@graph``): kernel against kernel, with no implementation's host path in the time."""
    results: List[Result] = []
    cuda = device == "cuda"
    for cell in cells:
        amount, unit = work(cell)
        free = torch.cuda.mem_get_info()[0] if cuda else None
        need = 6 * cell.batch * max(cell.seqlen_q, cell.seqlen_k) * cell.heads_q * cell.head_dim * 2
        if cell.kind == "decode":  # the KV cache (= the bytes read) and little else
            need = 1.25 * amount
        if free is not None and need > 0.8 * free:
            for name in [i.name for i in impls] + list(peers):
                results.append(Result(cell, name, name in peers, f"n/a: needs ~{need / 2**30:.0f} GiB"))
                if on_result:
                    on_result(results[-1], [results[-1]])
                if progress:
                    progress.step(f"{cell.label()} {name} (skipped)")
            continue
        inp = make_inputs(cell, device)
        ref_out = None
        cell_results: List[Result] = []

        def emit(r: Result) -> None:
            results.append(r)
            cell_results.append(r)
            if on_result:
                on_result(r, cell_results)
        entries = [(p, True, False) for p in peers] + [(i, False, False) for i in impls]
        if has_csr_form(cell):
            entries += [(i, False, True) for i in impls]
        # 1. build and warm every runner, checking its forward output against the first one's;
        # 2. capture the graphs; 3. time all of them in the same interleaved rounds.
        rows: List[List[Result]] = []     # per entry: its eager row, then its graph row
        timed: List[Tuple[Result, Callable[[], object], float]] = []
        for entry, is_peer, csr in entries:
            name = entry if is_peer else entry.name + (CSR if csr else "")
            r = Result(cell, name, is_peer, unit=unit)
            rows.append([r])
            try:
                runner = peer_runner(entry, inp) if is_peer else dualattn_runner(entry, inp, csr=csr)
                seconds = timer.warm(runner.fn)
                if runner.out is not None:
                    o = runner.out().float()
                    if ref_out is None:
                        ref_out = o
                    elif o.shape == ref_out.shape:
                        r.maxdiff = float((o - ref_out).abs().max())
                timed.append((r, runner.fn, seconds))
            except NotApplicable as e:
                r.status = f"n/a: {e}"
            except Exception as e:  # a failing implementation is reported, the run goes on
                r.status = _error(e)
                if cuda:
                    torch.cuda.synchronize()
                continue
            if (cell.kind == "decode" or graph) and cuda and r.status == "ok":
                g = Result(cell, name + GRAPH, is_peer, unit=unit)
                rows[-1].append(g)
                try:
                    replay = cuda_graph_replay(runner.fn)
                    timed.append((g, replay, timer.warm(replay)))
                except Exception as e:  # e.g. a peer that cannot be captured
                    g.status = _error(e)
                    torch.cuda.synchronize()
        if timed:
            measured = timer.time_interleaved([fn for _, fn, _ in timed], warm=False,
                                              seconds=[s for _, _, s in timed])
            mhz = getattr(timer, "clocks_mhz", None)
            for (r, _, _), (ms, reps) in zip(timed, measured):
                if isinstance(ms, BaseException):
                    r.status, r.maxdiff = _error(ms), None
                    continue
                r.ms, r.reps = ms, reps
                r.rate = amount / (r.ms * 1e-3) / 1e12
                r.sm_mhz = statistics.median(mhz) if mhz else None
        for entry_rows in rows:
            for r in entry_rows:
                emit(r)
            if progress:
                progress.step(f"{cell.label()} {entry_rows[0].impl}")
        del inp
        if cuda:
            torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------

def table_header(peers: Sequence[str]) -> str:
    head = f"{'cell':44s} {'impl':16s} {'ms':>9s} {'rate':>8s} {'unit':7s} " \
        + " ".join(f"{'vs ' + p:>9s}" for p in peers) + f" {'maxdiff':>8s}  note"
    return head + "\n" + "-" * len(head)


def format_row(r: Result, peers: Sequence[str], cell_results: Sequence[Result]) -> str:
    """One line: time, rate, speed ratio to each peer of the same cell (peer ms / ms); a graph
    replay row is compared with the peers' graph replays."""
    peer_ms = {x.impl: x.ms for x in cell_results if x.peer and x.status == "ok"}
    suffix = GRAPH if r.impl.endswith(GRAPH) else ""
    ratios = []
    for p in peers:
        if r.peer or r.status != "ok" or peer_ms.get(p + suffix) is None:
            ratios.append(f"{'':>9s}")
        else:
            ratios.append(f"{peer_ms[p + suffix] / r.ms:8.2f}x")
    ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9s}"
    rate = f"{r.rate:8.1f}" if r.rate is not None else f"{'-':>8s}"
    diff = f"{r.maxdiff:8.1e}" if r.maxdiff is not None else f"{'':>8s}"
    note = r.status[:90] if r.status != "ok" else f"SM {r.sm_mhz:.0f} MHz between runs" if r.sm_mhz else ""
    return f"{r.cell.label():44s} {r.impl:16s} {ms} {rate} {r.unit or '':7s} {' '.join(ratios)} {diff}  {note}"


def format_table(results: List[Result], peers: Sequence[str]) -> str:
    by_cell: Dict[Cell, List[Result]] = {}
    for r in results:
        by_cell.setdefault(r.cell, []).append(r)
    lines = [table_header(peers)]
    for cell, rs in by_cell.items():
        lines += [format_row(r, peers, rs) for r in rs]
    return "\n".join(lines)


def _open_text(path: str, mode: str):
    """A text file, gzip-compressed where the name ends in .gz (the JSON kept under docs/)."""
    return gzip.open(path, mode + "t", encoding="utf-8") if path.endswith(".gz") else open(path, mode)


def write_json(path: str, results: List[Result], meta: dict) -> None:
    """The run as JSON, one result per line (diffable; a third the size of an indented dump);
    gzip-compressed where ``path`` ends in .gz."""
    with _open_text(path, "w") as f:
        f.write(dumps_results(meta, [r.to_json() for r in results]))


def dumps_results(meta: dict, results: list) -> str:
    rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in results)
    return '{"meta": %s,\n "results": [\n  %s]}\n' % (json.dumps(meta), rows)


def load_results(path: str) -> List[Result]:
    """Results written by --json (plain or .gz), for --replot."""
    with _open_text(path, "r") as f:
        data = json.load(f)
    out = []
    for d in data["results"]:
        cell = {k: tuple(v) if isinstance(v, list) else v for k, v in d["cell"].items() if k != "label"}
        out.append(Result(**{**d, "cell": Cell(**cell)}))
    return out


def plot(results: List[Result], path: str) -> None:
    """Bar charts: one panel per (kind, head dim, mask), x = sequence length, one colour per impl."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib (pip install 'dualattn[plot]'): {e}")
    ok = [r for r in results if r.status == "ok"]
    if not ok:
        raise SystemExit("--plot: no successful measurement to plot")
    panels: Dict[str, List[Result]] = {}
    for r in ok:
        panels.setdefault(r.cell.panel(), []).append(r)
    names = []
    for r in ok:  # dualattn impls first, then peers, in order of appearance
        if r.impl not in names and not r.peer:
            names.append(r.impl)
    for r in ok:
        if r.impl not in names:
            names.append(r.impl)
    cmap = plt.get_cmap("tab10")
    colour = {n: cmap(i % 10) for i, n in enumerate(names)}
    n = len(panels)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.6 * rows), squeeze=False)
    for ax, (title, rs) in zip(axes.flat, panels.items()):
        xs = []
        for r in rs:
            if r.cell.x_label() not in xs:
                xs.append(r.cell.x_label())
        present = [nm for nm in names if any(r.impl == nm for r in rs)]
        width = 0.8 / max(1, len(present))
        for j, nm in enumerate(present):
            vals = {r.cell.x_label(): r.rate for r in rs if r.impl == nm}
            pos = [i + (j - (len(present) - 1) / 2) * width for i in range(len(xs))]
            bars = ax.bar(pos, [vals.get(x, 0.0) for x in xs], width, label=nm, color=colour[nm])
            ax.bar_label(bars, labels=[("" if x not in vals else f"{vals[x]:.0f}" if vals[x] >= 10 else f"{vals[x]:.2g}")
                                       for x in xs], fontsize=6)
        ax.set_xticks(range(len(xs)))
        ax.set_xticklabels(xs, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(rs[0].unit)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[nm]) for nm in names]
    fig.legend(handles, names, loc="upper center", ncol=min(8, len(names)), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _csv(s: Optional[str]) -> List[str]:
    return [x.strip() for x in s.split(",") if x.strip()] if s else []


def _ints(s: Optional[str]) -> List[int]:
    out = []
    for x in _csv(s):
        x = x.lower()
        out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dualattn bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a ~2 minute subset of the matrix")
    p.add_argument("--kind", default=",".join(KINDS), help="comma list of fwd,bwd,fwdbwd,decode (default: all)")
    p.add_argument("--impls", default=None, help="dualattn implementations, by name or family (comma list; "
                                                 "default: every one except the torch oracle)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {','.join(PEERS)}, or 'none' "
                   "(fa4-split: FA4 with its own split along the keys, num_splits=0)")
    p.add_argument("--hdim", default=None, help="only these head dims (comma list)")
    p.add_argument("--seqlen", default=None, help="only these sequence lengths / cache lengths (e.g. 2k,16k)")
    p.add_argument("--group", default=None, help="only these groups: dense,gqa,window,docs,sparse,chunk,decode")
    p.add_argument("--causal", choices=("yes", "no"), default=None, help="only causal / only non-causal cells")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (at most)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cold-host", action="store_true", help="no untimed call of the same implementation "
                   "before each timed run: eager rows then include host paths run with the CPU caches "
                   "left by the other implementations of the round")
    p.add_argument("--json", metavar="FILE", help="write all results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="bar charts (needs matplotlib)")
    p.add_argument("--replot", metavar="FILE.json", help="no measuring: draw --plot from an earlier --json "
                   "(for GPU machines without matplotlib)")
    p.add_argument("--graph", action="store_true", help="also time every cell as a CUDA-graph replay (rows "
                   "<impl>@graph, compared with the peers' replays): the kernels without any host path")
    p.add_argument("--list", action="store_true", help="print the cells and exit (no GPU needed)")
    return p


def select_cells(args) -> List[Cell]:
    kinds = _csv(args.kind)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise SystemExit(f"--kind: unknown {bad}; choose from {', '.join(KINDS)}")
    cells = (quick_matrix if args.quick else standard_matrix)(kinds, args.dtype)
    causal = None if args.causal is None else args.causal == "yes"
    return filter_cells(cells, head_dims=_ints(args.hdim), seqlens=_ints(args.seqlen), groups=_csv(args.group),
                        causal=causal)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if args.replot:
        if not args.plot:
            raise SystemExit("--replot needs --plot FILE.png")
        plot(load_results(args.replot), args.plot)
        print(f"# wrote {args.plot}")
        return 0
    cells = select_cells(args)
    peers = [] if args.peers.strip().lower() == "none" else _csv(args.peers)
    bad = [p for p in peers if p not in PEERS + ("sdpa-math", "fa4-split")]
    if bad:
        raise SystemExit(f"--peers: unknown {bad}; choose from {', '.join(PEERS)} or 'none'")
    if args.list:
        for c in cells:
            amount, unit = work(c)
            print(f"{c.label():48s} {amount / 1e9:10.1f} G{'FLOP' if unit == 'TFLOP/s' else 'B'}")
        print(f"{len(cells)} cells")
        return 0
    if not torch.cuda.is_available():
        print("dualattn bench needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              "(use --list to see the matrix without one)", file=sys.stderr)
        return 2
    if not cells:
        print("no benchmark cell matches the filters", file=sys.stderr)
        return 2
    impls = select_impls(_csv(args.impls))
    if "fa4" in peers and fa4_available() is not None:
        print(f"note: FlashAttention-4 peer unavailable: {fa4_available()}", file=sys.stderr)
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth_tbps()
    meta = {"device": dev, "capability": list(torch.cuda.get_device_capability()), "torch": torch.__version__,
            "copy_tbps": copy_bw, "impls": [i.name for i in impls], "peers": peers, "quick": args.quick,
            "dtype": args.dtype, "cold_host": args.cold_host, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"# {dev} (sm_{meta['capability'][0]}{meta['capability'][1]}), torch {torch.__version__}, {args.dtype}; "
          f"device copy {copy_bw:.2f} TB/s (read+write)")
    print(f"# dualattn: {', '.join(meta['impls']) or '-'}; peers: {', '.join(peers) or '-'}; "
          f"rates: useful TFLOP/s (bwd = 2.5x fwd FLOPs), decode TB/s of KV read; 'vs X' = X's time / this time")
    timer = Timer(warmup=args.warmup, reps=args.reps, rehearse=not args.cold_host)
    progress = Progress(len(cells) * (len(impls) + len(peers)))
    print(table_header(peers), flush=True)

    done: List[Result] = []

    def stream(r, cell_results):  # rows appear as they are measured; the JSON is kept current too,
        done.append(r)            # so a run stopped by a time limit still leaves its measurements
        print(format_row(r, peers, cell_results), flush=True)
        if args.json:
            write_json(args.json, done, meta)
    results = run_matrix(cells, impls, peers, timer, progress, on_result=stream, graph=args.graph)
    if args.json:
        write_json(args.json, results, meta)
        print(f"# wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"# wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
