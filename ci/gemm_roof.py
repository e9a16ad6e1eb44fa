"""The practical tensor-core roof of this GPU: torch.matmul (cuBLAS) bf16 TFLOP/s on large GEMMs,
timed like the bench (CUDA events, median of reps), to read attention TFLOP/s against.

    python ci/gemm_roof.py
"""
import statistics

import torch


def tflops(m, n, k, batch=1, reps=20):
    a = torch.randn(batch, m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(batch, k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return 2 * batch * m * n * k / statistics.median(times) / 1e9


if __name__ == "__main__":
    print(torch.cuda.get_device_name())
    # square GEMMs only: attention's own shapes (K = 128, or N = 128) are memory-bound as GEMMs
    for shape in [(4096, 4096, 4096, 8), (8192, 8192, 8192, 1), (8192, 8192, 8192, 4),
                  (16384, 16384, 16384, 1)]:
        m, n, k, b = shape
        print(f"bf16 matmul batch {b} {m} x {n} x {k}: {tflops(m, n, k, b):.0f} TFLOP/s", flush=True)
