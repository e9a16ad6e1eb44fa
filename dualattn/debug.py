"""Reference mode, check mode, compare/localize, repro files.

* ``with dualattn.reference_mode():`` (or ``DUALATTN_MODE=reference``) routes every call to the
  torch oracle.
* ``with dualattn.check_mode():`` (or ``DUALATTN_MODE=check``) runs the requested implementation
  and the oracle side by side and raises :class:`MismatchError` at the first disagreement, with
  the report of :func:`compare`.
* :func:`compare` runs one implementation against the oracle under the accuracy rule and
  localizes the worst error to (batch, head, query block, key block), naming the CSR and key-range
  entries of that tile; it can write a repro file that ``python -m dualattn diff FILE`` replays.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from . import accuracy, dispatch, spec as spec_mod

_MODE = contextvars.ContextVar("dualattn_mode", default=None)


class MismatchError(AssertionError):
    """An implementation disagreed with the reference beyond the accuracy rule."""

    def __init__(self, report: "Report"):
        super().__init__(str(report))
        self.report = report


# DUALATTN_MODE is read on every call (a test or a script may set it after import), straight from
# os.environ's backing dict with the key encoded once: os.environ.get encodes the key and goes
# through the Mapping machinery, about 0.7 us of a cached fast call's few tens (where CPython keeps
# no such dict, the public lookup is used)
_ENV_DATA = getattr(os.environ, "_data", None)
try:
    _ENV_KEY = os.environ.encodekey("DUALATTN_MODE")
except AttributeError:  # pragma: no cover - not CPython's os._Environ
    _ENV_DATA = None


def _env_mode() -> Optional[str]:
    if _ENV_DATA is not None:
        raw = _ENV_DATA.get(_ENV_KEY)
        if raw is None:
            return None
        raw = os.environ.decodevalue(raw)
    else:  # pragma: no cover
        raw = os.environ.get("DUALATTN_MODE", "")
    env = raw.strip().lower()
    return env if env in ("reference", "check") else None


def current_mode() -> Optional[str]:
    m = _MODE.get()
    return m if m is not None else _env_mode()


@contextlib.contextmanager
def reference_mode():
    tok = _MODE.set("reference")
    try:
        yield
    finally:
        _MODE.reset(tok)


@contextlib.contextmanager
def check_mode():
    tok = _MODE.set("check")
    try:
        yield
    finally:
        _MODE.reset(tok)


@dataclass
class Report:
    impl: str
    spec: object
    checks: List[accuracy.Check]
    locations: List[str] = field(default_factory=list)
    repro_path: Optional[str] = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __str__(self) -> str:
        lines = [f"{self.impl} vs torch oracle on {self.spec.short()}: {'ok' if self.ok else 'MISMATCH'}"]
        lines += [f"  {c}" for c in self.checks]
        lines += [f"  {x}" for x in self.locations]
        if self.repro_path:
            lines.append(f"  repro: python -m dualattn diff {self.repro_path}")
        return "\n".join(lines)


def _locate(call, name: str, idx) -> str:
    """Describe where index ``idx`` of output ``name`` lies: batch, head, query/key block, mask entries."""
    spec = call.spec
    bm, bn = spec.block_size or (128, 128)
    if idx is None:
        return f"{name}: no location"
    if name == "lse":
        if spec.mode == "varlen":
            h, t = idx
            b, row = _varlen_row(call, t)
        else:
            b, h, row = idx
        where = f"batch {b}, head {h}, query row {row} (query block {row // bm})"
    elif name in ("out", "dq"):
        if spec.mode == "varlen":
            t, h = idx[0], idx[1]
            b, row = _varlen_row(call, t)
        else:
            b, row, h = idx[0], idx[1], idx[2]
        where = f"batch {b}, head {h}, query row {row} (query block {row // bm})"
        if call.key_ranges is not None:
            kr = call.key_ranges
            if spec.mode == "varlen":
                ent = kr[0, min(h, kr.shape[1] - 1), idx[0]]
            else:
                ent = kr[min(b, kr.shape[0] - 1), min(h, kr.shape[1] - 1), row]
            where += f"; key_ranges entry {ent.tolist()}"
        if call.block_sparse is not None:
            bs = call.block_sparse
            bb, hh = min(b, bs.broadcast_shape[0] - 1), min(h, bs.broadcast_shape[1] - 1)
            where += (f"; CSR row {row // bm}: full {bs.q2k_full.row(bb, hh, row // bm)} "
                      f"mask {bs.q2k_mask.row(bb, hh, row // bm)}")
    else:  # dk, dv: index is a key position
        if spec.mode == "varlen":
            t, h = idx[0], idx[1]
            b, col = _varlen_row(call, t, keys=True)
        else:
            b, col, h = idx[0], idx[1], idx[2]
        where = f"batch {b}, kv head {h}, key {col} (key block {col // bn})"
        if call.block_sparse is not None:
            bs = call.block_sparse
            # the CSR is per query head; kv head h serves query heads h * gqa_ratio ...
            bb, hh = min(b, bs.broadcast_shape[0] - 1), min(h * spec.gqa_ratio, bs.broadcast_shape[1] - 1)
            where += (f"; k2q CSR row {col // bn}: full {bs.k2q_full.row(bb, hh, col // bn)} "
                      f"mask {bs.k2q_mask.row(bb, hh, col // bn)}")
    return f"worst {name}: {where}"


def localize_key_blocks(call, chosen, block_n: int = 128, max_blocks: int = 64) -> str:
    """Which key blocks are wrong on their own: the forward of ``chosen`` is run once per key block
    of ``block_n`` keys with every row's keys restricted to that block (key ranges intersected with
    the call's own), each against the oracle under the accuracy rule. A block that fails alone is
    named; when every block agrees alone, the error is in combining them (the online softmax's
    running max / rescaling), which is said instead. Forward outputs of batched and varlen calls."""
    from dataclasses import replace

    spec = call.spec
    if spec.mode not in ("batched", "varlen"):
        return "key blocks: not localised for kv-cache calls"
    n_blocks = -(-spec.seqlen_k // block_n)
    if n_blocks == 0:
        return "key blocks: the call has no keys"
    dev = call.q.device
    rows = call.q.shape[1] if spec.mode == "batched" else call.q.shape[0]
    kr0 = call.key_ranges
    if kr0 is None:
        kr0 = torch.tensor([0, 2 ** 31 - 1], dtype=torch.int32, device=dev).expand(1, 1, rows, 1, 2)
    failing, skipped = [], n_blocks > max_blocks
    for blk in range(min(n_blocks, max_blocks)):
        lo_b, hi_b = blk * block_n, min((blk + 1) * block_n, spec.seqlen_k)
        lo = kr0[..., 0].clamp(lo_b, hi_b)
        hi = torch.maximum(lo, kr0[..., 1].clamp(lo_b, hi_b))
        kr = torch.stack([lo, hi], -1).to(torch.int32).contiguous()
        sub_spec = replace(spec, num_key_ranges=kr.shape[3], needs_grad=False)
        reason = chosen.can_implement(sub_spec)
        if reason is not None:
            return f"key blocks: not localised ({chosen.name} refuses the restricted calls: {reason})"
        sub = replace(call, spec=sub_spec, key_ranges=kr, extra={})
        out, lse = chosen.forward(sub)
        if not all(c.ok for c in accuracy.check_outputs(sub, out, lse)):
            failing.append(blk)
    tail = f" (first {max_blocks} of {n_blocks} checked)" if skipped else ""
    if failing:
        return f"key blocks of {block_n} keys that fail on their own: {failing}{tail}"
    return (f"every key block of {block_n} keys agrees with the oracle on its own{tail}: the error is in "
            f"combining blocks (running max / rescaling of the online softmax)")


def _add_key_block_location(rep, call, chosen) -> None:
    if any(not c.ok for c in rep.checks if c.name in ("out", "lse")):
        try:  # a debugging aid: never let it hide the mismatch itself
            bn = call.spec.block_size[1] if call.spec.block_size else 128
            rep.locations.append(localize_key_blocks(call, chosen, bn))
        except Exception as e:
            rep.locations.append(f"key blocks: not localised ({type(e).__name__}: {e})")


def _varlen_row(call, t, keys=False):
    cu = (call.cu_seqlens_k if keys else call.cu_seqlens_q).cpu()
    b = int(torch.searchsorted(cu, torch.tensor([t], dtype=cu.dtype), right=True)[0]) - 1
    return b, int(t - cu[b])


def compare(call, impl: str = "auto", *, backward: bool = False, repro_dir: Optional[str] = None,
            seed: int = 0, dout: Optional[torch.Tensor] = None) -> Report:
    """Run ``impl`` and the oracle on ``call``; the accuracy rule on O, LSE (and dQ/dK/dV).

    With ``backward``, ``dout`` is the output gradient (random from ``seed`` when not given)."""
    from dataclasses import replace

    chosen = dispatch.select(replace(call.spec, needs_grad=backward), impl)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if backward:
        if dout is None:
            shape = call.q.shape[:-1] + (call.v.shape[-1],)
            dout = torch.randn(shape, generator=gen).to(call.q.device, call.q.dtype)
        out, lse = chosen.forward(replace(call, spec=replace(call.spec, needs_grad=True)))
        dq, dk, dv = chosen.backward(call, out, lse, dout)
        checks = accuracy.check_outputs(call, out, lse, dq, dk, dv, dout=dout)
    else:
        dout = None
        out, lse = chosen.forward(call)
        checks = accuracy.check_outputs(call, out, lse)
    rep = Report(chosen.name, call.spec, checks)
    rep.locations = [_locate(call, c.name, c.worst) for c in checks if not c.ok and c.worst is not None]
    _add_key_block_location(rep, call, chosen)
    if not rep.ok and repro_dir is not None:
        rep.repro_path = save_repro(call, chosen.name, repro_dir, backward=backward, dout=dout)
    return rep


def check_against_reference(call, chosen, out, lse) -> None:
    checks = accuracy.check_outputs(call, out, lse)
    rep = Report(chosen.name, call.spec, checks)
    if not rep.ok:
        rep.locations = [_locate(call, c.name, c.worst) for c in checks if not c.ok]
        _add_key_block_location(rep, call, chosen)
        rep.repro_path = save_repro(call, chosen.name, os.environ.get("DUALATTN_REPRO_DIR", "repros"))
        raise MismatchError(rep)


# ---- repro files --------------------------------------------------------------------------

_TENSOR_FIELDS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "key_ranges", "cache_seqlens", "page_table",
                  "k_new", "v_new")


def save_repro(call, impl: str, directory: str, *, backward: bool = False, dout=None, name: Optional[str] = None) -> str:
    """Write inputs + spec to ``directory``; returns the path. Replay with ``python -m dualattn diff``."""
    os.makedirs(directory, exist_ok=True)
    s = call.spec
    payload = {
        "spec": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in s.__dict__.items()},
        "tensors": {f: getattr(call, f).detach().cpu() for f in _TENSOR_FIELDS if getattr(call, f) is not None},
        "impl": impl, "backward": backward, "dout": None if dout is None else dout.cpu(),
    }
    if call.block_sparse is not None:
        bs = call.block_sparse
        payload["block_sparse"] = {"full_rowptr": bs.q2k_full.rowptr.cpu(), "full_col": bs.q2k_full.col.cpu(),
                                   "mask_rowptr": bs.q2k_mask.rowptr.cpu(), "mask_col": bs.q2k_mask.col.cpu(),
                                   "block": (bs.block_m, bs.block_n), "seqlen": (bs.seqlen_q, bs.seqlen_k)}
    fname = name or f"repro-{s.mode}-{abs(hash((s, os.getpid(), id(call)))) % 10**10}.pt"
    path = os.path.join(directory, fname)
    torch.save(payload, path)
    return path


def replay_device(saved_device_type: str, device=None):
    """Where a repro replays: ``device`` if given, else where it was found when that is here (a
    GPU find replays on the GPU, as ``python -m dualattn diff REPRO`` is printed after a GPU
    failure), else the CPU."""
    if device is not None:
        return device
    if saved_device_type == "cuda" and torch.cuda.is_available():
        return "cuda"
    return None  # the saved (CPU) tensors as they are


def load_repro(path: str, device=None):
    """Rebuild (call, impl, backward, dout) from a repro file, validating it as a fresh call."""
    from .sparse import BlockSparse

    p = torch.load(path, weights_only=False)
    s = p["spec"]
    device = replay_device(s.get("device_type", "cpu"), device)
    t = {k: (v.to(device) if device is not None else v) for k, v in p["tensors"].items()}
    bs = None
    if "block_sparse" in p:
        d = p["block_sparse"]
        bs = BlockSparse.from_csr(d["full_rowptr"], d["full_col"], d["mask_rowptr"], d["mask_col"], *d["block"],
                                  *d["seqlen"])
        if device is not None:
            bs = bs.to(device)
    common = dict(causal=s["causal"], window=tuple(s["window"]), softcap=s["softcap"], scale=s["scale"])
    if s["mode"] == "batched":
        call = spec_mod.build_dense(t["q"], t["k"], t["v"], key_ranges=t.get("key_ranges"), block_sparse=bs,
                                    deterministic=s["deterministic"], return_lse=True, **common)
    elif s["mode"] == "varlen":
        call = spec_mod.build_varlen(t["q"], t["k"], t["v"], t["cu_seqlens_q"], t["cu_seqlens_k"], s["seqlen_q"],
                                     s["seqlen_k"], key_ranges=t.get("key_ranges"), block_sparse=bs,
                                     deterministic=s["deterministic"], return_lse=True, **common)
    else:
        call = spec_mod.build_kvcache(t["q"], t["k"], t["v"], cache_seqlens=t["cache_seqlens"],
                                      page_table=t.get("page_table"), k_new=t.get("k_new"), v_new=t.get("v_new"),
                                      num_splits=s["num_splits"], return_lse=True, **common)
    dout = p.get("dout")
    if dout is not None and device is not None:
        dout = dout.to(device)
    return call, p["impl"], p["backward"], dout


def diff(path: str, impl: Optional[str] = None, device=None) -> Report:
    """Replay a repro file: the saved impl (or ``impl``) against the oracle."""
    call, saved_impl, backward, dout = load_repro(path, device)
    return compare(call, impl or saved_impl, backward=backward, dout=dout)
