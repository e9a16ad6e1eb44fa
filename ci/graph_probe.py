"""Why a CUDA-graph replay can time slower than the same eager call (GPU only).

    python ci/graph_probe.py [--impls fast-sm90,cudnn]

For a few long cells, per implementation: the bench's eager and graph timings twice, alternated,
then each mode's kernel time from torch.profiler (GPU time of the kernels alone, no host path),
with the SM clock (NVML) read after each. If the kernels themselves run slower inside the graph,
the profiler shows it; if only the timing differs, the cause is around the kernel.
"""
import argparse

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B
from kernel_times import kernel_times  # ci/ (this script's folder)


def kernel_ms(fn, reps=5):
    return {name[:40]: round(ms, 4) for name, ms in kernel_times(fn, reps)[:2]}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--impls", default="fast-sm90,cudnn")
    a = ap.parse_args()
    timer = B.Timer(warmup=3, reps=10)
    cells = [B.Cell("fwd", "dense", 1, 16384, 16384, 32, 32, 64),
             B.Cell("fwd", "dense", 1, 16384, 16384, 16, 16, 128, True),
             B.Cell("fwd", "dense", 2, 8192, 8192, 32, 8, 128)]
    for cell in cells:
        inp = B.make_inputs(cell)
        flops = B.work(cell)[0]
        for name in a.impls.split(","):
            r = B.dualattn_runner(sm90.FORWARD, inp) if name == "fast-sm90" else B.peer_runner(name, inp)
            r.fn()
            graph = B.cuda_graph_replay(r.fn)
            row = []
            for mode, fn in (("eager", r.fn), ("graph", graph), ("eager", r.fn), ("graph", graph)):
                ms = timer.time_ms(fn)[0]
                row.append(f"{mode} {flops / ms / 1e9:.0f} ({torch.cuda.clock_rate()} MHz)")
            ke, kg = kernel_ms(r.fn), kernel_ms(graph)
            print(f"{cell.label()} {name}: " + ", ".join(row), flush=True)
            print(f"    kernels eager {ke}\n    kernels graph {kg}", flush=True)
            del graph
        del inp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
