"""fast-sm120 backward (FA2 on mma.sync) against the torch oracle with the accuracy rule, on a GPU.

Every GPU test runs under a thread-method timeout: a hung kernel (a semaphore that is never
released in deterministic mode) fails the run instead of stalling it. CPU tests at the bottom
check what the training implementation refuses. The whole GPU part takes well under 2 minutes.
"""
from __future__ import annotations

import pytest
import torch

from dualattn.accuracy import check_outputs
from dualattn.spec import AttentionSpec, build_dense, build_varlen
from test_fast_sm120 import _qkv  # same inputs as the forward tests

HAS_CUDA = torch.cuda.is_available()


def gpu_test(f):
    f = pytest.mark.timeout(240, method="thread")(f)
    f = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")(f)
    return pytest.mark.gpu(f)


def _impl():
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120 import TRAIN_IMPL
    if TRAIN_IMPL is None:
        pytest.skip("fast-sm120 backward switched off (impl.BACKWARD_ENABLED)")
    return TRAIN_IMPL


def _poison_allocator(nbytes: int) -> None:
    """Leave NaN in the caching allocator's free blocks, so outputs the kernel fails to write show up."""
    x = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del x


def _grad_call(call):
    from dataclasses import replace
    return replace(call, spec=replace(call.spec, needs_grad=True))


def _run_and_check(call, seed=0, bitwise_reruns=0):
    impl = _impl()
    call = _grad_call(call)
    reason = impl.can_implement(call.spec)
    assert reason is None, reason
    out, lse = impl.forward(call)
    g = torch.Generator(device="cuda").manual_seed(seed + 1000)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    _poison_allocator(16 * (call.q.numel() + call.k.numel()))
    dq, dk, dv = impl.backward(call, out, lse, dout)
    torch.cuda.synchronize()
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t).all(), f"{name} has NaN/Inf"
    checks = check_outputs(call, out, lse, dq, dk, dv, dout=dout)
    assert all(c.ok for c in checks), f"{call.spec.short()}: " + "; ".join(str(c) for c in checks)
    for _ in range(bitwise_reruns):
        _poison_allocator(16 * call.q.numel())
        dq2, dk2, dv2 = impl.backward(call, out, lse, dout)
        torch.cuda.synchronize()
        assert torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2), "not bitwise reproducible"
    return dq, dk, dv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_dense(dtype, D, causal):
    _run_and_check(build_dense(*_qkv(2, 333, 333, 4, 4, D, dtype), causal=causal, return_lse=True))


@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (203, 113), (239, 1), (1, 239), (128, 256)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 192, 256])
@gpu_test
def test_odd_shapes(sq, sk, causal, D):
    # Sq > Sk with bottom-right causal leaves the first rows with no key: zero gradients there
    _run_and_check(build_dense(*_qkv(1, sq, sk, 2, 2, D, torch.bfloat16, seed=sq * 7 + sk), causal=causal,
                               return_lse=True), seed=sq)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_gqa(hq, hkv, causal):
    _run_and_check(build_dense(*_qkv(2, 150, 270, hq, hkv, 64, torch.float16), causal=causal, return_lse=True))


@pytest.mark.parametrize("window,causal", [((32, 0), False), ((16, 8), False), ((-1, 16), False), ((40, -1), False),
                                           ((100, 3), True)])
@pytest.mark.parametrize("sq,sk", [(300, 300), (130, 400), (400, 130)])
@gpu_test
def test_window(window, causal, sq, sk):
    _run_and_check(build_dense(*_qkv(1, sq, sk, 2, 1, 128, torch.bfloat16), causal=causal, window=window,
                               return_lse=True))


@pytest.mark.parametrize("causal", [False, True])
@gpu_test
def test_varlen(causal):
    lens_q = [17, 0, 1, 300, 129]
    lens_k = [40, 5, 1, 300, 64]
    cq = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    ck = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(lens_q), 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lens_k), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    _run_and_check(build_varlen(q, k, v, cq, ck, max(lens_q), max(lens_k), causal=causal, return_lse=True))


@pytest.mark.parametrize("D,causal,shape", [(64, True, (2, 700, 500, 8, 2)), (128, False, (1, 239, 203, 6, 1)),
                                             (96, True, (1, 333, 300, 4, 2)), (32, False, (2, 300, 333, 4, 4)),
                                             (192, True, (1, 239, 203, 4, 2)), (256, False, (2, 130, 270, 2, 1)),
                                            (128, True, (1, 113, 1030, 4, 4)), (64, False, (1, 1, 1, 2, 1))])
@gpu_test
def test_deterministic_bitwise(D, causal, shape):
    B, Sq, Sk, Hq, Hkv = shape
    call = build_dense(*_qkv(B, Sq, Sk, Hq, Hkv, D, torch.bfloat16, seed=D), causal=causal, deterministic=True,
                       return_lse=True)
    _run_and_check(call, bitwise_reruns=3)


@pytest.mark.parametrize("D,causal,window", [(64, False, (-1, -1)), (128, True, (-1, -1)), (128, False, (40, 8))])
@gpu_test
def test_softcap(D, causal, window):
    # q scaled up so that tanh saturates on part of the tile (the 1 - tanh^2 factor matters)
    q, k, v = _qkv(2, 203, 317, 6, 2, D, torch.bfloat16, seed=D + causal)
    _run_and_check(build_dense(q * 4, k, v, causal=causal, window=window, softcap=20.0, return_lse=True), seed=D)


@pytest.mark.parametrize("R,causal,D", [(1, False, 128), (2, True, 64), (4, False, 64)])
@gpu_test
def test_key_ranges_random(R, causal, D):
    # per (batch, head) random intervals, a row with every interval empty (zero dQ), GQA 4/2
    B, Sq, Sk, Hq = 2, 260, 333, 4
    g = torch.Generator().manual_seed(R * 10 + causal)
    a = torch.randint(0, Sk + 1, (B, Hq, Sq, R, 2), generator=g)
    kr = torch.stack([a.min(-1).values, a.max(-1).values], -1).to(torch.int32)
    kr[:, :, 5] = 0
    q, k, v = _qkv(B, Sq, Sk, Hq, 2, D, torch.bfloat16, seed=R)
    _run_and_check(build_dense(q, k, v, causal=causal, key_ranges=kr.cuda(), return_lse=True))


@gpu_test
def test_key_ranges_documents_softcap_deterministic_bitwise():
    # packed documents broadcast over batch and heads, with softcap, in deterministic mode
    from dualattn import segments_to_key_ranges
    S = 700
    kr = segments_to_key_ranges([[100, 250, 300]], S, causal=True, device="cuda")
    q, k, v = _qkv(2, S, S, 4, 4, 128, torch.float16, seed=11)
    _run_and_check(build_dense(q, k, v, key_ranges=kr, softcap=15.0, deterministic=True, return_lse=True),
                   bitwise_reruns=2)


@gpu_test
def test_key_ranges_varlen():
    lens = [50, 0, 300, 17]
    cq = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    T = sum(lens)
    g = torch.Generator().manual_seed(5)
    lo = torch.randint(0, 18, (1, 2, T, 1, 1), generator=g)  # every interval inside the shortest sequence (17)
    kr = torch.cat([lo, lo + torch.randint(0, 60, lo.shape, generator=g)], -1).clamp(max=17).to(torch.int32).cuda()
    gq = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(T, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gq) for _ in range(3))
    _run_and_check(build_varlen(q, k, v, cq, cq, max(lens), max(lens), key_ranges=kr, return_lse=True))


@pytest.mark.parametrize("D,block,causal,det", [(64, (128, 128), False, True), (64, (128, 256), True, False),
                                                 (96, (128, 128), True, True), (32, (128, 256), False, False),
                                                 (192, (128, 128), True, True), (256, (128, 64), False, False),
                                                 (128, (128, 128), True, True), (128, (256, 128), False, False),
                                                 (128, (128, 256), False, True)])
@gpu_test
def test_block_sparse_random(D, block, causal, det):
    # per (batch, query head) random ABSENT/MASK/FULL states under GQA 4/2: the heads of a group visit
    # different query blocks; some query blocks list nothing, and many are first visited by a key
    # block other than 0 (rank-based lock values; lock = key-block index would deadlock there).
    # 300 x 517 ends inside the last CSR blocks on both sides.
    from dualattn.sparse import BlockSparse
    B, Sq, Sk, H = 2, 300, 517, 4
    nq, nk = -(-Sq // block[0]), -(-Sk // block[1])
    g = torch.Generator().manual_seed(D + block[0] + causal)
    states = torch.randint(0, 3, (B, H, nq, nk), generator=g, dtype=torch.int8)
    states[0, 1, 0, :] = 0
    states[1, :, :, 0] = 0
    bs = BlockSparse.from_block_states(states.cuda(), block[0], block[1], Sq, Sk)
    q, k, v = _qkv(B, Sq, Sk, H, 2, D, torch.bfloat16, seed=D)
    _run_and_check(build_dense(q, k, v, causal=causal, block_sparse=bs, deterministic=det, return_lse=True),
                   bitwise_reruns=2 if det else 0)


@pytest.mark.parametrize("window", [(-1, -1), (100, 0)])
@gpu_test
def test_block_sparse_exact_csr_broadcast_heads(window):
    # the exact CSR of causal (+ window), broadcast over batch and heads, GQA 6/2, with key ranges
    # of packed documents on the mask blocks; deterministic
    from dualattn import segments_to_key_ranges
    from dualattn.sparse import BlockSparse
    S = 650
    kr = segments_to_key_ranges([[200, 333, 117]], S, causal=True, device="cuda")
    bs = BlockSparse.from_key_ranges(kr, S, S, 128, 128, causal=True, window=window).to("cuda")
    q, k, v = _qkv(2, S, S, 6, 2, 128, torch.float16, seed=3)
    _run_and_check(build_dense(q, k, v, causal=True, window=window, key_ranges=kr, block_sparse=bs,
                               deterministic=True, return_lse=True), bitwise_reruns=1)


@gpu_test
def test_deterministic_window_varlen_bitwise():
    lens = [300, 0, 517, 64]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(9)
    T = sum(lens)
    q, k, v = (torch.randn(T, 4, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    call = build_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, window=(150, -1), deterministic=True,
                        return_lse=True)
    _run_and_check(call, bitwise_reruns=2)


# the tuning hook (DUALATTN_SM120_BWD_TILES) may pick any of these, and the benchmark compares them:
# each schedule (two-stage, one-stage with dS^T over dO, one-stage with its own dS^T tile), 16 and
# 32 key rows per warp, 4 and 8 warps and both grid orders must be right, not only the table's picks
ALT_TILES = ["64:64,128,256,4,2,0", "64:64,64,128,2,2,0,1", "64:32,128,128,2,2,0,1", "64:32,256,256,2,2,0",
             "64:128,128,256,4,1,0,1", "128:64,128,256,2,1,1,1", "128:32,128,256,2,2,1"]


@pytest.mark.parametrize("tiles", ALT_TILES)
@gpu_test
def test_tile_configs(tiles, monkeypatch):
    monkeypatch.setenv("DUALATTN_SM120_BWD_TILES", tiles)
    D = int(tiles.split(":")[0])
    from dualattn.fast.sm120.bwd import BwdTileConfig, bwd_tile_config
    v = [int(x) for x in tiles.split(":")[1].split(",")]
    assert bwd_tile_config(D) == BwdTileConfig(*v[:5], bool(v[5]), len(v) > 6 and bool(v[6]))
    for causal in (False, True):
        _run_and_check(build_dense(*_qkv(2, 333, 300, 4, 2, D, torch.bfloat16, seed=D), causal=causal,
                                   return_lse=True))
    call = build_dense(*_qkv(1, 250, 390, 4, 1, D, torch.float16, seed=5), causal=True, deterministic=True,
                       return_lse=True)
    _run_and_check(call, bitwise_reruns=2)


@gpu_test
def test_autograd_through_api():
    # impl="fast" serves a training call end to end through torch.autograd
    import dualattn
    _impl()
    q, k, v = (t.requires_grad_() for t in _qkv(1, 200, 260, 4, 2, 64, torch.bfloat16, seed=4))
    out = dualattn.attention(q, k, v, causal=True, impl="fast")
    dout = torch.randn_like(out)
    out.backward(dout)
    call = _grad_call(build_dense(q.detach(), k.detach(), v.detach(), causal=True, return_lse=True))
    checks = check_outputs(call, out.detach(), None, q.grad, k.grad, v.grad, dout=dout)
    assert all(c.ok for c in checks), "; ".join(str(c) for c in checks)


# ---------------------------------------------------------------------------- CPU: refusals
def _spec(**kw):
    base = dict(mode="batched", batch=1, seqlen_q=128, seqlen_k=128, num_heads_q=4, num_heads_kv=4, head_dim=128,
                head_dim_v=128, dtype=torch.bfloat16, device_type="cuda", needs_grad=True)
    base.update(kw)
    return AttentionSpec(**base)


@pytest.mark.parametrize("kw,words", [
    (dict(needs_grad=False), "training calls only"),
    (dict(block_size=(32, 128)), "block-sparse block size"),
    (dict(head_dim=160, head_dim_v=160), "head dim"),
    (dict(head_dim=224, head_dim_v=224), "head dim"),
    (dict(mode="kvcache"), "kvcache"),
    (dict(device_type="cpu"), "CUDA"),
])
def test_train_impl_refuses_with_reason(kw, words):
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120 import IMPL
    from dualattn.fast.sm120.bwd_impl import FastSm120Train
    reason = FastSm120Train(IMPL).can_implement(_spec(**kw))
    assert reason is not None and words in reason, reason


def test_train_impl_accepts_supported_spec_up_to_the_gpu_check():
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120 import IMPL
    from dualattn.fast.sm120.bwd_impl import FastSm120Train
    for kw in (dict(), dict(head_dim=64, head_dim_v=64, causal=True, num_heads_kv=1, deterministic=True),
               dict(mode="varlen", window=(64, 0), dtype=torch.float16)):
        reason = FastSm120Train(IMPL).can_implement(_spec(**kw))
        assert reason is None or reason.startswith("no CUDA GPU") or "sm_" in reason, reason


def test_bwd_compile_key_ignores_runtime_values():
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.bwd_impl import compile_key
    a = compile_key(_spec(seqlen_q=5, seqlen_k=7, batch=3, num_heads_q=8, num_heads_kv=2, scale=0.1), 90)
    b = compile_key(_spec(seqlen_q=4096, seqlen_k=100, batch=1, num_heads_q=4, num_heads_kv=4), 90)
    assert a == b
    assert compile_key(_spec(causal=True), 90) != compile_key(_spec(), 90)
    assert compile_key(_spec(deterministic=True), 90) != compile_key(_spec(), 90)
    assert compile_key(_spec(), 120) != compile_key(_spec(), 90)


def test_bwd_query_tile_rotation_choice(monkeypatch):
    """rotate_m (staggered query-tile walk) is compiled in where it was measured faster: without a
    causal/window band; never with a CSR or in deterministic mode (ascending semaphore order)."""
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.bwd_impl import _rotate_m, build_kernel, compile_key
    monkeypatch.delenv("DUALATTN_SM120_BWD_ROTATE", raising=False)
    assert _rotate_m(_spec()) and not _rotate_m(_spec(causal=True))
    assert not _rotate_m(_spec(window=(64, 0))) and not _rotate_m(_spec(deterministic=True))
    assert build_kernel(compile_key(_spec(), 90)).rotate_m
    assert not build_kernel(compile_key(_spec(causal=True), 90)).rotate_m
    monkeypatch.setenv("DUALATTN_SM120_BWD_ROTATE", "0")
    assert not _rotate_m(_spec())
    monkeypatch.setenv("DUALATTN_SM120_BWD_ROTATE", "1")
    assert _rotate_m(_spec(causal=True)) and not _rotate_m(_spec(causal=True, deterministic=True))
    # the kernel refuses it on its own where the order matters, whatever the key says
    key = list(compile_key(_spec(deterministic=True), 90))
    key[-4] = True  # (.., rotate_m, defer_dq, early_s, arch)
    assert not build_kernel(tuple(key)).rotate_m


def test_bwd_deferred_dq_and_early_s_choice(monkeypatch):
    """The dQ atomics are deferred into the next step's S^T product except in deterministic mode
    (whose semaphore orders them); S^T runs before dO is waited for where dO loads after the dQ
    product (one stage, dS^T over dO: hd128), not with two stages (hd64)."""
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.bwd_impl import build_kernel, compile_key
    for env in ("DUALATTN_SM120_BWD_DEFER_DQ", "DUALATTN_SM120_BWD_EARLY_S"):
        monkeypatch.delenv(env, raising=False)
    k128 = build_kernel(compile_key(_spec(), 90))
    assert k128.defer_dq and k128.early_s
    assert not build_kernel(compile_key(_spec(deterministic=True), 90)).defer_dq
    k64 = build_kernel(compile_key(_spec(head_dim=64, head_dim_v=64), 90))
    assert k64.defer_dq and not k64.early_s
    key = list(compile_key(_spec(deterministic=True), 90))
    key[-3] = True  # forced on: the kernel still refuses it in deterministic mode
    assert not build_kernel(tuple(key)).defer_dq
    monkeypatch.setenv("DUALATTN_SM120_BWD_DEFER_DQ", "0")
    monkeypatch.setenv("DUALATTN_SM120_BWD_EARLY_S", "0")
    k128 = build_kernel(compile_key(_spec(), 90))
    assert not k128.defer_dq and not k128.early_s


def test_bwd_causal_grid_order_by_length():
    """Causal calls up to 2k keys launch key blocks fastest (their Q / dO shared in L2), longer ones
    key blocks slowest (longest first); a window keeps key blocks slowest at any length."""
    pytest.importorskip("cutlass")
    from dualattn.fast.sm120.bwd_impl import CAUSAL_KEYS_FASTEST_MAX_SEQLEN, tile_for
    n = CAUSAL_KEYS_FASTEST_MAX_SEQLEN
    assert not tile_for(_spec(causal=True, seqlen_q=n, seqlen_k=n)).n_slowest
    assert tile_for(_spec(causal=True, seqlen_q=n + 1, seqlen_k=n + 1)).n_slowest
    assert tile_for(_spec(window=(64, 0), seqlen_q=300, seqlen_k=300)).n_slowest
    assert not tile_for(_spec(seqlen_q=8192, seqlen_k=8192)).n_slowest
