"""Power, SM clock and work per joule of each implementation on long cells (GPU only).

    python ci/power_probe.py [--impls fast-sm90,fa4,cudnn] [--seconds 1.5] [--rounds 4] [--settle 1]

Is the forward at long sequences bound by the board's power limit? For each cell, every
implementation's CUDA-graph replay runs back to back for ``--seconds`` at a time, the
implementations taking turns in a rotated order over ``--rounds`` rounds (so all of them meet
the same temperature), each after ``--settle`` seconds of running unmeasured,
while NVML is read every few replays: board power, SM clock. Printed per implementation: TFLOP/s
over the whole stretch, mean power and clock, and TFLOP per joule (useful FLOPs / energy).
Where every implementation sits at the power limit, speed is energy per FLOP: a kernel that
moves fewer bytes per FLOP runs at a higher clock. A dense GEMM (torch.matmul) is measured the
same way for scale.
"""
import argparse
import os
import statistics
import time

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B


def nvml_sample():
    return torch.cuda.power_draw() / 1000.0, torch.cuda.clock_rate()  # W, MHz


def set_knob(assignment):
    """ATTR=VALUE (a dualattn.fast.sm90 attribute) or env:NAME=VALUE; returns its undo."""
    attr, value = assignment.split("=", 1)
    if attr.startswith("env:"):  # an environment variable read per call
        name, old = attr[4:], os.environ.get(attr[4:])
        os.environ[name] = value
        return lambda: os.environ.pop(name) if old is None else os.environ.__setitem__(name, old)
    old = getattr(sm90, attr)
    setattr(sm90, attr, value)
    return lambda: setattr(sm90, attr, old)


def run_stretch(fn, seconds, settle):
    """Replay ``fn`` for ``settle`` s (NVML's power reading averages over a window, so it still
    shows the previous implementation), then for ``seconds`` more, measured; return (calls,
    elapsed s, [(W, MHz), ...]) of the measured part."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < settle:
        fn()
        torch.cuda.synchronize()
    samples, calls = [], 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
        samples.append(nvml_sample())
    return calls, time.perf_counter() - t0, samples


GEMM = "gemm 8192^3"
GEMM_FLOP = 2 * 8192 ** 3


def graph_replays(cell, inp, impls):
    """{name: CUDA-graph replay} of each implementation in ``impls`` (fast-sm90 or a bench peer;
    one that does not run here is reported and left out), then a dense GEMM 8192^3
    (torch.matmul, ``GEMM``) for scale."""
    fns = {}
    for name in impls:
        try:
            r = B.dualattn_runner(sm90.FORWARD, inp) if name == "fast-sm90" else B.peer_runner(name, inp)
            r.fn()
            fns[name] = B.cuda_graph_replay(r.fn)
        except Exception as e:  # a peer missing here
            print(f"{cell.label()} {name}: {type(e).__name__}: {e}")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    fns[GEMM] = lambda: torch.matmul(x, x)
    return fns


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--impls", default="fast-sm90,fa4,cudnn")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--knob", action="append", default=[], metavar="ATTR=VALUE",
                    help="also fast-sm90 with dualattn.fast.sm90.ATTR set to VALUE while it compiles "
                         "(e.g. _TILE_INFO_ENV=0), or with an environment variable (env:NAME=VALUE, "
                         "e.g. env:DUALATTN_SM90_TILES=128:80,2,1,1,3), several joined by '+'; repeatable")
    ap.add_argument("--hdim", default="", help="only these head dims (comma list)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds run before each measured stretch")
    ap.add_argument("--seqlen", default="", help="instead of the 16k cells: dense cells of these "
                    "lengths (comma list; 16k tokens, heads x dim = 2048, as the bench), causal and not")
    ap.add_argument("--causal", default="", help="only causal (1) or non-causal (0) cells")
    a = ap.parse_args()
    cells = [B.Cell("fwd", "dense", 1, 16384, 16384, 16, 16, 128),
             B.Cell("fwd", "dense", 1, 16384, 16384, 16, 16, 128, True),
             B.Cell("fwd", "dense", 1, 16384, 16384, 32, 32, 64),
             B.Cell("fwd", "dense", 1, 16384, 16384, 8, 8, 256)]
    if a.seqlen:
        cells = [B.Cell("fwd", "dense", 16384 // n, n, n, 2048 // d, 2048 // d, d, causal)
                 for d in (64, 128, 256) for causal in (False, True) for n in map(int, a.seqlen.split(","))]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name()}; {a.rounds} rounds x {a.seconds} s per implementation; peak at a "
          f"clock: {sms} SMs x 4096 dense bf16 FLOP per clock")
    if a.hdim:
        cells = [c for c in cells if str(c.head_dim) in a.hdim.split(",")]
    if a.causal:
        cells = [c for c in cells if c.causal == (a.causal == "1")]
    for cell in cells:
        inp = B.make_inputs(cell)
        flops = B.work(cell)[0]
        fns = graph_replays(cell, inp, a.impls.split(","))
        for knob in a.knob:
            saved = [set_knob(part) for part in knob.split("+")]
            sm90.FORWARD._entries.clear()
            r = B.dualattn_runner(sm90.FORWARD, inp)
            r.fn()
            fns[f"fast-sm90 {knob}"] = B.cuda_graph_replay(r.fn)  # the replay keeps the kernel
            for undo in reversed(saved):
                undo()
            sm90.FORWARD._entries.clear()
        stats = {n: [0, 0.0, []] for n in fns}
        names = list(fns)
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:  # a rotated order
                calls, secs, samples = run_stretch(fns[n], a.seconds, a.settle)
                stats[n][0] += calls
                stats[n][1] += secs
                stats[n][2] += samples
        for n, (calls, secs, samples) in stats.items():
            work = GEMM_FLOP if n == GEMM else flops
            tflops = work * calls / secs / 1e12
            watts = statistics.mean(w for w, _ in samples)
            mhz = statistics.mean(c for _, c in samples)
            print(f"{cell.label():44s} {n:28s} {tflops:7.1f} TFLOP/s  {watts:6.1f} W  {mhz:6.0f} MHz  "
                  f"{tflops / watts:6.3f} TFLOP/J  {tflops / (sms * 4096 * mhz / 1e6) * 100:5.1f} % of "
                  f"the peak at that clock", flush=True)
        del inp, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
