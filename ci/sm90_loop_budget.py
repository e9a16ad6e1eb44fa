"""What one key block of fast-sm90's steady-state loop costs each pipe of an SM sub-partition,
read from the SASS on a machine without a GPU (CuTe DSL build for sm_90a, Triton's ptxas and
cuobjdump; fast/sm90/sass.py):

    python ci/sm90_loop_budget.py            # the bench's dense configs
    python ci/sm90_loop_budget.py 128 1 4096 # head dim, causal (0/1), seqlen
    python ci/sm90_loop_budget.py --all-loops 128 1 16384 1024   # every key-block loop (the
                                             # masked ones too), with a left window of 1024

Per key block and SMSP: the tensor cores' clocks for the warpgroups' HGMMA at the data sheet's
rate, the MUFU clocks for their exponentials (4 lanes per SMSP), and the issue clocks (one
instruction per clock; every consumer warpgroup has one warp per SMSP). The largest of the three
caps the kernel at 989.4 x tensor / largest TFLOP/s before latency, waits, tile edges and the
clock's fall under the power limit (cuBLAS reaches 674-770 on an H100: docs section 17).
"""
import sys
import tempfile
from collections import Counter

import torch

from dualattn.fast.sm90 import FastSm90Forward
from dualattn.fast.sm90.sass import (H100_DENSE_BF16_TFLOPS, assemble, key_block_loops, loop_budget,
                                    opcode, steady_loop)
from dualattn.spec import AttentionSpec

# (label, head dim, causal, seqlen): one of each tile configuration the bench's dense cells get
CONFIGS = [("hd64", 64, False, 8192), ("hd64 causal < 4k", 64, True, 1024),
           ("hd64 causal >= 4k", 64, True, 8192), ("hd128", 128, False, 8192),
           ("hd128 causal", 128, True, 8192), ("hd256", 256, False, 8192),
           ("hd256 causal < 8k", 256, True, 2048), ("hd256 causal >= 8k", 256, True, 8192)]


def _sass(head_dim: int, causal: bool, seqlen: int, window_left: int = -1):
    spec = AttentionSpec("batched", 2, seqlen, seqlen, 8, 8, head_dim, head_dim, torch.bfloat16,
                         "cuda", causal=causal, return_lse=True,
                         **({"window": (window_left, 0)} if window_left >= 0 else {}))
    tile_m, tile_n = FastSm90Forward.config(spec)[:2]
    with tempfile.TemporaryDirectory() as tmp:
        _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, tmp)
    return sass, tile_m, tile_n


def budget(head_dim: int, causal: bool, seqlen: int) -> dict:
    sass, tile_m, tile_n = _sass(head_dim, causal, seqlen)
    lo, hi = steady_loop(sass)
    out = loop_budget(sass[lo:hi + 1], tile_m // 64)
    out.update(tile=f"{tile_m}x{tile_n}", warpgroups=tile_m // 64)
    return out


def all_loops(argv):
    """Every key-block loop of one config: the unmasked one and the masked ones (diagonal,
    window edge), with the mask's instructions (FSEL selects, ISETP compares, R2P bit moves)."""
    sass, tile_m, tile_n = _sass(int(argv[0]), argv[1] == "1", int(argv[2]),
                                 int(argv[3]) if len(argv) > 3 else -1)
    steady = steady_loop(sass)
    print(f"tile {tile_m}x{tile_n}; per key block and warp:")
    for lo, hi in key_block_loops(sass):
        b = loop_budget(sass[lo:hi + 1], tile_m // 64)
        ops = Counter(opcode(ln).split(".")[0] for ln in sass[lo:hi + 1])
        print(f"  {'unmasked' if (lo, hi) == steady else 'masked':9} {b['instructions']:4} instructions, "
              f"FSEL {ops['FSEL']:3}, ISETP {ops['ISETP']:3}, R2P {ops['R2P']:2}; issue "
              f"{b['issue_clk']:.0f}, tensor {b['tensor_clk']:.0f}, MUFU {b['mufu_clk']:.0f} clocks")


def main(argv):
    if argv[:1] == ["--all-loops"]:
        return all_loops(argv[1:])
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
