"""The stall counts ptxas encodes in fast-sm90's steady key-block loop (sm_90a SASS, no GPU;
docs section 39): how far apart it issues one warp's exponentials (MUFU.EX2) and what sits
between them.

    python ci/sm90_sass_stalls.py                 # hd128, non-causal, 2k
    python ci/sm90_sass_stalls.py 64 1 4096 --listing

Each SASS instruction carries a stall count: the cycles its warp waits before issuing the next
one (variable-latency results are waited for through scoreboards instead). Summed between two
MUFU.EX2 of a straight run of code, the counts give the spacing ptxas chose for the warp's
exponentials; the MUFU quarter of a sub-partition takes 8 cycles per warp instruction.
"""
import sys
import tempfile
from collections import Counter

import torch

from dualattn.fast.sm90 import FastSm90Forward
from dualattn.fast.sm90.sass import assemble, exp2_spacing, opcode, steady_loop
from dualattn.spec import AttentionSpec


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    head_dim, causal, seqlen = (int(args[0]), args[1] == "1", int(args[2])) if args else (128, False, 2048)
    spec = AttentionSpec("batched", 8, seqlen, seqlen, 16, 16, head_dim, head_dim, torch.bfloat16,
                         "cuda", causal=causal, return_lse=True)
    ctrl = []
    with tempfile.TemporaryDirectory() as tmp:
        _, sass = assemble(FastSm90Forward().compile_only(spec, arch=90).__ptx__, tmp, ctrl)
    lo, hi = steady_loop(sass)
    body = list(zip(sass[lo:hi + 1], ctrl[lo:hi + 1]))
    cycles, gaps = exp2_spacing(sass[lo:hi + 1], ctrl[lo:hi + 1])
    print(f"hd{head_dim} {'causal' if causal else 'non-causal'} {seqlen}: steady loop {len(body)} "
          f"instructions, {cycles} cycles of stall counts, {sum(opcode(l).startswith('MUFU.EX2') for l, _ in body)} "
          f"MUFU.EX2")
    print("cycles between consecutive MUFU.EX2 (stall counts only):",
          ", ".join(f"{g}: {n}" for g, n in sorted(Counter(gaps).items())))
    if "--listing" in sys.argv:
        for line, c in body:
            text = line.split("*/", 1)[-1].split(";")[0].strip()
            print(f"S{c['stall']:2d} sb_w {c['write_sb'] if c['write_sb'] != 7 else '-'} "
                  f"wait {c['wait_mask']:02x}  {text}")


if __name__ == "__main__":
    main()
