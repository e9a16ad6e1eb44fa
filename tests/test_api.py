"""Public API: autograd, dispatch and explain, reference/check modes, compare and repro files, CLI."""
import os
import subprocess
import sys

import pytest
import torch

import dualattn
from dualattn import debug, dispatch
from dualattn import spec as S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _OffByOneCausal:
    """A deliberately wrong implementation: causal diagonal shifted by one (sees one key too many)."""

    name = "broken-test-impl"
    family = "fast"

    def can_implement(self, spec):
        return None if spec.mode == "batched" and not spec.needs_grad else "test impl: batched forward only"

    def forward(self, call):
        from dualattn.reference.torch_ref import attention_ref

        k = torch.cat([call.k, call.k[:, -1:]], 1)  # one more key: the diagonal moves by one
        v = torch.cat([call.v, call.v[:, -1:]], 1)
        wrong = S.build_dense(call.q, k, v, causal=call.spec.causal)
        r = attention_ref(wrong)
        return r.out.to(call.spec.dtype), r.lse


@pytest.fixture
def broken_fast(monkeypatch):
    dispatch.implementations()  # load providers first
    monkeypatch.setitem(dispatch._REGISTRY, "fast", [_OffByOneCausal()] + dispatch._REGISTRY["fast"])
    yield


def qkv(sq=33, sk=47, hq=4, hkv=2, d=16, dtype=torch.float32, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(2, s, h, d, generator=g, dtype=dtype) for s, h in ((sq, hq), (sk, hkv), (sk, hkv))]
    return [x.requires_grad_(grad) for x in t]


def test_autograd_through_torch_impl_matches_oracle():
    q, k, v = qkv(grad=True)
    out = dualattn.attention(q, k, v, causal=True, window=(10, 3), impl="torch")
    dout = torch.randn_like(out)
    out.backward(dout)
    call = S.build_dense(q.detach(), k.detach(), v.detach(), causal=True, window=(10, 3))
    from dualattn.reference.torch_ref import attention_ref
    r = attention_ref(call, torch.float64, dout.double())
    for g, ref in ((q.grad, r.dq), (k.grad, r.dk), (v.grad, r.dv)):
        assert torch.allclose(g.double(), ref, atol=1e-5)


def test_return_lse_shapes():
    q, k, v = qkv()
    out, lse = dualattn.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 33, 4, 16) and lse.shape == (2, 4, 33) and lse.dtype == torch.float32


def test_explain_names_every_family():
    q, k, v = qkv()
    text = dualattn.explain(q, k, v, causal=True)
    assert "auto picks" in text
    for fam in dispatch.FAMILIES:
        assert fam in text


def test_fast_without_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the refusal path is for CPU-only machines")
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match=r"impl='fast' cannot serve this call .*Implementations that can: .*torch"):
        dualattn.attention(q, k, v, impl="fast")


def test_auto_uses_broken_fast_and_check_mode_catches_it(broken_fast, tmp_path, monkeypatch):
    monkeypatch.setenv("DUALATTN_REPRO_DIR", str(tmp_path))
    q, k, v = qkv(sq=40, sk=40)
    wrong = dualattn.attention(q, k, v, causal=True)  # auto picks the broken fast impl
    with dualattn.reference_mode():
        right = dualattn.attention(q, k, v, causal=True)
    assert not torch.allclose(wrong, right, atol=1e-3)
    with dualattn.check_mode():
        with pytest.raises(dualattn.MismatchError) as ei:
            dualattn.attention(q, k, v, causal=True)
    rep = ei.value.report
    assert not rep.ok and rep.impl == "broken-test-impl"
    assert any("query row" in x for x in rep.locations)
    assert rep.repro_path and os.path.exists(rep.repro_path)
    # the repro replays to the same failure, and the right implementation passes it
    assert not debug.diff(rep.repro_path).ok
    assert debug.diff(rep.repro_path, impl="torch").ok


def test_env_reference_mode(broken_fast, monkeypatch):
    q, k, v = qkv(sq=20, sk=20)
    monkeypatch.setenv("DUALATTN_MODE", "reference")
    a = dualattn.attention(q, k, v, causal=True)
    b = dualattn.attention(q, k, v, causal=True, impl="torch")
    assert torch.equal(a, b)


def test_compare_report_localizes_block_sparse(broken_fast, tmp_path):
    q, k, v = qkv(sq=64, sk=64)
    bs = dualattn.BlockSparse.from_key_ranges(None, 64, 64, 16, 16, causal=True)
    call = S.build_dense(q, k, v, causal=True, return_lse=True)
    rep = dualattn.compare(call, "fast", repro_dir=str(tmp_path))
    assert not rep.ok and rep.repro_path
    call2 = S.build_dense(q, k, v, causal=True, block_sparse=bs)
    rep2 = dualattn.compare(call2, "torch", backward=True)
    assert rep2.ok, str(rep2)
    assert {c.name for c in rep2.checks} == {"out", "lse", "dq", "dk", "dv"}


class _ZeroGrad:
    """Right forward, zero gradients: right exactly when dO is zero."""

    name = "zero-grad-test-impl"
    family = "fast"

    def can_implement(self, spec):
        return None if spec.mode == "batched" else "test impl: batched only"

    def forward(self, call):
        from dualattn.reference.torch_ref import attention_ref

        r = attention_ref(call)
        return r.out.to(call.spec.dtype), r.lse

    def backward(self, call, out, lse, dout):
        return torch.zeros_like(call.q), torch.zeros_like(call.k), torch.zeros_like(call.v)


def test_diff_replays_the_saved_dout(monkeypatch, tmp_path):
    # diff used to draw a fresh dO instead of the one saved in the repro
    dispatch.implementations()
    monkeypatch.setitem(dispatch._REGISTRY, "fast", [_ZeroGrad()] + dispatch._REGISTRY["fast"])
    q, k, v = qkv(sq=8, sk=8)
    call = S.build_dense(q, k, v, return_lse=True)
    path = debug.save_repro(call, "zero-grad-test-impl", str(tmp_path), backward=True,
                            dout=torch.zeros(2, 8, 4, 16), name="zero.pt")
    assert debug.diff(path).ok
    path = debug.save_repro(call, "zero-grad-test-impl", str(tmp_path), backward=True,
                            dout=torch.ones(2, 8, 4, 16), name="ones.pt")
    assert not debug.diff(path).ok
    # compare's own repro carries its dO (drawn from a non-default seed) to the replay
    rep = dualattn.compare(call, "zero-grad-test-impl", backward=True, seed=7, repro_dir=str(tmp_path))
    assert not rep.ok
    _, _, _, dout = debug.load_repro(rep.repro_path)
    gen = torch.Generator().manual_seed(7)
    assert torch.equal(dout, torch.randn(2, 8, 4, 16, generator=gen))


def test_locate_dk_names_the_csr_of_its_own_head():
    # the dK/dV location used to print head 0's k2q row whatever the head
    q, k, v = qkv(sq=16, sk=16, hq=4, hkv=2)
    states = torch.zeros(1, 4, 2, 2, dtype=torch.int8)
    states[0, 2, 1, 0] = 2  # query head 2 (kv head 1): query block 1 sees key block 0 in full
    bs = dualattn.BlockSparse.from_block_states(states, 8, 8, 16, 16)
    call = S.build_dense(q, k, v, block_sparse=bs)
    assert "k2q CSR row 0: full [1] mask []" in debug._locate(call, "dk", (0, 3, 1, 0))
    assert "k2q CSR row 0: full [] mask []" in debug._locate(call, "dk", (0, 3, 0, 0))


def test_compare_backward_on_kvcache_says_why():
    # the torch impl used to accept a kv-cache backward and crash on the missing gradients
    g = torch.Generator().manual_seed(3)
    call = S.build_kvcache(torch.randn(1, 1, 2, 16, generator=g), torch.randn(1, 8, 2, 16, generator=g),
                           torch.randn(1, 8, 2, 16, generator=g), cache_seqlens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="no backward through the kv-cache path"):
        dualattn.compare(call, "torch", backward=True)
    assert dualattn.compare(call, "torch").ok


def test_repro_roundtrip_every_mode(tmp_path):
    from dualattn import cases
    for case in cases.CASES:
        call = cases.make_call(case, "cpu", torch.float16, False)
        path = debug.save_repro(call, "torch", str(tmp_path), name=f"{abs(hash(case.name))}.pt")
        call2, impl, backward, _ = debug.load_repro(path)
        assert call2.spec == call.spec and impl == "torch"


def test_window_bounds_are_clamped_to_the_sequences():
    from dualattn import spec as spec_mod
    q, k, v = (torch.randn(1, 5, 2, 32) for _ in range(3))
    k, v = (torch.randn(1, 7, 2, 32) for _ in range(2))
    call = spec_mod.build_dense(q, k, v, window=(2 ** 31 - 1, 2 ** 40))
    assert call.spec.window == (12, 12)
    assert spec_mod.build_dense(q, k, v, window=(3, -1)).spec.window == (3, -1)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32)
    call = spec_mod.build_varlen(q[0], k[0], v[0], cu_q, cu_k, 3, 4, window=(-1, 2 ** 31))
    assert call.spec.window == (-1, 7)


def test_repro_replays_where_it_was_found(monkeypatch):
    # a GPU find replays on the GPU by default (the property tests print "python -m dualattn diff
    # REPRO" after a GPU failure); without a GPU, or for a CPU find, on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert debug.replay_device("cuda") == "cuda" and debug.replay_device("cpu") is None
    assert debug.replay_device("cuda", "cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert debug.replay_device("cuda") is None


def _cli(*args, env_extra=None, timeout=600):
    env = dict(os.environ, DUALATTN_PROGRESS="0", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "dualattn", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_cli_check_and_info():
    r = _cli("check", "--impls", "torch", "--filter", "varlen")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and " 0 failed" in r.stdout
    r = _cli("info")
    assert r.returncode == 0 and "torch" in r.stdout


def test_check_runs_the_forward_kernel_of_a_family_beside_its_training_one(monkeypatch, capsys):
    """Where a family's inference calls and its training calls go to different kernels (on Hopper
    "fast": fast-sm90 forward, fast-sm120-train forward + backward), `check` checks both: the
    training kernel forward and backward, the inference kernel forward only."""
    import argparse

    from dualattn import __main__ as cli, dispatch
    torch_impl = dispatch.implementations("torch")[0]
    fwd_kernel = type("FwdKernel", (), {})()  # a stand-in inference-only kernel
    fwd_kernel.name = "fwd-kernel"
    fwd_kernel.can_implement = lambda spec: "no backward" if spec.needs_grad else None
    fwd_kernel.forward = torch_impl.forward
    real = dispatch.family_reasons

    def family_reasons(spec, family):
        if family != "torch":
            return real(spec, family)
        return (torch_impl, []) if spec.needs_grad else (fwd_kernel, [])
    monkeypatch.setattr(dispatch, "family_reasons", family_reasons)
    args = argparse.Namespace(impls="torch", dtypes="float32", filter="seqlen 1", small=True, no_backward=False, seed=0,
                              part=None)
    assert cli.cmd_check(args) == 0
    out = capsys.readouterr().out
    assert "torch " in out and "fwd-kernel  PASS" in out and "(fwd only)" in out


def test_check_part_splits_the_variants(capsys):
    """`check --part k/n` runs every n-th variant from the k-th: the parts together are the run."""
    import argparse

    from dualattn import __main__ as cli, cases
    names = []
    for k in (1, 2, 3):
        args = argparse.Namespace(impls="torch", dtypes="float32", filter="dense", small=True, no_backward=True,
                                  seed=0, part=f"{k}/3")
        assert cli.cmd_check(args) == 0
        names += [ln.split("  ")[0] for ln in capsys.readouterr().out.splitlines() if "  torch " in ln]
    assert sorted(names) == sorted(c.name for c in cases.CASES if "dense" in c.name)
    with pytest.raises(SystemExit):
        cli.cmd_check(argparse.Namespace(impls="torch", dtypes="float32", filter=None, small=True, no_backward=True,
                                         seed=0, part="4/3"))


def test_check_compiles_first_in_jobs_processes(monkeypatch, tmp_path):
    """On a GPU, `check` first starts --jobs processes that each run a share of its rows (the
    same arguments plus --warm-part k/n) to fill the on-disk compile caches; none without the
    disk cache, with --jobs 0 or 1, and never more processes than rows."""
    import argparse

    from dualattn import __main__ as cli
    started = []

    class Proc:
        def __init__(self, cmd, **kw):
            started.append(cmd)

        def wait(self):
            return 0
    monkeypatch.setattr(cli.subprocess, "Popen", Proc)
    monkeypatch.setenv("DUALATTN_CACHE_DIR", str(tmp_path))
    cli._warm_caches(argparse.Namespace(jobs="3"), ["--filter", "dense"], 5)
    assert [c[c.index("check"):] for c in started] == [
        ["check", "--filter", "dense", "--warm-part", f"{k}/3"] for k in (1, 2, 3)]
    started.clear()
    cli._warm_caches(argparse.Namespace(jobs="8"), [], 2)
    assert [c[-1] for c in started] == ["1/2", "2/2"]
    for jobs, env in (("0", str(tmp_path)), ("1", str(tmp_path)), ("4", "off")):
        started.clear()
        monkeypatch.setenv("DUALATTN_CACHE_DIR", env)
        cli._warm_caches(argparse.Namespace(jobs=jobs), [], 10)
        assert started == []
    assert 1 <= cli._check_jobs("auto") <= 8


def test_check_warm_part_runs_its_share_of_rows_once_and_checks_nothing(monkeypatch, capsys):
    """A --jobs worker (--warm-part k/n) runs the implementations of every n-th row from the k-th
    once, forward and backward, with no oracle and no table: the shares together are the run."""
    import argparse

    from dualattn import __main__ as cli, accuracy, cases, dispatch
    torch_impl = dispatch.implementations("torch")[0]
    calls = []

    class Counting:
        name = "counting"

        def can_implement(self, spec):
            return None

        def forward(self, call):
            calls.append(("fwd", call.spec.seqlen_q, call.spec.seqlen_k))
            return torch_impl.forward(call)

        def backward(self, call, out, lse, dout):
            calls.append(("bwd", call.spec.seqlen_q, call.spec.seqlen_k))
            return torch_impl.backward(call, out, lse, dout)
    monkeypatch.setattr(dispatch, "family_reasons", lambda spec, family: (Counting(), []))
    monkeypatch.setattr(accuracy, "reference_pair", lambda *a, **k: pytest.fail("a worker ran the oracle"))
    for k in (1, 2):
        args = argparse.Namespace(impls="torch", dtypes="float32", filter="dense", small=True, no_backward=False,
                                  seed=0, part=None, warm_part=f"{k}/2")
        assert cli.cmd_check(args) == 0
    assert capsys.readouterr().out == ""
    n_rows = sum(1 for c in cases.CASES if "dense" in c.name)
    assert sum(1 for c in calls if c[0] == "fwd") == n_rows
    assert sum(1 for c in calls if c[0] == "bwd") == n_rows


def test_cli_diff_exit_codes(broken_fast, tmp_path):
    q, k, v = qkv(sq=24, sk=24)
    call = S.build_dense(q, k, v, causal=True)
    path = debug.save_repro(call, "torch", str(tmp_path), name="ok.pt")
    r = _cli("diff", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout


def test_cli_fuzz_from_another_directory(tmp_path):
    # fuzz used to look for "props/" in the current directory
    env = dict(os.environ, DUALATTN_PROGRESS="0")
    r = subprocess.run([sys.executable, "-m", "dualattn", "fuzz", "--", "--collect-only", "-q"], capture_output=True,
                       text=True, cwd=str(tmp_path), env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "test_differential.py" in r.stdout


class _ZeroedKeyBlock:
    """Reads zeros for the values of keys 128..255 (key block 1): wrong only where they are seen."""

    name = "zeroed-key-block-test-impl"
    family = "fast"

    def can_implement(self, spec):
        return None if spec.mode == "batched" and not spec.needs_grad else "test impl: batched forward only"

    def forward(self, call):
        from dataclasses import replace
        from dualattn.reference.torch_ref import attention_ref

        v = call.v.clone()
        v[:, 128:256] = 0
        r = attention_ref(replace(call, v=v))
        return r.out.to(call.spec.dtype), r.lse


class _WrongOnlyWhenCombined(_ZeroedKeyBlock):
    """Right on any call restricted to one key block, 1 % off on the call itself."""

    name = "wrong-when-combined-test-impl"

    def forward(self, call):
        from dualattn.reference.torch_ref import attention_ref

        r = attention_ref(call)
        scale = 1.0 if call.key_ranges is not None else 1.01
        return (r.out * scale).to(call.spec.dtype), r.lse


def test_compare_names_the_key_block_that_fails_alone():
    q, k, v = qkv(sq=70, sk=300)
    call = S.build_dense(q, k, v, return_lse=True)
    dispatch.implementations()  # load the providers before replacing the fast family
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(dispatch._REGISTRY, "fast", [_ZeroedKeyBlock(), _WrongOnlyWhenCombined()])
        rep = debug.compare(call, _ZeroedKeyBlock.name)
        assert not rep.ok
        assert "key blocks of 128 keys that fail on their own: [1]" in str(rep), str(rep)
        rep = debug.compare(call, _WrongOnlyWhenCombined.name)
        assert not rep.ok
        assert "agrees with the oracle on its own" in str(rep) and "combining blocks" in str(rep), str(rep)


def test_env_mode_is_read_on_every_call(monkeypatch):
    # current_mode reads os.environ's backing dict directly (host time): a change after import,
    # through os.environ or monkeypatch, must take effect at once, and the context managers win
    from dualattn import debug
    monkeypatch.delenv("DUALATTN_MODE", raising=False)
    assert debug.current_mode() is None
    monkeypatch.setenv("DUALATTN_MODE", " Check ")
    assert debug.current_mode() == "check"
    os.environ["DUALATTN_MODE"] = "reference"
    assert debug.current_mode() == "reference"
    with debug.check_mode():
        assert debug.current_mode() == "check"
    monkeypatch.setenv("DUALATTN_MODE", "bogus")
    assert debug.current_mode() is None
    monkeypatch.delenv("DUALATTN_MODE")
    assert debug.current_mode() is None


def test_props_parts_split_the_campaign_without_overlap(tmp_path):
    # DUALATTN_PROPS_PART=k/n (ci/gpu props in n calls): the parts together are the whole
    # campaign, each item in exactly one part
    def collect(part):
        env = dict(os.environ, DUALATTN_PROGRESS="0", DUALATTN_PROPS_PROFILE="gpu", DUALATTN_PROPS_PART=part)
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "props/"],
                           capture_output=True, text=True, env=env, timeout=600,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert r.returncode == 0, r.stdout + r.stderr
        return [ln for ln in r.stdout.splitlines() if "::" in ln]
    whole, one, two = collect(""), collect("1/2"), collect("2/2")
    assert len(whole) > 10 and one and two and not set(one) & set(two)
    assert sorted(one + two) == sorted(whole)
