"""Property 3: the forward is always bitwise repeatable; with deterministic=True so are dQ, dK, dV."""
from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import given
from hypothesis import strategies as st

from props import harness, profiles
from props import strategies as S


def _bits(t):
    if t is None:
        return None
    t = t.detach()
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).cpu()


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(_bits(a), _bits(b)))


@profiles.examples(0.8)
@given(case=st.one_of(S.batched_cases(), S.varlen_cases(), S.kvcache_cases()))
def test_bitwise_repeatable(case):
    if case.mode != "kvcache":
        case = replace(case, deterministic=True)
    inp = S.materialize(case)
    call = S.build_call(inp)
    dout = S.make_dout(call) if case.backward and case.mode != "kvcache" else None
    for impl in harness.applicable(call.spec):
        runs = [harness.run(impl, inp, dout=dout)[0] for _ in range(3)]
        for name, i in (("out", 0), ("lse", 1), ("dq", 2), ("dk", 3), ("dv", 4)):
            for r in runs[1:]:
                if not _same(runs[0][i], r[i]):
                    path = harness.save(call, impl.family, backward=dout is not None, dout=dout)
                    raise AssertionError(f"{impl.name}: {name} differs bitwise between repeated runs "
                                         f"(deterministic=True) on {call.spec.short()}; repro: {path}")
