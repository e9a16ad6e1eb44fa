"""What a kernel's start and end cost against the peers (GPU only): one query tile per head and 132
heads, so every CTA of a 132-SM GPU runs one tile per round; 1, 2, 4 and 8 rounds of 1024 keys and
one round of 128. CUDA-graph replays, L2 flushed before each.

    python ci/launch_floor_probe.py [cudnn,fa4]

With a head per tile these shapes read K and V from HBM for every tile, so they measure a kernel's
fixed costs (launch, first loads, last store), not what a tile costs inside a long run
(ci/tile_cost_probe.py). SDPA's causal mask is top-left aligned and ours bottom-right, so the
causal rows compare different work where the query and key lengths differ."""
import sys
import warnings

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B


def main(peers) -> None:
    warnings.filterwarnings("ignore")
    timer = B.Timer(warmup=3, reps=30)
    print(torch.cuda.get_device_name(0), flush=True)
    x = torch.zeros(1024, device="cuda")
    ms, _ = timer.time_ms(B.cuda_graph_replay(lambda: x.add_(1)))
    print(f"trivial kernel (graph, L2 flushed): {ms * 1e3:.1f} us", flush=True)
    for head_dim, causal in ((128, False), (128, True), (64, False), (256, False)):
        for batch, sq, sk in ((1, 128, 128), (1, 128, 1024), (2, 128, 1024), (4, 128, 1024), (8, 128, 1024)):
            if head_dim == 64:
                sq = sq * 3 // 2  # hd64 runs 192-row tiles
            cell = B.Cell("fwd", "dense", batch, sq, sk, 132, 132, head_dim, causal=causal)
            inp = B.make_inputs(cell)
            row = []
            for name in ["fast-sm90"] + peers:
                try:
                    r = B.dualattn_runner(sm90.FORWARD, inp) if name == "fast-sm90" else B.peer_runner(name, inp)
                    r.fn()
                    ms, _ = timer.time_ms(B.cuda_graph_replay(r.fn))
                    row.append(f"{name} {ms * 1e3:7.1f}")
                except Exception as e:  # a peer that cannot run this shape: say so, go on
                    row.append(f"{name} n/a ({type(e).__name__})")
            print(f"hd{head_dim} {'causal' if causal else 'plain '} b{batch} sq{sq} sk{sk}: "
                  + "  ".join(row) + " us", flush=True)
            del inp
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main([p for p in (sys.argv[1] if len(sys.argv) > 1 else "cudnn").split(",") if p])
