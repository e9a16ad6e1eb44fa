"""Triton kernels: the interpreter suite (in its own process) and the GPU suite (marked gpu).

CPU: tests/test_triton_interp.py needs TRITON_INTERPRET=1 before the kernels are defined, and
setting it in this process would also switch every other test's impl="auto" CPU calls onto the
interpreter; so it runs in a child process here.
GPU: the same case catalogue at realistic sizes in bf16/fp16 against the oracle, bitwise
determinism of the backward, and CUDA-graph capture of the decode path.
"""
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from test_triton_cases import CASES, clone_call, make_call

HERE = Path(__file__).resolve().parent
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.timeout(600)
def test_interpreter_suite_in_child_process():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 here: tests/test_triton_interp.py runs in this process instead")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_triton_interp.py")]
    try:
        r = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired as e:  # a hang is a failure
        pytest.fail(f"interpreter suite timed out:\n{(e.stdout or '')[-4000:]}")
    assert r.returncode == 0, f"interpreter suite failed (rc {r.returncode}):\n{r.stdout[-8000:]}\n{r.stderr[-2000:]}"
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


def test_can_implement_refuses_cpu_without_interpreter():
    from dualattn.reference import triton as ttr
    from dualattn import spec as S
    if ttr.KERNELS_INTERPRETED:
        pytest.skip("kernels were built for the interpreter in this process")
    q = torch.randn(1, 4, 1, 16)
    reason = ttr.IMPL.can_implement(S.build_dense(q, q, q).spec)
    assert reason is not None and "TRITON_INTERPRET" in reason


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------

def _impl():
    from dualattn.reference import triton as ttr
    if ttr.KERNELS_INTERPRETED:
        pytest.skip("kernels were built for the interpreter in this process")
    return ttr.IMPL


def _check(call, out, lse, grads, dout):
    from dualattn.accuracy import check_outputs
    checks = check_outputs(call, out, lse, *grads, dout=dout)
    assert all(c.ok for c in checks), "\n".join(str(c) for c in checks)


GPU_FP16 = {"odd 113x203 gqa", "causal sq>sk (empty rows)", "causal+window (20,-1)", "softcap 5 causal",
            "hd 256", "dv!=d 192/128 causal", "key ranges: documents", "block sparse: documents (64,64)",
            "varlen causal gqa", "kvcache paged + append causal"}
GPU_PARAMS = [pytest.param(c, torch.bfloat16, id=f"{c.name}-bf16") for c in CASES] + \
             [pytest.param(c, torch.float16, id=f"{c.name}-fp16") for c in CASES if c.name in GPU_FP16]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,dtype", GPU_PARAMS)
def test_gpu_case(case, dtype):
    impl = _impl()
    call = make_call(case, "cuda", dtype, large=True)
    assert impl.can_implement(call.spec) is None, impl.can_implement(call.spec)
    before = clone_call(call)
    out, lse = impl.forward(call)
    grads, dout = (), None
    if case.backward:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device="cuda", dtype=dtype)
        grads = impl.backward(call, out, lse, dout)
    torch.cuda.synchronize()
    _check(before, out, lse, grads, dout)


COMPACT_CASES = [pytest.param(n, dt, id=f"{n}-{str(dt)[6:]}") for n, dt in (
    ("hd 256", torch.bfloat16), ("dv!=d 192/128 causal", torch.bfloat16), ("hd 256", torch.float32),
    ("odd 113x203 gqa", torch.bfloat16), ("odd 113x203 gqa", torch.float32))]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,dtype", COMPACT_CASES)
def test_gpu_tiles_of_gpus_with_99kb_shared_memory(name, dtype, monkeypatch):
    """The tiles RTX 30xx/40xx/50xx get (configs._COMPACT*), run here by making the launcher see
    99 KB of shared memory per block."""
    from dualattn.reference.triton import launch
    monkeypatch.setattr(launch, "device_shared_memory", lambda index: 99 * 1024)
    test_gpu_case(next(c for c in CASES if c.name == name), dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["odd 113x203 gqa", "causal sq<sk", "block sparse: random per head (32,32)",
                                  "varlen causal gqa", "key ranges: documents"])
def test_gpu_backward_bitwise_deterministic(name):
    impl = _impl()
    case = next(c for c in CASES if c.name == name)
    call = make_call(case, "cuda", torch.bfloat16, large=True)
    call.spec = replace(call.spec, deterministic=True)  # a no-op: no atomics anywhere
    out, lse = impl.forward(call)
    dout = torch.randn_like(out)
    first = impl.backward(call, out, lse, dout)
    for _ in range(4):
        again = impl.backward(call, out, lse, dout)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    out2, lse2 = impl.forward(call)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_decode_cuda_graph(paged):
    """Capture append + split + combine once; replay with new queries, new tokens and new cache
    lengths written into the captured tensors; compare each replay with the oracle."""
    from dualattn import spec as S
    impl = _impl()
    case = next(c for c in CASES if c.name == ("kvcache paged + append causal" if paged else "kvcache decode gqa"))
    call = make_call(case, "cuda", torch.bfloat16, large=True)
    impl.forward(clone_call(call))  # compile outside the capture
    torch.cuda.synchronize()
    S.set_value_checks(False)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = impl.forward(call)
        gen = torch.Generator().manual_seed(7)
        cap = call.spec.seqlen_k
        for step in range(3):
            call.q.copy_(torch.randn(call.q.shape, generator=gen).to(call.q))
            n_new = call.spec.num_new_kv
            call.cache_seqlens.copy_(torch.randint(0, cap - n_new + 1, call.cache_seqlens.shape, generator=gen).to(call.cache_seqlens))
            if n_new:
                call.k_new.copy_(torch.randn(call.k_new.shape, generator=gen).to(call.k_new))
                call.v_new.copy_(torch.randn(call.v_new.shape, generator=gen).to(call.v_new))
            before = clone_call(call)
            g.replay()
            torch.cuda.synchronize()
            _check(before, out, lse, (), None)
    finally:
        S.set_value_checks(True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
def test_gpu_decode_page_offsets_past_2_31():
    """Pages at the end of a >2**31-element paged cache: the offsets must be 64-bit."""
    from dualattn import spec as S
    impl = _impl()
    ps, hkv, d, b, cap = 256, 8, 128, 2, 2048
    n_pages = (1 << 31) // (ps * hkv * d) + 2 * (cap // ps) + 1
    kc = torch.empty(n_pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    table = torch.arange(n_pages - b * (cap // ps), n_pages, device="cuda", dtype=torch.int32).reshape(b, cap // ps)
    kc[table.flatten().long()] = torch.randn(b * (cap // ps), ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc[table.flatten().long()] = torch.randn(b * (cap // ps), ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(b, 1, 4 * hkv, d, device="cuda", dtype=torch.bfloat16)
    kn, vn = (torch.randn(b, 2, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([cap - 2, 1000], dtype=torch.int32, device="cuda")
    call = S.build_kvcache(q, kc, vc, cache_seqlens=lens, page_table=table, k_new=kn, v_new=vn, causal=True,
                           return_lse=True)
    out, lse = impl.forward(call)
    torch.cuda.synchronize()
    _check(call, out, lse, (), None)
    last = table[0, -1].long()
    assert torch.equal(kc[last, ps - 2:], kn[0])  # appended into the last page, past 2**31 elements
    del kc, vc
    torch.cuda.empty_cache()


def test_decode_split_count_fills_whole_waves():
    from dualattn.reference.triton.decode import MAX_SPLITS, choose_num_splits
    # H100/H200 with the hd128 tile (128 keys, one program per SM): 132 slots. batch 8 x 8 KV
    # heads at 8k (64 blocks): 2 splits fill one wave; batch 64 needs none; batch 1 at 32k: 16
    assert choose_num_splits(64, 64, 132) == 2
    assert choose_num_splits(512, 64, 132) == 1
    assert choose_num_splits(8, 256, 132) == 16
    # with 64-key blocks and two programs per SM (264 slots): 4 splits fill one wave, where the
    # earlier rule's 9 needed three waves of 15-block programs
    assert choose_num_splits(64, 128, 264) == 4
    assert choose_num_splits(64, 512, 264) == 4
    # batch 64: 512 items are already two waves; splitting adds waves and combine work
    assert choose_num_splits(512, 128, 264) == 1
    # one item: as many splits as slots allow, but never more than blocks or MAX_SPLITS
    assert choose_num_splits(1, 3, 264) == 3
    assert choose_num_splits(1, 10_000, 264) == MAX_SPLITS
    assert choose_num_splits(8, 0, 264) == 1  # an empty cache
    for units, blocks, slots in ((3, 97, 7), (64, 128, 132), (17, 1000, 264), (600, 40, 264)):
        s = choose_num_splits(units, blocks, slots)
        assert 1 <= s <= min(blocks, MAX_SPLITS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch,cache", [(8, 8192), (64, 2048), (1, 4096)])
def test_gpu_decode_bench_shapes_eager_and_graph(batch, cache):
    """The benchmark's decode shape (GQA 32/8, hd128, bf16, full caches) against the oracle, with
    the split count the plan picks (one split writes the output directly; several go through the
    combine); a CUDA-graph replay of the same call is bitwise equal to the eager call."""
    from dualattn import spec as S
    from dualattn.reference.triton import decode
    impl = _impl()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, cache, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    lens[0] = cache - 77  # one partial last block
    call = S.build_kvcache(q, k, v, cache_seqlens=lens, return_lse=True)
    out, lse = impl.forward(call)
    torch.cuda.synchronize()
    _check(call, out, lse, (), None)
    plan = decode.decode_plan(call)
    print(f"b{batch} cache {cache}: {plan.num_splits} splits, {plan.slots} resident programs, tile {plan.tile}")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gout, glse = impl.forward(call)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(gout, out) and torch.equal(glse, lse)


def test_wide_rows_only_where_a_sequence_passes_2_31_elements():
    # the backward computes in-sequence row offsets in 64 bits only when rows x row stride can pass
    # 2**31 (common._row): meta tensors, no memory
    from dualattn import spec as S
    from dualattn.reference.triton.launch import Launch
    q = torch.empty(1, 16, 8, 256, device="meta", dtype=torch.float16)
    # (a 256-row margin covers the tile that overhangs the last row)
    for sk, wide in ((4096, False), ((1 << 31) // (8 * 256) - 300, False), ((1 << 31) // (8 * 256) - 100, True),
                     ((1 << 31) // (8 * 256) + 10, True)):
        k = torch.empty(1, sk, 8, 256, device="meta", dtype=torch.float16)
        L = Launch(S.build_dense(q, k, k, return_lse=True), "dkdv")
        assert L.wide_rows() == wide, sk
    # a long dO (laid out like q) alone also needs it
    k = torch.empty(1, 4096, 8, 256, device="meta", dtype=torch.float16)
    L = Launch(S.build_dense(q, k, k, return_lse=True), "dkdv")
    big_do = torch.empty(1, 16, 1 << 20, 256, device="meta", dtype=torch.float16).transpose(1, 2)
    assert not L.wide_rows() and L.wide_rows(q_like=(big_do,))


def test_interpreter_range_fix_squeezes_one_element_scalars(monkeypatch):
    """Triton 3.6's interpreter turns a tensor loop bound into an int with ``int(data)``, where
    ``data`` is a (1,) numpy array; NumPy >= 2.4 refuses that (triton-lang/triton#9171), so every
    ``for blk in range(lo, hi)`` of the reference kernels failed under TRITON_INTERPRET=1 there
    (seen on the H100 machine: triton 3.6.0, numpy 2.5.2). reference/triton/common's shim wraps
    the interpreter's tensor patch with newer Triton's ``int(data.squeeze())`` where the
    installed one fails, and leaves a working one alone."""
    import types

    import numpy as np
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    from dualattn.reference.triton import common

    one = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([7], np.int32)))

    def triton36_patch(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    def squeezing_index(self):
        return int(self.handle.data.squeeze())

    def triton39_patch(tensor, scope):
        scope.set_attr(tensor, "__index__", squeezing_index)

    if np.lib.NumpyVersion(np.__version__) >= "2.4.0":  # the case the shim exists for
        class Unfixed:
            pass

        triton36_patch(Unfixed, interpreter._LangPatchScope())
        with pytest.raises(TypeError, match="0-dimensional"):
            Unfixed.__index__(one)
    for patch, keeps in ((triton36_patch, False), (triton39_patch, True)):
        monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)
        common._interpreter_range_fix()
        assert interpreter._patch_lang_tensor is not patch

        class Tensor:
            pass

        scope = interpreter._LangPatchScope()
        interpreter._patch_lang_tensor(Tensor, scope)
        assert Tensor.__index__(one) == 7
        assert (Tensor.__index__ is squeezing_index) == keeps
        scope.restore()
        assert not hasattr(Tensor, "__index__")
