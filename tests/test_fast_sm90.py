"""GPU tests of the Hopper forward kernel (fast-sm90) against the torch oracle.

Every case runs in one worker subprocess under a wall-clock timeout, so a deadlocked kernel fails
the tests instead of stalling the run. For each case the worker:

* fills the output and LSE buffers with NaN before the launch (poisoned outputs: a tile that is
  never written shows up as NaN),
* checks O and LSE with the accuracy rule (dualattn.accuracy.check_outputs),
* runs the kernel a second time and requires bitwise-identical O and LSE.

The tests are marked ``gpu`` and skip with "needs CUDA" on machines without a GPU (CI), and with
"needs an sm_90 GPU" on other GPUs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

WORKER_TIMEOUT_S = int(os.environ.get("DUALATTN_SM90_TEST_TIMEOUT", "600"))

# (name, B, Sq, Sk, Hq, Hkv, D, dtype, causal, persistent) ; persistent None = the default
# choice of FastSm90Forward.config, "0"/"1" forces the grid kind (both code paths stay tested)
CASES = []


def _case(name, B, Sq, Sk, Hq, Hkv, D, dtype="bfloat16", causal=False, persistent=None, **kw):
    tag = "" if persistent is None else f"-persistent{persistent}"
    tag += "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
    CASES.append((f"{name}-{dtype}-d{D}{'-causal' if causal else ''}{tag}", B, Sq, Sk, Hq, Hkv, D,
                  dtype, causal, persistent, kw))


for _d in (64, 128, 96, 192, 256):
    for _c in (False, True):
        _case("dense", 2, 1024, 1024, 4, 4, _d, "bfloat16", _c)
        _case("odd", 2, 113, 203, 4, 2, _d, "bfloat16", _c)
for _c in (False, True):
    for _d in (64, 128):
        _case("dense", 1, 512, 512, 4, 4, _d, "float16", _c)
        _case("len1", 1, 1, 1, 2, 2, _d, "bfloat16", _c)
        _case("q239k1", 1, 239, 1, 2, 1, _d, "bfloat16", _c)    # causal: most rows see no key
        _case("q1k239", 1, 1, 239, 2, 1, _d, "bfloat16", _c)
        _case("q203k113", 2, 203, 113, 4, 4, _d, "bfloat16", _c)  # causal: fully masked rows
    _case("long", 1, 4224, 4224, 2, 2, 128, "bfloat16", _c)
    for _hkv in (1, 2, 4, 8):  # GQA ratios 8, 4, 2, 1
        _case(f"gqa8to{_hkv}", 2, 300, 300, 8, _hkv, 128, "bfloat16", _c)
    _case("gqa6to2", 1, 257, 129, 6, 2, 64, "bfloat16", _c)   # ratio 3
    _case("gqa7to1", 1, 130, 400, 7, 1, 128, "bfloat16", _c)  # ratio 7
    for _p in ("0", "1"):
        for _d in (64, 128, 256):
            _case("dense", 2, 1000, 1000, 4, 2, _d, "bfloat16", _c, _p)
        _case("q203k113", 2, 203, 113, 4, 4, 128, "bfloat16", _c, _p)
# sliding windows (bottom-right diagonal) and softcap
for _w, _c in (((64, 0), False), ((-1, 32), False), ((100, -1), False), ((33, 7), True),
               ((200, 50), False), ((0, 0), False)):
    _case("win", 2, 1000, 1000, 4, 2, 128, "bfloat16", _c, window=_w)
    _case("win", 1, 300, 700, 4, 1, 64, "bfloat16", _c, window=_w)
    _case("win", 2, 203, 113, 2, 2, 128, "bfloat16", _c, window=_w)  # rows with no key
_case("win", 2, 1000, 1000, 4, 2, 256, "bfloat16", False, window=(128, 128))
_case("win", 2, 1000, 1000, 4, 2, 128, "float16", False, "1", window=(77, 0))
_case("win", 2, 1000, 1000, 4, 2, 128, "bfloat16", True, "1", window=(300, -1))
for _c in (False, True):
    _case("softcap", 2, 777, 777, 4, 2, 128, "bfloat16", _c, softcap=20.0)
    _case("softcap", 1, 113, 203, 4, 4, 64, "float16", _c, softcap=5.0)
_case("softcap", 1, 500, 500, 2, 1, 256, "bfloat16", False, window=(50, 0), softcap=10.0)
# non-contiguous q / k / v (strides reach the kernel as runtime values)
_case("strided", 2, 300, 517, 4, 2, 128, "bfloat16", False, strided=True)
_case("strided", 2, 517, 300, 6, 3, 64, "bfloat16", True, "1", strided=True)


# varlen: (name, seqlens_q, seqlens_k, Hq, Hkv, D, causal, kw); lengths include 0 and 1
VARLEN_CASES = []
for _c in (False, True):
    for _d in (64, 128, 256):
        VARLEN_CASES.append((f"varlen-odd-d{_d}{'-causal' if _c else ''}", [113, 0, 1, 300, 129],
                             [203, 5, 1, 300, 0], 4, 2, _d, _c, {}))
    VARLEN_CASES.append((f"varlen-long-d128{'-causal' if _c else ''}", [1000, 2049, 7],
                         [1500, 2049, 300], 8, 1, 128, _c, {}))
    VARLEN_CASES.append((f"varlen-gqa3-d96{'-causal' if _c else ''}", [257, 64, 128],
                         [129, 640, 128], 6, 2, 96, _c, {}))
VARLEN_CASES.append(("varlen-win-d128", [300, 17, 450], [700, 33, 450], 4, 2, 128, True,
                     {"window": (40, 0)}))
VARLEN_CASES.append(("varlen-softcap-d64", [77, 333], [333, 77], 2, 2, 64, False, {"softcap": 8.0}))
for _c in (False, True):
    # rows with no visible key (causal, Sq > Sk), single-row / single-key sequences, all-empty K
    VARLEN_CASES.append((f"varlen-q239k1-d128{'-causal' if _c else ''}", [239, 1, 0], [1, 239, 0],
                         2, 1, 128, _c, {}))
    VARLEN_CASES.append((f"varlen-d192{'-causal' if _c else ''}", [130, 1, 257], [129, 2, 256],
                         4, 2, 192, _c, {}))
VARLEN_CASES.append(("varlen-nokeys-d64", [5, 17], [0, 0], 2, 2, 64, False, {}))
VARLEN_CASES.append(("varlen-10docs-d128-causal", [409] * 9 + [415], [409] * 9 + [415], 4, 4, 128,
                     True, {}))
VARLEN_CASES.append(("varlen-fp16-d128", [333, 129], [129, 333], 4, 2, 128, False,
                     {"dtype": "float16"}))


def _run_varlen_case(f, name, lq, lk, Hq, Hkv, D, causal, kw):
    from dualattn.accuracy import check_outputs
    from dualattn.dispatch import select
    from dualattn.spec import build_varlen

    kw = dict(kw)
    dt = getattr(torch, kw.pop("dtype", "bfloat16"))
    rec = {"name": name}
    try:
        cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device="cuda")
        Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
        q = torch.randn(Tq, Hq, D, device="cuda", dtype=dt)
        k = torch.randn(Tk, Hkv, D, device="cuda", dtype=dt)
        v = torch.randn(Tk, Hkv, D, device="cuda", dtype=dt)
        call = build_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, return_lse=True,
                            **kw)
        impl = select(call.spec, "fast")
        rec["impl"] = impl.name
        outs, guard_ok = [], True
        for _ in range(2):
            # NaN-poisoned outputs with poisoned guard rows after the end: a store past the last
            # sequence's end would overwrite them
            buf = torch.full((Tq + 160, Hq, D), float("nan"), device="cuda", dtype=dt)
            call.extra["out"] = buf[:Tq]
            call.extra["lse"] = torch.full((Hq, Tq), float("nan"), device="cuda")
            o, lse = impl.forward(call)
            torch.cuda.synchronize()
            guard_ok = guard_ok and bool(buf[Tq:].isnan().all())
            outs.append((o.clone(), lse.clone()))
        checks = check_outputs(call, outs[0][0], outs[0][1])
        rec["checks"] = [str(c) for c in checks]
        rec["ok"] = all(c.ok for c in checks) and guard_ok
        if not guard_ok:
            rec["checks"].append("guard rows after the last sequence were written")
        rec["bitwise"] = bool(torch.equal(outs[0][0], outs[1][0])
                              and torch.equal(outs[0][1].nan_to_num(), outs[1][1].nan_to_num()))
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    f.write(json.dumps(rec) + "\n")
    f.flush()


def _run_worker(out_path: str) -> None:
    """Run every case, one JSON line per case on stdout (flushed, so a hang keeps earlier lines)."""
    import dualattn.fast.sm90 as sm90
    from dualattn.accuracy import check_outputs
    from dualattn.dispatch import select
    from dualattn.spec import build_dense

    torch.manual_seed(0)
    with open(out_path, "w") as f:
        for name, B, Sq, Sk, Hq, Hkv, D, dtype, causal, persistent, kw in CASES:
            sm90._PERSISTENT_ENV = persistent or ""
            dt = getattr(torch, dtype)
            rec = {"name": name}
            try:
                kw = dict(kw)
                if kw.pop("strided", False):
                    # strided views (a slice of a wider q, k and v interleaved in one buffer):
                    # the launch passes q/k/v strides, not just shapes
                    q = torch.randn(B, Sq, Hq + 3, D, device="cuda", dtype=dt)[:, :, 2:Hq + 2]
                    kv = torch.randn(B, Sk, Hkv, 2, D, device="cuda", dtype=dt)
                    k, v = kv[:, :, :, 0], kv[:, :, :, 1]
                else:
                    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=dt)
                    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
                    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
                call = build_dense(q, k, v, causal=causal, return_lse=True, **kw)
                impl = select(call.spec, "fast")
                rec["impl"] = impl.name
                outs = []
                for _ in range(2):
                    call.extra["out"] = torch.full((B, Sq, Hq, D), float("nan"), device="cuda", dtype=dt)
                    call.extra["lse"] = torch.full((B, Hq, Sq), float("nan"), device="cuda")
                    o, lse = impl.forward(call)
                    torch.cuda.synchronize()
                    outs.append((o.clone(), lse.clone()))
                checks = check_outputs(call, outs[0][0], outs[0][1])
                rec["checks"] = [str(c) for c in checks]
                rec["ok"] = all(c.ok for c in checks)
                rec["bitwise"] = bool(torch.equal(outs[0][0], outs[1][0])
                                      and torch.equal(outs[0][1].nan_to_num(), outs[1][1].nan_to_num()))
            except Exception as e:  # reported per case; the next case still runs
                rec["error"] = f"{type(e).__name__}: {e}"
            f.write(json.dumps(rec) + "\n")
            f.flush()
        sm90._PERSISTENT_ENV = ""
        for case in VARLEN_CASES:
            _run_varlen_case(f, *case)


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "needs CUDA"
    major, minor = torch.cuda.get_device_capability()
    if major * 10 + minor != 90:
        return f"needs an sm_90 GPU (found sm_{major}{minor})"
    return None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    path = str(tmp_path_factory.mktemp("sm90") / "results.jsonl")
    timed_out = False
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", path], timeout=WORKER_TIMEOUT_S,
                              capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        timed_out, tail = True, ""
    res = {}
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            res[r["name"]] = r
    return res, timed_out, tail


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_oracle(results, case):
    res, timed_out, tail = results
    name = case[0]
    if name not in res:
        pytest.fail(f"{name}: no result ({'worker timed out: hang?' if timed_out else 'worker died'}) {tail}")
    r = res[name]
    assert "error" not in r, r["error"]
    assert r["impl"] == "fast-sm90", f"dispatcher picked {r['impl']}"
    assert r["ok"], "; ".join(r["checks"])
    assert r["bitwise"], "two runs gave different bits"


def _run_overhead_worker(out_path: str) -> None:
    """Host overhead of a cached call: N back-to-back forward calls on a tiny problem without
    synchronising (the GPU queue absorbs the launches), wall time / N. Then the last call's
    outputs are checked against the oracle."""
    import time

    from dualattn.accuracy import check_outputs
    from dualattn.dispatch import select
    from dualattn.spec import build_dense

    torch.manual_seed(0)
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    call = build_dense(q, k, v, causal=False, return_lse=True)
    impl = select(call.spec, "fast")
    rec = {"impl": impl.name}
    impl.forward(call)  # compile + first launch
    torch.cuda.synchronize()
    n, per_call = 200, []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            o, lse = impl.forward(call)
        per_call.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    rec["us_per_call"] = per_call
    checks = check_outputs(call, o, lse)
    rec["checks"] = [str(c) for c in checks]
    rec["ok"] = all(c.ok for c in checks)
    with open(out_path, "w") as f:
        f.write(json.dumps(rec))


@pytest.mark.gpu
def test_cached_call_host_overhead(tmp_path):
    """Prints the host time of a cached call (the issue's target is < 15 us); asserts only that
    the results are right (timings vary with the host)."""
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    path = str(tmp_path / "overhead.json")
    proc = subprocess.run([sys.executable, __file__, "--overhead", path], timeout=300,
                          capture_output=True, text=True)
    assert os.path.exists(path), (proc.stdout + proc.stderr)[-3000:]
    r = json.load(open(path))
    assert r["impl"] == "fast-sm90", f"dispatcher picked {r['impl']}"
    print(f"\nfast-sm90 cached-call host overhead (us/call, 5 rounds of 200 calls): "
          f"{', '.join(f'{x:.1f}' for x in r['us_per_call'])}; min {min(r['us_per_call']):.1f}")
    assert r["ok"], "; ".join(r["checks"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_forward_matches_oracle(results, case):
    test_forward_matches_oracle(results, case)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _run_worker(sys.argv[2])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--overhead":
    _run_overhead_worker(sys.argv[2])
