"""Profiles: Hypothesis settings plus the size limits the strategies draw within.

The strategies read :func:`current` at draw time, so the profile chosen by the environment
(``DUALATTN_PROPS_PROFILE``) or by ``pytest --props-profile`` (props/conftest.py) applies to every
property. CPU sizes stay tiny: the oracle materialises Sq x Sk scores, twice per example.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings


@dataclass(frozen=True)
class Limits:
    name: str
    device: str            # where the tensors live
    max_batch: int
    max_seqlen: int        # per sequence, queries and keys
    max_heads_kv: int
    max_gqa_ratio: int
    max_key_ranges: int
    max_blocks: int        # per side, for CSR drawn without tensors (protocol model)
    examples: int          # base max_examples; properties scale it
    watchdog_s: float      # a single implementation call longer than this is a hang
    shards: int = 1        # the costly properties run as this many pytest items (xdist spreads them)


PROFILES = {
    # CPU CI: 2 cores, minutes for the whole suite; derandomized so a red CI run replays exactly
    "ci": Limits("ci", "cpu", max_batch=3, max_seqlen=40, max_heads_kv=2, max_gqa_ratio=8, max_key_ranges=3,
                 max_blocks=6, examples=25, watchdog_s=300.0),
    # one GPU, about ten minutes: lengths that cross 64/128-row tiles and end off them. H100 run
    # (pytest -n 14): with examples=60, 21 of the 48 items had finished after 400 s (CuTe and Triton
    # compiles of each drawn config dominate), so 30 was the estimate for ~10 minutes; at 30, two
    # runs of ci/gpu props (2026-11-25, costly items first) took 494 s (one item cut short at 240 s)
    # and more than 540 s (55 of 56 items done; the slowest items 150-275 s each): 24 (-20 %)
    # is the estimate for the stage's 540 s, not yet timed
    "gpu": Limits("gpu", "cuda", max_batch=4, max_seqlen=300, max_heads_kv=4, max_gqa_ratio=8, max_key_ranges=4,
                  max_blocks=12, examples=24, watchdog_s=240.0, shards=6),
    # long hunt; run with pytest -n <gpus> --hypothesis-show-statistics
    # the ci profile inside a process with TRITON_INTERPRET=1: the Triton interpreter runs every
    # program instance in numpy, so heads, batch and lengths stay smaller still
    "ci-interp": Limits("ci-interp", "cpu", max_batch=2, max_seqlen=24, max_heads_kv=1, max_gqa_ratio=3,
                        max_key_ranges=2, max_blocks=6, examples=10, watchdog_s=600.0),
    "campaign": Limits("campaign", "cuda", max_batch=6, max_seqlen=1100, max_heads_kv=8, max_gqa_ratio=8,
                       max_key_ranges=6, max_blocks=24, examples=2000, watchdog_s=600.0),
}

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.large_base_example]
for _name, _lim in PROFILES.items():
    settings.register_profile(
        f"dualattn-{_name}", deadline=None, suppress_health_check=_SUPPRESS, max_examples=_lim.examples,
        derandomize=_name.startswith("ci"), print_blob=not _name.startswith("ci"),
        # the ci profiles keep no example database: a CI run is a pure function of the code
        **({"database": None} if _name.startswith("ci") else {}))

_current = None


def select(name: str | None = None) -> Limits:
    """Make ``name`` (default: $DUALATTN_PROPS_PROFILE, else "ci") the active profile."""
    global _current
    name = name or os.environ.get("DUALATTN_PROPS_PROFILE", "ci")
    if name == "ci" and os.environ.get("TRITON_INTERPRET") == "1":
        name = "ci-interp"
    if name not in PROFILES:
        raise ValueError(f"DUALATTN_PROPS_PROFILE / --props-profile: unknown profile {name!r}; "
                         f"choose one of {', '.join(PROFILES)}")
    _current = PROFILES[name]
    settings.load_profile(f"dualattn-{name}")
    return _current


def current() -> Limits:
    return _current if _current is not None else select()


def sharded(weight: float = 1.0):
    """For the costly properties (every impl, compiles per drawn config): ``examples(weight)``
    split over the profile's ``shards`` pytest items, each drawing its own examples. One test
    function held the gpu profile's whole budget of a property on one xdist worker, so four
    properties ran past 10 minutes while 8 of 12 workers sat idle (H100 run); sharded, every
    worker draws. The test takes a ``shard`` argument (its index, unused otherwise)."""
    import pytest

    n = current().shards

    def deco(fn):
        fn = examples(weight / n)(fn)
        fn.props_shard_weight = weight  # props/conftest.py hands the heaviest out first
        return pytest.mark.parametrize("shard", range(n), ids=[f"shard{i}of{n}" for i in range(n)])(fn)
    return deco


def examples(weight: float = 1.0) -> settings:
    """Settings of the active profile with max_examples scaled by ``weight`` (cheap properties
    get more examples, expensive ones fewer)."""
    lim = current()
    base = int(os.environ.get("DUALATTN_PROPS_EXAMPLES", lim.examples))  # quick runs: fewer examples
    return settings(settings.get_profile(f"dualattn-{lim.name}"), max_examples=max(1, int(base * weight)))
