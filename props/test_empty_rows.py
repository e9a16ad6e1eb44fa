"""Property 4: a query row with no visible key gives output 0 and LSE -inf exactly and a zero dQ row;
a key that no query sees gets zero dK/dV; nothing anywhere is NaN. Visibility is computed
independently (props/independent.py), including FULL/MASK/ABSENT blocks of a CSR."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from props import harness, independent, profiles
from props import strategies as S

# every mechanism that empties rows: key ranges with empty rows, documents that stop short,
# drawn CSR rows, causal with Sq > Sk (bottom-right: the first rows see nothing), windows,
# and zero-length key sequences in varlen
emptying = st.one_of(
    S.batched_cases(key_ranges=True, kr_kinds=["empty_rows", "docs"]),
    S.batched_cases(blocks=True, block_kinds=("drawn",)),
    S.batched_cases(),
    S.varlen_cases(),
    S.varlen_cases(key_ranges=True, kr_kinds=["empty_rows"]),
)


@profiles.sharded(1.0)
@given(case=emptying)
def test_rows_without_keys(shard, case):
    inp = S.materialize(case)
    call = S.build_call(inp)
    dout = S.make_dout(call) if case.backward else None
    masks = independent.masks(inp)
    g = case.heads_q // case.heads_kv
    for impl in harness.applicable(call.spec):
        (out, lse, dq, dk, dv), _ = harness.run(impl, inp, dout=dout)
        problems = []
        for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            if t is not None and bool(torch.isnan(t).any()):
                problems.append(f"NaN in {name}")
        for b, vis in enumerate(masks):
            empty = ~vis.any(-1)                      # (Hq, Sq_b)
            unseen = ~vis.reshape(case.heads_kv, g, *vis.shape[1:]).any(axis=(1, 2))  # (Hkv, Sk_b)
            o = independent.split_rows(case, out, b).detach().cpu()   # (Sq_b, Hq, Dv)
            l = independent.split_lse(case, lse, b).detach().cpu()    # (Hq, Sq_b)
            for h, i in zip(*np.nonzero(empty)):
                if bool((o[i, h] != 0).any()):
                    problems.append(f"batch {b} head {h} row {i}: no visible key but output != 0")
                if not (l[h, i] == float("-inf")):
                    problems.append(f"batch {b} head {h} row {i}: no visible key but LSE {float(l[h, i])} != -inf")
                if dq is not None and bool((independent.split_rows(case, dq, b)[i, h] != 0).any()):
                    problems.append(f"batch {b} head {h} row {i}: no visible key but dQ != 0")
            if dk is not None:
                kk = independent.split_rows(case, dk, b, "k").cpu()
                vv = independent.split_rows(case, dv, b, "k").cpu()
                for h, j in zip(*np.nonzero(unseen)):
                    if bool((kk[j, h] != 0).any()) or bool((vv[j, h] != 0).any()):
                        problems.append(f"batch {b} kv head {h} key {j}: seen by no query but dK/dV != 0")
            if len(problems) > 8:
                break
        if problems:
            path = harness.save(call, impl.family, backward=dout is not None, dout=dout)
            raise AssertionError(f"{impl.name} on {call.spec.short()}:\n  " + "\n  ".join(problems[:8])
                                 + f"\n  repro: python -m dualattn diff {path}")
