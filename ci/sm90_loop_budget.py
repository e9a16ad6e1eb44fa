"""What one key block of fast-sm90's steady-state loop costs each pipe of an SM sub-partition,
read from the SASS on a machine without a GPU (CuTe DSL build for sm_90a, Triton's ptxas and
cuobjdump; fast/sm90/sass.py):

    python ci/sm90_loop_budget.py            # the bench's dense configs
    python ci/sm90_loop_budget.py 128 1 4096 # head dim, causal (0/1), seqlen

Per key block and SMSP: the tensor cores' clocks for the warpgroups' HGMMA at the data sheet's
rate, the MUFU clocks for their exponentials (4 lanes per SMSP), and the issue clocks (one
instruction per clock; every consumer warpgroup has one warp per SMSP). The largest of the three
caps the kernel at 989.4 x tensor / largest TFLOP/s before latency, waits, tile edges and the
clock's fall under the power limit (cuBLAS reaches 674-770 on an H100: docs section 17).
"""
import sys
import tempfile

import torch

from dualattn.fast.sm90 import FastSm90Forward
from dualattn.fast.sm90.sass import H100_DENSE_BF16_TFLOPS, assemble, loop_budget, steady_loop
from dualattn.spec import AttentionSpec

# (label, head dim, causal, seqlen): one of each tile configuration the bench's dense cells get
CONFIGS = [("hd64", 64, False, 8192), ("hd64 causal < 4k", 64, True, 1024),
           ("hd64 causal >= 4k", 64, True, 8192), ("hd128", 128, False, 8192),
           ("hd128 causal", 128, True, 8192), ("hd256", 256, False, 8192),
           ("hd256 causal < 8k", 256, True, 2048), ("hd256 causal >= 8k", 256, True, 8192)]


def budget(head_dim: int, causal: bool, seqlen: int) -> dict:
    spec = AttentionSpec("batched", 2, seqlen, seqlen, 8, 8, head_dim, head_dim, torch.bfloat16,
                         "cuda", causal=causal, return_lse=True)
    tile_m, tile_n = FastSm90Forward.config(spec)[:2]
    with tempfile.TemporaryDirectory() as tmp:
        _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, tmp)
    lo, hi = steady_loop(sass)
    out = loop_budget(sass[lo:hi + 1], tile_m // 64)
    out.update(tile=f"{tile_m}x{tile_n}", warpgroups=tile_m // 64)
    return out


def main(argv):
    configs = CONFIGS if not argv else [(" ".join(argv), int(argv[0]), argv[1] == "1", int(argv[2]))]
    print(f"{'config':20} {'tile':8} {'WGs':>3} {'instr':>5} {'MUFU':>4} {'HGMMA':>5} "
          f"{'tensor':>6} {'MUFU':>6} {'issue':>6}  bound   cap TFLOP/s")
    for label, d, causal, s in configs:
        b = budget(d, causal, s)
        clocks = {"tensor": b["tensor_clk"], "MUFU": b["mufu_clk"], "issue": b["issue_clk"]}
        bound = max(clocks, key=clocks.get)
        cap = H100_DENSE_BF16_TFLOPS * b["tensor_clk"] / clocks[bound]
        print(f"{label:20} {b['tile']:8} {b['warpgroups']:>3} {b['instructions']:>5} {b['mufu']:>4} "
              f"{b['hgmma']:>5} {b['tensor_clk']:>6.0f} {b['mufu_clk']:>6.0f} {b['issue_clk']:>6.0f}  "
              f"{bound:7} {cap:.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
