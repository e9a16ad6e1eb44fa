"""A catalogue of named attention calls covering every variant, used by ``python -m dualattn check``.

Each case builds a validated AttentionCall from fresh random inputs at one of two sizes: "small"
(CPU: the oracle and the Triton interpreter are slow) or "large" (GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List

import torch

from . import spec as S
from .masks import segments_to_key_ranges
from .sparse import BlockSparse


@dataclass
class Case:
    name: str
    make: Callable  # (gen, device, dtype, large) -> AttentionCall
    backward: bool = True


def _rand(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _qkv(gen, device, dtype, b, sq, sk, hq, hkv, d, dv=None):
    return (_rand(gen, (b, sq, hq, d), dtype, device), _rand(gen, (b, sk, hkv, d), dtype, device),
            _rand(gen, (b, sk, hkv, dv or d), dtype, device))


def _dense(sq, sk, hq=4, hkv=4, d=64, dv=None, b=2, big=(2048, 2048, 16, 16, 128), **kw):
    def make(gen, device, dtype, large):
        if large:
            bb, s_q, s_k, h_q, h_kv = 2, big[0], big[1], big[2], big[2] * hkv // hq
            dd = 128 if d == 64 else d
            ddv = dd if dv is None else dv
        else:
            bb, s_q, s_k, h_q, h_kv, dd, ddv = b, sq, sk, hq, hkv, d, dv or d
        q, k, v = _qkv(gen, device, dtype, bb, s_q, s_k, h_q, h_kv, dd, ddv)
        extra = {key: (f(gen, device, bb, s_q, s_k, h_q) if callable(f) else f) for key, f in kw.items()}
        return S.build_dense(q, k, v, return_lse=True, **extra)
    return make


def _docs_key_ranges(gen, device, b, sq, sk, hq):
    # three documents with boundaries off tile edges, causal inside each
    cuts = [sq * 3 // 10 + 1, sq * 4 // 10 + 3]
    lengths = [cuts[0], cuts[1], sq - cuts[0] - cuts[1]]
    return segments_to_key_ranges([lengths] * b, sq, causal=True, device=device)


def _docs_block_sparse(gen, device, b, sq, sk, hq):
    kr = _docs_key_ranges(gen, device, b, sq, sk, hq)
    return BlockSparse.from_key_ranges(kr, sq, sk, 64, 64)


def _random_key_ranges(gen, device, b, sq, sk, hq):
    lo = torch.randint(0, sk + 1, (b, hq, sq, 2, 1), generator=gen)
    ln = torch.randint(0, max(2, sk // 2), (b, hq, sq, 2, 1), generator=gen)
    kr = torch.cat([lo, torch.clamp(lo + ln, max=sk)], -1).to(torch.int32)
    kr[:, :, 0] = 0  # first query row of each head sees nothing: an empty row
    return kr.to(device)


def _varlen(lengths_q, lengths_k, hq=4, hkv=2, d=64, **kw):
    def make(gen, device, dtype, large):
        lq, lk = (lengths_q, lengths_k) if not large else ([x * 16 for x in lengths_q], [x * 16 for x in lengths_k])
        h_q, h_kv, dd = (hq, hkv, d) if not large else (16, 16 * hkv // hq, 128)
        q = _rand(gen, (sum(lq), h_q, dd), dtype, device)
        k = _rand(gen, (sum(lk), h_kv, dd), dtype, device)
        v = _rand(gen, (sum(lk), h_kv, dd), dtype, device)
        cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32, device=device)
        return S.build_varlen(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **kw)
    return make


def _kvcache(paged: bool, n_new: int, **kw):
    def make(gen, device, dtype, large):
        b, hq, hkv, d = (3, 8, 2, 64) if not large else (8, 32, 8, 128)
        cap, ps = (256, 64) if not large else (8192, 256)
        q = _rand(gen, (b, 1 if not n_new else n_new, hq, d), dtype, device)
        lens = torch.randint(0, cap - n_new + 1, (b,), generator=gen).to(torch.int32)
        lens[0] = cap - n_new  # one full cache
        if paged:
            n_pages = b * cap // ps
            k = _rand(gen, (n_pages, ps, hkv, d), dtype, device)
            v = _rand(gen, (n_pages, ps, hkv, d), dtype, device)
            table = torch.randperm(n_pages, generator=gen)[: b * (cap // ps)].reshape(b, cap // ps).to(torch.int32)
            extra = dict(page_table=table.to(device))
        else:
            k = _rand(gen, (b, cap, hkv, d), dtype, device)
            v = _rand(gen, (b, cap, hkv, d), dtype, device)
            extra = {}
        if n_new:
            extra["k_new"] = _rand(gen, (b, n_new, hkv, d), dtype, device)
            extra["v_new"] = _rand(gen, (b, n_new, hkv, d), dtype, device)
        return S.build_kvcache(q, k, v, cache_seqlens=lens.to(device), return_lse=True, **extra, **kw)
    return make


CASES: List[Case] = [
    Case("dense", _dense(128, 128)),
    Case("dense odd 113x203", _dense(113, 203)),
    Case("seqlen 1", _dense(1, 1)),
    Case("239x1", _dense(239, 1)),
    Case("gqa 4:1", _dense(96, 160, hq=8, hkv=2)),
    Case("mqa", _dense(64, 64, hq=4, hkv=1)),
    # short query blocks of a GQA group: fast-sm90 packs the group's heads into one tile
    Case("gqa 4:1 short queries", _dense(24, 300, hq=8, hkv=2, big=(48, 4096, 32))),
    Case("gqa 8:1 short queries, causal", _dense(9, 200, hq=8, hkv=1, causal=True, big=(33, 2048, 32))),
    Case("causal sq<sk", _dense(70, 130, causal=True)),
    # a prompt's chunk against its context: on a GPU few tiles, which fast-sm90 cuts along the keys
    Case("chunk 128 vs 16k keys, causal", _dense(40, 150, hq=8, hkv=2, causal=True, big=(128, 16384, 32))),
    Case("causal sq>sk (empty rows)", _dense(150, 90, causal=True)),
    Case("window (32,8)", _dense(160, 160, window=(32, 8))),
    Case("causal+window 16", _dense(129, 129, causal=True, window=(16, -1))),
    Case("softcap 20", _dense(96, 96, softcap=20.0)),
    Case("hd 128", _dense(64, 80, d=128)),
    Case("hd 256", _dense(40, 56, d=256, b=1, hq=2, hkv=2)),
    Case("dv!=d 192/128", _dense(48, 72, d=192, dv=128, b=1, hq=2, hkv=2)),
    Case("key ranges: documents", _dense(200, 200, key_ranges=_docs_key_ranges)),
    Case("key ranges: random + empty rows", _dense(90, 110, key_ranges=_random_key_ranges)),
    Case("block sparse: documents", _dense(200, 200, key_ranges=_docs_key_ranges, block_sparse=_docs_block_sparse)),
    Case("varlen", _varlen([37, 0, 1, 80], [50, 5, 1, 64])),
    Case("varlen causal", _varlen([64, 17, 100], [64, 30, 100], causal=True)),
    Case("kvcache decode", _kvcache(False, 0), backward=False),
    Case("kvcache paged + append", _kvcache(True, 3, causal=True), backward=False),
]


def make_call(case: Case, device, dtype, large: bool, seed: int = 0, backward: bool = False):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    call = case.make(gen, device, dtype, large)
    if backward and case.backward:
        call.spec = replace(call.spec, needs_grad=True)
    return call
