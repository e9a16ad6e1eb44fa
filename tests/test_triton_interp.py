"""Triton kernels under the CPU interpreter against the oracle (accuracy rule), every variant.

The interpreter must be chosen before the kernels are defined, so this module runs only in a
process started with TRITON_INTERPRET=1; tests/test_triton.py starts that process (and the rest
of the suite keeps compiled-kernel semantics). Run directly with
``TRITON_INTERPRET=1 pytest tests/test_triton_interp.py``.
"""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs in its own process with TRITON_INTERPRET=1 (started by tests/test_triton.py)",
                allow_module_level=True)

import torch  # noqa: E402

from dualattn.accuracy import check_outputs  # noqa: E402
from dualattn.reference import triton as ttr  # noqa: E402
from dualattn.reference.torch_impl import append_kv_inplace  # noqa: E402
from test_triton_cases import CASES, FP32_CASES, clone_call, make_call  # noqa: E402

if not ttr.KERNELS_INTERPRETED:  # pragma: no cover - imported earlier without the interpreter
    pytest.skip("dualattn.reference.triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

IMPL = ttr.IMPL
PARAMS = [pytest.param(c, torch.float16, id=f"{c.name}-fp16") for c in CASES] + \
         [pytest.param(c, torch.float32, id=f"{c.name}-fp32") for c in CASES if c.name in FP32_CASES]


def run_and_check(call, backward: bool, seed: int = 1):
    assert IMPL.can_implement(call.spec) is None, IMPL.can_implement(call.spec)
    before = clone_call(call)
    out, lse = IMPL.forward(call)
    grads, dout = (), None
    if backward:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
        grads = IMPL.backward(call, out, lse, dout)
    checks = check_outputs(before, out, lse, *grads, dout=dout)
    if backward and call.spec.mode == "batched" and call.spec.seqlen_k == 1:
        checks = [c for c in checks if c.name not in ("dq", "dk")] + single_key_grad_checks(call, grads, dout)
    assert all(c.ok for c in checks), "\n".join(str(c) for c in checks)
    if call.spec.mode == "kvcache" and call.k_new is not None:  # appended in place, like the oracle's impl
        append_kv_inplace(before)
        assert torch.equal(call.k, before.k) and torch.equal(call.v, before.v)
    return out, lse, grads


def single_key_grad_checks(call, grads, dout):
    """With one key, P = 1 and dQ = dK = 0 exactly: dS = P (dP - delta) cancels two fp32 sums of
    the same D products taken in different orders. The oracle's reference is then 0 and the rule's
    bound degenerates to the oracle's own noise, so bound the cancellation instead: each sum is
    off by at most D * u32 * sum|dO * V|, times |K| (|Q|) * scale in dQ (dK)."""
    from dualattn.accuracy import Check
    D = call.spec.head_dim_v
    g = call.spec.gqa_ratio
    v = call.v.float().repeat_interleave(g, dim=2)
    dpv = (dout.float().abs() * v.abs()).sum(-1).max().item()
    u32 = 2.0 ** -24
    res = []
    for name, grad, other, mult in (("dq", grads[0], call.k, 1), ("dk", grads[1], call.q, g * call.spec.seqlen_q)):
        bound = 2 * D * u32 * dpv * other.float().abs().max().item() * call.spec.scale * mult
        err = grad.float().abs().max().item()
        res.append(Check(name + " (single key)", err, bound, err <= bound))
    return res


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_case(case, dtype):
    call = make_call(case, "cpu", dtype, large=False)
    run_and_check(call, case.backward)


def test_bf16_upcast_path():
    # the interpreter's bf16 tl.dot is wrong, so the kernels upcast there; the rule still holds
    case = next(c for c in CASES if c.name == "causal+window (20,-1)")
    run_and_check(make_call(case, "cpu", torch.bfloat16, large=False), True)


def test_deterministic_flag_is_a_noop_and_bitwise():
    case = next(c for c in CASES if c.name == "odd 113x203 gqa")
    call = make_call(case, "cpu", torch.float16, large=False)
    from dataclasses import replace
    call_det = call.with_tensors()
    call_det.spec = replace(call.spec, deterministic=True)
    out, lse = IMPL.forward(call)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    g1 = IMPL.backward(call, out, lse, dout)
    g2 = IMPL.backward(call_det, out, lse, dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_fully_masked_rows_are_zero_not_nan():
    # key ranges that hide everything: out 0, LSE -inf, grads 0
    from dualattn import spec as S
    q, k, v = (torch.randn(1, 40, 2, 32, dtype=torch.float16) for _ in range(3))
    kr = torch.zeros(1, 1, 40, 1, 2, dtype=torch.int32)
    call = S.build_dense(q, k, v, key_ranges=kr, return_lse=True)
    out, lse = IMPL.forward(call)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
    dq, dk, dv = IMPL.backward(call, out, lse, torch.randn_like(out))
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


def test_can_implement_refuses_odd_block_size_and_page_size():
    from dataclasses import replace
    case = next(c for c in CASES if c.name == "dense 64x64")
    spec = make_call(case, "cpu", torch.float16, large=False).spec
    assert "multiples of 16" in IMPL.can_implement(replace(spec, block_size=(24, 64)))
    assert IMPL.can_implement(replace(spec, block_size=(48, 80))) is None  # tiles of 16 divide them
    kspec = replace(spec, mode="kvcache", paged=True, page_size=8, needs_grad=False)
    assert "page size" in IMPL.can_implement(kspec)


def test_decode_split_counts_agree_and_single_split_writes_output_directly():
    # one split (the kernel writes out/LSE itself, no combine) and several (workspace + combine)
    # both meet the accuracy rule; a repeated call is bitwise identical and reuses its plan
    from dataclasses import replace
    from dualattn.reference.triton import decode
    case = next(c for c in CASES if c.name == "kvcache window softcap splits")
    base = make_call(case, "cpu", torch.float16, large=False)
    for splits in (1, 2, 7):
        call = base.with_tensors(k=base.k.clone(), v=base.v.clone())
        call.spec = replace(base.spec, num_splits=splits)
        plan = decode.decode_plan(call)
        assert plan.num_splits == splits and plan.grid[0] == splits
        out, lse, _ = run_and_check(call, False)
        again = IMPL.forward(base.with_tensors(k=base.k.clone(), v=base.v.clone(), spec=call.spec))
        assert torch.equal(again[0], out) and torch.equal(again[1], lse)
        assert decode.decode_plan(call) is plan


def test_decode_auto_split_count_from_the_plan():
    from dualattn.reference.triton import decode
    case = next(c for c in CASES if c.name == "kvcache hd 128, mqa")
    call = make_call(case, "cpu", torch.float16, large=False)
    plan = decode.decode_plan(call)
    spec = call.spec
    units = spec.batch * spec.num_heads_kv * plan.grid[2]
    want = decode.choose_num_splits(units, -(-spec.seqlen_k // plan.tile.block_n), plan.slots)
    assert plan.num_splits == want and plan.grid == (want, spec.batch * spec.num_heads_kv, 1)
    run_and_check(call, False)


def test_decode_plan_cache_is_bounded_and_keeps_recent_plans(monkeypatch):
    # a server whose batch sizes keep changing makes a new spec per batch size: the plan cache
    # drops the least recently used plan past PLAN_CACHE_SIZE instead of growing without end
    from dataclasses import replace
    from dualattn.reference.triton import decode
    monkeypatch.setattr(decode, "PLAN_CACHE_SIZE", 3)
    monkeypatch.setattr(decode, "_PLANS", type(decode._PLANS)())
    case = next(c for c in CASES if c.name == "kvcache hd 128, mqa")
    base = make_call(case, "cpu", torch.float16, large=False)
    calls = []
    for splits in (1, 2, 3, 4):
        call = base.with_tensors(k=base.k.clone(), v=base.v.clone())
        call.spec = replace(base.spec, num_splits=splits)
        calls.append(call)
    first = decode.decode_plan(calls[0])
    for call in calls[1:3]:
        decode.decode_plan(call)
    assert decode.decode_plan(calls[0]) is first  # a hit refreshes it
    decode.decode_plan(calls[3])                  # evicts calls[1]'s plan, the least recent
    assert len(decode._PLANS) == 3
    assert decode.decode_plan(calls[0]) is first
    run_and_check(calls[1], False)  # an evicted plan is simply remade


def test_huge_window_bounds_mean_unbounded():
    # bounds past Sq + Sk are clamped by the spec: 2**31 - 1 used to wrap the kernels' 32-bit
    # block-range arithmetic to "no key visible" (Triton: all zeros; fast-sm120's deterministic
    # backward: lock ranks that no key block reaches)
    import dualattn
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 64, 2, 32, dtype=torch.float16) for _ in range(3))
    want = dualattn.attention(q, k, v, impl="torch")
    for w in ((-1, 2 ** 31 - 1), (2 ** 31 - 1, 2 ** 31 - 1), (2 ** 40, 2 ** 33)):
        got = dualattn.attention(q, k, v, window=w, impl="triton")
        assert torch.equal(got, dualattn.attention(q, k, v, impl="triton")), w
        assert (got.float() - want.float()).abs().max() < 1e-2, w


def _ram_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) / 2 ** 20
    except (OSError, ValueError, IndexError):
        return 0.0


@pytest.mark.skipif(_ram_gb() < 12, reason="maps a 4 GiB (lazily allocated) buffer")
@pytest.mark.parametrize("mode", ["batched", "kvcache-append"])
def test_row_offsets_past_2_31_elements(mode):
    # K (or the cache) holds Sk x Hkv x D = 2**31 + 25600 elements: row offsets inside the sequence
    # wrapped in int32 and read (or, appending, wrote) 4 GiB before the tensor. The tensor is a view
    # 2**31 elements into a lazily allocated buffer, so a wrapped access lands on zero pages inside
    # it: wrong numbers, not a crash. One query sees the last 41 keys (causal + window (40, -1)).
    import dualattn
    D, Dv, left = 256, 8, 40
    sk = (1 << 31) // D + 100
    buf = torch.empty((1 << 31) + sk * D, dtype=torch.float16)
    k = buf[(1 << 31):].view(1, sk, 1, D)
    v = torch.zeros(1, sk, 1, Dv, dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    q = (3 * torch.randn(1, 1, 1, D, generator=g)).to(torch.float16)
    last = sk - 1 if mode == "batched" else sk - 2  # kvcache: the appended key is the last one
    vis = slice(last - left + (mode != "batched"), last + 1)
    k[0, vis] = torch.randn(vis.stop - vis.start, 1, D, generator=g).to(torch.float16)
    v[0, vis] = torch.randn(vis.stop - vis.start, 1, Dv, generator=g).to(torch.float16)
    if mode == "batched":
        keys, vals = k[0, sk - 1 - left:, 0], v[0, sk - 1 - left:, 0]
        out, lse = dualattn.attention(q, k, v, causal=True, window=(left, -1), impl="triton", return_lse=True)
    else:
        k_new = torch.randn(1, 1, 1, D, generator=g).to(torch.float16)
        v_new = torch.randn(1, 1, 1, Dv, generator=g).to(torch.float16)
        keys = torch.cat([k[0, sk - 1 - left:sk - 1, 0], k_new[0, :, 0]])
        vals = torch.cat([v[0, sk - 1 - left:sk - 1, 0], v_new[0, :, 0]])
        out, lse = dualattn.attention_with_kvcache(
            q, k, v, cache_seqlens=torch.tensor([sk - 1], dtype=torch.int32), k_new=k_new, v_new=v_new,
            causal=True, window=(left, -1), impl="triton", return_lse=True)
        assert torch.equal(k[0, sk - 1], k_new[0, 0]) and torch.equal(v[0, sk - 1], v_new[0, 0])
    s = (q[0, 0, 0].float() @ keys.float().T) / D ** 0.5
    assert abs(float(lse) - float(torch.logsumexp(s, 0))) < 1e-3
    assert (out[0, 0, 0].float() - torch.softmax(s, 0) @ vals.float()).abs().max() < 2e-3
