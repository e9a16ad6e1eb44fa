"""Share of the tensor peak per clock at the full SM clock and at the power limit (GPU only).

    python ci/clock_probe.py [--impls fast-sm90,fa4,cudnn] [--rounds 2]

Why: at 4k-16k tokens every kernel runs at the board's 700 W limit (ci/power_probe.py), so a
bench row mixes two things, the kernel's work per clock and the clock the power allows. This
probe separates them. For each cell and implementation (CUDA-graph replays), and a dense GEMM
8192^3 for scale:

* cold: after 3 s idle (the clock back at its maximum), 40 calls timed one by one with CUDA
  events and no sync between them; the median of calls 2-6 is the rate at the full clock;
* hot: after 2 s of back-to-back calls (at the power limit), 40 more calls; the clock and power
  are the mean of the NVML readings over the second before them.

Printed: TFLOP/s and the share of the tensor peak (SMs x 4096 dense bf16 FLOP per clock) at the
clock read, cold and hot. The implementations take turns in each round.
"""
import argparse
import statistics
import time

import torch

from dualattn import bench as B
from power_probe import GEMM, GEMM_FLOP, graph_replays  # ci/, the script's own directory

CELLS = [B.Cell("fwd", "dense", 1, 16384, 16384, 16, 16, 128), B.Cell("fwd", "dense", 16, 1024, 1024, 16, 16, 128),
         B.Cell("fwd", "dense", 1, 16384, 16384, 8, 8, 256), B.Cell("fwd", "dense", 1, 16384, 16384, 32, 32, 64)]


def burst(fn, n=40):
    """Per-call times (ms) of ``n`` calls issued back to back, one CUDA event between each."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impls", default="fast-sm90,fa4,cudnn")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    peak = lambda mhz: sms * 4096 * mhz / 1e6  # TFLOP/s at that clock
    print(f"# {torch.cuda.get_device_name()}, {sms} SMs; TFLOP/s (% of the tensor peak at the clock read)")
    for cell in CELLS:
        inp = B.make_inputs(cell)
        flops = B.work(cell)[0]
        fns = graph_replays(cell, inp, a.impls.split(","))
        for _ in range(a.rounds):
            for name, fn in fns.items():
                work = GEMM_FLOP if name == GEMM else flops
                rate = lambda ms: work / (statistics.median(ms) / 1e3) / 1e12
                torch.cuda.synchronize()
                time.sleep(3)
                cold_mhz = torch.cuda.clock_rate()
                cold = rate(burst(fn)[1:6])
                t0, samples = time.perf_counter(), []
                while time.perf_counter() - t0 < 2.0:
                    fn()
                    torch.cuda.synchronize()
                    if time.perf_counter() - t0 > 1.0:  # one reading swings by +-5 %: the last second's mean
                        samples.append((torch.cuda.clock_rate(), torch.cuda.power_draw() / 1000))
                hot_mhz = statistics.mean(m for m, _ in samples)
                watts = statistics.mean(w for _, w in samples)
                hot = rate(burst(fn))
                print(f"{cell.label():36s} {name:12s} cold {cold:6.1f} ({cold / peak(cold_mhz) * 100:4.1f} % at "
                      f"{cold_mhz} MHz)  hot {hot:6.1f} ({hot / peak(hot_mhz) * 100:4.1f} % at {hot_mhz:.0f} MHz, "
                      f"{watts:.0f} W)", flush=True)
        del inp, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
