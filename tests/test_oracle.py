"""The torch oracle against a literal transcription of the definitions, in fp64."""
import math

import pytest
import torch

import dualattn
from dualattn import spec as S
from dualattn.reference import torch_ref
from dualattn.reference.torch_ref import attention_ref

D64 = torch.float64


def naive(q, k, v, causal=False, window=(-1, -1), softcap=0.0, scale=None, visible=None):
    """Per (b, h, i): a python-level loop over keys; the definition, not an algorithm."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = scale or 1 / math.sqrt(D)
    out = torch.zeros(B, Sq, Hq, v.shape[-1], dtype=D64)
    lse = torch.full((B, Hq, Sq), float("-inf"), dtype=D64)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(Sq):
                keys = []
                for j in range(Sk):
                    diag = i + Sk - Sq
                    ok = (not causal or j <= diag) and (window[0] < 0 or j >= diag - window[0]) \
                        and (window[1] < 0 or j <= diag + window[1])
                    if visible is not None:
                        ok = ok and bool(visible[b, h, i, j])
                    if ok:
                        keys.append(j)
                if not keys:
                    continue
                s = (q[b, i, h].double() @ k[b, keys, kh].double().T) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ v[b, keys, kh].double()
    return out, lse


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D64)


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(3, 2)), dict(causal=True, window=(4, -1)),
                                dict(softcap=2.0), dict(scale=0.3)])
@pytest.mark.parametrize("sq,sk", [(7, 11), (11, 7), (1, 1), (9, 1)])
def test_dense_variants(kw, sq, sk):
    q, k, v = rand(2, sq, 4, 8, seed=1), rand(2, sk, 2, 8, seed=2), rand(2, sk, 2, 16, seed=3)
    call = S.build_dense(q.float(), k.float(), v.float(), **kw)
    call = call.with_tensors(q=q, k=k, v=v)
    r = attention_ref(call, D64)
    o, l = naive(q, k, v, **kw)
    assert torch.allclose(r.out, o, atol=1e-12) and torch.equal(torch.isinf(r.lse), torch.isinf(l))
    assert torch.allclose(r.lse[torch.isfinite(l)], l[torch.isfinite(l)], atol=1e-12)


def test_key_ranges_union_of_overlapping_intervals():
    q, k, v = rand(1, 5, 2, 8, seed=4), rand(1, 9, 2, 8, seed=5), rand(1, 9, 2, 8, seed=6)
    kr = torch.tensor([[[[0, 3], [2, 5]], [[4, 4], [7, 9]], [[1, 1], [1, 1]], [[0, 9], [0, 0]], [[8, 9], [3, 4]]]],
                      dtype=torch.int32)[:, None].expand(1, 2, 5, 2, 2).contiguous()
    vis = torch.zeros(1, 2, 5, 9, dtype=torch.bool)
    for i in range(5):
        for lo, hi in kr[0, 0, i].tolist():
            vis[0, :, i, lo:hi] = True
    call = S.build_dense(q.float(), k.float(), v.float(), key_ranges=kr).with_tensors(q=q, k=k, v=v)
    r = attention_ref(call, D64)
    o, l = naive(q, k, v, visible=vis)
    assert torch.allclose(r.out, o, atol=1e-12)
    assert torch.isinf(r.lse[0, :, 2]).all() and (r.out[0, 2] == 0).all()


def test_empty_rows_zero_output_and_gradients():
    q = rand(1, 6, 2, 8, seed=7).float().requires_grad_()
    k = rand(1, 3, 2, 8, seed=8).float().requires_grad_()
    v = rand(1, 3, 2, 8, seed=9).float().requires_grad_()
    o, lse = dualattn.attention(q, k, v, causal=True, return_lse=True, impl="torch")  # rows 0..2 see nothing
    assert (o[0, :3] == 0).all() and torch.isinf(lse[0, :, :3]).all() and (lse[0, :, :3] < 0).all()
    o.square().sum().backward()
    assert (q.grad[0, :3] == 0).all()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()


def test_chunking_does_not_change_results(monkeypatch):
    q, k, v = rand(1, 40, 2, 8, seed=10), rand(1, 50, 2, 8, seed=11), rand(1, 50, 2, 8, seed=12)
    call = S.build_dense(q.float(), k.float(), v.float(), causal=True).with_tensors(q=q, k=k, v=v)
    dout = rand(1, 40, 2, 8, seed=13)
    whole = attention_ref(call, D64, dout)
    monkeypatch.setattr(torch_ref, "CHUNK_ELEMENTS", 7 * 50 * 2)  # 7 rows per chunk
    parts = attention_ref(call, D64, dout)
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert torch.allclose(getattr(whole, name), getattr(parts, name), atol=1e-12), name


def test_backward_matches_autograd_of_naive():
    q, k, v = (rand(1, 6, 2, 8, seed=s).requires_grad_() for s in (14, 15, 16))
    dout = rand(1, 6, 2, 8, seed=17)
    o, _ = naive(q, k, v, causal=True, softcap=3.0)
    gq, gk, gv = torch.autograd.grad(o, (q, k, v), dout)
    call = S.build_dense(q.detach().float(), k.detach().float(), v.detach().float(), causal=True, softcap=3.0)
    r = attention_ref(call.with_tensors(q=q.detach(), k=k.detach(), v=v.detach()), D64, dout)
    for a, b in ((r.dq, gq), (r.dk, gk), (r.dv, gv)):
        assert torch.allclose(a, b, atol=1e-10)


def test_varlen_equals_separate_sequences():
    lengths_q, lengths_k = [3, 0, 8, 1], [5, 2, 8, 0]
    q = rand(sum(lengths_q), 4, 8, seed=18).float()
    k = rand(sum(lengths_k), 2, 8, seed=19).float()
    v = rand(sum(lengths_k), 2, 8, seed=20).float()
    cq = torch.tensor([0, 3, 3, 11, 12], dtype=torch.int32)
    ck = torch.tensor([0, 5, 7, 15, 15], dtype=torch.int32)
    o, lse = dualattn.attention_varlen(q, k, v, cq, ck, 8, 8, causal=True, return_lse=True, impl="torch")
    assert lse.shape == (4, 12)
    for b in range(4):
        if lengths_q[b] == 0:
            continue
        ob, lb = dualattn.attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]],
                                    causal=True, return_lse=True, impl="torch")
        assert torch.allclose(o[cq[b]:cq[b + 1]], ob[0], atol=1e-6)
        assert torch.equal(torch.isinf(lse[:, cq[b]:cq[b + 1]]), torch.isinf(lb[0]))


def test_kvcache_paged_equals_contiguous_and_appends():
    g = torch.Generator().manual_seed(21)
    B, cap, ps, H, D = 2, 32, 8, 2, 16
    kc, vc = torch.randn(B, cap, H, D, generator=g), torch.randn(B, cap, H, D, generator=g)
    table = torch.tensor([[3, 0, 5, 1], [7, 2, 6, 4]], dtype=torch.int32)
    kp, vp = torch.zeros(8, ps, H, D), torch.zeros(8, ps, H, D)
    for b in range(B):
        for p in range(4):
            kp[table[b, p]] = kc[b, p * ps:(p + 1) * ps]
            vp[table[b, p]] = vc[b, p * ps:(p + 1) * ps]
    q = torch.randn(B, 2, 4, D, generator=g)
    kn, vn = torch.randn(B, 2, H, D, generator=g), torch.randn(B, 2, H, D, generator=g)
    lens = torch.tensor([13, 30], dtype=torch.int32)
    a = dualattn.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn, causal=True, impl="torch")
    b = dualattn.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table, k_new=kn, v_new=vn,
                                        causal=True, impl="torch")
    assert torch.allclose(a, b, atol=1e-6)
    # the new tokens were written in place, and attending over the full sequence gives the same
    for bb in range(B):
        n = int(lens[bb]) + 2
        assert torch.equal(kc[bb, n - 2:n], kn[bb])
        full = dualattn.attention(q[bb:bb + 1], kc[bb:bb + 1, :n], vc[bb:bb + 1, :n], causal=True, impl="torch")
        assert torch.allclose(full, a[bb:bb + 1], atol=1e-6)


def test_kvcache_empty_batch():
    # batch 0 used to crash the oracle (torch.stack of an empty list)
    for page_table, kc in ((None, torch.randn(0, 8, 2, 16)),
                           (torch.zeros(0, 2, dtype=torch.int32), torch.randn(5, 4, 2, 16))):
        out, lse = dualattn.attention_with_kvcache(
            torch.randn(0, 3, 4, 16), kc, torch.randn(kc.shape[:3] + (32,)),
            cache_seqlens=torch.zeros(0, dtype=torch.int32), page_table=page_table, impl="torch", return_lse=True)
        assert out.shape == (0, 3, 4, 32) and out.dtype == torch.float32
        assert lse.shape == (0, 4, 3) and lse.dtype == torch.float32


def test_accuracy_bound_ignores_unused_cache_slots():
    """The score bound of a kv-cache call comes from the keys a query can see: garbage (inf, NaN)
    in cache slots past cache_seqlens must neither fail a right answer nor pass a wrong one."""
    from dualattn import accuracy

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 2, 16, generator=g)
    kc, vc = torch.randn(2, 16, 2, 16, generator=g), torch.randn(2, 16, 2, 16, generator=g)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    kc[0, 5:] = float("nan")
    call = S.build_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True)
    r = attention_ref(call)
    assert all(c.ok for c in accuracy.check_outputs(call, r.out.clone(), r.lse.clone()))
    kc[0, 5:] = float("inf")
    call = S.build_kvcache(q, kc, vc, cache_seqlens=lens, return_lse=True)
    assert not any(c.ok for c in accuracy.check_outputs(call, r.out + 1.0, r.lse + 1.0))


def _fp32_dot(a, b, order):
    """q.k in fp32 in a summation order other than torch's: reversed, or pairwise (a tree)."""
    import numpy as np

    prods = (a.flatten().numpy() * b.flatten().numpy()).astype(np.float32)
    if order == "pairwise":
        while len(prods) > 1:
            prods = (prods[0::2] + prods[1::2]).astype(np.float32)
        return prods[0]
    acc = np.float32(0)
    for p in prods[::-1]:
        acc = np.float32(acc + p)
    return acc


def test_accuracy_bound_covers_score_rounding_before_a_softcap():
    """fp32 with a softcap: q.k is rounded before the cap, and the cap passes that rounding on
    (tanh' <= 1), so the rule's conditioning term must take the size of the terms of q.k, not
    the cap. A q.k that cancels from terms of size ~36 down to ~0.07 (the case a GPU property
    campaign found in the Triton kernel) summed in another fp32 order must pass; the bound taken
    from the cap failed 118 of 900 such cases (300 seeds, three fp32 orders), by up to 92x. A wrong LSE must still fail."""
    import numpy as np

    from dualattn import accuracy

    worst = 0.0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 1, 1, 128, generator=g, dtype=D64) * 6
        k = torch.randn(1, 1, 1, 128, generator=g, dtype=D64) * 6
        k = k - (q * k).sum() / (q * q).sum() * q + 1e-3 * q / q.norm()  # q.k ~ 0.07 (scaled ~ 0.006), terms ~ 36
        q, k = q.float(), k.float()
        v = torch.randn(1, 1, 1, 128, generator=g)
        call = S.build_dense(q, k, v, softcap=1.0, return_lse=True)
        refs = accuracy.reference_pair(call)
        for order in ("reversed", "pairwise"):
            s = np.float32(_fp32_dot(q, k, order) * np.float32(call.spec.scale))
            lse = torch.tensor(np.float32(math.tanh(float(s)))).reshape(1, 1, 1)  # one key: LSE = capped score
            checks = accuracy.check_outputs(call, v.clone(), lse, refs=refs)
            assert all(c.ok for c in checks), (seed, order, checks)
            worst = max(worst, max(c.err / c.bound for c in checks))
            assert not accuracy.check_outputs(call, v.clone(), lse + 1e-4, refs=refs)[1].ok
    assert worst > 0.01  # the cases do exercise the term
