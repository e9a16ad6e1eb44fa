"""fast-sm120 (FA2 on mma.sync) against the torch oracle with the accuracy rule, on a GPU.

On an H100/H200 this runs the SM80-class code path that sm_120 uses. Every GPU test has a
thread-method timeout: a hung kernel ends the run with a failure instead of stalling it.
The can_implement tests at the bottom run on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from dualattn import dispatch
from dualattn.accuracy import check_outputs
from dualattn.spec import AttentionSpec, build_dense, build_varlen

HAS_CUDA = torch.cuda.is_available()


def gpu_test(f):
    """GPU only (skipped with a reason elsewhere), under a timeout that also catches a hung kernel."""
    f = pytest.mark.timeout(300, method="thread")(f)
    f = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(f)
    return pytest.mark.gpu(f)


def _impl():
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120 import IMPL
    return IMPL


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so outputs the kernel fails to write show up."""
    x = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del x


def _run_and_check(call, repeat_bitwise=True):
    impl = _impl()
    reason = impl.can_implement(call.spec)
    assert reason is None, reason
    _poison_allocator(4 * (call.q.numel() + call.q.shape[0] * call.q.shape[1] * 8))
    out, lse = impl.forward(call)
    torch.cuda.synchronize()
    checks = check_outputs(call, out, lse)
    assert all(c.ok for c in checks), f"{call.spec.short()}: " + "; ".join(str(c) for c in checks)
    if repeat_bitwise:
        _poison_allocator(4 * call.q.numel())
        out2, lse2 = impl.forward(call)
        torch.cuda.synchronize()
        assert torch.equal(out, out2) and torch.equal(lse, lse2), "not bitwise repeatable"
    return out, lse


def _qkv(B, Sq, Sk, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_dense(dtype, D, causal):
    _run_and_check(build_dense(*_qkv(2, 333, 333, 4, 4, D, dtype), causal=causal, return_lse=True))


@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (203, 113), (239, 1), (1, 239), (128, 128), (64, 300)])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_odd_shapes(sq, sk, causal):
    # Sq > Sk with bottom-right causal leaves the first rows with no key: out 0, LSE -inf
    _run_and_check(build_dense(*_qkv(1, sq, sk, 2, 2, 128, torch.bfloat16, seed=sq * 7 + sk), causal=causal,
                               return_lse=True))


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_gqa(hq, hkv, causal):
    _run_and_check(build_dense(*_qkv(2, 150, 270, hq, hkv, 64, torch.float16), causal=causal, return_lse=True))


@pytest.mark.parametrize("window,causal", [((32, 0), False), ((16, 8), False), ((-1, 16), False), ((40, -1), False),
                                           ((50, -1), True), ((0, 0), False), ((100, 3), True)])
@pytest.mark.parametrize("sq,sk", [(300, 300), (130, 400), (400, 130)])
@gpu_test
def test_window(window, causal, sq, sk):
    _run_and_check(build_dense(*_qkv(1, sq, sk, 2, 2, 64, torch.bfloat16), causal=causal, window=window,
                               return_lse=True))


@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_softcap(causal):
    q, k, v = _qkv(2, 200, 260, 4, 2, 128, torch.bfloat16)
    _run_and_check(build_dense(q * 4, k, v, causal=causal, softcap=20.0, return_lse=True))


@pytest.mark.parametrize("D", [32, 96, 160, 192, 256])
@gpu_test
def test_head_dims(D):
    _run_and_check(build_dense(*_qkv(1, 150, 190, 2, 1, D, torch.float16), causal=True, return_lse=True))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_varlen(D, causal):
    lens_q = [17, 0, 1, 300, 129]
    lens_k = [40, 5, 1, 300, 64]
    cq = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(lens_q), 4, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lens_k), 2, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lens_k), 2, D, device="cuda", dtype=torch.bfloat16, generator=g)
    _run_and_check(build_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal, return_lse=True))


@pytest.mark.parametrize("D,block", [(64, (128, 128)), (128, (128, 128)), (128, (256, 64)), (256, (64, 128))])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_block_sparse_random(D, block, causal):
    from dualattn.sparse import BlockSparse
    B, Sq, Sk, H = 2, 300, 517, 4
    nq, nk = -(-Sq // block[0]), -(-Sk // block[1])
    g = torch.Generator().manual_seed(D + block[0] + causal)
    # per (batch, head) random ABSENT/MASK/FULL states; some query blocks list nothing
    states = torch.randint(0, 3, (B, H, nq, nk), generator=g, dtype=torch.int8)
    states[0, 1, 0, :] = 0
    bs = BlockSparse.from_block_states(states.cuda(), block[0], block[1], Sq, Sk)
    q, k, v = _qkv(B, Sq, Sk, H, 2, D, torch.bfloat16)
    _run_and_check(build_dense(q, k, v, causal=causal, block_sparse=bs, return_lse=True))


@pytest.mark.parametrize("window", [(-1, -1), (100, 0)])
@gpu_test
def test_block_sparse_exact_csr_matches_dense(window):
    # the exact CSR of a predicate gives the same result as the predicate alone
    from dualattn.sparse import BlockSparse
    q, k, v = _qkv(1, 400, 400, 2, 2, 64, torch.float16)
    bs = BlockSparse.from_key_ranges(None, 400, 400, 128, 128, causal=True, window=window).to("cuda")
    out_bs, lse_bs = _run_and_check(build_dense(q, k, v, causal=True, window=window, block_sparse=bs,
                                                return_lse=True))
    out, lse = _impl().forward(build_dense(q, k, v, causal=True, window=window, return_lse=True))
    assert (out_bs.float() - out.float()).abs().max() < 1e-2
    assert torch.allclose(lse_bs, lse, atol=1e-4, rtol=0, equal_nan=False)


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_key_ranges_random(R, causal):
    B, Sq, Sk, H = 2, 260, 333, 4
    g = torch.Generator().manual_seed(R * 10 + causal)
    a = torch.randint(0, Sk + 1, (B, H, Sq, R, 2), generator=g)
    kr = torch.stack([a.min(-1).values, a.max(-1).values], -1).to(torch.int32)
    kr[:, :, 5] = 0  # a row whose intervals are all empty: out 0, LSE -inf
    q, k, v = _qkv(B, Sq, Sk, H, 2, 128, torch.bfloat16)
    _run_and_check(build_dense(q, k, v, causal=causal, key_ranges=kr.cuda(), return_lse=True))


@gpu_test
def test_key_ranges_documents_broadcast_and_block_sparse():
    # packed documents (key ranges broadcast over heads), alone and with their exact CSR
    from dualattn import segments_to_key_ranges
    from dualattn.sparse import BlockSparse
    S = 700
    kr = segments_to_key_ranges([[100, 250, 300], [700]], S, causal=True, device="cuda")
    q, k, v = _qkv(2, S, S, 4, 4, 64, torch.float16)
    out, lse = _run_and_check(build_dense(q, k, v, key_ranges=kr, return_lse=True))
    bs = BlockSparse.from_key_ranges(kr, S, S, 128, 128).to("cuda")
    out2, lse2 = _run_and_check(build_dense(q, k, v, key_ranges=kr, block_sparse=bs, return_lse=True))
    assert (out2.float() - out.float()).abs().max() < 1e-2


@gpu_test
def test_key_ranges_varlen():
    lens = [50, 0, 300]
    cq = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    T = sum(lens)
    g = torch.Generator().manual_seed(5)
    lo = torch.randint(0, 40, (1, 1, T, 1, 1), generator=g)
    kr = torch.cat([lo, lo + torch.randint(0, 60, lo.shape, generator=g)], -1).clamp(max=50).to(torch.int32).cuda()
    q = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16)
    _run_and_check(build_varlen(q, k, v, cq, cq, max(lens), max(lens), key_ranges=kr, return_lse=True))


@gpu_test
def test_cuda_graph_capture():
    # no host synchronisation in forward: it can be captured once compiled, and replays correctly
    impl = _impl()
    q, k, v = _qkv(2, 200, 300, 4, 2, 128, torch.bfloat16)
    call = build_dense(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = impl.forward(call)  # compiles outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out, lse = impl.forward(call)
    torch.cuda.current_stream().wait_stream(s)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


@gpu_test
def test_scale_and_noncontiguous():
    q, k, v = _qkv(2, 100, 120, 4, 4, 64, torch.float16)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided view: forward makes it contiguous
    _run_and_check(build_dense(q, k, v, scale=0.3, return_lse=True))


@gpu_test
def test_no_recompile_for_new_shapes():
    impl = _impl()
    from dualattn.fast.sm120.impl import compile_cache
    _run_and_check(build_dense(*_qkv(1, 77, 99, 2, 2, 64, torch.bfloat16), return_lse=True))
    n = compile_cache().compiles
    _run_and_check(build_dense(*_qkv(3, 500, 45, 4, 2, 64, torch.bfloat16), return_lse=True))
    assert compile_cache().compiles == n
    assert impl is not None


@gpu_test
def test_dispatch_fast_family():
    q, k, v = _qkv(1, 64, 64, 2, 2, 64, torch.bfloat16)
    spec = build_dense(q, k, v).spec
    chosen = dispatch.select(spec, "fast")
    assert chosen.family == "fast"
    assert _impl().can_implement(spec) is None


# ---------------------------------------------------------------------------- CPU: refusals
def _spec(**kw):
    base = dict(mode="batched", batch=1, seqlen_q=128, seqlen_k=128, num_heads_q=4, num_heads_kv=4, head_dim=128,
                head_dim_v=128, dtype=torch.bfloat16, device_type="cuda")
    base.update(kw)
    return AttentionSpec(**base)


@pytest.mark.parametrize("kw,words", [
    (dict(needs_grad=True), "backward"),
    (dict(mode="kvcache"), "kvcache"),
    (dict(dtype=torch.float32), "dtype"),
    (dict(head_dim=80, head_dim_v=80), "head dim"),
    (dict(head_dim_v=64), "head_dim_v"),
    (dict(num_key_ranges=5), "key ranges"),
    (dict(block_size=(64, 64), head_dim=64, head_dim_v=64), "block size"),
    (dict(device_type="cpu"), "CUDA"),
])
def test_can_implement_refuses_with_reason(kw, words):
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.impl import FastSm120Forward
    reason = FastSm120Forward().can_implement(_spec(**kw))
    assert reason is not None and words in reason, reason


def test_compile_key_ignores_runtime_values():
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.impl import compile_key
    a = compile_key(_spec(seqlen_q=5, seqlen_k=7, batch=3, num_heads_q=8, num_heads_kv=2, scale=0.1), 90)
    b = compile_key(_spec(seqlen_q=4096, seqlen_k=100, batch=1, num_heads_q=4, num_heads_kv=4), 90)
    assert a == b
    assert compile_key(_spec(causal=True), 90) != compile_key(_spec(), 90)
    assert compile_key(_spec(), 120) != compile_key(_spec(), 90)
