"""What a query tile costs beside its key blocks, for fast-sm90 and the peers (GPU only).

    python ci/tile_cost_probe.py [--peers fa4,cudnn] [--hdim 64,128] [--reps 10]

The short causal cells (1k-2k keys) are where fast-sm90 trails cuDNN. A tile there visits
4.5 key blocks on average, so what a tile costs once (its Q load, the first Q K^T that nothing
overlaps, the last P V, the epilogue) weighs as much as the per-block rate does. This probe
separates the two. It keeps the query side fixed (1024 queries a head, so the same number of
128-row tiles and rounds of the grid) and gives the keys 128 to 4096 (1 to 32 key blocks a tile,
non-causal, no tail). A kernel's time is then close to A + B * blocks. B is the time per key block
and A the time per tile beside it; A / B is a tile's fixed cost in key blocks. Times are CUDA-graph
replays (kernels without their host paths). A peer that tiles differently still gets a
comparable A / B in units of 128 keys.
"""
import argparse

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B

KEYS = [128, 256, 512, 1024, 2048, 4096]


def fit(xs, ys):
    """Least-squares line y = a + b x: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peers", default="fa4,cudnn")
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    timer = B.Timer(warmup=3, reps=a.reps)
    print(f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    for hd in [int(h) for h in a.hdim.split(",")]:
        heads = 2048 // hd
        for name in ["fast-sm90"] + [p for p in a.peers.split(",") if p]:
            blocks, ms_list, row = [], [], []
            for sk in KEYS:
                cell = B.Cell("fwd", "dense", 16, 1024, sk, heads, heads, hd)
                inp = B.make_inputs(cell)
                try:
                    r = B.dualattn_runner(sm90.FORWARD, inp) if name == "fast-sm90" else B.peer_runner(name, inp)
                    r.fn()
                    ms, _ = timer.time_ms(B.cuda_graph_replay(r.fn))
                except Exception as e:  # a peer that cannot run this shape: say so, go on
                    row.append(f"{sk}: n/a ({type(e).__name__})")
                    continue
                finally:
                    del inp
                blocks.append(sk // 128)
                ms_list.append(ms)
                row.append(f"{sk}: {B.work(cell)[0] / ms / 1e9:.0f}")
            line = f"hd{hd} {name:10} TFLOP/s by keys  " + "  ".join(row)
            if len(blocks) >= 3:
                a0, b0 = fit(blocks, ms_list)
                # the fit is of the whole kernel: both terms carry the same number of rounds
                line += f" | kernel = {a0 * 1e3:.1f} us + {b0 * 1e3:.1f} us x blocks: a tile's fixed cost = {a0 / b0:.2f} blocks"
            print(line, flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
