"""The Triton reference under the CPU interpreter, in the CPU CI.

``TRITON_INTERPRET=1`` must be set before Triton kernels are defined, so the interpreted run is a
separate process: the differential, empty-row and determinism properties on the smaller
``ci-interp`` sizes (props/profiles.py). In a process that already has TRITON_INTERPRET=1 the
properties themselves include Triton, and this test has nothing to add.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from props import profiles

ROOT = Path(__file__).resolve().parents[1]
# names of the implementations that accept a tiny fp32 CPU call in the interpreted process
PROBE = """
from props import strategies as S, harness
case = S.Case("batched", (5,), (7,), 2, 1, 32, 32, "float32", causal=True)
print(" ".join(i.name for i in harness.applicable(S.build_call(S.materialize(case, "cpu")).spec)))
"""
PROPERTIES = ["props/test_differential.py", "props/test_empty_rows.py", "props/test_determinism.py"]


@pytest.mark.device_free
def test_properties_under_triton_interpreter(tmp_path):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the properties above already include Triton")
    if profiles.current().device != "cpu":
        pytest.skip("the gpu/campaign profiles run Triton on the GPU")
    env = dict(os.environ, TRITON_INTERPRET="1", DUALATTN_PROPS_PROFILE="ci", DUALATTN_REPRO_DIR=str(tmp_path))
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stdout + probe.stderr
    names = probe.stdout.split()
    if not any(n != "torch" for n in names):
        pytest.skip(f"no implementation besides torch runs on CPU under TRITON_INTERPRET=1 ({names})")
    cmd = [sys.executable, "-m", "pytest", *PROPERTIES, "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=",
           "-p", "no:xdist", "-rA"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"properties failed under TRITON_INTERPRET=1:\n{log[-8000:]}"
