"""Per-kernel GPU time of one benchmark cell: where an implementation spends its milliseconds.

    python ci/kernel_times.py --impls triton --kind bwd --group window,docs [--csr] [--reps 5]

Each (cell, impl) runs once to warm up, then ``--reps`` times under torch.profiler; the table gives
each CUDA kernel's mean time per call. A diagnosis tool beside ci/bench (which gives the totals).
"""
from __future__ import annotations

import argparse
import collections

import torch

from dualattn import bench


def kernel_times(fn, reps: int):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time_total / 1000.0 / reps  # ms per call
    return sorted(per.items(), key=lambda kv: -kv[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--impls", default="triton")
    ap.add_argument("--kind", default="bwd")
    ap.add_argument("--group", default="window,docs")
    ap.add_argument("--hdim", default="128")
    ap.add_argument("--csr", action="store_true", help="also the exact-CSR form of docs/window cells")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    cells = bench.filter_cells(bench.standard_matrix([a.kind]), groups=a.group.split(","),
                               head_dims=[int(h) for h in a.hdim.split(",")])
    for cell in cells:
        inp = bench.make_inputs(cell)
        for impl in bench.select_impls(a.impls.split(",")):
            for csr in ([False, True] if a.csr and bench.has_csr_form(cell) else [False]):
                name = impl.name + (bench.CSR if csr else "")
                try:
                    runner = bench.dualattn_runner(impl, inp, csr=csr)
                except bench.NotApplicable as e:
                    print(f"{cell.label():50s} {name:18s} n/a: {e}")
                    continue
                rows = kernel_times(runner.fn, a.reps)
                total = sum(t for _, t in rows)
                print(f"{cell.label():50s} {name:18s} total {total:.3f} ms")
                for k, t in rows[:8]:
                    print(f"    {t:8.3f} ms  {k[:100]}")


if __name__ == "__main__":
    main()
