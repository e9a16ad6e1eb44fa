"""Run one benchmark cell's forward for Nsight Compute (GPU only): warm-up and compile outside the
profiled range, then the timed calls between cudaProfilerStart/Stop, one runner per implementation.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
        python ci/ncu_cell.py --hdim 128 --seqlen 1k --causal yes --impls fast-sm90,cudnn

Where the time of a kernel goes (tensor-pipe share, stall reasons), beside ci/bench's totals.
"""
import argparse

import torch

import dualattn.fast.sm90 as sm90
from dualattn import bench as B


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", default="1k")
    ap.add_argument("--causal", default="yes")
    ap.add_argument("--group", default="dense")
    ap.add_argument("--impls", default="fast-sm90", help="fast-sm90 and/or peers (cudnn, fa2, fa4, flex)")
    ap.add_argument("--calls", type=int, default=1, help="profiled calls per implementation")
    a = ap.parse_args()
    seqlen = int(a.seqlen[:-1]) * 1024 if a.seqlen.endswith("k") else int(a.seqlen)
    cells = B.filter_cells(B.standard_matrix(("fwd",)), groups=[a.group], head_dims=[a.hdim],
                           seqlens=[seqlen], causal=a.causal == "yes")
    for cell in cells:
        inp = B.make_inputs(cell)
        for name in a.impls.split(","):
            r = (B.dualattn_runner(sm90.FORWARD, inp) if name == "fast-sm90" else B.peer_runner(name, inp))
            for _ in range(3):
                r.fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for _ in range(a.calls):
                r.fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"{cell.label()} {name}: profiled {a.calls} call(s)", flush=True)


if __name__ == "__main__":
    main()
