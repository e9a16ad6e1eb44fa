"""fast-sm90's grid choice A/B (GPU only): the default grid against the persistent grid, on the
bench's mask cells and its causal dense / GQA cells at hd128 and hd256, in one process,
interleaved (three rounds, medians; the launch memo cleared between them).

    python ci/sm90_grid_ab.py

The figures behind fast/sm90's _short_masked_tiles came from this script.
"""
import statistics, torch
import dualattn.fast.sm90 as sm90
from dualattn import bench as B

impl = sm90.FORWARD
timer = B.Timer(warmup=3, reps=10)
cells = B.filter_cells(B.standard_matrix(("fwd",)), groups=["window", "docs", "sparse"])
cells += B.filter_cells(B.standard_matrix(("fwd",)), groups=["dense"], head_dims=[128, 256], causal=True)
cells += B.filter_cells(B.standard_matrix(("fwd",)), groups=["gqa"], causal=True)
for cell in cells:
    inp = B.make_inputs(cell)
    flops = B.work(cell)[0]
    for csr in ([False, True] if B.has_csr_form(cell) else [False]):
        ms = {"": [], "1": []}
        for _ in range(3):
            for mode in ("", "1"):
                sm90._PERSISTENT_ENV = mode
                impl._entries.clear()
                r = B.dualattn_runner(impl, inp, csr)
                ms[mode].append(timer.time_ms(r.fn)[0])
        a, b = statistics.median(ms[""]), statistics.median(ms["1"])
        name = f"{cell.label() if hasattr(cell, 'label') else cell}{' +csr' if csr else ''}"
        print(f"{name:60s} default {flops/a/1e9:7.1f}  persistent {flops/b/1e9:7.1f} TFLOP/s  ratio {a/b:.3f}", flush=True)
    del inp
    torch.cuda.empty_cache()
