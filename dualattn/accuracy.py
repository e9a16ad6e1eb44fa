"""The accuracy rule, as FlashAttention's tests use it, for every output (O, LSE, dQ, dK, dV):

    max|out - ref_hi| <= 2 * max|ref_lo - ref_hi| + eps

``ref_hi`` is the oracle in fp32 (fp64 for fp32 inputs), ``ref_lo`` the oracle run in the input
dtype, and ``eps`` one unit roundoff of the input dtype times max|ref_hi| — the error of merely
storing the exact result in that dtype. Entries where the reference LSE is -inf (rows with no
visible key) must be -inf exactly; NaN anywhere fails.
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


def hi_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def check_tensor(name: str, actual: torch.Tensor, ref_hi: torch.Tensor, ref_lo: torch.Tensor,
                 dtype: torch.dtype) -> Check:
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
    scale = float(torch.where(fin, h.abs(), torch.zeros_like(h)).max()) if h.numel() else 0.0
    eps = UNIT_ROUNDOFF[dtype] * scale
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
    checks = [check_tensor("out", out, hi.out, lo.out, dt)]
    if lse is not None:
        checks.append(check_tensor("lse", lse, hi.lse, lo.lse, dt))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        if g is not None:
            checks.append(check_tensor(name, g, getattr(hi, name), getattr(lo, name), dt))
    return checks
