"""dualattn.ops: torch.library custom ops, torch.compile without graph breaks, CUDA graphs.

CPU tests use impl="torch"; the GPU tests (CUDA graph capture) use the kernel families.
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import dualattn
from dualattn import ops
from dualattn.sparse import BlockSparse

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _qkv(b=2, sq=24, sk=24, hq=4, hkv=2, d=16, dv=None, dtype=torch.float32, grad=False, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dv = dv or d
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32).to(device=device, dtype=dtype).requires_grad_(grad)
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, dv)


def _grads(fn, q, k, v):
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), dq, dk, dv


# ---------------------------------------------------------------------------------------------
# eager: the op path equals the API path (forward and gradients)
# ---------------------------------------------------------------------------------------------

CASES = [
    dict(causal=True),
    dict(causal=False, window=(3, 2), softcap=5.0, scale=0.3),
    dict(causal=True, window=(4, -1)),
]


@pytest.mark.parametrize("kw", CASES)
def test_op_matches_api_dense(kw):
    q, k, v = _qkv(grad=True, sq=20, sk=28)
    torch.manual_seed(1)
    a = _grads(lambda q, k, v: ops.attention(q, k, v, impl="torch", **kw), q, k, v)
    torch.manual_seed(1)
    b = _grads(lambda q, k, v: dualattn.attention(q, k, v, impl="torch", **kw), q, k, v)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_op_lse_and_key_ranges_and_block_sparse():
    q, k, v = _qkv(b=1, sq=32, sk=32, grad=True)
    kr = dualattn.segments_to_key_ranges([[10, 22]], 32, causal=True)
    bs = BlockSparse.from_key_ranges(kr, 32, 32, 8, 8)
    torch.manual_seed(2)
    a_out, a_lse = ops.attention(q, k, v, key_ranges=kr, block_sparse=bs, return_lse=True, impl="torch")
    b_out, b_lse = dualattn.attention(q, k, v, key_ranges=kr, block_sparse=bs, return_lse=True, impl="torch")
    torch.testing.assert_close(a_out, b_out, rtol=0, atol=0)
    torch.testing.assert_close(a_lse, b_lse, rtol=0, atol=0)
    assert a_lse.shape == (1, 4, 32) and a_lse.dtype == torch.float32 and not a_lse.requires_grad
    dout = torch.randn_like(a_out)
    ga = torch.autograd.grad(a_out, (q, k, v), dout)
    gb = torch.autograd.grad(b_out, (q, k, v), dout)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_op_varlen_matches_api():
    lens = [5, 17, 9]
    cu = torch.tensor([0, 5, 22, 31], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(31, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(31, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(31, 2, 16, generator=g, requires_grad=True)
    a = _grads(lambda q, k, v: ops.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                     impl="torch"), q, k, v)
    torch.manual_seed(0)
    b = _grads(lambda q, k, v: dualattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                          impl="torch"), q, k, v)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    # the random douts differ between the two calls; check gradients against the oracle instead
    from dualattn.accuracy import check_outputs
    from dualattn.spec import build_varlen
    call = build_varlen(q.detach(), k.detach(), v.detach(), cu, cu, 17, 17, causal=True)
    out = ops.attention_varlen(q, k, v, cu, cu, 17, 17, causal=True, impl="torch")
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert all(c.ok for c in check_outputs(call, out.detach(), dq=dq, dk=dk, dv=dv, dout=dout))


def test_op_errors_are_the_api_errors():
    q, k, v = _qkv(hq=3, hkv=2)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        ops.attention(q, k, v, impl="torch")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="impl"):
        ops.attention(q, k, v, impl="nope")
    # 0.0 encodes "default scale" inside the op: a caller's 0 must still be refused, as eagerly
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale"):
            dualattn.attention(q, k, v, scale=bad, impl="torch")
        with pytest.raises(ValueError, match="scale"):
            ops.attention(q, k, v, scale=bad, impl="torch")


def test_op_honours_reference_mode():
    q, k, v = _qkv()
    with dualattn.reference_mode():
        out = ops.attention(q, k, v, causal=True, impl="triton")  # routed to the oracle
    torch.testing.assert_close(out, dualattn.attention(q, k, v, causal=True, impl="torch"), rtol=0, atol=0)


def test_opcheck_fwd_bwd_kvcache():
    """torch.library.opcheck: schema, fake (meta) implementation, autograd registration, AOT dispatch."""
    q, k, v = _qkv(b=1, sq=8, sk=12, grad=True)
    args = (q, k, v, None, None, 0, 0, None, None, None, None, None, [0, 0, 0, 0], True, -1, -1, 0.0, 0.0, False,
            True, "torch")
    torch.library.opcheck(torch.ops.dualattn.fwd.default, args)
    kc, vc = torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16)
    qd = torch.randn(2, 1, 4, 16)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.dualattn.kvcache.default,
                          (qd, kc, vc, seqlens, None, True, -1, -1, 0.0, 0.0, 0, "torch"))
    kn, vn = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    torch.library.opcheck(torch.ops.dualattn.kvcache_append.default,
                          (qd, kc, vc, seqlens, None, kn, vn, True, -1, -1, 0.0, 0.0, 0, "torch"))


# ---------------------------------------------------------------------------------------------
# torch.compile: no graph break, no recompile per sequence length
# ---------------------------------------------------------------------------------------------

class TinyAttentionModel(torch.nn.Module):
    """One pre-norm attention block calling the public dualattn API (as model code would)."""

    def __init__(self, dim=32, heads=4, kv_heads=2, head_dim=8):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, head_dim
        self.norm = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, heads * head_dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim)
        self.o = torch.nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        B, S, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, S, self.h, self.d)
        k, v = self.kv(h).view(B, S, 2, self.hkv, self.d).unbind(2)
        a = dualattn.attention(q, k, v, causal=True, impl="torch")
        return x + self.o(a.reshape(B, S, self.h * self.d))


def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()


def test_compile_fullgraph_model_no_graph_break_no_recompile():
    _fresh_dynamo()
    torch.manual_seed(0)
    model = TinyAttentionModel()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    for s in (16, 24, 40, 56):
        x = torch.randn(2, s, 32, requires_grad=True)
        y = compiled(x)
        y.square().sum().backward()
        gx, gw = x.grad.clone(), model.q.weight.grad.clone()
        x.grad = None
        model.zero_grad()
        y_ref = model(x)
        y_ref.square().sum().backward()
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw, model.q.weight.grad, rtol=1e-5, atol=1e-5)
        model.zero_grad()
    assert not counters["graph_break"], dict(counters["graph_break"])
    # automatic dynamic shapes: one static compile, one dynamic one, then none per new length
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 2, f"compiled {graphs} graphs for 4 sequence lengths"


def test_compile_graph_contains_the_custom_op():
    _fresh_dynamo()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    f = torch.compile(lambda q, k, v: dualattn.attention(q, k, v, window=(2, 2), impl="torch"), backend=backend,
                      fullgraph=True)
    q, k, v = _qkv()
    torch.testing.assert_close(f(q, k, v), dualattn.attention(q, k, v, window=(2, 2), impl="torch"))
    assert len(graphs) == 1 and "dualattn.fwd" in graphs[0]


def test_compile_varlen_dynamic_total_tokens():
    _fresh_dynamo()
    cnt = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=cnt, fullgraph=True, dynamic=True)
    def f(q, k, v, cu, max_s):
        return dualattn.attention_varlen(q, k, v, cu, cu, max_s, max_s, causal=True, impl="torch")

    for lens in ([3, 5], [7, 2, 6], [11, 4, 4, 9]):
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
        T = int(cu[-1])
        q, k, v = torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)
        got = f(q, k, v, cu, max(lens))
        want = dualattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, impl="torch")
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # (frame_count may include a restart of the analysis; unique graphs are the compiles that count)
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_kvcache_decode_with_append():
    _fresh_dynamo()
    cnt = CompileCounterWithBackend("aot_eager")

    def step(q, kc, vc, seqlens, kn, vn):
        return dualattn.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k_new=kn, v_new=vn, causal=True,
                                               impl="torch")

    f = torch.compile(step, backend=cnt, fullgraph=True)
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(2, 32, 2, 16, generator=g)
    vc = torch.randn(2, 32, 2, 16, generator=g)
    kc2, vc2 = kc.clone(), vc.clone()
    seqlens = torch.tensor([4, 11], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 16, generator=g)
    kn, vn = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    got = f(q, kc, vc, seqlens, kn, vn)
    want = step(q, kc2, vc2, seqlens, kn, vn)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the append happened in the caller's cache, in compiled and eager code alike
    torch.testing.assert_close(kc, kc2, rtol=0, atol=0)
    assert torch.equal(kc[1, 11], kn[1, 0]) and torch.equal(vc[0, 4], vn[0, 0])
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1


# ---------------------------------------------------------------------------------------------
# GPU: CUDA graph capture of forward, backward and decode
# ---------------------------------------------------------------------------------------------

def _families_for(spec):
    return [f for f in ("fast", "triton") if dualattn.dispatch.family_reasons(spec, f)[0] is not None]


def _capture(step):
    """Warm up ``step`` on a side stream (compiles kernels, creates autograd nodes there), drop every
    result, then capture one call in a CUDA graph; returns (graph, captured outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            res = step()
        del res
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _dense_inputs(grad):
    q, k, v = _qkv(b=2, sq=256, sk=256, hq=8, hkv=2, d=64, dtype=torch.bfloat16, device="cuda", grad=grad)
    return q, k, v


def _gpu_families(grad):
    from dataclasses import replace
    from dualattn.spec import build_dense
    q, k, v = _dense_inputs(grad)
    fams = _families_for(replace(build_dense(q, k, v, causal=True).spec, needs_grad=grad))
    if not fams:
        pytest.skip("no GPU implementation (fast/triton) can serve bf16 causal GQA" + (" backward" if grad else ""))
    return fams


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fam", ["fast", "triton"])
def test_cuda_graph_forward(fam):
    if fam not in _gpu_families(False):
        pytest.skip(f"impl={fam!r} cannot serve this call on this GPU")
    q, k, v = _dense_inputs(False)
    graph, out = _capture(lambda: ops.attention(q, k, v, causal=True, impl=fam))
    q.copy_(torch.randn_like(q))  # new values in the captured buffers, then replay
    graph.replay()
    torch.cuda.synchronize()
    want = ops.attention(q, k, v, causal=True, impl=fam)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fam", ["fast", "triton"])
def test_cuda_graph_backward(fam):
    if fam not in _gpu_families(True):
        pytest.skip(f"impl={fam!r} has no backward for this call on this GPU")
    q, k, v = _dense_inputs(True)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step():
        o = ops.attention(q, k, v, causal=True, impl=fam)
        return (o,) + torch.autograd.grad(o, (q, k, v), dout)
    graph, (o_g, dq_g, dk_g, dv_g) = _capture(step)
    with torch.no_grad():
        q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    o_e, dq_e, dk_e, dv_e = step()
    torch.testing.assert_close(o_g, o_e, rtol=0, atol=0)
    # backward kernels may accumulate in a run-dependent order: compare at bf16 resolution
    for g, e in ((dq_g, dq_e), (dk_g, dk_e), (dv_g, dv_e)):
        torch.testing.assert_close(g, e, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fam", ["fast", "triton"])
def test_cuda_graph_decode(fam):
    from dualattn.spec import build_kvcache
    qd = torch.randn(4, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(4, 4096, 2, 64, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([100, 4000, 1, 2048], dtype=torch.int32, device="cuda")
    if fam not in _families_for(build_kvcache(qd, kc, vc, cache_seqlens=lens).spec):
        pytest.skip(f"impl={fam!r} has no decode kernel for this call on this GPU")
    graph, out = _capture(lambda: ops.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens, impl=fam))
    # the lengths change between replays without a new capture (no host-side copy of them)
    lens.copy_(torch.tensor([3000, 7, 4096, 512], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    from dualattn.accuracy import check_outputs
    checks = check_outputs(build_kvcache(qd, kc, vc, cache_seqlens=lens), out)
    assert all(c.ok for c in checks), [str(c) for c in checks]


@pytest.mark.gpu
@needs_cuda
def test_compile_fullgraph_on_gpu():
    _fresh_dynamo()
    q, k, v = _qkv(b=2, sq=128, sk=128, hq=8, hkv=2, d=64, dtype=torch.bfloat16, device="cuda", grad=True)
    f = torch.compile(lambda q, k, v: dualattn.attention(q, k, v, causal=True), fullgraph=True)
    out = f(q, k, v)
    out.float().sum().backward()
    want = dualattn.attention(q, k, v, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert not counters["graph_break"]


def test_bwd_fake_strides_match_for_transposed_inputs():
    # the layout the transformers integration passes: (B, H, S, D).transpose(1, 2); the fake
    # gradients must have the real ones' strides (inductor asserted on the mismatch)
    torch.manual_seed(0)
    B, S, H, Hkv, D = 2, 12, 4, 2, 16
    q = torch.randn(B, H, S, D).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D).transpose(1, 2)
    v = torch.randn(B, Hkv, S, D).transpose(1, 2)
    out, lse = ops.attention(q, k, v, causal=True, return_lse=True, impl="torch")
    args = (torch.randn_like(out), q, k, v, out, lse, None, None, 0, 0, None, None, None, None, None,
            [0, 0, 0, 0], True, -1, -1, 0.0, 0.0, False, "torch")
    torch.library.opcheck(torch.ops.dualattn.bwd.default, args)
