"""The per-call host path: what a repeated call skips, and that skipping never hides bad input.

A cached kernel call should cost little on the CPU (issue 5: < 15 us), so repeated calls reuse
the validated spec (spec.build_dense), the dispatch decision (dispatch.select) and the packed
launch struct (fast/common/launch_args.py). These tests check the reuse and its limits on CPU.
"""
from __future__ import annotations

import pickle
import threading

import pytest
import torch

import dualattn
from dualattn import dispatch
from dualattn import spec as S


def _qkv(dtype=torch.float16, sq=5, sk=7, hq=4, hkv=2, d=16):
    q = torch.randn(1, sq, hq, d, dtype=dtype)
    k = torch.randn(1, sk, hkv, d, dtype=dtype)
    return q, k, torch.randn_like(k)


def test_repeated_dense_call_reuses_the_validated_spec():
    q, k, v = _qkv()
    a = S.build_dense(q, k, v, causal=True, window=(3, 0), softcap=2.0, scale=0.5, return_lse=True)
    b = S.build_dense(q, k, v, causal=True, window=(3, 0), softcap=2.0, scale=0.5, return_lse=True)
    assert b.spec is a.spec and b.q is q and b.k is k and b.v is v
    S._DENSE_MEMO.clear()
    c = S.build_dense(q, k, v, causal=True, window=(3, 0), softcap=2.0, scale=0.5, return_lse=True)
    assert c.spec == a.spec and c.spec is not a.spec
    # any argument that changes the spec gives another one
    assert S.build_dense(q, k, v, causal=False, window=(3, 0), softcap=2.0, scale=0.5).spec.causal is False
    assert S.build_dense(q, k, v, causal=True, window=(3, 0), softcap=2.0, scale=0.5,
                         needs_grad=True).spec.needs_grad
    assert S.build_dense(q[:, :4], k, v).spec.seqlen_q == 4


def test_repeated_call_skips_the_checks(monkeypatch):
    q, k, v = _qkv()
    S.build_dense(q, k, v, scale=0.25)

    def boom(*a, **kw):
        raise AssertionError("checks ran again")

    monkeypatch.setattr(S, "_check_scalars", boom)
    S.build_dense(q, k, v, scale=0.25)  # served from the memo
    with pytest.raises(AssertionError, match="checks ran again"):
        S.build_dense(q, k, v, scale=0.3)  # new arguments are checked


@pytest.mark.parametrize("good,bad,err", [
    (dict(causal=True), dict(causal=1), TypeError),
    (dict(window=(1, 0)), dict(window=(True, 0)), TypeError),
    (dict(window=(1, 0)), dict(window=(1.0, 0)), TypeError),
    (dict(window=(1, 0)), dict(window=(-2, 0)), ValueError),
    (dict(scale=1.0), dict(scale=-1.0), ValueError),
    (dict(softcap=1.0), dict(softcap=float("nan")), ValueError),
    (dict(softcap=1.0), dict(softcap=[1.0]), TypeError),
])
def test_memo_never_lets_bad_input_through(good, bad, err):
    q, k, v = _qkv()
    for _ in range(2):
        S.build_dense(q, k, v, **good)
        with pytest.raises(err):
            S.build_dense(q, k, v, **bad)


def test_memo_keys_on_tensors_dtype_device_and_shape():
    q, k, v = _qkv()
    S.build_dense(q, k, v)
    with pytest.raises(TypeError, match="k: dtype"):
        S.build_dense(q, k.bfloat16(), v)
    with pytest.raises(ValueError, match="v: shape"):
        S.build_dense(q, k, v[:, :3])
    with pytest.raises(ValueError, match="multiple"):
        S.build_dense(q[:, :, :3], k, v)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        S.build_dense(q.numpy(), k, v)


def test_spec_hash_is_cached_but_not_pickled():
    q, k, v = _qkv()
    spec = S.build_dense(q, k, v).spec
    h = hash(spec)
    assert hash(spec) == h and spec.__dict__.get("_hash") == h
    back = pickle.loads(pickle.dumps(spec))
    assert back == spec and "_hash" not in back.__dict__ and hash(back) == h
    other = S.AttentionSpec(**{n: getattr(spec, n) for n in S._SPEC_FIELDS})
    assert other == spec and hash(other) == h


class _Recorder:
    name = "recorder"
    family = "torch"

    def __init__(self):
        self.specs = []

    def can_implement(self, spec):
        self.specs.append(spec)
        return None

    def forward(self, call):
        self.specs.append(call.spec)
        out = torch.zeros(call.q.shape[:3] + (call.v.shape[-1],), dtype=call.q.dtype)
        return out, torch.zeros(call.q.shape[0], call.q.shape[2], call.q.shape[1])


def test_api_sets_needs_grad_and_reuses_dispatch(monkeypatch):
    dispatch._load()  # register the real implementations before the registry is swapped
    rec = _Recorder()
    monkeypatch.setitem(dispatch._REGISTRY, "torch", [rec])
    q, k, v = _qkv(torch.float32)
    dualattn.attention(q, k, v, impl="torch")
    dualattn.attention(q, k, v, impl="torch")
    # can_implement ran once (the second call reused the decision), forward twice
    assert len(rec.specs) == 3 and not rec.specs[-1].needs_grad
    with torch.no_grad():
        dualattn.attention(q, k, v.requires_grad_(), impl="torch")
    assert not rec.specs[-1].needs_grad
    v.requires_grad_(False)
    q.requires_grad_()
    S._DENSE_MEMO.clear()
    spec = S.build_dense(q, k, v, needs_grad=dualattn.api._needs_grad(q, k, v)).spec
    assert spec.needs_grad


def test_select_memo_follows_the_registry(monkeypatch):
    dispatch._load()
    q, k, v = _qkv(torch.float32)
    spec = S.build_dense(q, k, v).spec
    first = dispatch.select(spec, "torch")
    assert dispatch.select(spec, "torch") is first
    rec = _Recorder()
    monkeypatch.setitem(dispatch._REGISTRY, "torch", [rec])
    assert dispatch.select(spec, "torch") is rec  # a swapped family list is seen at once
    monkeypatch.undo()
    assert dispatch.select(spec, "torch") is first
    n = len(dispatch._SELECT_MEMO)
    assert n > 0
    monkeypatch.setitem(dispatch._REGISTRY, "torch", list(dispatch._REGISTRY["torch"]))
    dispatch.register(rec)  # registering clears every remembered decision
    assert len(dispatch._SELECT_MEMO) == 0
    assert dispatch.select(spec, "torch") is first  # registered after: first still wins


class _LaunchingRecorder(_Recorder):
    """A recorder that also offers api.attention a per-signature launcher (as fast-sm90 does)."""
    name = "launching-recorder"

    def __init__(self):
        super().__init__()
        self.made, self.runs = [], 0

    def direct_launcher(self, call):
        self.made.append(call.spec)

        def run(q, k, v):
            self.runs += 1
            return (torch.full(q.shape[:3] + (v.shape[-1],), 7.0, dtype=q.dtype),
                    torch.zeros(q.shape[0], q.shape[2], q.shape[1]))
        return run


def test_api_launch_memo_replays_only_identical_inference_calls(monkeypatch):
    dispatch._load()
    monkeypatch.delenv("DUALATTN_MODE", raising=False)
    rec = _LaunchingRecorder()
    monkeypatch.setitem(dispatch._REGISTRY, "torch", [rec])
    q, k, v = _qkv(torch.float32)
    first = dualattn.attention(q, k, v, impl="torch")  # checks, dispatch, forward; launcher kept
    assert len(rec.made) == 1 and rec.runs == 0 and bool((first == 0).all())
    again = dualattn.attention(q, k, v, impl="torch")  # the same arguments: replayed
    assert rec.runs == 1 and bool((again == 7).all())
    out, lse = dualattn.attention(q, k, v, impl="torch", return_lse=True)  # another key: full path
    assert rec.runs == 1 and len(rec.made) == 2 and lse is not None
    # new data of the same shapes is replayed; a different flag, a strided view, autograd or a
    # debugging mode are not
    dualattn.attention(torch.randn_like(q), k, v, impl="torch")
    assert rec.runs == 2
    dualattn.attention(q, k, v, impl="torch", causal=True)
    dualattn.attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, impl="torch")
    dualattn.attention(q.clone().requires_grad_(), k, v, impl="torch")
    monkeypatch.setenv("DUALATTN_MODE", "reference")
    dualattn.attention(q, k, v, impl="torch")
    monkeypatch.delenv("DUALATTN_MODE")
    assert rec.runs == 2
    # a swapped family list is seen at once: the new one decides (and its launcher is kept)
    rec2 = _LaunchingRecorder()
    monkeypatch.setitem(dispatch._REGISTRY, "torch", [rec2])
    assert bool((dualattn.attention(q, k, v, impl="torch") == 0).all())
    assert bool((dualattn.attention(q, k, v, impl="torch") == 7).all()) and rec2.runs == 1 and rec.runs == 2
    # bad input is never replayed: its key differs from every remembered one
    with pytest.raises(TypeError):
        dualattn.attention(q, k, v, impl="torch", causal=1)


def test_api_launch_memo_keeps_no_launcher_where_none_is_offered(monkeypatch):
    dispatch._load()
    rec = _Recorder()
    monkeypatch.setitem(dispatch._REGISTRY, "torch", [rec])
    dispatch.LAUNCH_MEMO.clear()
    q, k, v = _qkv(torch.float32)
    for _ in range(3):
        dualattn.attention(q, k, v, impl="torch", window=(2, 0))
    assert len(rec.specs) == 4  # can_implement once, forward three times
    assert [hit[1] for hit in dispatch.LAUNCH_MEMO.values()] == [None]  # remembered once, as "none"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal,return_lse,d", [(False, False, 64), (True, True, 64), (False, True, 128)])
def test_api_launch_memo_on_fast_sm90(causal, return_lse, d):
    """fast-sm90's launcher, replayed by api.attention, computes what the full path does: fresh
    data each call, odd shapes, the accuracy rule against the oracle, bitwise equal to the full
    path's output; a misaligned (offset) input falls back to the full path, which copies it."""
    from dualattn.accuracy import check_outputs
    if dispatch.device_arch(0) != 90:
        pytest.skip("fast-sm90 needs an sm_90 GPU")
    torch.manual_seed(0)
    shape_q, shape_k = (2, 113, 4, d), (2, 203, 2, d)
    for rep in range(3):
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16)
        res = dualattn.attention(q, k, v, causal=causal, return_lse=return_lse, impl="fast")
        out, lse = res if return_lse else (res, None)
        call = S.build_dense(q, k, v, causal=causal, return_lse=return_lse)
        assert all(c.ok for c in check_outputs(call, out, lse)), rep
        full, full_lse = dispatch.select(call.spec, "fast").forward(call)
        assert torch.equal(out, full) and (lse is None or torch.equal(lse, full_lse))
    key = next(key for key in dispatch.LAUNCH_MEMO if key[0][0] == torch.Size(shape_q) and key[-1] == "fast")
    assert dispatch.LAUNCH_MEMO[key][1] is not None  # the replays above went through the launcher
    buf = torch.randn(q.numel() + 1, device="cuda", dtype=torch.bfloat16)
    q_off = buf[1:].view(shape_q)  # contiguous, but 2 bytes off 16-byte alignment
    res = dualattn.attention(q_off, k, v, causal=causal, return_lse=return_lse, impl="fast")
    out = res[0] if return_lse else res
    call = S.build_dense(q_off, k, v, causal=causal)
    assert all(c.ok for c in check_outputs(call, out))


# -- launch_args --------------------------------------------------------------------------------

def _schema():
    from dualattn.fast.common.launch_args import ArgSchema
    return ArgSchema([("a", "i32"), ("b", "i64"), ("c", "f32"), ("d", "i32")])


def test_pack_reuses_one_struct_per_thread():
    pytest.importorskip("cutlass")
    sch = _schema()
    p1 = sch.pack(1, 2, 0.5, 3)
    ptrs = [x.value for x in p1.__c_pointers__()]
    s = p1.storage
    assert (s.a, s.b, s.c, s.d) == (1, 2, 0.5, 3)
    p2 = sch.pack(-4, 1 << 40, 1.5, 7)
    assert [x.value for x in p2.__c_pointers__()] == ptrs  # same addresses, no per-call objects
    assert (p2.storage.a, p2.storage.b, p2.storage.c, p2.storage.d) == (-4, 1 << 40, 1.5, 7)
    with pytest.raises(RuntimeError, match="stale"):
        p1.__c_pointers__()  # its values were overwritten: never launched silently
    other = {}

    def worker():
        p = sch.pack(9, 9, 9.0, 9)
        other["ptrs"] = [x.value for x in p.__c_pointers__()]
        other["vals"] = (p.storage.a, p.storage.d)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert other["vals"] == (9, 9) and other["ptrs"] != ptrs  # threads never share a struct
    assert p2.storage.a == -4 and p2.__c_pointers__()  # this thread's pack is untouched
    offs = sch.offsets
    assert [p - ptrs[0] for p in ptrs] == [o - offs[0] for o in offs]


def _probe():
    """A host-only compiled entry (runs on the CPU: no kernel) that writes its fields to ``out``."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32

    def schema():
        from dualattn.fast.common.launch_args import ArgSchema
        return ArgSchema([("out", ("ptr", cutlass.Float32, 4)), ("a", "i32"), ("b", "i64"),
                          ("c", "f32"), ("d", "i32")])

    @cute.jit
    def probe(args, stream):
        out_ptr, a, b, c, d = args.values
        t = cute.make_tensor(out_ptr, cute.make_layout(4))
        t[0] = Float32(a)
        t[1] = Float32(b // 1024)
        t[2] = c
        t[3] = Float32(d)

    sch = schema()
    return cute.compile(probe, sch.fake(), cuda.CUstream(0)), sch, schema


@pytest.mark.compile_only
def test_direct_launcher_matches_the_dsl_call():
    pytest.importorskip("cutlass")
    import cuda.bindings.driver as cuda
    from dualattn.fast.common.launch_args import DirectLauncher

    fn, sch, schema = _probe()
    launch = DirectLauncher(fn)
    buf = torch.zeros(4)
    rets = []
    for i in range(4):  # the first call goes through the DSL and primes; the rest are direct
        rets.append(launch(sch.pack(buf.data_ptr(), -5 - i, (3 + i) << 10, 2.5 + i, 100 + i), cuda.CUstream(0)))
        assert buf.tolist() == [-5.0 - i, 3.0 + i, 2.5 + i, 100.0 + i]
    assert rets == [0] * 4  # the DSL's return value (CUDA status) on both paths
    assert launch.enabled and launch._tls.state is not None
    # the stream slot holds a pointer to the handle, as the DSL's own stream adapter passes it
    launch(sch.pack(buf.data_ptr(), 1, 1, 1.0, 1), cuda.CUstream(4242))
    assert launch._tls.state[1].value == 4242
    # another schema (another spec sharing the compiled kernel) gets its own ready array
    other, buf2 = schema(), torch.zeros(4)
    launch(other.pack(buf2.data_ptr(), 7, 2048, 1.0, 3), cuda.CUstream(0))
    assert buf2.tolist() == [7.0, 2.0, 1.0, 3.0]
    stale = sch.pack(buf.data_ptr(), 1, 1, 1.0, 1)
    sch.pack(buf.data_ptr(), 2, 2, 2.0, 2)
    with pytest.raises(RuntimeError, match="stale"):
        launch(stale, cuda.CUstream(0))
    # switched off: every call takes the DSL's path, with the same results
    off = DirectLauncher(fn)
    off.enabled = False
    off(sch.pack(buf.data_ptr(), 9, 9 << 10, 9.0, 9), cuda.CUstream(0))
    off(sch.pack(buf.data_ptr(), 8, 8 << 10, 8.0, 8), cuda.CUstream(0))
    assert buf.tolist() == [8.0, 8.0, 8.0, 8.0] and getattr(off._tls, "state", None) is None


@pytest.mark.compile_only
def test_bound_launch_writes_only_the_pointers_and_keeps_its_fixed_fields():
    # fast-sm90's replayed inference call: the fields after the pointers are packed once, into
    # the bound launch's own struct; calls write the pointers alone (host-only probe, CPU)
    pytest.importorskip("cutlass")
    import threading

    import cuda.bindings.driver as cuda
    from dualattn.fast.common.launch_args import BoundLaunch, DirectLauncher

    fn, sch, _ = _probe()
    launch = DirectLauncher(fn)
    first = BoundLaunch(launch, sch, 1, (-5, 3 << 10, 2.5, 100))
    second = BoundLaunch(launch, sch, 1, (7, 9 << 10, -1.5, 4))
    bufs = [torch.zeros(4) for _ in range(3)]
    for i in range(3):  # the first call packs everything and primes the launcher; then direct
        first((bufs[i].data_ptr(),), cuda.CUstream(0))
        assert bufs[i].tolist() == [-5.0, 3.0, 2.5, 100.0]
    assert first._tls.ready is not None
    # another signature on the same launcher, and a regular packed call of the same schema in
    # between, leave the first one's fixed fields alone
    second((bufs[0].data_ptr(),), cuda.CUstream(0))
    assert bufs[0].tolist() == [7.0, 9.0, -1.5, 4.0]
    launch(sch.pack(bufs[1].data_ptr(), 1, 1 << 10, 1.0, 1), cuda.CUstream(0))
    first((bufs[2].data_ptr(),), 4242)
    assert bufs[2].tolist() == [-5.0, 3.0, 2.5, 100.0] and launch._tls.state[1].value == 4242
    # another thread gets its own struct and array (and primes the launcher there first)
    other = torch.zeros(4)

    def in_thread():
        for _ in range(2):
            first((other.data_ptr(),), cuda.CUstream(0))
    th = threading.Thread(target=in_thread)
    th.start()
    th.join()
    assert other.tolist() == [-5.0, 3.0, 2.5, 100.0]
    # a disabled launcher: every call packs all fields and takes the DSL's path
    off = DirectLauncher(fn)
    off.enabled = False
    bound_off = BoundLaunch(off, sch, 1, (8, 8 << 10, 8.0, 8))
    for _ in range(2):
        bound_off((bufs[1].data_ptr(),), cuda.CUstream(0))
    assert bufs[1].tolist() == [8.0, 8.0, 8.0, 8.0] and getattr(bound_off._tls, "ready", None) is None
    with pytest.raises(ValueError, match="do not match"):
        BoundLaunch(launch, sch, 2, (1, 2, 3.0))  # the second field is no pointer


@pytest.mark.compile_only
def test_packed_entry_passes_call_arguments_in_order():
    # the sm120 kernels' one-struct launch: a schema derived from __call__'s prototypes, compiled
    # through PackedEntry.from_packed, hands every value to __call__ in its place (host-only probe)
    pytest.importorskip("cutlass")
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from dualattn.fast.common.launch_args import DirectLauncher, schema_like
    from dualattn.fast.common.packed_entry import PackedEntry

    class Probe(PackedEntry):
        @cute.jit
        def __call__(self, p_out: cute.Pointer, a: Int32, s: Float32, p_unused: cute.Pointer, b: Int32, stream):
            t = cute.make_tensor(p_out, cute.make_layout(3))
            t[0] = Float32(a)
            t[1] = s
            t[2] = Float32(b)

    ptr = cute.runtime.make_ptr
    protos = [ptr(Float32, 1 << 20, cute.AddressSpace.gmem, assumed_align=4), Int32(1), Float32(1.0),
              ptr(Int32, 1 << 20, cute.AddressSpace.gmem, assumed_align=8), Int32(1)]
    sch = schema_like(protos)
    assert sch.kinds == ["ptr", "i32", "f32", "ptr", "i32"]
    assert [sch.ptr_info[n][1] for n in ("a0", "a3")] == [4, 8]  # alignments are compiled in
    fn = cute.compile(Probe().from_packed, sch.fake(), cuda.CUstream(0))
    launch, buf = DirectLauncher(fn), torch.zeros(3)
    for i in range(3):  # the DSL's path, then the direct one
        launch(sch.pack(buf.data_ptr(), 7 + i, 0.25 * i, 64, -3 - i), cuda.CUstream(0))
        assert buf.tolist() == [7.0 + i, 0.25 * i, -3.0 - i]
    with pytest.raises(TypeError, match="argument 1"):
        schema_like([protos[0], 3])


def test_empty_output_is_contiguous_in_qs_dtype_and_device():
    from dualattn.fast.common.launch_args import empty_f32, empty_output
    q = torch.randn(2, 5, 3, 64, dtype=torch.bfloat16)
    strided = torch.randn(2, 3, 5, 64, dtype=torch.bfloat16).transpose(1, 2)  # not contiguous
    for t in (q, strided):
        for dv in (64, 32):
            o = empty_output(t, dv)
            assert o.shape == (2, 5, 3, dv) and o.dtype == t.dtype and o.device == t.device
            assert o.is_contiguous() and o.data_ptr() != t.data_ptr()
    lse = empty_f32(q, (2, 3, 5))
    assert lse.shape == (2, 3, 5) and lse.dtype == torch.float32 and lse.is_contiguous()


def test_fast_sm90_offers_no_launcher_where_forward_does_more_than_one_launch():
    """direct_launcher refuses what forward() treats specially (checked before any compile, so on
    the CPU too): varlen, key ranges, a CSR, preallocated outputs, inputs _prep would copy, empty
    calls, and an object whose forward was replaced (props.planted)."""
    pytest.importorskip("cutlass")
    from dualattn.fast.sm90 import FastSm90Forward
    from dualattn.masks import segments_to_key_ranges
    from dualattn.sparse import BlockSparse
    impl = FastSm90Forward()
    q, k, v = _qkv(torch.bfloat16, sq=128, sk=128, d=64)
    kr = segments_to_key_ranges([[64, 64]], 128, causal=True)
    refused = [
        S.build_dense(q, k, v, key_ranges=kr),
        S.build_dense(q, k, v, block_sparse=BlockSparse.from_key_ranges(kr, 128, 128, 128, 128)),
        S.build_dense(q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
        S.build_dense(q[:, :0], k, v),
        S.build_dense(q, k[:, :0], v[:, :0]),
        S.build_varlen(q[0], k[0], v[0], torch.tensor([0, 128], dtype=torch.int32),
                       torch.tensor([0, 128], dtype=torch.int32), 128, 128),
    ]
    extra = S.build_dense(q, k, v)
    extra.extra["out"] = torch.empty_like(q)
    refused.append(extra)
    for call in refused:
        assert impl.direct_launcher(call) is None, call.spec.short()
    impl.forward = lambda call: None  # a replaced forward: even a plain call gets no launcher
    assert impl.direct_launcher(S.build_dense(q, k, v)) is None


def test_fast_sm90_launcher_packs_what_forward_packs(monkeypatch):
    """The replayed launcher hands the compiled entry the same packed values as forward() does
    (pointers, shapes, strides, runtime scalars, split tail groups: arg_schema's fields), with fresh
    outputs."""
    pytest.importorskip("cutlass")
    import dualattn.fast.sm90 as sm90
    impl = sm90.FastSm90Forward()
    q, k, v = _qkv(torch.bfloat16, sq=128, sk=96, hq=4, hkv=2, d=64)
    call = S.build_dense(q, k, v, causal=True, return_lse=True)
    tail = impl.scalar_fields(call.spec, 132)
    schema = impl.arg_schema(call.spec)
    # (a causal call on the persistent grid carries the stream-K fields; none cut at this size)
    monkeypatch.setattr(sm90, "_NUM_SMS_ENV", "132")  # (no GPU to ask)
    plan = impl.stream_k_plan(call.spec, q.device) + (2, True) if impl.stream_k(call.spec) else None
    assert plan is None or plan[0] == 0
    monkeypatch.setattr(impl, "_entry", lambda spec, device: ("entry", schema.pack, tail, plan))
    launched = []
    # the launcher hands _launch a BoundLaunch and the five pointers; it packs them before its
    # fixed values (BoundLaunch's own CPU test shows that)
    monkeypatch.setattr(sm90, "_launch", lambda fn, args, device: launched.append((fn.launcher, (*args, *fn.fixed))))
    run = impl.direct_launcher(call)
    out, lse = run(q, k, v)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (1, 4, 128)
    expected = impl.pack_args(lambda *vals: vals, tail, q, k, v, out, lse, impl.no_cut_fields(call.spec))
    assert launched == [("entry", expected)]
    assert len(expected) == len(impl.arg_schema(call.spec).names)
    assert run(q[:, :, :, :].clone(), k, v) is not None and len(launched) == 2  # new data, same launcher
