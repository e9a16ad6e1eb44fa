"""Running implementations for the properties: which ones apply, the hang watchdog, the oracle
check, and repro files for failures.

Implementations are enumerated through dualattn.dispatch (never by name), so every kernel that
registers itself is fuzzed without an edit here.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from dataclasses import replace
from typing import Callable, List, Optional

import torch
from hypothesis import event

from dualattn import accuracy, debug, dispatch

from . import profiles
from .strategies import Inputs, build_call, make_dout

# (test id, path) of repro files written by the test now running; props/conftest.py prints them
SAVED_REPROS: List[str] = []


def repro_dir() -> str:
    return os.environ.get("DUALATTN_REPRO_DIR", "repros")


def _interpreted(impl, spec) -> bool:
    return spec.device_type == "cpu" and impl.family != "torch"


def applicable(spec) -> List[object]:
    """Every registered implementation that accepts ``spec`` and can run it here.

    The one exclusion beyond can_implement: Triton's CPU interpreter computes tl.dot on bf16
    operands wrongly (DESIGN.md, known pitfalls), so a non-torch implementation running on CPU
    tensors is not asked for bf16; those paths are fuzzed by the gpu profile.
    """
    out = []
    for impl in dispatch.implementations():
        if impl.can_implement(spec) is not None:
            continue
        if _interpreted(impl, spec) and spec.dtype == torch.bfloat16:
            continue
        out.append(impl)
    return out


def families(spec) -> List[str]:
    """Families that the public API (impl=family) can serve ``spec`` with, here."""
    fams = []
    for fam in dispatch.FAMILIES:
        chosen, _ = dispatch.family_reasons(spec, fam)
        if chosen is not None and not (_interpreted(chosen, spec) and spec.dtype == torch.bfloat16):
            fams.append(fam)
    return fams


def test_id() -> str:
    cur = os.environ.get("PYTEST_CURRENT_TEST", "props").split(" ")[0]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", cur.split("::")[-1])


def save(call, impl_label: str, *, backward=False, dout=None, tag: str = "") -> str:
    """Write a repro of ``call``; one file per (test, implementation): the last write is the
    final, shrunk example (Hypothesis replays the minimal failure last)."""
    name = f"{test_id()}{'-' + tag if tag else ''}-{impl_label}.pt"
    path = debug.save_repro(call, impl_label if impl_label in dispatch.FAMILIES else "auto", repro_dir(),
                            backward=backward, dout=dout, name=name)
    if path not in SAVED_REPROS:
        SAVED_REPROS.append(path)
    return path


# ---------------------------------------------------------------------------------------------
# watchdog: a hang is a failure that leaves a repro behind
# ---------------------------------------------------------------------------------------------

def _die(msg: str) -> None:  # pragma: no cover - ends the process
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
    # a pytest-xdist worker's stderr dies with it ("node down: Not properly terminated"), so the
    # message also goes to a file beside the repros
    try:
        os.makedirs(repro_dir(), exist_ok=True)
        with open(os.path.join(repro_dir(), "HANGS.txt"), "a") as f:
            f.write(msg + "\n")
    except OSError:
        pass
    os._exit(124)


# A compile is not a hang. A cold compile of a large config on a busy machine outlived the gpu
# profile's 240 s (H100, 14 workers: the Triton fp32 d192 GQA backward with a window, key ranges
# and a CSR took 141 s alone on the idle machine and 17 s from the cache). When the timer runs
# out while the watched thread is inside one of these compilers, the timer starts again, up to
# MAX_COMPILE_PERIODS more times; a hung kernel leaves the thread waiting on the device instead.
COMPILER_SOURCES = tuple(os.sep + os.path.join(*parts) for parts in (
    ("triton", "compiler", ""), ("triton", "backends", ""),  # Triton: lowering, ptxas
    ("cutlass", "base_dsl", "compiler.py"), ("cutlass", "base_dsl", "dsl.py"),  # CuTe DSL
    ("cutlass", "base_dsl", "ast_preprocessor.py")))
MAX_COMPILE_PERIODS = 3


def compiling(thread_id: int) -> bool:
    """Is thread ``thread_id`` inside a kernel compiler now (a frame of COMPILER_SOURCES)?"""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if any(src in frame.f_code.co_filename for src in COMPILER_SOURCES):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def watchdog(call, impl, *, backward=False, dout=None, timeout: Optional[float] = None,
             on_timeout: Callable[[str], None] = _die):
    """Run the body with a timer: past ``timeout`` seconds the repro is saved and ``on_timeout``
    runs (by default the process exits with 124, since a hung GPU kernel cannot be interrupted),
    unless the body is compiling a kernel then (``compiling``; the timer restarts up to
    MAX_COMPILE_PERIODS times). The body should synchronise the device before it ends (see
    :func:`sync`)."""
    timeout = profiles.current().watchdog_s if timeout is None else timeout
    fired = threading.Event()
    watched = threading.get_ident()
    periods = [0]
    timer = [None]
    lock = threading.Lock()  # a restarted timer must not outlive the body's end
    done = [False]

    def fire():
        with lock:
            if done[0]:
                return
            if periods[0] < MAX_COMPILE_PERIODS and compiling(watched):
                periods[0] += 1
                timer[0] = threading.Timer(timeout, fire)
                timer[0].daemon = True
                timer[0].start()
                return
        fired.set()
        try:
            path = save(call, impl.family, backward=backward, dout=dout, tag="hang")
        except Exception as e:  # the message matters more than the file
            path = f"(repro not saved: {e})"
        spent = timeout * (1 + periods[0])
        on_timeout(f"HANG: {impl.name} did not finish within {spent:.0f} s on {call.spec.short()}"
                   f"{' (still compiling)' if compiling(watched) else ''}; "
                   f"repro: python -m dualattn diff {path}")

    timer[0] = threading.Timer(timeout, fire)
    timer[0].daemon = True
    timer[0].start()
    try:
        yield fired
    finally:
        with lock:
            done[0] = True
            timer[0].cancel()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# running and checking
# ---------------------------------------------------------------------------------------------

def run(impl, inp: Inputs, call=None, dout=None):
    """(out, lse, dq, dk, dv) of one implementation (gradients None without ``dout``), under the
    watchdog. Kv-cache calls get a private copy of the cache, which the forward appends to."""
    if inp.case.mode == "kvcache":
        inp = inp.clone_cache()
        call = None
    call = call if call is not None else build_call(inp, needs_grad=dout is not None)
    try:
        with watchdog(call, impl, backward=dout is not None, dout=dout):
            out, lse = impl.forward(call)
            grads = (None, None, None)
            if dout is not None:
                grads = impl.backward(call, out, lse, dout)
            sync(inp.q.device)
    except Exception as e:
        # an implementation that accepted the call and then raised (a compile error, a CUDA error, a
        # refusal that can_implement did not announce) is a failure like a wrong number: it leaves a
        # repro too (an H100 gpu-profile failure of this kind left none and was lost with the log)
        try:
            path = save(call, impl.family, backward=dout is not None, dout=dout, tag="error")
            e.add_note(f"{impl.name} raised on {call.spec.short()}; repro: python -m dualattn diff {path}")
        except Exception as save_error:  # the original error matters more than the file
            e.add_note(f"{impl.name} raised on {call.spec.short()}; repro not saved: {save_error}")
        raise
    return (out, lse) + tuple(grads), call


def format_failure(impl, call, checks, path) -> str:
    rep = debug.Report(impl.name, call.spec, checks)
    try:  # localisation is a debugging aid; never let it hide the failure itself
        rep.locations = [debug._locate(call, c.name, c.worst) for c in checks if not c.ok and c.worst is not None]
    except Exception as e:
        rep.locations = [f"(no location: {e})"]
    rep.repro_path = path
    return str(rep)


def assert_matches_oracle(inp: Inputs, impls=None, refs=None):
    """Property 1 for one case: every applicable implementation meets the accuracy rule on O, LSE
    (and dQ, dK, dV when the case asks for gradients). Returns the implementations checked."""
    case = inp.case
    call = build_call(inp)
    dout = make_dout(call) if case.backward and case.mode != "kvcache" else None
    impls = applicable(call.spec) if impls is None else impls
    event("implementations: " + ", ".join(i.name for i in impls))
    if refs is None:
        refs = accuracy.reference_pair(call, dout)
    for impl in impls:
        res, used = run(impl, inp, dout=dout)
        checks = accuracy.check_outputs(call, *res[:2], *(res[2:] if dout is not None else ()), dout=dout, refs=refs)
        if case.mode == "kvcache":
            checks.append(_cache_appended(inp, used))
        if not all(c.ok for c in checks):
            path = save(call, impl.family, backward=dout is not None, dout=dout)
            raise AssertionError(format_failure(impl, call, checks, path))
    return impls


def _cache_appended(inp: Inputs, used) -> accuracy.Check:
    """After a kv-cache forward with k_new/v_new, the cache holds them at cache_seqlens (bit exact),
    and nothing else changed."""
    c = inp.case
    want_k, want_v = inp.k.clone(), inp.v.clone()
    if c.cache.n_new:
        for b, n in enumerate(c.cache.cache_seqlens):
            pos = torch.arange(n, n + c.cache.n_new, device=inp.q.device)
            if c.cache.paged:
                ps = c.cache.page_size
                pages = inp.page_table[b][(pos // ps).long()].long()
                want_k[pages, pos % ps] = inp.k_new[b]
                want_v[pages, pos % ps] = inp.v_new[b]
            else:
                want_k[b, pos] = inp.k_new[b]
                want_v[b, pos] = inp.v_new[b]
    ok = torch.equal(used.k, want_k) and torch.equal(used.v, want_v)
    return accuracy.Check("kv-cache contents after append", 0.0 if ok else float("inf"), 0.0, ok)


def bound(refs_hi, refs_lo, name: str, dtype) -> float:
    """The accuracy rule's bound for one output, from a reference pair."""
    h, lo = getattr(refs_hi, name), getattr(refs_lo, name)
    return accuracy.check_tensor(name, h, h, lo, dtype).bound


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Equal within ``tol``, with infinities (empty rows' LSE) matching exactly and no NaN."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape or torch.isnan(a).any() or torch.isnan(b).any():
        return False
    inf = torch.isinf(a) | torch.isinf(b)
    if not torch.equal(a[inf], b[inf]):
        return False
    return bool(((a - b).abs()[~inf] <= tol).all())


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        return float("inf")
    fin = torch.isfinite(a) & torch.isfinite(b)
    d = (a - b).abs()[fin]
    return float(d.max()) if d.numel() else 0.0
