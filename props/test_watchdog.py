"""Property 5's machinery: a call that outlives the watchdog saves a repro and reports a hang."""
from __future__ import annotations

import os
import time

import pytest

from dualattn import debug
from props import harness
from props import strategies as S


class _Sleeper:
    name, family = "sleeper", "torch"


@pytest.mark.device_free
def test_watchdog_fires_and_saves_repro(tmp_path, monkeypatch):
    monkeypatch.setenv("DUALATTN_REPRO_DIR", str(tmp_path))
    case = S.Case("batched", (3,), (5,), 2, 1, 32, 32, "float32", causal=True)
    call = S.build_call(S.materialize(case, "cpu"))
    messages = []
    with harness.watchdog(call, _Sleeper(), timeout=0.05, on_timeout=messages.append) as fired:
        time.sleep(0.5)  # stands in for a kernel that never returns
    assert fired.is_set() and messages and messages[0].startswith("HANG: sleeper")
    path = messages[0].rsplit("diff ", 1)[1]
    assert os.path.exists(path)
    replayed, impl, backward, _ = debug.load_repro(path)
    assert replayed.spec == call.spec and impl == "torch" and not backward


@pytest.mark.device_free
def test_watchdog_quiet_when_in_time():
    case = S.Case("batched", (3,), (5,), 2, 1, 32, 32, "float32")
    call = S.build_call(S.materialize(case, "cpu"))
    messages = []
    with harness.watchdog(call, _Sleeper(), timeout=5.0, on_timeout=messages.append) as fired:
        pass
    time.sleep(0.05)
    assert not fired.is_set() and not messages


def _fake_compiler(seconds: float):
    """A function whose code lives in a file named like Triton's compiler package (what
    harness.compiling looks for on the watched thread's stack), sleeping ``seconds``."""
    src = "import time\ndef compile_kernel(seconds):\n    time.sleep(seconds)\n"
    scope = {}
    exec(compile(src, os.path.join(os.sep, "site", "triton", "compiler", "fake.py"), "exec"), scope)
    return lambda: scope["compile_kernel"](seconds)


@pytest.mark.device_free
def test_watchdog_waits_for_a_compile(tmp_path, monkeypatch):
    """A body inside a compiler when the timer runs out gets more periods (a cold compile on a
    busy machine is not a hang); past MAX_COMPILE_PERIODS more it is reported, marked as
    compiling."""
    monkeypatch.setenv("DUALATTN_REPRO_DIR", str(tmp_path))
    case = S.Case("batched", (3,), (5,), 2, 1, 32, 32, "float32")
    call = S.build_call(S.materialize(case, "cpu"))
    messages = []
    with harness.watchdog(call, _Sleeper(), timeout=0.2, on_timeout=messages.append) as fired:
        _fake_compiler(0.5)()  # 2.5 periods, inside the compiler
    time.sleep(0.5)  # a restarted timer must not fire after the body's end
    assert not fired.is_set() and not messages
    with harness.watchdog(call, _Sleeper(), timeout=0.05, on_timeout=messages.append) as fired:
        _fake_compiler(0.05 * (harness.MAX_COMPILE_PERIODS + 3))()
    assert fired.is_set() and messages and "(still compiling)" in messages[0]
    messages.clear()
    with harness.watchdog(call, _Sleeper(), timeout=0.05, on_timeout=messages.append) as fired:
        time.sleep(0.3)  # outside any compiler: a hang at the first period
    assert fired.is_set() and messages and "compiling" not in messages[0]


class _Raiser:
    name, family = "raiser", "torch"

    def forward(self, call):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.mark.device_free
def test_an_implementation_that_raises_leaves_a_repro(tmp_path, monkeypatch):
    monkeypatch.setenv("DUALATTN_REPRO_DIR", str(tmp_path))
    case = S.Case("batched", (3,), (5,), 2, 1, 32, 32, "float32")
    inp = S.materialize(case, "cpu")
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        harness.run(_Raiser(), inp)
    notes = getattr(info.value, "__notes__", [])
    assert notes and notes[0].startswith("raiser raised on ")
    path = notes[0].rsplit("diff ", 1)[1]
    replayed, impl, backward, _ = debug.load_repro(path)
    assert replayed.spec.short() == S.build_call(inp).spec.short() and impl == "torch" and not backward
