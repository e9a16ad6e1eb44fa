"""dualattn.compat against FlashAttention's semantics, argument by argument.

The expected values come from a naive attention written here from FlashAttention's documented
semantics (bottom-right causal, windows from the same diagonal, softcap, scale, GQA), in float64,
independent of dualattn's oracle; outputs are compared in fp32 under dualattn's accuracy rule's
spirit (fp32 inputs: tight tolerance).
"""
import math

import pytest
import torch

import dualattn
from dualattn import compat
from dualattn.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

TOL = dict(rtol=2e-5, atol=2e-5)


def naive(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, sq_used=None, sk_used=None):
    """One sequence: q (Sq, Hq, D), k/v (Sk, Hkv, D) -> out (Sq, Hq, Dv) float64, lse (Hq, Sq)."""
    q, k, v = q.double(), k.double(), v.double()
    Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[:2]
    sq = Sq if sq_used is None else sq_used
    sk = Sk if sk_used is None else sk_used
    g = Hq // Hkv
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq)[:, None]
    j = torch.arange(Sk)[None, :]
    diag = i + sk - sq
    vis = (j < sk) & (i < sq)
    if causal:
        vis &= j <= diag
    if window[0] is not None and window[0] >= 0:
        vis &= j >= diag - window[0]
    if window[1] is not None and window[1] >= 0:
        vis &= j <= diag + window[1]
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, lse


def rand(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def batched_naive(q, k, v, **kw):
    outs, lses = zip(*(naive(q[b], k[b], v[b], **kw) for b in range(q.shape[0])))
    return torch.stack(outs), torch.stack(lses)


# ------------------------------------------------------------------------------------------------
# flash_attn_func
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(softmax_scale=0.2),
    dict(window_size=(3, 1)),
    dict(window_size=(None, 2)),             # FA4 spelling of unbounded
    dict(window_size=(4, -1), causal=True),
    dict(softcap=3.0, causal=True),
    dict(deterministic=True, causal=True),
])
def test_flash_attn_func_args(kw):
    q, k, v = rand(2, 9, 4, 16, seed=1), rand(2, 13, 2, 16, seed=2), rand(2, 13, 2, 16, seed=3)  # Sq != Sk, GQA
    out = flash_attn_func(q, k, v, impl="torch", **kw)
    want, _ = batched_naive(q, k, v, scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                            window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0))
    assert out.shape == (2, 9, 4, 16) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), want, **TOL)


def test_flash_attn_func_positional_order_is_fa2():
    q, k, v = rand(1, 6, 2, 8, seed=4), rand(1, 6, 2, 8, seed=5), rand(1, 6, 2, 8, seed=6)
    # (q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    out, lse, probs = flash_attn_func(q, k, v, 0.0, 0.5, True, (2, 0), 0.0, None, False, True, impl="torch")
    want, want_lse = batched_naive(q, k, v, scale=0.5, causal=True, window=(2, 0))
    torch.testing.assert_close(out.double(), want, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)
    assert probs is None


def test_return_conventions():
    q, k, v = rand(2, 5, 2, 8), rand(2, 7, 2, 8, seed=1), rand(2, 7, 2, 8, seed=2)
    out = flash_attn_func(q, k, v, causal=True, impl="torch")
    assert isinstance(out, torch.Tensor)
    o2, lse, p = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, impl="torch")
    o3, lse3 = flash_attn_func(q, k, v, causal=True, return_lse=True, impl="torch")  # FA4 convention
    assert p is None and lse.shape == (2, 2, 5) and lse.dtype == torch.float32
    torch.testing.assert_close(o2, out, rtol=0, atol=0)
    torch.testing.assert_close(lse3, lse, rtol=0, atol=0)
    _, want_lse = batched_naive(q, k, v, causal=True)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)


def test_empty_rows_lse_minus_inf():
    # Sq > Sk with causal bottom-right: the first Sq - Sk rows see no key -> out 0, lse -inf
    q, k, v = rand(1, 6, 2, 8), rand(1, 3, 2, 8, seed=1), rand(1, 3, 2, 8, seed=2)
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True, impl="torch")
    assert torch.all(out[0, :3] == 0) and torch.all(torch.isneginf(lse[0, :, :3]))
    assert torch.isfinite(lse[0, :, 3:]).all()


def test_gradients_match_naive():
    q, k, v = rand(1, 8, 4, 8, grad=True), rand(1, 8, 2, 8, seed=1, grad=True), rand(1, 8, 2, 8, seed=2, grad=True)
    out = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=2.0, impl="torch")
    dout = rand(*out.shape, seed=9)
    got = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want_out, _ = naive(qd[0], kd[0], vd[0], causal=True, window=(3, 0), softcap=2.0)
    want = torch.autograd.grad(want_out, (qd, kd, vd), dout[0].double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, **TOL)


def test_packed_variants():
    qkv = rand(2, 6, 3, 2, 8)
    out = compat.flash_attn_qkvpacked_func(qkv, causal=True, impl="torch")
    torch.testing.assert_close(out, flash_attn_func(*qkv.unbind(2), causal=True, impl="torch"), rtol=0, atol=0)
    q, kv = rand(2, 4, 4, 8), rand(2, 6, 2, 2, 8, seed=1)
    out = compat.flash_attn_kvpacked_func(q, kv, impl="torch")
    torch.testing.assert_close(out, flash_attn_func(q, *kv.unbind(2), impl="torch"), rtol=0, atol=0)


@pytest.mark.parametrize("kw, match", [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
    (dict(qv=torch.ones(1)), "qv"),
    (dict(q_descale=torch.ones(1)), "q_descale"),
    (dict(attention_chunk=4), "attention_chunk"),
    (dict(learnable_sink=torch.ones(2)), "learnable_sink"),
    (dict(mask_mod=lambda *a: True), "mask_mod"),
])
def test_unsupported_features_raise(kw, match):
    q = rand(1, 4, 2, 8)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_func(q, q, q, impl="torch", **kw)


def test_bad_input_errors_come_from_the_spec():
    q, k = rand(1, 4, 3, 8), rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        flash_attn_func(q, k, k, impl="torch")
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(k, k, k, window_size=(-3, 0), impl="torch")
    with pytest.raises(TypeError, match="unexpected keyword"):
        flash_attn_func(k, k, k, bogus=1)


# ------------------------------------------------------------------------------------------------
# flash_attn_varlen_func
# ------------------------------------------------------------------------------------------------

LQ, LK = [3, 9, 5], [7, 9, 2]


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def _varlen_naive(q, k, v, lq, lk, used_q=None, used_k=None, **kw):
    outs, lses = [], []
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for b in range(len(lq)):
        o, l = naive(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                     sq_used=None if used_q is None else used_q[b], sk_used=None if used_k is None else used_k[b], **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses, 1)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(2, 1), softcap=1.5),
                                dict(causal=True, softmax_scale=0.7)])
def test_varlen_args(kw):
    q, k, v = rand(sum(LQ), 4, 8, seed=1), rand(sum(LK), 2, 8, seed=2), rand(sum(LK), 2, 8, seed=3)
    out, lse, _ = flash_attn_varlen_func(q, k, v, _cu(LQ), _cu(LK), max(LQ), max(LK), return_attn_probs=True,
                                         impl="torch", **kw)
    want, want_lse = _varlen_naive(q, k, v, LQ, LK, scale=kw.get("softmax_scale"), causal=kw.get("causal", False),
                                   window=kw.get("window_size", (-1, -1)), softcap=kw.get("softcap", 0.0))
    assert lse.shape == (4, sum(LQ))  # FA2 >= 2.4 varlen LSE layout (H, total_q)
    torch.testing.assert_close(out.double(), want, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)


@pytest.mark.parametrize("name", ["block_table", "page_table"])
def test_varlen_paged_kv(name):
    ps, lk = 4, [7, 9, 2]
    k, v = rand(sum(lk), 2, 8, seed=2), rand(sum(lk), 2, 8, seed=3)
    q = rand(sum(LQ), 2, 8, seed=1)
    # scatter the packed keys into pages in a shuffled order
    n_pages = 12
    kc, vc = torch.zeros(n_pages, ps, 2, 8), torch.zeros(n_pages, ps, 2, 8)
    perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(0))
    table = torch.zeros(3, 3, dtype=torch.int32)
    cu = _cu(lk).tolist()
    nxt = 0
    for b in range(3):
        for p in range((lk[b] + ps - 1) // ps):
            page = int(perm[nxt]); nxt += 1
            table[b, p] = page
            seg = slice(cu[b] + p * ps, min(cu[b + 1], cu[b] + (p + 1) * ps))
            n = seg.stop - seg.start
            kc[page, :n], vc[page, :n] = k[seg], v[seg]
    out = flash_attn_varlen_func(q, kc, vc, _cu(LQ), _cu(lk), max(LQ), max(lk), causal=True, impl="torch",
                                 **{name: table})
    want, _ = _varlen_naive(q, k, v, LQ, lk, causal=True)
    torch.testing.assert_close(out.double(), want, **TOL)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (2, 0)), (False, (1, 1))])
def test_varlen_seqused(causal, window):
    q, k, v = rand(sum(LQ), 2, 8, seed=1), rand(sum(LK), 2, 8, seed=2), rand(sum(LK), 2, 8, seed=3)
    used_q, used_k = [3, 6, 4], [5, 9, 0]
    out, lse = flash_attn_varlen_func(q, k, v, _cu(LQ), _cu(LK), max(LQ), max(LK), causal=causal,
                                      window_size=window, seqused_q=torch.tensor(used_q, dtype=torch.int32),
                                      seqused_k=torch.tensor(used_k, dtype=torch.int32), return_lse=True,
                                      impl="torch")
    want, want_lse = _varlen_naive(q, k, v, LQ, LK, used_q, used_k, causal=causal, window=window)
    torch.testing.assert_close(out.double(), want, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)


def test_varlen_unsupported_and_bad():
    q = rand(6, 2, 8)
    cu = _cu([2, 4])
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, 0.5)
    with pytest.raises(TypeError, match="seqused_k"):
        flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, seqused_k=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        flash_attn_varlen_func(q, q, q, torch.tensor([0, 4, 2], dtype=torch.int32), cu, 4, 4, impl="torch")


# ------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ------------------------------------------------------------------------------------------------

def test_kvcache_decode_int_and_tensor_seqlens():
    B, cap = 2, 16
    kc, vc = rand(B, cap, 2, 8, seed=1), rand(B, cap, 2, 8, seed=2)
    q = rand(B, 1, 4, 8, seed=3)
    o_int = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=10, causal=True, impl="torch")
    lens = torch.tensor([10, 10], dtype=torch.int32)
    o_t, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, return_softmax_lse=True,
                                       impl="torch")
    torch.testing.assert_close(o_int, o_t, rtol=0, atol=0)
    want, want_lse = batched_naive(q, kc[:, :10], vc[:, :10], causal=True)
    torch.testing.assert_close(o_t.double(), want, **TOL)
    torch.testing.assert_close(lse.double(), want_lse, **TOL)
    # cache_seqlens=None: the whole cache
    o_all = flash_attn_with_kvcache(q, kc, vc, impl="torch")
    torch.testing.assert_close(o_all.double(), batched_naive(q, kc, vc)[0], **TOL)


def test_kvcache_append_and_paged():
    B, ps, n_pages = 2, 4, 8
    lens = torch.tensor([5, 2], dtype=torch.int32)
    kp, vp = rand(n_pages, ps, 2, 8, seed=1), rand(n_pages, ps, 2, 8, seed=2)
    table = torch.tensor([[3, 0, 6], [7, 1, 2]], dtype=torch.int32)
    kn, vn = rand(B, 3, 2, 8, seed=4), rand(B, 3, 2, 8, seed=5)
    q = rand(B, 3, 4, 8, seed=3)
    # expected: contiguous view of each sequence's cache + the new tokens, causal bottom-right
    def seq(cache, b):
        return cache[table[b].long()].reshape(-1, 2, 8)
    want = []
    for b in range(B):
        n = int(lens[b])
        kk = torch.cat([seq(kp, b)[:n], kn[b]])
        vv = torch.cat([seq(vp, b)[:n], vn[b]])
        want.append(naive(q[b], kk, vv, causal=True, window=(2, -1))[0])
    out = flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=table, causal=True,
                                  window_size=(2, -1), impl="torch")
    torch.testing.assert_close(out.double(), torch.stack(want), **TOL)
    # the new tokens were written into the pages at cache_seqlens
    for b in range(B):
        n = int(lens[b])
        torch.testing.assert_close(seq(kp, b)[n:n + 3], kn[b], rtol=0, atol=0)
        torch.testing.assert_close(seq(vp, b)[n:n + 3], vn[b], rtol=0, atol=0)


@pytest.mark.parametrize("kw, match", [
    (dict(rotary_cos=torch.ones(1), rotary_sin=torch.ones(1)), "rotary_cos"),
    (dict(cache_batch_idx=torch.zeros(1, dtype=torch.int32)), "cache_batch_idx"),
    (dict(cache_leftpad=torch.zeros(1, dtype=torch.int32)), "cache_leftpad"),
    (dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
])
def test_kvcache_unsupported(kw, match):
    kc = rand(1, 8, 2, 8)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_with_kvcache(rand(1, 1, 2, 8), kc, kc, cache_seqlens=4, **kw)


def test_kvcache_bad_seqlens():
    kc = rand(1, 8, 2, 8)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(rand(1, 1, 2, 8), kc, kc, cache_seqlens=9, impl="torch")


def test_impl_keyword_routes_through_dispatch():
    q = rand(1, 4, 2, 8)
    with pytest.raises(ValueError, match="impl"):
        flash_attn_func(q, q, q, impl="cudnn")
    with dualattn.reference_mode():
        torch.testing.assert_close(flash_attn_func(q, q, q, impl="auto"), flash_attn_func(q, q, q, impl="torch"))


def test_compat_compiles_without_graph_break():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=cnt, fullgraph=True)
    def f(q, k, v, kc, vc):
        o = flash_attn_func(q, k, v, causal=True, window_size=(3, None), softcap=2.0, impl="torch")
        d = flash_attn_with_kvcache(q[:, -1:], kc, vc, cache_seqlens=5, causal=True, impl="torch")
        return o, d

    q, k, v = rand(1, 8, 2, 8, grad=True), rand(1, 8, 2, 8, seed=1, grad=True), rand(1, 8, 2, 8, seed=2, grad=True)
    kc, vc = rand(1, 8, 2, 8, seed=3), rand(1, 8, 2, 8, seed=4)
    o, d = f(q, k, v, kc, vc)
    o.sum().backward()
    torch.testing.assert_close(o, flash_attn_func(q, k, v, causal=True, window_size=(3, None), softcap=2.0,
                                                  impl="torch"))
    torch.testing.assert_close(d, flash_attn_with_kvcache(q[:, -1:].detach(), kc, vc, cache_seqlens=5, causal=True,
                                                          impl="torch"))
    assert q.grad is not None and not counters["graph_break"]


def test_paged_varlen_block_table_values_are_checked():
    from dualattn.compat import flash_attn_varlen_func
    kc, vc = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    q = torch.randn(5, 2, 8)
    cu_q = torch.tensor([0, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 6], dtype=torch.int32)
    for table, words in (([[-1, 0]], "entries must lie"), ([[0, 3]], "entries must lie"), ([[0]], "pages per sequence")):
        with pytest.raises(ValueError, match=words):
            flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 5, 6, block_table=torch.tensor(table, dtype=torch.int32),
                                   impl="torch")
    out = flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 5, 6, block_table=torch.tensor([[2, 0]], dtype=torch.int32),
                                 impl="torch")
    assert out.shape == q.shape
