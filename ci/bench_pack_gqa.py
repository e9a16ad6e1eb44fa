"""fast-sm90 forward with and without GQA heads packed into the M tile, short query blocks (GPU).

    python ci/bench_pack_gqa.py [--sq 1,4,16,32,64,128] [--hdim 128] [--heads 32/8]

Times dualattn.attention(impl="fast") on (B, Sq, Hq, D) queries against an 8k-key cache-like
K/V (B=8, bf16, non-causal and causal), with the group's heads packed and not (the
switch DUALATTN_SM90_PACK_GQA stands for, set per variant), and torch SDPA (cuDNN, enable_gqa) for scale, by CUDA events,
median of 30 after warm-up. Reports us per call and the K/V read rate (GB/s): these shapes are
bound by reading K and V, which packing reads once per KV head instead of once per query head.
"""
from __future__ import annotations

import argparse

import torch

import dualattn


def timed(fn, reps=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sq", default="1,4,16,32,64,128")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--sk", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    hq, hkv = (int(x) for x in a.heads.split("/"))
    B, Sk, D = a.batch, a.sk, a.hdim
    k, v = (torch.randn(B, Sk, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv_bytes = 2 * k.numel() * k.element_size()
    import dualattn.fast.sm90 as sm90
    from dualattn import dispatch
    from dualattn.fast.sm90 import FastSm90Forward
    from dualattn.spec import build_dense
    print(f"B={B} Sk={Sk} heads {hq}/{hkv} hd{D} bf16; us per call (K/V GB/s)")
    for sq in (int(x) for x in a.sq.split(",")):
        for causal in (False, True):
            q = torch.randn(B, sq, hq, D, device="cuda", dtype=torch.bfloat16)
            spec = build_dense(q, k, v, causal=causal).spec
            row = f"Sq={sq:<4}{' causal' if causal else '       '} default pack={FastSm90Forward.pack_gqa(spec)}:"
            impl = dispatch.select(spec, "fast")
            for label, env in (("packed", "1"), ("unpacked", "0")):
                sm90._PACK_GQA_ENV = env
                impl._entries.clear()  # the per-spec launch memo holds the kernel chosen before
                t = timed(lambda: dualattn.attention(q, k, v, causal=causal, impl="fast"))
                row += f"  {label} {t:7.1f} ({kv_bytes / t / 1e3:6.0f})"
            sm90._PACK_GQA_ENV = ""
            impl._entries.clear()
            if causal:  # SDPA's causal is top-left aligned: one query would see one key
                print(row, flush=True)
                continue
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    t = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, enable_gqa=True))
                row += f"  cudnn {t:7.1f} ({kv_bytes / t / 1e3:6.0f})"
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                row += f"  cudnn n/a ({type(e).__name__})"
            print(row, flush=True)


if __name__ == "__main__":
    main()
