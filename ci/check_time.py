"""Where the time of ``python -m dualattn check`` goes (a diagnosis tool, GPU machine).

    python ci/check_time.py [check arguments, e.g. --part 1/4 --jobs 0]

Runs the check in this process with timers around the CuTe DSL compiles (``cute.compile``),
Triton's (``JITFunction._do_compile``), the oracle (``accuracy.reference_pair``) and each row
(``_check_row``), and prints the totals and counts after the table. With ``--jobs`` above 1 the
compiles happen in the worker processes, so they do not show here; fresh ``DUALATTN_CACHE_DIR``
and ``TRITON_CACHE_DIR`` give a cold run (docs/bench-h100-20261124.md, section 50).
"""
from __future__ import annotations

import collections
import sys
import time

SECONDS: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(owner, name: str, tag: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its time and calls under ``tag``."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[tag] += time.perf_counter() - t0
            CALLS[tag] += 1
    setattr(owner, name, wrapper)


def main() -> int:
    import cutlass.cute as cute
    import triton.runtime.jit as triton_jit

    import dualattn.__main__ as cli
    from dualattn import accuracy
    timed(cute, "compile", "CuTe DSL compiles")
    timed(triton_jit.JITFunction, "_do_compile", "Triton compiles")
    timed(accuracy, "reference_pair", "the oracle")
    timed(cli, "_check_row", "rows (run + check)")
    t0 = time.perf_counter()
    rc = cli.main(["check", *sys.argv[1:]])
    print(f"check: {time.perf_counter() - t0:.1f} s in all", file=sys.stderr)
    for tag, sec in SECONDS.items():
        print(f"  {tag}: {sec:.1f} s in {CALLS[tag]} calls", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
