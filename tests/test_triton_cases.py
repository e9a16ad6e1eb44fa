"""Case catalogue for the Triton kernel tests (no tests here; imported by test_triton*.py).

Every case builds a validated call at a small size (CPU, Triton interpreter) or a realistic one
(GPU). Small sizes stay tiny on purpose: the interpreter runs every program in Python.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from dualattn import spec as S
from dualattn.masks import segments_to_key_ranges
from dualattn.sparse import MASK, FULL, BlockSparse


@dataclass
class TCase:
    name: str
    make: Callable  # (gen, device, dtype, large) -> AttentionCall
    backward: bool = True


def _rand(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _scale(large, small_val, large_val):
    return large_val if large else small_val


def dense(sq, sk, hq=2, hkv=1, d=64, dv=None, b=1, big=None, kr=None, bs=None, **kw):
    """big: (sq, sk, hq, hkv) at GPU size; default 2k x 2k, 16 heads, same GQA ratio."""
    def make(gen, device, dtype, large):
        if large:
            s_q, s_k, h_q, h_kv = big or (2048, 2048, 16, 16 * hkv // hq)
            bb = 2
        else:
            s_q, s_k, h_q, h_kv, bb = sq, sk, hq, hkv, b
        q = _rand(gen, (bb, s_q, h_q, d), dtype, device)
        k = _rand(gen, (bb, s_k, h_kv, d), dtype, device)
        v = _rand(gen, (bb, s_k, h_kv, dv or d), dtype, device)
        key_ranges = kr(gen, device, bb, s_q, s_k, h_q) if kr else None
        block_sparse = bs(gen, device, bb, s_q, s_k, h_q, key_ranges, kw) if bs else None
        return S.build_dense(q, k, v, key_ranges=key_ranges, block_sparse=block_sparse, return_lse=True, **kw)
    return make


def docs_kr(gen, device, b, sq, sk, hq):
    # three documents, boundaries off tile edges, causal inside each (sq == sk)
    cuts = [sq * 3 // 10 + 1, sq * 4 // 10 + 3]
    return segments_to_key_ranges([[cuts[0], cuts[1], sq - sum(cuts)]] * b, sq, causal=True, device=device)


def random_kr(gen, device, b, sq, sk, hq):
    # two ranges per row, per head; row 0 sees nothing (an empty row)
    lo = torch.randint(0, sk + 1, (b, hq, sq, 2, 1), generator=gen)
    ln = torch.randint(0, max(2, sk // 2), (b, hq, sq, 2, 1), generator=gen)
    kr = torch.cat([lo, torch.clamp(lo + ln, max=sk)], -1).to(torch.int32)
    kr[:, :, 0] = 0
    return kr.to(device)


def bs_exact(block_m, block_n):
    """The exact CSR of the call's predicate (key ranges, causal, window)."""
    def make(gen, device, b, sq, sk, hq, key_ranges, kw):
        return BlockSparse.from_key_ranges(key_ranges, sq, sk, block_m, block_n, causal=kw.get("causal", False),
                                           window=kw.get("window", (-1, -1))).to(device)
    return make


def bs_random(block_m, block_n, per_head=True):
    """Random ABSENT / MASK / FULL states (full blocks: the caller's promise, the predicate is
    skipped there), per head or broadcast over heads."""
    def make(gen, device, b, sq, sk, hq, key_ranges, kw):
        nq, nk = -(-sq // block_m), -(-sk // block_n)
        st = torch.randint(0, 3, (b, hq if per_head else 1, nq, nk), generator=gen).to(torch.int8)
        return BlockSparse.from_block_states(st, block_m, block_n, sq, sk).to(device)
    return make


def varlen(lq, lk, hq=2, hkv=1, d=64, kr=None, bs=None, **kw):
    def make(gen, device, dtype, large):
        lens_q = [x * 16 for x in lq] if large else lq
        lens_k = [x * 16 for x in lk] if large else lk
        h_q, h_kv = (16, 16 * hkv // hq) if large else (hq, hkv)
        q = _rand(gen, (sum(lens_q), h_q, d), dtype, device)
        k = _rand(gen, (sum(lens_k), h_kv, d), dtype, device)
        v = _rand(gen, (sum(lens_k), h_kv, d), dtype, device)
        cq = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
        extra = {}
        if kr is not None:
            extra["key_ranges"] = kr(gen, device, lens_q, lens_k, h_q)
        if bs is not None:
            extra["block_sparse"] = bs(gen, device, len(lens_q), max(lens_q), max(lens_k), h_q, None, kw)
        return S.build_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), return_lse=True, **extra, **kw)
    return make


def varlen_prefix_kr(gen, device, lens_q, lens_k, hq):
    # prefix-LM per sequence: row i sees keys [0, max(i + 1, len_k // 3)), local indices
    rows = []
    for nq, nk in zip(lens_q, lens_k):
        i = torch.arange(nq)
        hi = torch.clamp(torch.maximum(i + 1, torch.tensor(nk // 3)), max=nk)
        rows.append(torch.stack([torch.zeros_like(hi), hi], -1))
    kr = torch.cat(rows, 0).to(torch.int32).reshape(1, 1, -1, 1, 2)
    return kr.to(device)


def kvcache(b=3, sq=1, hq=4, hkv=2, d=64, cap=96, ps=0, n_new=0, splits=0, lens=None, **kw):
    def make(gen, device, dtype, large):
        bb, s_q, h_q, h_kv, c, p = (8, sq, 32, 8, 8192, ps and 256) if large else (b, sq, hq, hkv, cap, ps)
        q = _rand(gen, (bb, s_q, h_q, d), dtype, device)
        ls = torch.randint(0, c - n_new + 1, (bb,), generator=gen).to(torch.int32)
        ls[0] = c - n_new  # one full cache
        if lens is not None and not large:
            ls = torch.tensor(lens, dtype=torch.int32)
        extra = {}
        if p:
            n_pages = bb * c // p + 2
            kc = _rand(gen, (n_pages, p, h_kv, d), dtype, device)
            vc = _rand(gen, (n_pages, p, h_kv, d), dtype, device)
            extra["page_table"] = torch.randperm(n_pages, generator=gen)[: bb * (c // p)].reshape(bb, c // p).to(
                torch.int32).to(device)
        else:
            kc = _rand(gen, (bb, c, h_kv, d), dtype, device)
            vc = _rand(gen, (bb, c, h_kv, d), dtype, device)
        if n_new:
            extra["k_new"] = _rand(gen, (bb, n_new, h_kv, d), dtype, device)
            extra["v_new"] = _rand(gen, (bb, n_new, h_kv, d), dtype, device)
        return S.build_kvcache(q, kc, vc, cache_seqlens=ls.to(device), num_splits=splits, return_lse=True,
                               **extra, **kw)
    return make


CASES = [
    TCase("dense 64x64", dense(64, 64, hq=2, hkv=2)),
    TCase("odd 113x203 gqa", dense(113, 203)),
    TCase("seqlen 1", dense(1, 1)),
    TCase("1x37 causal", dense(1, 37, causal=True)),
    TCase("239x1", dense(239, 1, hq=1, hkv=1, big=(4001, 1, 16, 16))),
    TCase("239x1 causal (empty rows)", dense(239, 1, hq=1, hkv=1, causal=True, big=(4001, 1, 16, 16))),
    TCase("causal sq<sk", dense(70, 130, causal=True, big=(1000, 3000, 16, 8))),
    TCase("causal sq>sk (empty rows)", dense(150, 90, causal=True, big=(3000, 1000, 16, 8))),
    TCase("window (16,8)", dense(100, 100, window=(16, 8))),
    TCase("causal+window (20,-1)", dense(97, 97, causal=True, window=(20, -1))),
    TCase("window right only (-1,5)", dense(60, 90, window=(-1, 5))),
    TCase("softcap 5 causal", dense(80, 80, causal=True, softcap=5.0)),
    TCase("gqa 4:1", dense(48, 80, hq=4, hkv=1, big=(2048, 2048, 32, 8))),
    TCase("mqa", dense(40, 40, hq=3, hkv=1, big=(2048, 2048, 16, 1))),
    TCase("hd 32", dense(50, 70, d=32)),
    TCase("hd 72", dense(33, 47, d=72)),
    TCase("hd 128", dense(40, 56, d=128)),
    TCase("hd 256", dense(33, 41, d=256, hq=1, hkv=1)),
    TCase("dv!=d 192/128 causal", dense(40, 56, d=192, dv=128, hq=1, hkv=1, causal=True)),
    TCase("key ranges: documents", dense(120, 120, kr=docs_kr, big=(2048, 2048, 16, 16))),
    TCase("key ranges: random + empty rows", dense(50, 70, kr=random_kr, big=(1024, 1024, 8, 8))),
    TCase("key ranges + causal + window", dense(90, 90, kr=docs_kr, causal=True, window=(30, -1))),
    TCase("block sparse: documents (64,64)", dense(120, 120, kr=docs_kr, bs=bs_exact(64, 64), big=(2048, 2048, 16, 16))),
    TCase("block sparse: causal (32,64)", dense(100, 130, causal=True, bs=bs_exact(32, 64), big=(2000, 3000, 16, 16))),
    TCase("block sparse: random per head (32,32)", dense(70, 90, hq=2, hkv=1, bs=bs_random(32, 32),
                                                          big=(1024, 1024, 8, 4))),
    TCase("block sparse: random + window (64,32)", dense(90, 75, window=(20, 20), bs=bs_random(64, 32, False),
                                                          big=(1024, 1024, 8, 8))),
    TCase("varlen", varlen([37, 0, 1, 50], [40, 5, 1, 33])),
    TCase("varlen causal gqa", varlen([30, 17, 45], [30, 40, 45], hq=4, hkv=2, causal=True)),
    TCase("varlen window softcap", varlen([33, 20], [41, 20], window=(8, 4), softcap=3.0)),
    TCase("varlen key ranges (prefix-LM)", varlen([40, 25], [40, 30], kr=varlen_prefix_kr)),
    TCase("varlen block sparse causal", varlen([40, 64], [40, 64], causal=True, bs=bs_exact(32, 32))),
    TCase("kvcache decode gqa", kvcache(), backward=False),
    TCase("kvcache empty + full caches", kvcache(b=2, lens=[0, 96], splits=3), backward=False),
    TCase("kvcache paged + append causal", kvcache(ps=32, n_new=3, sq=3, causal=True), backward=False),
    TCase("kvcache window softcap splits", kvcache(ps=16, n_new=1, window=(40, -1), softcap=4.0, splits=4),
          backward=False),
    TCase("kvcache hd 128, mqa", kvcache(hq=4, hkv=1, d=128, cap=64), backward=False),
]

# the subset that also runs in fp32 under the interpreter (fp16 runs all)
FP32_CASES = {"odd 113x203 gqa", "239x1 causal (empty rows)", "causal sq>sk (empty rows)", "window (16,8)",
              "softcap 5 causal", "hd 256", "key ranges: random + empty rows", "block sparse: random per head (32,32)",
              "varlen causal gqa", "kvcache paged + append causal"}


def make_call(case: TCase, device, dtype, large: bool, seed: int = 0, backward: bool = True):
    gen = torch.Generator().manual_seed(seed)
    call = case.make(gen, device, dtype, large)
    if backward and case.backward:
        call.spec = replace(call.spec, needs_grad=True)
    return call


def clone_call(call):
    """A copy whose kv cache the oracle may read (the kernel appends into the original)."""
    if call.spec.mode != "kvcache":
        return call
    return call.with_tensors(k=call.k.clone(), v=call.v.clone())


__all__ = ["TCase", "CASES", "FP32_CASES", "make_call", "clone_call", "MASK", "FULL"]
