"""Side-by-side forward benchmark on one Hopper GPU: fast-sm90 vs cuDNN and FA2 (torch SDPA).

bf16, tokens = batch * seqlen = 16k, heads * head_dim = 2048. TFLOP/s counts 4 * B * S^2 * H * D
for non-causal and half of it for causal (the useful FLOPs, FlashAttention's convention).

    python -m dualattn.fast.sm90.bench_sm90 [--hd 64 128] [--seqlens 1024 ... 16384] [--json out]
"""
from __future__ import annotations

import argparse
import json
import math

import torch


def _time_ms(fn, warmup=3, iters=10):
    for _ in range(warmup):
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
    times.sort()
    return times[len(times) // 2]


def bench(head_dims, seqlens, causals, tokens=16384, width=2048):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from dualattn.fast.sm90 import FORWARD
    from dualattn.spec import build_dense

    rows = []
    for d in head_dims:
        h = width // d
        for s in seqlens:
            b = max(tokens // s, 1)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA wants (B, H, S, D)
            for causal in causals:
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                call = build_dense(q, k, v, causal=causal)
                row = {"hd": d, "seqlen": s, "batch": b, "heads": h, "causal": causal}
                fns = {"fast-sm90": lambda: FORWARD.forward(call)}
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                    def f(be=be):
                        with sdpa_kernel(be):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    fns[name] = f
                for name, fn in fns.items():
                    try:
                        ms = _time_ms(fn)
                        row[name] = flops / ms / 1e9
                    except Exception as e:  # a backend that cannot run this shape is reported
                        row[name] = None
                        row[name + "_error"] = f"{type(e).__name__}: {str(e)[:80]}"
                rows.append(row)
                fmt = lambda x: "   -  " if x is None else f"{x:6.0f}"
                r_cd = row["fast-sm90"] / row["cudnn"] if row["fast-sm90"] and row["cudnn"] else float("nan")
                r_fa = row["fast-sm90"] / row["fa2"] if row["fast-sm90"] and row["fa2"] else float("nan")
                print(f"hd{d:3d} s{s:6d} b{b:2d} h{h:2d} {'causal' if causal else 'full  '} "
                      f"fast {fmt(row['fast-sm90'])} cudnn {fmt(row['cudnn'])} fa2 {fmt(row['fa2'])} "
                      f"fast/cudnn {r_cd:.2f} fast/fa2 {r_fa:.2f}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hd", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--json")
    a = ap.parse_args()
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[a.causal]
    print(torch.cuda.get_device_name(), flush=True)
    rows = bench(a.hd, a.seqlens, causals)
    if a.json:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
