"""Hypothesis strategies for dualattn calls.

A drawn :class:`Case` is a small, readable description (sizes, flags, mask recipe, seed); the
tensors are made from it by :func:`materialize`, identically on CPU and GPU. Every size strategy
shrinks toward 1 (or 0 where 0 is legal), sampled choices toward their first, simplest entry, so a
failure shrinks to a small case that Hypothesis prints.

Coverage asked of these strategies: lengths 1 and off every tile edge, GQA ratios 1..8, head dims
{32, 64, 96, 128, 192, 256} with Dv != D, fp32/fp16/bf16, causal, windows, softcap; varlen
packings with zero-length and one-token sequences (and max_seqlen larger than the longest);
key ranges (documents with boundaries off tile edges, prefix-LM, random and overlapping intervals,
rows with no visible key); block-sparse CSR built exactly from the predicate, from a dense mask,
or drawn directly (random full/mask/empty blocks, rows whose first visiting key block is not 0,
key blocks visiting nothing, all-empty and all-full rows); kv-cache with random cache_seqlens,
appended tokens and random page tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import numpy as np
import torch
from hypothesis import strategies as st

from dualattn import spec as spec_mod
from dualattn.sparse import ABSENT, FULL, MASK, BlockSparse

from . import profiles

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = ("float32", "float16", "bfloat16")
# lengths just around tile sizes that kernels use (16 .. 256): the usual place of boundary bugs
EDGE_LENGTHS = (1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 191, 255, 257, 383, 512, 513, 1023)
BLOCK_SIZES = ((16, 16), (32, 16), (16, 32), (32, 32), (64, 64), (128, 128), (128, 64), (64, 128), (112, 128),
               (176, 80), (192, 128), (128, 176))


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@dataclass(frozen=True)
class KeyRanges:
    """Recipe for a key_ranges tensor (B or 1, Hq or 1, rows, R, 2)."""
    kind: str                 # "docs" | "prefix" | "random" | "empty_rows"
    num: int = 1              # R
    per_batch: bool = False
    per_head: bool = False
    docs: Tuple[Tuple[int, ...], ...] = ()   # docs: per batch, document lengths (sum <= S)
    prefix: Tuple[int, ...] = ()             # prefix: per batch, prefix length
    p_empty: float = 0.0      # random: chance that an interval is empty
    seed: int = 0


@dataclass(frozen=True)
class Blocks:
    """Recipe for a BlockSparse."""
    kind: str                 # "exact" (from_key_ranges) | "dense" (from_dense_mask) | "drawn"
    block_m: int
    block_n: int
    per_batch: bool = False
    per_head: bool = False
    states: Tuple[int, ...] = ()  # drawn: flat (B', H', n_qblocks, n_kblocks) ABSENT/MASK/FULL


@dataclass(frozen=True)
class Cache:
    cache_seqlens: Tuple[int, ...]
    n_new: int = 0
    capacity: int = 0         # per sequence (paged: pages per sequence * page_size)
    paged: bool = False
    page_size: int = 0
    extra_pages: int = 0      # unused pages in the pool
    page_seed: int = 0        # page table = a random permutation of the pool
    num_splits: int = 0


@dataclass(frozen=True)
class Case:
    mode: str                 # "batched" | "varlen" | "kvcache"
    seqlens_q: Tuple[int, ...]  # per sequence (batched/kvcache: all equal)
    seqlens_k: Tuple[int, ...]  # per sequence (kvcache: cache_seqlens + n_new)
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    scale: Optional[float] = None
    key_ranges: Optional[KeyRanges] = None
    blocks: Optional[Blocks] = None
    cache: Optional[Cache] = None
    deterministic: bool = False
    backward: bool = False
    max_seqlen_q: int = 0     # varlen: may exceed the longest sequence
    max_seqlen_k: int = 0
    magnitude: float = 1.0    # std of q and k: large values give sharp softmax rows
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def seqlen_q(self) -> int:  # the CSR's and key ranges' query extent
        return self.max_seqlen_q if self.mode == "varlen" else (self.seqlens_q[0] if self.seqlens_q else 0)

    @property
    def seqlen_k(self) -> int:
        return self.max_seqlen_k if self.mode == "varlen" else (self.seqlens_k[0] if self.seqlens_k else 0)


# ---------------------------------------------------------------------------------------------
# basic pieces
# ---------------------------------------------------------------------------------------------

def seqlens(lo: int = 1, hi: Optional[int] = None):
    hi = profiles.current().max_seqlen if hi is None else hi
    edges = [x for x in EDGE_LENGTHS if lo <= x <= hi]
    base = st.integers(lo, hi)
    return st.one_of(base, st.sampled_from(edges)) if edges else base


def heads():
    lim = profiles.current()
    return st.tuples(st.integers(1, lim.max_heads_kv), st.integers(1, lim.max_gqa_ratio)).map(
        lambda t: (t[0] * t[1], t[0]))


@st.composite
def head_dims(draw):
    d = draw(st.sampled_from(HEAD_DIMS))
    dv = draw(st.one_of(st.just(d), st.sampled_from(HEAD_DIMS)))  # Dv != D half of the time
    return d, dv


@st.composite
def windows(draw, sk: int):
    if not draw(st.booleans()):
        return (-1, -1)
    side = st.one_of(st.just(-1), st.integers(0, max(0, sk + 2)), st.sampled_from([0, 1, 16, 63, 64, 128]))
    return (draw(side), draw(side))


def softcaps():
    return st.one_of(st.just(0.0), st.sampled_from([1.0, 5.0, 30.0, 50.0]))


def scales():
    return st.one_of(st.none(), st.sampled_from([0.05, 0.5, 1.0, 2.0]))


def magnitudes():
    return st.sampled_from([1.0, 0.1, 3.0])


# ---------------------------------------------------------------------------------------------
# key ranges
# ---------------------------------------------------------------------------------------------

@st.composite
def documents(draw, length: int):
    """Document lengths summing to at most ``length`` (a trailing gap sees nothing)."""
    out, left = [], length
    while left > 0 and len(out) < 12:
        n = draw(st.integers(0, left))
        out.append(n)
        left -= n
        if not draw(st.booleans()):
            break
    if left and draw(st.booleans()):
        out.append(left)  # usually the documents cover the sequence
    return tuple(out)


@st.composite
def key_ranges_recipes(draw, case_mode: str, batch: int, sq: int, sk: int, kinds=None):
    lim = profiles.current()
    kinds = kinds or (["random", "docs", "prefix", "empty_rows"] if case_mode == "batched" and sq == sk
                      else ["random", "prefix", "empty_rows"])
    kind = draw(st.sampled_from(kinds))
    per_batch = case_mode == "batched" and batch > 1 and draw(st.booleans())
    per_head = draw(st.booleans())
    nb = batch if per_batch else 1
    if kind == "docs":
        # documents pair query i with key i, so they cover at most min(Sq, Sk) positions; rows past
        # the last document see nothing (a caller may ask for docs with Sq != Sk: the emptying cases)
        span = min(sq, sk)
        return KeyRanges("docs", 1, per_batch, False, docs=tuple(draw(documents(span)) for _ in range(nb)))
    if kind == "prefix":
        # R=2 writes prefix-LM as two overlapping intervals [0, p) and [0, diag+1)
        return KeyRanges("prefix", draw(st.sampled_from([1, 2])), per_batch, False,
                         prefix=tuple(draw(st.integers(0, sk)) for _ in range(nb)))
    return KeyRanges(kind, draw(st.integers(1, lim.max_key_ranges)), per_batch, per_head,
                     p_empty=draw(st.sampled_from([0.0, 0.25, 0.75])), seed=draw(st.integers(0, 2 ** 16)))


def make_key_ranges(rec: KeyRanges, case: Case) -> torch.Tensor:
    """The key_ranges tensor of a recipe (CPU, int32)."""
    g = torch.Generator().manual_seed(rec.seed)
    hq = case.heads_q if rec.per_head else 1
    if case.mode == "varlen":
        rows_lens = [(sq, sk) for sq, sk in zip(case.seqlens_q, case.seqlens_k)]
        kr = torch.zeros(1, hq, sum(case.seqlens_q), rec.num, 2, dtype=torch.int32)
        off = 0
        for b, (sq, sk) in enumerate(rows_lens):
            kr[0, :, off:off + sq] = _rows(rec, b, sq, sk, hq, g)
            off += sq
        return kr
    nb = case.batch if rec.per_batch else 1
    sq, sk = case.seqlen_q, case.seqlen_k
    return torch.stack([_rows(rec, b, sq, sk, hq, g) for b in range(nb)])


def _rows(rec: KeyRanges, b: int, sq: int, sk: int, hq: int, g) -> torch.Tensor:
    """(hq, sq, R, 2) intervals of one sequence."""
    out = torch.zeros(hq, sq, rec.num, 2, dtype=torch.int32)
    i = torch.arange(sq)
    bi = b if rec.per_batch else 0
    if rec.kind == "docs":
        start = 0
        for n in rec.docs[bi]:
            out[:, start:start + n, 0, 0] = start
            out[:, start:start + n, 0, 1] = start + n
            start += n
        return out  # rows past the last document keep [0, 0): empty
    if rec.kind == "prefix":
        p = rec.prefix[bi]
        causal_hi = torch.clamp(i + sk - sq + 1, 0, sk)
        if rec.num == 1:
            out[:, :, 0, 1] = torch.maximum(causal_hi, torch.tensor(min(p, sk)))
        else:
            out[:, :, 0, 1] = min(p, sk)
            out[:, :, 1, 1] = causal_hi
        return out
    lo = torch.randint(0, sk + 1, (hq, sq, rec.num), generator=g)
    hi = lo + (torch.rand(hq, sq, rec.num, generator=g) * (sk + 1 - lo)).long()
    empty = torch.rand(hq, sq, rec.num, generator=g) < rec.p_empty
    hi = torch.where(empty, lo, torch.clamp(hi, max=sk))
    if rec.kind == "empty_rows" and sq:
        rows = torch.rand(sq, generator=g) < 0.3
        rows[int(torch.randint(0, sq, (1,), generator=g))] = True  # at least one row sees nothing
        hi = torch.where(rows[None, :, None], lo, hi)
    out[..., 0], out[..., 1] = lo.to(torch.int32), hi.to(torch.int32)
    return out


# ---------------------------------------------------------------------------------------------
# block-sparse CSR
# ---------------------------------------------------------------------------------------------

ROW_KINDS = ("random", "empty", "full", "skip_first", "last_only")


@st.composite
def block_states(draw, bp: int, hp: int, nq: int, nk: int, max_entries: int = 600):
    """Flat ABSENT/MASK/FULL states for (bp, hp, nq, nk), with special rows and columns.

    Row kinds: random; all empty; all full; first visiting key block not 0 ("skip_first");
    only the last key block ("last_only"). Some key blocks may be visited by no query block.
    """
    if bp * hp * nq * nk > max_entries:  # too many to draw one by one: a seeded pattern
        seed = draw(st.integers(0, 2 ** 16))
        probs = draw(st.sampled_from([(0.5, 0.25, 0.25), (0.2, 0.4, 0.4), (0.8, 0.1, 0.1)]))
        g = np.random.default_rng(seed)
        s = g.choice([ABSENT, MASK, FULL], size=(bp, hp, nq, nk), p=probs)
    else:
        flat = draw(st.lists(st.sampled_from([ABSENT, MASK, FULL]), min_size=bp * hp * nq * nk,
                             max_size=bp * hp * nq * nk))
        s = np.array(flat, dtype=np.int64).reshape(bp, hp, nq, nk)
    if nq and nk:
        for b in range(bp):
            for h in range(hp):
                for r in range(nq):
                    kind = draw(st.sampled_from(ROW_KINDS))
                    if kind == "empty":
                        s[b, h, r] = ABSENT
                    elif kind == "full":
                        s[b, h, r] = FULL
                    elif kind == "skip_first":
                        s[b, h, r, 0] = ABSENT
                        if nk > 1 and not (s[b, h, r, 1:] != ABSENT).any():
                            s[b, h, r, nk - 1] = draw(st.sampled_from([MASK, FULL]))
                    elif kind == "last_only":
                        s[b, h, r] = ABSENT
                        s[b, h, r, nk - 1] = draw(st.sampled_from([MASK, FULL]))
        if draw(st.booleans()):  # a key block that no query block visits
            c = draw(st.integers(0, nk - 1))
            s[..., c] = ABSENT
    return tuple(int(x) for x in s.reshape(-1))


@st.composite
def blocks_recipes(draw, case: Case, kinds=("exact", "dense", "drawn")):
    bm, bn = draw(st.sampled_from(BLOCK_SIZES))
    kind = draw(st.sampled_from(kinds))
    if kind == "dense" and case.mode != "batched":
        kind = "exact"
    if kind != "drawn":
        return Blocks(kind, bm, bn)
    per_batch = case.batch > 1 and draw(st.booleans())
    per_head = draw(st.booleans())
    bp, hp = (case.batch if per_batch else 1), (case.heads_q if per_head else 1)
    nq, nk = _cdiv(case.seqlen_q, bm), _cdiv(case.seqlen_k, bn)
    return Blocks("drawn", bm, bn, per_batch, per_head, draw(block_states(bp, hp, nq, nk)))


def _cdiv(a, b):
    return (a + b - 1) // b


def make_block_sparse(rec: Blocks, case: Case, key_ranges: Optional[torch.Tensor]) -> BlockSparse:
    sq, sk = case.seqlen_q, case.seqlen_k
    if rec.kind == "drawn":
        bp, hp = (case.batch if rec.per_batch else 1), (case.heads_q if rec.per_head else 1)
        st_ = torch.tensor(rec.states, dtype=torch.int8).reshape(bp, hp, _cdiv(sq, rec.block_m), _cdiv(sk, rec.block_n))
        return BlockSparse.from_block_states(st_, rec.block_m, rec.block_n, sq, sk)
    if case.mode == "batched":
        if rec.kind == "exact":
            return BlockSparse.from_key_ranges(key_ranges, sq, sk, rec.block_m, rec.block_n, causal=case.causal,
                                               window=case.window)
        # "dense": the element mask computed here (not by dualattn.masks), then from_dense_mask
        from .independent import element_mask
        m = torch.stack([torch.from_numpy(element_mask(case, key_ranges, b, with_blocks=None))
                         for b in range(case.batch)])
        return BlockSparse.from_dense_mask(m, rec.block_m, rec.block_n)
    # varlen, exact: per sequence (its own diagonal), padded to the max lengths
    nq, nk = _cdiv(sq, rec.block_m), _cdiv(sk, rec.block_n)
    hp = key_ranges.shape[1] if key_ranges is not None else 1
    states = torch.zeros(case.batch, hp, nq, nk, dtype=torch.int8)
    off = 0
    for b, (sqb, skb) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
        if sqb and skb:
            kr = key_ranges[:, :, off:off + sqb] if key_ranges is not None else None
            one = BlockSparse.from_key_ranges(kr, sqb, skb, rec.block_m, rec.block_n, causal=case.causal,
                                              window=case.window).block_states()
            states[b, :, :one.shape[2], :one.shape[3]] = one[0].expand(hp, -1, -1)
        off += sqb
    return BlockSparse.from_block_states(states, rec.block_m, rec.block_n, sq, sk)


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------

@st.composite
def _common(draw, sk_for_window: int, allow_softcap=True):
    hq, hkv = draw(heads())
    d, dv = draw(head_dims())
    return dict(heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=dv, dtype=draw(st.sampled_from(DTYPES)),
                causal=draw(st.booleans()), window=draw(windows(sk_for_window)),
                softcap=draw(softcaps()) if allow_softcap else 0.0, scale=draw(scales()),
                magnitude=draw(magnitudes()), seed=draw(st.integers(0, 2 ** 16)))


@st.composite
def batched_cases(draw, key_ranges=None, blocks=None, backward=None, kr_kinds=None, block_kinds=None,
                  min_seqlen=1):
    """Dense (B, S, H, D) calls. key_ranges / blocks / backward: None = draw, True/False = force."""
    lim = profiles.current()
    batch = draw(st.integers(1, lim.max_batch))
    sq = draw(seqlens(min_seqlen))
    sk = sq if draw(st.booleans()) else draw(seqlens(min_seqlen))
    case = Case("batched", (sq,) * batch, (sk,) * batch, **draw(_common(sk)))
    return draw(_masks_and_flags(case, key_ranges, blocks, backward, kr_kinds, block_kinds))


@st.composite
def _masks_and_flags(draw, case, key_ranges, blocks, backward, kr_kinds, block_kinds):
    want_kr = draw(st.booleans()) if key_ranges is None else key_ranges
    if want_kr:
        case = replace(case, key_ranges=draw(key_ranges_recipes(case.mode, case.batch, case.seqlen_q,
                                                                 case.seqlen_k, kr_kinds)))
    want_bs = draw(st.booleans()) if blocks is None else blocks
    if want_bs:
        case = replace(case, blocks=draw(blocks_recipes(case, block_kinds or ("exact", "dense", "drawn"))))
    bwd = draw(st.booleans()) if backward is None else backward
    det = draw(st.booleans())
    return replace(case, backward=bwd, deterministic=det)


@st.composite
def varlen_cases(draw, key_ranges=None, blocks=None, backward=None, kr_kinds=None, block_kinds=None):
    """Packed sequences, including zero-length and one-token ones; max_seqlen may exceed the longest."""
    lim = profiles.current()
    batch = draw(st.integers(1, lim.max_batch + 1))
    special = st.sampled_from([0, 1])
    lens = st.one_of(special, seqlens(1))
    self_attn = draw(st.booleans())
    sq = tuple(draw(lens) for _ in range(batch))
    sk = sq if self_attn else tuple(draw(lens) for _ in range(batch))
    msq = max(sq) + draw(st.sampled_from([0, 0, 1, 7]))
    msk = max(sk) + draw(st.sampled_from([0, 0, 1, 7]))
    case = Case("varlen", sq, sk, max_seqlen_q=msq, max_seqlen_k=msk, **draw(_common(max(sk))))
    return draw(_masks_and_flags(case, key_ranges, blocks, backward, kr_kinds, block_kinds))


@st.composite
def kvcache_cases(draw, n_new=None, paged=None, sq=None):
    """Decode / chunked prefill: random cache_seqlens, appended tokens, random page tables."""
    lim = profiles.current()
    batch = draw(st.integers(1, lim.max_batch))
    nq = sq if sq is not None else draw(st.one_of(st.just(1), seqlens(1, min(lim.max_seqlen, 64))))
    n_new = draw(st.one_of(st.just(0), st.just(nq), seqlens(1, 16))) if n_new is None else n_new
    paged = draw(st.booleans()) if paged is None else paged
    cs = tuple(draw(st.one_of(st.just(0), seqlens(1))) for _ in range(batch))
    need = max(cs) + n_new
    if paged:
        page_size = draw(st.sampled_from([1, 3, 4, 16, 64, 256]))
        pages = max(1, _cdiv(need, page_size)) + draw(st.integers(0, 2))
        capacity = pages * page_size
        cache = Cache(cs, n_new, capacity, True, page_size, draw(st.integers(0, 3)), draw(st.integers(0, 2 ** 16)),
                      draw(st.sampled_from([0, 1, 2, 3])))
    else:
        capacity = max(1, need + draw(st.sampled_from([0, 1, 5])))
        cache = Cache(cs, n_new, capacity, num_splits=draw(st.sampled_from([0, 1, 2, 3])))
    sk = tuple(c + n_new for c in cs)
    return Case("kvcache", (nq,) * batch, sk, cache=cache, **draw(_common(max(sk))))


def cases(modes=("batched", "varlen", "kvcache"), **kw):
    """Any call; ``kw`` goes to the batched and varlen strategies (the kv-cache takes no masks)."""
    parts = []
    if "batched" in modes:
        parts.append(batched_cases(**kw))
    if "varlen" in modes:
        parts.append(varlen_cases(**kw))
    if "kvcache" in modes:
        parts.append(kvcache_cases())
    return st.one_of(*parts)


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """Everything a call needs, as tensors on the target device."""
    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    key_ranges: Optional[torch.Tensor] = None
    block_sparse: Optional[BlockSparse] = None
    cache_seqlens: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
    k_new: Optional[torch.Tensor] = None
    v_new: Optional[torch.Tensor] = None

    def kwargs(self) -> dict:
        """Keyword arguments of the public API for this case (impl excluded)."""
        c = self.case
        kw = dict(causal=c.causal, window=c.window, softcap=c.softcap, scale=c.scale)
        if c.mode == "kvcache":
            kw.update(cache_seqlens=self.cache_seqlens, page_table=self.page_table, k_new=self.k_new,
                      v_new=self.v_new, num_splits=c.cache.num_splits)
        else:
            kw.update(key_ranges=self.key_ranges, block_sparse=self.block_sparse, deterministic=c.deterministic)
        return kw

    def positional(self) -> tuple:
        if self.case.mode == "varlen":
            c = self.case
            return (self.q, self.k, self.v, self.cu_seqlens_q, self.cu_seqlens_k, c.max_seqlen_q, c.max_seqlen_k)
        return (self.q, self.k, self.v)

    def clone_cache(self) -> "Inputs":
        return replace(self, k=self.k.clone(), v=self.v.clone())


def materialize(case: Case, device=None) -> Inputs:
    device = torch.device(device or profiles.current().device)
    g = torch.Generator().manual_seed(case.seed)
    dt = case.torch_dtype

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(dt).to(device)

    hq, hkv, d, dv, mag = case.heads_q, case.heads_kv, case.head_dim, case.head_dim_v, case.magnitude
    B = case.batch
    if case.mode == "kvcache":
        c = case.cache
        sq = case.seqlens_q[0]
        q = rnd(B, sq, hq, d, std=mag)
        if c.paged:
            per_seq = c.capacity // c.page_size
            pool = B * per_seq + c.extra_pages
            kc, vc = rnd(pool, c.page_size, hkv, d, std=mag), rnd(pool, c.page_size, hkv, dv)
            perm = torch.randperm(pool, generator=torch.Generator().manual_seed(c.page_seed))
            pt = perm[:B * per_seq].reshape(B, per_seq).to(torch.int32).to(device)
        else:
            kc, vc = rnd(B, c.capacity, hkv, d, std=mag), rnd(B, c.capacity, hkv, dv)
            pt = None
        kn = vn = None
        if c.n_new:
            kn, vn = rnd(B, c.n_new, hkv, d, std=mag), rnd(B, c.n_new, hkv, dv)
        return Inputs(case, q, kc, vc, cache_seqlens=torch.tensor(c.cache_seqlens, dtype=torch.int32, device=device),
                      page_table=pt, k_new=kn, v_new=vn)
    if case.mode == "varlen":
        tq, tk = sum(case.seqlens_q), sum(case.seqlens_k)
        q, k, v = rnd(tq, hq, d, std=mag), rnd(tk, hkv, d, std=mag), rnd(tk, hkv, dv)
        cq = torch.tensor([0] + list(np.cumsum(case.seqlens_q)), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + list(np.cumsum(case.seqlens_k)), dtype=torch.int32, device=device)
        inp = Inputs(case, q, k, v, cq, ck)
    else:
        sq, sk = case.seqlen_q, case.seqlen_k
        inp = Inputs(case, rnd(B, sq, hq, d, std=mag), rnd(B, sk, hkv, d, std=mag), rnd(B, sk, hkv, dv))
    kr = make_key_ranges(case.key_ranges, case) if case.key_ranges is not None else None
    if case.blocks is not None:
        inp.block_sparse = make_block_sparse(case.blocks, case, kr).to(device)
    inp.key_ranges = kr.to(device) if kr is not None else None
    return inp


def build_call(inp: Inputs, needs_grad: Optional[bool] = None):
    """The validated AttentionCall of ``inp`` (needs_grad defaults to the case's backward flag)."""
    c = inp.case
    kw = inp.kwargs()
    if c.mode == "kvcache":
        call = spec_mod.build_kvcache(inp.q, inp.k, inp.v, return_lse=True, **kw)
    elif c.mode == "varlen":
        call = spec_mod.build_varlen(*inp.positional(), return_lse=True, **kw)
    else:
        call = spec_mod.build_dense(inp.q, inp.k, inp.v, return_lse=True, **kw)
    grad = c.backward if needs_grad is None else needs_grad
    if grad and c.mode != "kvcache":
        call.spec = replace(call.spec, needs_grad=True)
    return call


def make_dout(call) -> torch.Tensor:
    """dO exactly as dualattn.debug.compare draws it, so a saved repro replays the same gradients."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = call.q.shape[:-1] + (call.v.shape[-1],)
    return torch.randn(shape, generator=gen).to(call.q.device, call.q.dtype)
