"""Property 1: every implementation that can serve a drawn call agrees with the torch oracle under
the accuracy rule (O, LSE, dQ, dK, dV), and, for kv-cache calls, appends k_new/v_new to the cache."""
from __future__ import annotations

from hypothesis import example, given

from props import harness, profiles
from props import strategies as S


@profiles.examples(1.5)
@given(case=S.batched_cases())
def test_batched_matches_oracle(case):
    harness.assert_matches_oracle(S.materialize(case))


@profiles.examples(1.0)
@given(case=S.varlen_cases())
@example(case=S.Case("varlen", (2, 0, 1), (1, 1, 0), 2, 1, 32, 32, "float32", max_seqlen_q=2, max_seqlen_k=1))
def test_varlen_matches_oracle(case):
    harness.assert_matches_oracle(S.materialize(case))


@profiles.examples(1.0)
@given(case=S.kvcache_cases())
def test_kvcache_matches_oracle(case):
    harness.assert_matches_oracle(S.materialize(case))
