"""Forward speed of fast-sm120 against FlashAttention-2 (torch SDPA flash backend), same GPU, one run.

    python -m dualattn.fast.sm120.bench [--tokens 16384] [--hdim 64 128] [--seqlens 1024 ... 16384]

bf16, batch x seqlen = tokens, heads x head_dim = 2048. TFLOP/s count 4*B*H*Sq*Sk*D, halved for
causal (the useful work). Times are the median of CUDA-event timings after warm-up.
"""
from __future__ import annotations

import argparse
import statistics

import torch


def _time(fn, iters: int, per_sample: int = 5) -> float:
    """Median seconds per call; calls are queued back to back so host overhead overlaps the GPU."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_sample):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / per_sample)
    return statistics.median(ts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hdim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    args = ap.parse_args(argv)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dualattn.fast.sm120 import IMPL
    from dualattn.spec import build_dense

    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; bf16, tokens={args.tokens}, heads*dim=2048; TFLOP/s (useful)")
    print(f"{'hd':>4} {'causal':>6} {'seqlen':>6} {'sm120':>8} {'FA2':>8} {'ratio':>6}")
    for d in args.hdim:
        h = 2048 // d
        for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]:
            for s in args.seqlens:
                b = max(args.tokens // s, 1)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                call = build_dense(q, k, v, causal=causal)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                t_ours = _time(lambda: IMPL.forward(call), args.iters)
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    t_fa2 = _time(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                  args.iters)
                print(f"{d:>4} {str(causal):>6} {s:>6} {flops / t_ours * 1e-12:8.1f} {flops / t_fa2 * 1e-12:8.1f} "
                      f"{t_fa2 / t_ours:6.2f}", flush=True)
                del q, k, v, qt, kt, vt, call


if __name__ == "__main__":
    main()
