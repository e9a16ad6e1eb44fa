"""Profile selection (ci / gpu / campaign), device placement, and the repro report.

    DUALATTN_PROPS_PROFILE=gpu pytest props/          # or: pytest props/ --props-profile gpu
    pytest props/ --props-profile campaign -n 8 --hypothesis-show-statistics

The gpu and campaign profiles need CUDA and skip (reason "needs CUDA") without it. Under
pytest-xdist each worker takes one GPU (worker i -> GPU i mod count).
"""
from __future__ import annotations

import os

import pytest
import torch

from props import harness, profiles


def pytest_addoption(parser):
    parser.addoption("--props-profile", default=None, choices=["ci", "gpu", "campaign"],
                     help="dualattn property profile (default: $DUALATTN_PROPS_PROFILE or ci)")


def pytest_configure(config):
    config.addinivalue_line("markers", "device_free: a property that needs no GPU in any profile (pure Python/CPU)")
    try:
        name = config.getoption("--props-profile")
    except ValueError:  # the option is registered only when props/ is an initial conftest
        name = None
    lim = profiles.select(name)
    if lim.device == "cuda" and torch.cuda.is_available():
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        if worker.startswith("gw"):
            torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())


def pytest_report_header(config):
    lim = profiles.current()
    from dualattn import dispatch
    names = ", ".join(f"{i.family}:{i.name}" for i in dispatch.implementations())
    return [f"dualattn props profile: {lim.name} (device {lim.device}, max_examples {lim.examples}, "
            f"max_seqlen {lim.max_seqlen})", f"dualattn implementations: {names}"]


def pytest_collection_modifyitems(config, items):
    # the sharded (costly) properties first, heaviest first: pytest-xdist hands items out in this
    # order, so the long ones start at once instead of ending the run on a few busy workers
    # (ci/gpu props on one H100 had 53 of 56 items done after 430 s, the costly shards last)
    items.sort(key=lambda item: -getattr(getattr(item, "function", None), "props_shard_weight", 0.0))
    part = os.environ.get("DUALATTN_PROPS_PART", "")
    if part:
        # "k/n": every n-th item from the k-th (1-based) of that order, so each part gets its
        # share of the costly shards (ci/gpu props in n calls where one is too short)
        k, n = (int(x) for x in part.split("/"))
        if not 1 <= k <= n:
            raise pytest.UsageError(f"DUALATTN_PROPS_PART={part}: want k/n with 1 <= k <= n")
        keep = items[k - 1::n]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    if profiles.current().device == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "props" in str(item.fspath) and "device_free" not in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _collect_repros():
    harness.SAVED_REPROS.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" and rep.failed and harness.SAVED_REPROS:
        lines = [f"python -m dualattn diff {p}" for p in harness.SAVED_REPROS]
        rep.sections.append(("dualattn repro (last file = the shrunk case)", "\n".join(lines)))
