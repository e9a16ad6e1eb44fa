"""Backward timing of fast-sm120-train vs FlashAttention-2 (torch SDPA flash backend), one GPU.

    python -m dualattn.fast.sm120.bench_bwd [--tokens 8192] [--heads 16]

Times the backward only (ours: delta preprocess + kernel + dQ conversion; SDPA: its whole
backward), median of CUDA-event timings, for hd 64/128, causal and not.
"""
from __future__ import annotations

import argparse

import torch


def _time(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    from dataclasses import replace

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dualattn.fast.sm120 import TRAIN_IMPL
    from dualattn.spec import build_dense

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--deterministic", action="store_true")
    a = ap.parse_args()
    S, H = a.tokens, a.heads
    print(f"{'hd':>4} {'causal':>6} {'ours ms':>9} {'fa2 ms':>9} {'ours TF/s':>10} {'speedup':>8}")
    for d in (64, 128):
        for causal in (False, True):
            q, k, v = (torch.randn(1, S, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            call = build_dense(q, k, v, causal=causal, deterministic=a.deterministic, return_lse=True)
            call = replace(call, spec=replace(call.spec, needs_grad=True))
            out, lse = TRAIN_IMPL.forward(call)
            dout = torch.randn_like(out)
            t_ours = _time(lambda: TRAIN_IMPL.backward(call, out, lse, dout))
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            go = dout.transpose(1, 2)
            t_fa2 = _time(lambda: torch.autograd.grad(o, (qt, kt, vt), go, retain_graph=True))
            flops = 2.5 * 4 * S * S * H * d * (0.5 if causal else 1.0)  # 5 matmuls of 2*S*S*d
            print(f"{d:>4} {str(causal):>6} {t_ours:9.3f} {t_fa2:9.3f} {flops / t_ours / 1e9:10.1f} "
                  f"{t_fa2 / t_ours:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
