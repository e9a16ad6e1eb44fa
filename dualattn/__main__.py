"""python -m dualattn {check, diff, bench, fuzz, info}

check   the main job: every variant with every implementation this machine can run, against the
        torch oracle under the accuracy rule; a table; exit code 1 on any failure.
        Without a GPU the Triton kernels run under the Triton interpreter, on small shapes.
diff    replay a repro file (written by check mode, compare or the property tests).
bench   side-by-side benchmark with the peers (needs CUDA); see dualattn.bench.
fuzz    the Hypothesis property campaign (pytest props/) with a profile.
info    GPU, arch, and which implementation serves which feature.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _prepare_triton_env() -> None:
    # Without a GPU, Triton kernels can still run in the interpreter; it must be chosen before
    # triton is imported.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _progress(i: int, n: int, label: str) -> None:
    if os.environ.get("DUALATTN_PROGRESS", "1") == "0":
        return
    width = 24
    done = int(width * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} {label[:48]:<48}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _check_row(rows, name, dt, call, impl, dout, refs, gpu) -> int:
    """Run ``impl`` on ``call`` (forward only where it cannot take the backward), check it against
    the oracle's ``refs`` and append its row; 1 for a failure, else 0."""
    import torch

    from . import accuracy
    try:
        c2, fwd_only = _row_call(call, impl)
        t0 = time.perf_counter()
        out, lse = impl.forward(c2)
        grads = (None, None, None)
        if c2.spec.needs_grad:
            grads = impl.backward(c2, out, lse, dout)
        if gpu:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        checks = accuracy.check_outputs(c2, out, lse, *grads, dout=dout, refs=refs)
        ok = all(c.ok for c in checks)
        worst = max(checks, key=lambda c: (c.err / c.bound) if c.bound > 0 else (0 if c.err == 0 else float("inf")))
        detail = f"{worst.name} {worst.err:.2e} <= {worst.bound:.2e}" if ok else "; ".join(str(c) for c in checks if not c.ok)
        if fwd_only:
            detail += " (fwd only)"
        rows.append((name, str(dt)[6:], impl.name, "PASS" if ok else "FAIL", detail, f"{ms:.1f}"))
        return 0 if ok else 1
    except Exception as e:  # a crash is a failure of that cell, reported, not hidden
        rows.append((name, str(dt)[6:], impl.name, "FAIL", f"{type(e).__name__}: {e}"[:100], ""))
        return 1


def _row_call(call, impl):
    """(the call ``impl`` runs for a row, forward only): without the backward where ``impl``
    cannot take it."""
    if call.spec.needs_grad and impl.can_implement(call.spec) is not None:
        from dataclasses import replace
        return replace(call, spec=replace(call.spec, needs_grad=False)), True
    return call, False


def _family_impls(spec, fam):
    """(impl that takes the whole call, the family's forward kernel, reasons) for a family. The
    forward kernel is what an inference call (no grad) of the family runs, which can differ from
    the one that also takes the backward (on Hopper, "fast" is fast-sm90 for inference and
    fast-sm120-train for training): check gives both a row."""
    from . import dispatch
    impl, reasons = dispatch.family_reasons(spec, fam)
    fwd_impl = impl
    if spec.needs_grad:
        from dataclasses import replace
        fwd_impl, _ = dispatch.family_reasons(replace(spec, needs_grad=False), fam)
    return impl, fwd_impl, reasons


def _check_jobs(value: str) -> int:
    """--jobs: processes that compile the check's kernels before it runs (auto: half the CPUs, at
    most 8; 0 or 1: none, each kernel compiles at its first row)."""
    if value == "auto":
        return min(8, (os.cpu_count() or 2) // 2)
    return int(value)


def _warm_caches(args, argv, n_work: int) -> None:
    """Compile every kernel the check will run before it runs, in ``--jobs`` processes at once.

    Compiling dominates a first check on a GPU machine (CuTe DSL kernels 2-5 s each and Triton
    kernels 1-2 s, single-threaded, about 70 % of a cold run), and every compiled kernel lands in
    an on-disk cache (dualattn's compile cache, Triton's own) that the rows then load in a fraction
    of a second. Each worker takes every n-th row of the same work list and runs its
    implementations once (forward and, where taken, backward) without the oracle; anything that
    fails there is left for the row itself to report. Nothing to share without the disk cache."""
    from .fast.common.compile_cache import cache_dir
    jobs = _check_jobs(getattr(args, "jobs", "auto"))
    if jobs <= 1 or n_work < 2 or cache_dir() is None:
        return
    jobs = min(jobs, n_work)
    t0 = time.perf_counter()
    if os.environ.get("DUALATTN_PROGRESS", "1") != "0":
        sys.stderr.write(f"compiling the kernels of {n_work} rows in {jobs} processes ...\n")
    env = dict(os.environ, DUALATTN_PROGRESS="0")
    procs = [subprocess.Popen([sys.executable, "-m", "dualattn", "check", *argv, "--warm-part", f"{k}/{jobs}"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for k in range(1, jobs + 1)]
    for proc in procs:
        proc.wait()
    if os.environ.get("DUALATTN_PROGRESS", "1") != "0":
        sys.stderr.write(f"compiled in {time.perf_counter() - t0:.0f} s\n")


def _warm_share(work, families, device, large, args) -> int:
    """A _warm_caches worker: run each row's implementations once, so their kernels compile into
    the disk caches; no oracle, no checks, errors ignored (the row reports them)."""
    import torch

    from . import cases
    for case, dt in work:
        try:
            call = cases.make_call(case, device, dt, large, seed=args.seed, backward=not args.no_backward)
        except Exception:
            continue
        dout = None
        if call.spec.needs_grad:
            dout = torch.randn(call.q.shape[:-1] + (call.v.shape[-1],), device=device, dtype=dt)
        for fam in families:
            impl, fwd_impl, _ = _family_impls(call.spec, fam)
            for one in {i.name: i for i in (impl, fwd_impl) if i is not None}.values():
                try:
                    c2, _ = _row_call(call, one)
                    out, lse = one.forward(c2)
                    if c2.spec.needs_grad:
                        one.backward(c2, out, lse, dout)
                except Exception:
                    pass
        if device == "cuda":
            torch.cuda.synchronize()
    return 0


def cmd_check(args, argv_of_check=()) -> int:
    _prepare_triton_env()
    import torch

    from . import accuracy, cases, dispatch

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")] if args.dtypes else (
        [torch.bfloat16, torch.float16] if gpu else [torch.float16, torch.float32])
    large = gpu and not args.small
    families = args.impls.split(",") if args.impls else [f for f in dispatch.FAMILIES]
    selected = [c for c in cases.CASES if not args.filter or args.filter.lower() in c.name.lower()]
    if args.part:  # "k/n": every n-th variant from the k-th (a long run split over calls)
        k, n = (int(x) for x in args.part.split("/"))
        if not 1 <= k <= n:
            raise SystemExit(f"--part: expected k/n with 1 <= k <= n, got {args.part!r}")
        selected = selected[k - 1::n]
    work = [(c, dt) for c in selected for dt in dtypes]
    warm_part = getattr(args, "warm_part", None)
    if warm_part:  # a worker of _warm_caches: compile this share of the work, check nothing
        k, n = (int(x) for x in warm_part.split("/"))
        return _warm_share(work[k - 1::n], families, device, large, args)
    if gpu:
        _warm_caches(args, argv_of_check, len(work))
    rows, failures = [], 0
    notes = []  # why a family serves none of a row (n/a), in full
    for i, (case, dt) in enumerate(work):
        _progress(i, len(work), f"{case.name} {str(dt)[6:]}")
        try:
            call = cases.make_call(case, device, dt, large, seed=args.seed, backward=not args.no_backward)
            dout = None
            if call.spec.needs_grad:
                gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
                dout = torch.randn(call.q.shape[:-1] + (call.v.shape[-1],), generator=gen).to(device, dt)
            refs = accuracy.reference_pair(call, dout)
        except Exception as e:  # a case that cannot be built fails its row; the others still run
            rows.append((case.name, str(dt)[6:], "-", "FAIL", f"{type(e).__name__}: {e}"[:100], ""))
            failures += 1
            continue
        for fam in families:
            impl, fwd_impl, reasons = _family_impls(call.spec, fam)
            if impl is None:
                impl = fwd_impl  # a fam that cannot take the backward may still take the forward
                if impl is None:
                    # the reasons in full below the table (they are long; a cut one says nothing)
                    text = "; ".join(reasons)
                    if text not in notes:
                        notes.append(text)
                    rows.append((case.name, str(dt)[6:], fam, "n/a", f"why: note {notes.index(text) + 1}", ""))
                    continue
            failures += _check_row(rows, case.name, dt, call, impl, dout, refs, gpu)
            if fwd_impl is not None and fwd_impl.name != impl.name:
                failures += _check_row(rows, case.name, dt, call, fwd_impl, dout, refs, gpu)
    _progress(len(work), len(work), "done")
    header = ("variant", "dtype", "impl", "result", "error vs bound", "ms")
    widths = [max(len(str(r[j])) for r in rows + [header]) for j in range(6)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*header))
    for r in rows:
        print(fmt.format(*r))
    for i, text in enumerate(notes):
        print(f"note {i + 1}: {text}")
    ran = sum(1 for r in rows if r[3] in ("PASS", "FAIL"))
    print(f"\n{ran - failures} passed, {failures} failed ({'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU'}; "
          f"{'large' if large else 'small'} shapes)")
    return 1 if failures else 0


def cmd_info(args) -> int:
    _prepare_triton_env()
    import torch

    from . import cases, dispatch

    print(f"torch {torch.__version__}")
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()} (sm_{dispatch.device_arch()})")
    else:
        print("GPU: none (Triton runs under the interpreter; fast kernels compile-only)")
    for fam in dispatch.FAMILIES:
        names = [i.name for i in dispatch.implementations(fam)]
        print(f"{fam:7s}: {', '.join(names) if names else 'not available: ' + dispatch._LOAD_ERRORS.get(fam, 'none registered')}")
    print("\nwho serves which variant (forward+backward where the variant has a backward):")
    for case in cases.CASES:
        call = cases.make_call(case, "cpu", torch.float16, False, backward=True)
        cells = []
        for fam in dispatch.FAMILIES:
            impl, reasons = dispatch.family_reasons(call.spec, fam)
            cells.append(f"{fam}={'yes' if impl else 'no'}")
        print(f"  {case.name:32s} {'  '.join(cells)}")
    return 0


def cmd_diff(args) -> int:
    _prepare_triton_env()
    from . import debug

    rep = debug.diff(args.repro, impl=args.impl, device=args.device)
    print(rep)
    return 0 if rep.ok else 1


def cmd_fuzz(args) -> int:
    env = dict(os.environ, DUALATTN_PROPS_PROFILE=args.profile)
    # props/ sits next to the package in a source checkout; found from there, not from the cwd
    props = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "props")
    if not os.path.isdir(props):
        props = "props/"
    cmd = [sys.executable, "-m", "pytest", props, "-q", "--hypothesis-show-statistics"] + args.pytest_args
    return subprocess.call(cmd, env=env)


def cmd_bench(argv) -> int:
    from . import bench

    return bench.main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    p = argparse.ArgumentParser(prog="python -m dualattn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="every variant x every available impl vs the oracle")
    c.add_argument("--impls", help="comma-separated families (default: all)")
    c.add_argument("--dtypes", help="comma-separated, e.g. float16,bfloat16")
    c.add_argument("--filter", help="only variants whose name contains this")
    c.add_argument("--small", action="store_true", help="small shapes even on a GPU")
    c.add_argument("--no-backward", action="store_true")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--part", help="k/n: every n-th variant from the k-th (split a long run)")
    c.add_argument("--jobs", default="auto",
                   help="processes that compile the kernels first, on a GPU (default auto: half the "
                        "CPUs, at most 8; 0: none)")
    c.add_argument("--warm-part", help=argparse.SUPPRESS)  # a --jobs worker's share: k/n
    sub.add_parser("info", help="GPU, arch, implementations and what they serve")
    d = sub.add_parser("diff", help="replay a repro file against the oracle")
    d.add_argument("repro")
    d.add_argument("--impl", default=None)
    d.add_argument("--device", default=None,
                   help="where to replay (default: where the repro was found if that device is here, else cpu)")
    f = sub.add_parser("fuzz", help="run the property campaign (pytest props/)")
    f.add_argument("--profile", default="ci", choices=["ci", "gpu", "campaign"])
    f.add_argument("pytest_args", nargs="*")
    sub.add_parser("bench", help="side-by-side benchmark (see python -m dualattn bench --help)")
    args = p.parse_args(argv)
    if args.cmd == "check":
        return cmd_check(args, argv[1:])
    return {"check": cmd_check, "info": cmd_info, "diff": cmd_diff, "fuzz": cmd_fuzz}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
