"""The accuracy rule, as FlashAttention's tests use it, for every output (O, LSE, dQ, dK, dV):

    max|out - ref_hi| <= 2 * max|ref_lo - ref_hi| + eps

``ref_hi`` is the oracle in fp32 (fp64 for fp32 inputs), ``ref_lo`` the oracle run in the input
dtype, and ``eps = r u max|ref_hi|`` with ``u`` the unit roundoff of the input dtype and ``r``
the number of roundings that FlashAttention's algorithm applies at the output's own magnitude,
each at most u relative: for O and the gradients, the last arithmetic step and the store (r = 2);
for LSE, computed in the log2 domain as every FlashAttention kernel does, the folded constant
scale * log2(e), the scaled maximum, the sum ``m2 + log2(l)`` and the final ``* ln(2)`` (r = 4).
(For 16-bit inputs the first term dominates; for fp32 inputs, where the fp32 oracle can land on
the fp64 value by luck, eps is what remains.)

To that eps adds the conditioning of the softmax, which no implementation escapes: scores are
formed in fp32 accumulators (whatever the input dtype), and a rounding of a score s perturbs its
probability by up to u32 |s| relative. With S a bound on |s| (scale * max|q_i| * max|k_j|, before
any softcap: the cap comes after the rounding and passes it on with a factor tanh' <= 1), that
is u32 * S on LSE and 2 u32 * S times the output's magnitude on O and the gradients. It is
negligible for 16-bit inputs and matters for fp32 inputs with large logits.

The gradients share one computation (dS feeds dQ and dK), so their magnitude scale is the
largest of the three: a gradient whose exact value is 0 (dK with a single key) still carries
the rounding of the terms that cancelled to give it. Entries where the reference LSE is -inf
(rows with no visible key) must be -inf exactly; NaN anywhere fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24,
                 torch.float64: 2.0 ** -53}


@dataclass
class Check:
    name: str
    err: float
    bound: float
    ok: bool
    worst: Optional[Tuple[int, ...]] = None  # index of the largest error
    note: str = ""

    def __str__(self) -> str:
        s = f"{self.name}: err {self.err:.3g} bound {self.bound:.3g} {'ok' if self.ok else 'FAIL'}"
        return s + (f" at {self.worst}" if self.worst is not None and not self.ok else "") + (f" ({self.note})" if self.note else "")


def _magnitude(t: torch.Tensor) -> float:
    t = t.detach().to(torch.float64).cpu()
    fin = torch.isfinite(t)
    return float(torch.where(fin, t.abs(), torch.zeros_like(t)).max()) if t.numel() else 0.0


# roundings at the output's magnitude (see the module docstring)
ROUNDINGS = {"out": 2, "lse": 4, "dq": 2, "dk": 2, "dv": 2}


def hi_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def score_bound(call) -> float:
    """An upper bound on |scaled score| before any softcap (Cauchy-Schwarz). A softcap does not
    lower it: the fp32 rounding happens in q.k, before the cap, and reaches the capped score
    c tanh(s / c) multiplied by tanh' <= 1, i.e. at up to full size where s is near 0 (a
    q.k that cancels from large terms: a GPU property-campaign case, fp32, softcap 1, q.k * scale
    = 0.0054 from terms summing to 30 in magnitude, missed the bound taken from the cap by 5 %)."""
    spec = call.spec
    if spec.mode == "kvcache":
        # only the keys a query can see: cache slots past cache_seqlens (and pages no table
        # entry reaches) may hold anything, inf and NaN included
        from dualattn.reference.torch_ref import gather_kvcache

        keys = [kb for kb in gather_kvcache(call)[0] if kb.numel()]
    else:
        keys = [call.k] if call.k.numel() else []
    if call.q.numel() == 0 or not keys:
        return 0.0
    qn = float(call.q.detach().float().norm(dim=-1).max())
    kn = max(float(kb.detach().float().norm(dim=-1).max()) for kb in keys)
    return spec.scale * qn * kn


def check_tensor(name: str, actual: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor,
                 dtype: torch.dtype, magnitude: Optional[float] = None, score_max: float = 0.0) -> Check:
    """The rule for one output; ``magnitude`` overrides max|ref_hi| as the scale of eps and
    ``score_max`` bounds |scaled score| (the conditioning term; 0 leaves it out)."""
    a = actual.detach().to(torch.float64).cpu()
    h = ref_hi.detach().to(torch.float64).cpu()
    lo = ref_lo.detach().to(torch.float64).cpu()
    if a.shape != h.shape:
        return Check(name, float("inf"), 0.0, False, note=f"shape {tuple(a.shape)} != reference {tuple(h.shape)}")
    if bool(torch.isnan(a).any()):
        idx = tuple(int(i) for i in torch.nonzero(torch.isnan(a))[0])
        return Check(name, float("nan"), 0.0, False, idx, "NaN in output")
    inf_ref = torch.isinf(h)
    if bool((torch.isinf(a) != inf_ref).any()) or bool((a[inf_ref] != h[inf_ref]).any()):
        bad = (torch.isinf(a) != inf_ref) | (inf_ref & (a != h))
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        return Check(name, float("inf"), 0.0, False, idx, "infinite where the reference is not, or the reverse")
    fin = ~inf_ref
    diff = torch.where(fin, (a - h).abs(), torch.zeros_like(a))
    lo_diff = torch.where(fin & torch.isfinite(lo), (lo - h).abs(), torch.zeros_like(h))
    scale = _magnitude(h) if magnitude is None else magnitude
    eps = ROUNDINGS.get(name, 2) * UNIT_ROUNDOFF[dtype] * scale
    u32 = UNIT_ROUNDOFF[torch.float32]
    eps += u32 * score_max * (1.0 if name == "lse" else 2.0 * scale)
    err = float(diff.max()) if diff.numel() else 0.0
    bound = 2.0 * (float(lo_diff.max()) if lo_diff.numel() else 0.0) + eps
    worst = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0]) if diff.numel() else None
    return Check(name, err, bound, err <= bound, worst)


def reference_pair(call, dout: Optional[torch.Tensor] = None):
    """(ref_hi, ref_lo) RefResults of the oracle for ``call``."""
    from dualattn.reference.torch_ref import attention_ref

    dt = call.spec.dtype
    return attention_ref(call, hi_dtype(dt), dout), attention_ref(call, dt, dout)


def check_outputs(call, out, lse=None, dq=None, dk=None, dv=None, dout=None, refs=None) -> List[Check]:
    """Apply the rule to every output given; ``refs`` may pass a precomputed reference_pair."""
    hi, lo = refs if refs is not None else reference_pair(call, dout if dq is not None else None)
    dt = call.spec.dtype
    smax = score_bound(call)
    checks = [check_tensor("out", out, hi.out, lo.out, dt, score_max=smax)]
    if lse is not None:
        checks.append(check_tensor("lse", lse, hi.lse, lo.lse, dt, score_max=smax))
    grads = [(n, g) for n, g in (("dq", dq), ("dk", dk), ("dv", dv)) if g is not None]
    grad_scale = max((_magnitude(getattr(hi, n)) for n, _ in grads), default=0.0)
    for name, g in grads:
        checks.append(check_tensor(name, g, getattr(hi, name), getattr(lo, name), dt, magnitude=grad_scale,
                                   score_max=smax))
    return checks
