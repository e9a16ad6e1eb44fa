"""Implementation registry, GPU arch detection and the choice that impl="auto" makes.

An implementation is an object with

* ``name``       e.g. "torch", "triton", "fast"
* ``family``     one of FAMILIES; what users pass as ``impl=``
* ``can_implement(spec) -> Optional[str]``: None when it can serve the call, else the reason
* ``forward(call) -> (out, lse)``: ``out`` in the input dtype and layout of q (Dv last);
  ``lse`` fp32, natural log, ``(B, Hq, Sq)``, or ``(Hq, total_q)`` for varlen
* ``backward(call, out, lse, dout) -> (dq, dk, dv)`` (only asked when ``spec.needs_grad``)

Optionally ``auto_skip(spec) -> Optional[str]``: a reason why impl="auto" should pass this
implementation over (it can serve the call, but something later in the order is measured to be
faster there); impl="auto" then comes back to it only if nothing later can serve.

Several implementations may share a family (the fast family has one class per arch and
direction); ``impl="fast"`` takes the first of its family that accepts the call.
Implementations are picked up from here by the API, the CLI and the property tests alike.
"""
from __future__ import annotations

import functools
import importlib
from typing import Dict, List, Optional, Tuple

import torch

FAMILIES = ("fast", "triton", "torch")  # auto tries them in this order
_REGISTRY: Dict[str, List[object]] = {f: [] for f in FAMILIES}
_LOAD_ERRORS: Dict[str, str] = {}
_LOADED = False

# modules that register implementations when imported; a failed import is recorded, not fatal
_PROVIDERS = {
    "torch": "dualattn.reference.torch_impl",
    "triton": "dualattn.reference.triton",
    "fast": "dualattn.fast",
}


# api.attention's per-signature launchers: (registry_snapshot(), launcher or None) by the call's
# arguments (dense checks' key, strides, impl); cleared with every registration, and a swapped
# family list (tests) is caught by the snapshot
LAUNCH_MEMO: Dict[tuple, tuple] = {}


def registry_snapshot() -> tuple:
    """The family lists a remembered decision was made with (select, LAUNCH_MEMO)."""
    return (_REGISTRY["fast"], _REGISTRY["triton"], _REGISTRY["torch"])


def registry_unchanged(snapshot: tuple) -> bool:
    """The registry is the one ``snapshot`` was taken of (tests swap family lists)."""
    reg = _REGISTRY
    return snapshot[0] is reg["fast"] and snapshot[1] is reg["triton"] and snapshot[2] is reg["torch"] and _LOADED


def register(impl) -> object:
    fam = impl.family
    if fam not in _REGISTRY:
        raise ValueError(f"unknown implementation family {fam!r}")
    if all(x.name != impl.name for x in _REGISTRY[fam]):
        _REGISTRY[fam].append(impl)
        _SELECT_MEMO.clear()
        LAUNCH_MEMO.clear()
    return impl


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for fam, mod in _PROVIDERS.items():
        try:
            importlib.import_module(mod)
        except Exception as e:  # an optional backend that cannot load is reported by explain()
            _LOAD_ERRORS[fam] = f"{type(e).__name__}: {e}"


def implementations(family: Optional[str] = None) -> List[object]:
    _load()
    if family is None:
        return [i for f in FAMILIES for i in _REGISTRY[f]]
    return list(_REGISTRY[family])


@functools.lru_cache(maxsize=None)
def device_arch(index: int = 0) -> Optional[int]:
    """Compute capability as an int (90 for sm_90), None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


def family_reasons(spec, family: str) -> Tuple[Optional[object], List[str]]:
    """The first implementation of ``family`` that can serve ``spec``, and the reasons of the others."""
    _load()
    reasons = []
    if not _REGISTRY[family]:
        why = _LOAD_ERRORS.get(family, "no implementation registered")
        return None, [f"{family}: not available ({why})"]
    for impl in _REGISTRY[family]:
        r = impl.can_implement(spec)
        if r is None:
            return impl, reasons
        reasons.append(f"{impl.name}: {r}")
    return None, reasons


# select()'s answers per (spec, impl): can_implement / auto_skip depend only on the spec and the
# machine, so a repeated call skips them. An entry remembers the registry lists it was made with
# (register() clears the memo; tests that swap a family's list get fresh answers).
_SELECT_MEMO: Dict[tuple, tuple] = {}
_SELECT_MEMO_MAX = 4096


def select(spec, impl: str = "auto"):
    """Return the implementation object for ``impl``; raise NotImplementedError when it cannot serve."""
    key = (spec, impl)
    hit = _SELECT_MEMO.get(key)
    if hit is not None and registry_unchanged(hit[0]):
        return hit[1]
    chosen = _select(spec, impl)
    if len(_SELECT_MEMO) >= _SELECT_MEMO_MAX:  # specs carry shapes: keep it bounded
        _SELECT_MEMO.clear()
    _SELECT_MEMO[key] = (registry_snapshot(), chosen)
    return chosen


def _select(spec, impl: str):
    if impl not in ("auto",) + FAMILIES:
        # an implementation's own name (e.g. "fast-sm120-train"): used by repro files and tests
        # to replay exactly the kernel that failed
        named = [i for i in implementations() if i.name == impl]
        if not named:
            raise ValueError(f"impl: must be one of 'auto', {', '.join(repr(f) for f in FAMILIES)} "
                             f"or an implementation name; got {impl!r}")
        why = named[0].can_implement(spec)
        if why is not None:
            raise NotImplementedError(f"impl={impl!r} cannot serve this call ({spec.short()}): {why}")
        return named[0]
    if impl != "auto":
        chosen, reasons = family_reasons(spec, impl)
        if chosen is None:
            can = [f for f in FAMILIES if family_reasons(spec, f)[0] is not None]
            raise NotImplementedError(
                f"impl={impl!r} cannot serve this call ({spec.short()}): " + "; ".join(reasons)
                + (f". Implementations that can: {', '.join(can)}" if can else ""))
        return chosen
    chosen = _auto_choice(spec)
    if chosen is not None:
        return chosen
    all_reasons = []
    for fam in FAMILIES:
        all_reasons += family_reasons(spec, fam)[1]
    raise NotImplementedError(f"no implementation can serve this call ({spec.short()}): " + "; ".join(all_reasons))


def _auto_choice(spec):
    """First implementation, in family order, that can serve and does not ask to be passed over;
    failing that, the first that can serve at all."""
    _load()
    fallback = None
    for fam in FAMILIES:
        for impl in _REGISTRY[fam]:
            if impl.can_implement(spec) is not None:
                continue
            skip = getattr(impl, "auto_skip", None)
            if skip is not None and skip(spec) is not None:
                fallback = fallback or impl
                continue
            return impl
    return fallback


def explain_spec(spec) -> str:
    lines = [f"call: {spec.short()}"]
    picked = _auto_choice(spec)
    for fam in FAMILIES:
        _load()
        if not _REGISTRY[fam]:
            lines.append(f"  {fam:7s} no   {family_reasons(spec, fam)[1][0]}")
        for impl in _REGISTRY[fam]:
            r = impl.can_implement(spec)
            if r is not None:
                lines.append(f"  {fam:7s} no   {impl.name}: {r}")
                continue
            skip = getattr(impl, "auto_skip", None)
            why = skip(spec) if skip is not None else None
            mark = "<- auto picks this" if impl is picked else (f"(auto passes over it: {why})" if why else "")
            lines.append(f"  {fam:7s} yes  {impl.name} {mark}".rstrip())
    return "\n".join(lines)
