"""The property suite must catch planted bugs (issue 4): for each of

(a) one output tile of one implementation perturbed by 1e-2,
(b) dQ lock value = key-block index instead of its rank,
(c) an off-by-one in one implementation's causal diagonal,

``pytest props/`` (ci profile, derandomized, no example database) is run in a subprocess with the
bug planted (props/planted.py as a plugin) and must fail, shrink, and, for the output bugs, leave a
repro file that dualattn.debug.diff replays: a mismatch with the bug planted, clean without it.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # props/ is a test package at the repository root, not installed
    sys.path.insert(0, str(ROOT))

# the property that must catch each bug, and the text its failure must contain
CASES = {
    "tile": ("props/test_differential.py::test_batched_matches_oracle", "out: err"),
    "causal": ("props/test_differential.py::test_batched_matches_oracle", "FAIL"),
    "lock": ("props/test_protocol.py", "deadlock with rank locks"),
}


def _run_planted(plant: str, target: str, repro_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DUALATTN_PLANT=plant, DUALATTN_PROPS_PROFILE="ci", DUALATTN_REPRO_DIR=str(repro_dir))
    env.pop("TRITON_INTERPRET", None)  # the plants target the torch impl; the interpreter only adds time
    cmd = [sys.executable, "-m", "pytest", target, "-x", "-q", "-p", "props.planted", "-p", "no:cacheprovider",
           "--no-header", "-o", "addopts="]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_plants_restore_everything():
    """Guard: planting nothing leaves the registry and dualattn.sparse exactly as they were."""
    from dualattn import dispatch, sparse
    from props import planted

    impl = planted.target_impl()
    before = (impl.__dict__.copy(), sparse.compute_lock_values)
    for name, plant in planted.PLANTS.items():
        with plant():
            pass
    assert (impl.__dict__, sparse.compute_lock_values) == before
    assert impl in dispatch.implementations()


@pytest.mark.parametrize("plant", ["tile", "lock", "causal"])
def test_props_catch_planted_bug(plant, tmp_path):
    from dualattn import debug
    from props import planted

    target, needle = CASES[plant]
    proc = _run_planted(plant, target, tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, f"pytest props with planted bug {plant!r} did not fail (rc {proc.returncode}):\n{log[-4000:]}"
    assert ("Falsifying example" in log or "Failing test case" in log) and needle in log, log[-4000:]
    if plant == "lock":
        return
    repros = sorted(glob.glob(str(tmp_path / "*.pt")))
    assert repros, f"no repro file saved for planted bug {plant!r}:\n{log[-3000:]}"
    # the last repro written is the shrunk case named in the report
    named = [p for p in repros if p in log]
    path = named[-1] if named else repros[-1]
    with planted.PLANTS[plant]():
        rep = debug.diff(path)
    assert not rep.ok, f"replaying {path} with the bug planted did not reproduce it:\n{rep}"
    assert debug.diff(path).ok, f"replaying {path} without the bug still fails"
