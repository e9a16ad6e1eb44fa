"""How much a forward loses to the grid's last, partly filled round (GPU only).

    python ci/wave_probe.py [--peers fa4,cudnn] [--reps 10]

Times fast-sm90 and the peers (CUDA-graph replays, so kernels against kernels) at shapes whose
tile count is just under, at and just over a multiple of the SM count: 2048 tiles of 128 query
rows (the bench's 16k-token cells) on 132 SMs are 15.5 rounds, 1980 are exactly 15, 2112 exactly
16. If the last round's idle SMs cost time, TFLOP/s at 2048 tiles sits below both neighbours.
"""
import argparse

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peers", default="fa4,cudnn")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timer = B.Timer(warmup=3, reps=a.reps)
    # (head_dim, batch, heads, seqlen, causal): tiles = batch * heads * ceil(seqlen / 128)
    shapes = [(128, 2, 15, 8448, False), (128, 2, 16, 8192, False), (128, 2, 16, 8448, False),
              (128, 1, 15, 16896, False), (128, 1, 16, 16384, False), (128, 1, 16, 16896, False),
              (256, 2, 8, 7936, False), (256, 2, 8, 8192, False), (256, 2, 8, 8448, False),
              (128, 4, 16, 4096, False), (128, 4, 16, 4224, False)]
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs")
    for hd, b, h, s, causal in shapes:
        cell = B.Cell("fwd", "dense", b, s, s, h, h, hd, causal)
        inp = B.make_inputs(cell)
        flops, _ = B.work(cell)
        tiles = b * h * -(-s // 128)
        row = f"hd{hd} b{b} h{h} s{s}: {tiles} tiles = {tiles / sms:.2f} rounds |"
        for name in ["fast-sm90"] + [p for p in a.peers.split(",") if p]:
            try:
                r = B.dualattn_runner(sm90.FORWARD, inp) if name == "fast-sm90" else B.peer_runner(name, inp)
                r.fn()
                ms, _ = timer.time_ms(B.cuda_graph_replay(r.fn))
                row += f" {name} {flops / ms / 1e9:.0f}"
            except Exception as e:  # a peer that cannot run this shape: say so, go on
                row += f" {name} n/a ({type(e).__name__})"
        print(row, flush=True)


if __name__ == "__main__":
    main()
