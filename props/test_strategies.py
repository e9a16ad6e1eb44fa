"""The strategies themselves: every drawn case must be a call the API accepts. A case the spec
rejects is a bug of the strategy, and it surfaces only as an error in whichever property drew it
(the gpu profile once drew documents longer than Sk=1 for Sq=2, a ValueError in
test_rows_without_keys). Cheap: tensors are built on the CPU and no attention runs."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from props import strategies as S

KR_KINDS = ["random", "docs", "prefix", "empty_rows"]

every_case = st.one_of(
    S.batched_cases(key_ranges=True, kr_kinds=KR_KINDS),
    S.batched_cases(key_ranges=True, kr_kinds=["docs"]),  # docs are drawn only on request when Sq != Sk
    S.batched_cases(blocks=True),
    S.batched_cases(key_ranges=True, blocks=True),
    S.varlen_cases(key_ranges=True, kr_kinds=["random", "prefix", "empty_rows"]),
    S.varlen_cases(blocks=True),
    S.kvcache_cases(),
)


@settings(max_examples=300)
@given(case=every_case)
def test_every_drawn_case_is_a_valid_call(case):
    inp = S.materialize(case, device="cpu")
    S.build_call(inp)  # raises on anything the spec refuses

