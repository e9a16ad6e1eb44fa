"""What a fast-sm90 call costs beyond its tiles, against cuDNN (GPU only): CUDA-graph replays with
the bench's timer (L2 flushed before each run), interleaved.

    python ci/call_cost.py

Part 1: batch 8 / 16 / 32 at 1k for hd64 / hd128 / hd256, causal and not; 2 T(8) - T(16) is the
per-call cost when both batches fill whole rounds of the grid (docs section 35). Part 2: grids of
one-block tiles (one tile, 132, 264) and a one-kernel graph for the launch floor."""
import warnings

import torch

from dualattn import bench as B
from dualattn.fast.sm90 import FastSm90Forward

warnings.filterwarnings("ignore")


def pair(timer, impl, cell):
    inp = B.make_inputs(cell)
    fns = [B.dualattn_runner(impl, inp).fn, B.peer_runner("cudnn", inp).fn]
    for f in fns:  # compile and warm before capture
        f()
    res = timer.time_interleaved([B.cuda_graph_replay(f) for f in fns])
    return [ms * 1e3 for ms, _ in res]


def main():
    timer = B.Timer(reps=40, budget_s=1.0)
    impl = FastSm90Forward()
    x = torch.zeros(1, device="cuda")
    (ms, _), = timer.time_interleaved([B.cuda_graph_replay(lambda: x.add_(1))])
    print(f"one-kernel graph replay {ms * 1e3:.1f} us")
    for d, causal, h in [(128, False, 16), (128, True, 16), (64, False, 32), (64, True, 32), (256, False, 8)]:
        us = {b: pair(timer, impl, B.Cell("fwd", "dense", b, 1024, 1024, h, h, d, causal=causal))
              for b in (8, 16, 32)}
        name = f"hd{d}{' causal' if causal else ''} 1k"
        print(f"{name:16} b8 / b16 / b32: fast " + " / ".join(f"{us[b][0]:.1f}" for b in us)
              + " us, cudnn " + " / ".join(f"{us[b][1]:.1f}" for b in us)
              + f" us; 2 T(8) - T(16): fast {2 * us[8][0] - us[16][0]:.1f}, cudnn {2 * us[8][1] - us[16][1]:.1f} us",
              flush=True)
    for heads in (1, 132, 264):
        fast, cudnn = pair(timer, impl, B.Cell("fwd", "dense", 1, 128, 128, heads, heads, 128))
        print(f"{heads:3} tiles of one 128 x 128 block (hd128): fast {fast:.1f} us, cudnn {cudnn:.1f} us", flush=True)


if __name__ == "__main__":
    main()
