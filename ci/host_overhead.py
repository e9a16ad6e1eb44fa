"""Where the host time of a cached fast-sm90 forward call goes (a diagnosis tool, GPU only).

    python ci/host_overhead.py [--impl fast-sm90|fast-sm120|fast-sm120-train] [--profile FILE]

Times, per call, back-to-back without synchronising (the GPU queue absorbs the launches) on a
tiny problem: the whole public call ``dualattn.attention(..., impl="fast")`` and each step of it
on its own (spec memo, dispatch, input checks, output allocation, compiled-entry lookup, argument
packing, stream lookup, the launch). The issue's target for the whole call is < 15 us.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

import torch

import dualattn
from dualattn import dispatch
from dualattn import debug
from dualattn.fast.common.launch_args import (BoundLaunch, DirectLauncher, current_stream_handle, empty_f32,
                                              empty_output)
from dualattn.spec import build_dense


def per_call_us(fn, n=2000, rounds=5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", help="write cProfile stats of the public call here (top 25 printed)")
    ap.add_argument("--impl", default="fast-sm90", help="fast-sm90 (every step), or another implementation "
                    "(the whole call and its forward / backward only)")
    a = ap.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if a.impl != "fast-sm90":
        return other_impl(a.impl, q, k, v)
    call = build_dense(q, k, v)
    impl = dispatch.select(call.spec, "fast")
    assert impl.name == "fast-sm90", impl.name
    impl.forward(call)
    fn, pack, tail, _ = impl._entry(call.spec, q.device)
    sk = impl.no_cut_fields(call.spec)  # stream-K fields: nothing cut at this size
    out, lse = impl.forward(call)
    dev = q.device
    run = impl.direct_launcher(call)
    bound = BoundLaunch(fn, pack.__self__, 5, (*impl.shape_values(q, k, v), *tail, *sk))
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr())
    stream = current_stream_handle(dev)
    bound(ptrs, stream)
    bound(ptrs, stream)
    ready = bound._tls.ready
    steps = {
        "dualattn.attention (whole public call)": lambda: dualattn.attention(q, k, v, impl="fast"),
        "dualattn.attention(return_lse=True)": lambda: dualattn.attention(q, k, v, impl="fast", return_lse=True),
        "impl.forward(prebuilt call)": lambda: impl.forward(call),
        "  build_dense (memoised spec)": lambda: build_dense(q, k, v),
        "  dispatch.select": lambda: dispatch.select(call.spec, "fast"),
        "  _prep x3": lambda: (impl._prep(q), impl._prep(k), impl._prep(v)),
        "  empty_output + empty_f32 (out + lse)": lambda: (empty_output(q, 64), empty_f32(q, (1, 2, 128))),
        "  (torch.empty(shape, dtype=, device=) x2, what they replaced)": lambda: (
            torch.empty((1, 128, 2, 64), dtype=q.dtype, device=dev),
            torch.empty((1, 2, 128), dtype=torch.float32, device=dev)),
        "  debug.current_mode": debug.current_mode,
        "  (os.environ.get of DUALATTN_MODE, what it replaced)": lambda: os.environ.get("DUALATTN_MODE", ""),
        "  _entry (memo)": lambda: impl._entry(call.spec, dev),
        "  pack_args": lambda: impl.pack_args(pack, tail, q, k, v, out, lse, sk),
        "  current_stream_handle": lambda: current_stream_handle(dev),
        "  pack + launch": lambda: fn(impl.pack_args(pack, tail, q, k, v, out, lse, sk), current_stream_handle(dev)),
        "replayed launcher run(q, k, v) (what a LAUNCH_MEMO hit calls)": lambda: run(q, k, v),
        "  bound launch (writes the 5 pointers, calls the host function)": lambda: bound(ptrs, stream),
        "  the compiled host function alone (ready array)": lambda: DirectLauncher._fire(ready[2], ready[1], stream),
        "torch.add (a one-kernel torch op, for scale)": lambda: torch.add(q, k),
    }
    for name, f in steps.items():
        print(f"{per_call_us(f):8.2f} us  {name}", flush=True)
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            dualattn.attention(q, k, v, impl="fast")
        pr.disable()
        torch.cuda.synchronize()
        pr.dump_stats(a.profile)
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def other_impl(name, q, k, v):
    """Whole-call and forward / backward host time of any implementation by name."""
    from dataclasses import replace
    impl = {i.name: i for i in dispatch.implementations()}[name]
    call = build_dense(q, k, v, return_lse=True)
    if name.endswith("-train"):
        call.spec = replace(call.spec, needs_grad=True)
    out, lse = impl.forward(call)
    steps = {f"dualattn.attention(impl={name!r})": lambda: dualattn.attention(q, k, v, impl=name),
             "impl.forward(prebuilt call)": lambda: impl.forward(call)}
    if name.endswith("-train"):
        dout = torch.randn_like(out)
        steps = {"impl.forward(prebuilt call)": lambda: impl.forward(call),
                 "impl.backward (preprocess + kernel + dQ cast)": lambda: impl.backward(call, out, lse, dout)}
    steps["torch.add (a one-kernel torch op, for scale)"] = lambda: torch.add(q, k)
    for label, f in steps.items():
        print(f"{per_call_us(f, n=500):8.2f} us  {label}", flush=True)


if __name__ == "__main__":
    main()
