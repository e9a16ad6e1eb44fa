"""fast-sm120-decode (split-KV decode on mma.sync) against the torch oracle, on a GPU.

On an H100/H200 this runs the SM80-class code that sm_120 uses. Every GPU test runs under a
thread-method timeout, so a hung kernel fails instead of stalling the run. Outputs are
preallocated and NaN-poisoned, and cache slots past the live length hold NaN, so a row the kernel
forgets to write or a stale slot it reads shows up. The can_implement / dispatch tests at the
bottom run on the CPU.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dualattn import dispatch
from dualattn import spec as S
from dualattn.accuracy import check_outputs
from dualattn.spec import AttentionSpec

HAS_CUDA = torch.cuda.is_available()


def gpu_test(f):
    """GPU only (skipped with a reason elsewhere), under a timeout that also catches a hung kernel."""
    f = pytest.mark.timeout(300, method="thread")(f)
    f = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(f)
    return pytest.mark.gpu(f)


def _impl():
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120 import DECODE_IMPL
    return DECODE_IMPL


def make_call(lens, *, hq=8, hkv=2, d=128, sq=1, cap=1024, dtype=torch.bfloat16, page_size=0, n_new=0,
              causal=False, window=(-1, -1), softcap=0.0, num_splits=0, seed=0, q_scale=1.0):
    """A kv-cache call whose slots past each live length (and unused pages) hold NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = len(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    q = rnd(B, sq, hq, d) * q_scale
    extra = {}
    if page_size:
        per_seq = cap // page_size
        n_pages = B * per_seq + 3  # spare pages: never reached, full of NaN
        k = torch.full((n_pages, page_size, hkv, d), float("nan"), device="cuda", dtype=dtype)
        v = torch.full_like(k, float("nan"))
        perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))[: B * per_seq]
        table = perm.reshape(B, per_seq).to(torch.int32).cuda()
        for b, n in enumerate(lens):
            flat_k = k[table[b].long()].reshape(-1, hkv, d)
            flat_v = v[table[b].long()].reshape(-1, hkv, d)
            flat_k[:n] = rnd(n, hkv, d)
            flat_v[:n] = rnd(n, hkv, d)
            k[table[b].long()] = flat_k.reshape(per_seq, page_size, hkv, d)
            v[table[b].long()] = flat_v.reshape(per_seq, page_size, hkv, d)
        extra["page_table"] = table
    else:
        k = torch.full((B, cap, hkv, d), float("nan"), device="cuda", dtype=dtype)
        v = torch.full_like(k, float("nan"))
        for b, n in enumerate(lens):
            k[b, :n] = rnd(n, hkv, d)
            v[b, :n] = rnd(n, hkv, d)
    if n_new:
        extra["k_new"] = rnd(B, n_new, hkv, d)
        extra["v_new"] = rnd(B, n_new, hkv, d)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return S.build_kvcache(q, k, v, cache_seqlens=lens_t, causal=causal, window=window, softcap=softcap,
                           num_splits=num_splits, return_lse=True, **extra)


def _gathered_new(call, b):
    """(k, v) rows of batch b at the appended positions, read back from the cache."""
    n, m = int(call.cache_seqlens[b]), call.spec.num_new_kv
    if call.spec.paged:
        ps = call.spec.page_size
        pos = torch.arange(n, n + m, device="cuda")
        pages = call.page_table[b, pos // ps].long()
        return call.k[pages, pos % ps], call.v[pages, pos % ps]
    return call.k[b, n:n + m], call.v[b, n:n + m]


def run_and_check(call, repeat_bitwise=True, refused=None):
    """``refused``: a word the dispatcher's refusal must contain; the kernel is then driven directly."""
    impl = _impl()
    reason = impl.can_implement(call.spec)
    if refused is None:
        assert reason is None, reason
    else:
        assert reason is not None and refused in reason, reason
    sp = call.spec
    out0 = torch.full((sp.batch, sp.seqlen_q, sp.num_heads_q, sp.head_dim_v), float("nan"), device="cuda",
                      dtype=sp.dtype)
    lse0 = torch.full((sp.batch, sp.num_heads_q, sp.seqlen_q), float("nan"), device="cuda")
    call.extra.update(out=out0, lse=lse0)
    out, lse = impl.forward(call)
    torch.cuda.synchronize()
    assert out.data_ptr() == out0.data_ptr() and lse.data_ptr() == lse0.data_ptr()
    checks = check_outputs(call, out, lse)
    assert all(c.ok for c in checks), f"{sp.short()}: " + "; ".join(str(c) for c in checks)
    for b in range(sp.batch if sp.num_new_kv else 0):  # the new tokens were appended in place
        kb, vb = _gathered_new(call, b)
        assert torch.equal(kb, call.k_new[b]) and torch.equal(vb, call.v_new[b])
    if repeat_bitwise:  # the append rewrites the same slots with the same values: same result
        call.extra.update(out=torch.full_like(out0, float("nan")), lse=torch.full_like(lse0, float("nan")))
        out2, lse2 = impl.forward(call)
        torch.cuda.synchronize()
        assert torch.equal(out, out2) and torch.equal(lse, lse2), "not bitwise repeatable"
    return out, lse


ODD_LENS = [0, 1, 63, 64, 65, 17, 1000, 1024]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@gpu_test
def test_decode_odd_lengths(dtype, d):
    # lengths 0 (no key: out 0, LSE -inf), 1, block +- 1, full capacity
    run_and_check(make_call(ODD_LENS, d=d, dtype=dtype, seed=d))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (32, 8), (16, 2), (48, 4), (40, 2), (6, 1)])
@gpu_test
def test_decode_gqa_ratios(hq, hkv):
    # ratios 1, 4, 8, 12, 20 (two m16 slabs: the 32-row tile), MQA 6
    run_and_check(make_call([300, 1, 777], hq=hq, hkv=hkv, seed=hq))


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("d", [64, 128])
@gpu_test
def test_decode_paged(page_size, d):
    run_and_check(make_call([1, 255, 513, 1024, 0], d=d, page_size=page_size, dtype=torch.float16, causal=True,
                            seed=page_size))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_new", [1, 3])
@gpu_test
def test_decode_append(paged, n_new):
    # causal with n_new query tokens: token t sees the cache and new tokens 0..t
    run_and_check(make_call([0, 5, 600, 1024 - n_new], sq=n_new, n_new=n_new, hq=16, hkv=4,
                            page_size=64 if paged else 0, causal=True, seed=n_new))


@pytest.mark.parametrize("window,causal,sq", [((100, -1), True, 1), ((64, 0), False, 4), ((33, 7), True, 4),
                                              ((-1, -1), True, 5)])
@gpu_test
def test_decode_window_causal(window, causal, sq):
    run_and_check(make_call([1, 50, 130, 999], sq=sq, hq=8, hkv=2, window=window, causal=causal, seed=sq))


@pytest.mark.parametrize("d,sq,hq,hkv", [(128, 8, 32, 4), (64, 6, 16, 2)])
@gpu_test
def test_decode_several_row_tiles(d, sq, hq, hkv):
    # 64 / 48 packed rows: two 32-row tiles per KV head (the second one partial), each with its own
    # causal/window key range. can_implement refuses these until this test has passed on a GPU
    run_and_check(make_call([3, 400, 1000], d=d, sq=sq, hq=hq, hkv=hkv, causal=True, window=(200, -1),
                            page_size=64, seed=sq), refused="more than one")


@gpu_test
def test_decode_softcap():
    run_and_check(make_call([70, 1024, 3], softcap=15.0, q_scale=4.0, seed=9))


@pytest.mark.parametrize("d", [192, 256])
@gpu_test
def test_decode_large_head_dims(d):
    run_and_check(make_call([1, 129, 700], d=d, hq=8, hkv=1, page_size=32, causal=True, n_new=2, sq=2, seed=d))


@pytest.mark.parametrize("splits", [1, 3, 40])
@gpu_test
def test_decode_forced_splits(splits):
    # more splits than key blocks leaves splits with nothing: LSE -inf partials the combine skips
    run_and_check(make_call([1000, 1, 64], num_splits=splits, seed=splits))


@gpu_test
def test_decode_page_offsets_past_2_31():
    """Pages at the end of a >2**31-element paged pool: the offsets must be 64-bit."""
    ps, hkv, d, b, cap = 256, 8, 128, 2, 2048
    n_pages = (1 << 31) // (ps * hkv * d) + 2 * (cap // ps) + 1
    kc = torch.empty(n_pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    table = torch.arange(n_pages - b * (cap // ps), n_pages, device="cuda", dtype=torch.int32).reshape(b, cap // ps)
    kc[table.flatten().long()] = torch.randn(b * (cap // ps), ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc[table.flatten().long()] = torch.randn(b * (cap // ps), ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, 1, 4 * hkv, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([cap - 1, 1000], dtype=torch.int32, device="cuda")
    try:
        run_and_check(S.build_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, causal=True,
                                      return_lse=True), repeat_bitwise=False)
    finally:
        del kc, vc
        torch.cuda.empty_cache()


@pytest.mark.parametrize("paged", [False, True])
@gpu_test
def test_decode_cuda_graph(paged):
    """Capture append + split + combine once; replay with new queries, new tokens and new cache
    lengths written into the captured tensors; every replay against the oracle."""
    impl = _impl()
    cap = 2048
    call = make_call([2048 - 2, 700, 1, 1500], hq=32, hkv=8, sq=2, n_new=2, cap=cap, causal=True,
                     page_size=128 if paged else 0, seed=5)
    # graph-safe inputs: no NaN slots here, replays move the live lengths over the whole cache
    call.k.nan_to_num_(0.0)
    call.v.nan_to_num_(0.0)
    impl.forward(call)  # compile outside the capture
    torch.cuda.synchronize()
    S.set_value_checks(False)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = impl.forward(call)
        gen = torch.Generator().manual_seed(7)
        for step in range(3):
            call.q.copy_(torch.randn(call.q.shape, generator=gen).to(call.q))
            call.cache_seqlens.copy_(torch.randint(0, cap - 2 + 1, call.cache_seqlens.shape, generator=gen)
                                     .to(call.cache_seqlens))
            call.k_new.copy_(torch.randn(call.k_new.shape, generator=gen).to(call.k_new))
            call.v_new.copy_(torch.randn(call.v_new.shape, generator=gen).to(call.v_new))
            g.replay()
            torch.cuda.synchronize()
            checks = check_outputs(call, out, lse)
            assert all(c.ok for c in checks), f"replay {step}: " + "; ".join(str(c) for c in checks)
    finally:
        S.set_value_checks(True)


@gpu_test
def test_decode_compiles_once_per_key():
    """New batch sizes, lengths and head counts reuse the compiled kernel (runtime values)."""
    from dualattn.fast.sm120.decode_impl import compile_cache
    impl = _impl()
    impl.forward(make_call([10, 20], hq=8, hkv=2, seed=1))
    n = compile_cache().compiles
    for lens, hq, hkv in (([5], 4, 1), ([900, 3, 1, 2], 16, 4), ([1024] * 3, 8, 8)):
        run_and_check(make_call(lens, hq=hq, hkv=hkv, seed=len(lens)), repeat_bitwise=False)
    assert compile_cache().compiles == n


@gpu_test
def test_decode_dispatch():
    """impl="fast" serves kv-cache calls with this kernel; on sm_90 impl="auto" passes over it."""
    _impl()
    call = make_call([10, 20], seed=2)
    assert dispatch.select(call.spec, "fast").name == "fast-sm120-decode"
    auto = dispatch.select(call.spec, "auto")
    if dispatch.device_arch() == 90:
        assert auto.name != "fast-sm120-decode"
    out, lse = __import__("dualattn").attention_with_kvcache(call.q, call.k, call.v, cache_seqlens=call.cache_seqlens,
                                                             impl="fast", return_lse=True)
    torch.cuda.synchronize()
    assert all(c.ok for c in check_outputs(call, out, lse))


# ---------------------------------------------------------------------------- CPU: what it refuses

def _spec(**kw):
    base = dict(mode="kvcache", batch=2, seqlen_q=1, seqlen_k=1024, num_heads_q=8, num_heads_kv=2, head_dim=128,
                head_dim_v=128, dtype=torch.bfloat16, device_type="cuda")
    base.update(kw)
    return AttentionSpec(**base)


@pytest.mark.parametrize("kw,words", [
    (dict(mode="batched"), "kv-cache"),
    (dict(needs_grad=True), "backward"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(head_dim=96, head_dim_v=96), "head dim 96"),
    (dict(head_dim_v=64), "head_dim_v"),
    (dict(paged=True, page_size=8), "page size 8"),
])
def test_can_implement_refuses(kw, words):
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.decode import FlashDecodeSm80
    reason = FlashDecodeSm80.can_implement(_spec(**kw))
    assert reason is not None and words in reason, reason


@pytest.mark.parametrize("kw", [dict(), dict(paged=True, page_size=16), dict(head_dim=64, head_dim_v=64),
                                dict(head_dim=256, head_dim_v=256, causal=True, window=(10, -1), softcap=5.0),
                                dict(seqlen_q=4, num_heads_q=40, num_heads_kv=2, dtype=torch.float16)])
def test_can_implement_accepts(kw):
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.decode import FlashDecodeSm80
    assert FlashDecodeSm80.can_implement(_spec(**kw)) is None


def test_auto_skip_on_sm90_only(monkeypatch):
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.decode_impl import FastSm120Decode
    for arch, skipped in ((90, True), (120, False), (80, False)):
        monkeypatch.setattr(dispatch, "device_arch", lambda index=0, a=arch: a)
        assert (FastSm120Decode().auto_skip(_spec()) is not None) == skipped


def test_num_splits_choice():
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.decode import decode_config
    from dualattn.fast.sm120.decode_impl import choose_num_splits
    cfg = decode_config(128, 4)
    h100 = (132, 228 * 1024)
    # forced splits win; a short cache gets one split (>= 4 key blocks per split)
    assert choose_num_splits(_spec(num_splits=7), cfg, *h100) == 7
    assert choose_num_splits(_spec(seqlen_k=128), cfg, *h100) == 1
    # GQA 32/8: the split counts measured fastest on the H100 (see choose_num_splits)
    big = dict(num_heads_q=32, num_heads_kv=8)
    assert choose_num_splits(_spec(batch=8, seqlen_k=32768, **big), cfg, *h100) == 4
    assert choose_num_splits(_spec(batch=8, seqlen_k=8192, **big), cfg, *h100) == 4
    assert choose_num_splits(_spec(batch=64, seqlen_k=8192, **big), cfg, *h100) == 2
    # sm_120 (99 KB per SM): one CTA per SM; 170 SMs, b8: 64 pairs x 3 splits = 192 > 170 slots ...
    s = choose_num_splits(_spec(batch=8, seqlen_k=32768, **big), cfg, 170, 100 * 1024)
    assert 64 * s / (-(-64 * s // 170) * 170) >= 0.9


def test_impl_refuses_more_than_one_row_tile():
    """Over 32 packed rows per KV head the kernel needs several row tiles, a path not yet run on a
    GPU: the registered implementation refuses it (Triton serves it) while one tile is served."""
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.decode_impl import FastSm120Decode
    impl = FastSm120Decode()
    many = impl.can_implement(_spec(seqlen_q=5, num_heads_q=16, num_heads_kv=2))  # 40 rows
    assert many is not None and "more than one" in many
    one = impl.can_implement(_spec(seqlen_q=4, num_heads_q=16, num_heads_kv=2))   # 32 rows
    assert one is None or "more than one" not in one


def test_q_views_spanning_2_31_elements_are_copied():
    # the kernel's q offsets are 32-bit: the last token of each long prompt (a view of a tensor of
    # 32 x 32768 x 32 x 128 elements) spans 2**32 elements although q has 32 x 1 x 32 x 128
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.decode_impl import q_needs_copy
    q_full = torch.empty(32, 32768, 32, 128, dtype=torch.bfloat16, device="meta")
    assert q_needs_copy(q_full[:, -1:])
    assert not q_needs_copy(q_full[:, -1:].contiguous())
    assert not q_needs_copy(torch.empty(8, 1, 32, 128, device="meta"))
    assert q_needs_copy(torch.empty(8, 1, 128, 32, device="meta").transpose(-1, -2))  # last stride != 1
