"""Block-sparse and packed-document calls through the public API against dense ones (GPU only).

    python ci/block_sparse_probe.py

Times ``dualattn.attention(..., impl="fast")`` (host checks included, unlike ci/bench, which builds
each call once) at hd128 bf16: dense, a CSR of all-full blocks and a 25 % pattern at 8k and 2k,
and 10 packed causal documents over 16k tokens (varlen). Useful TFLOP/s.
"""
import sys, torch, dualattn
from dualattn.sparse import BlockSparse, FULL
from dualattn import dispatch

def timeit(f, reps=30):
    f(); torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(3):
        st.record()
        for _ in range(reps): f()
        en.record(); torch.cuda.synchronize()
        best.append(st.elapsed_time(en) / reps)
    return min(best)

def states(nq, nk, density, seed=1234):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(nq, nk, generator=g) < density
    keep |= torch.eye(nq, nk, dtype=torch.bool)
    return (keep.to(torch.int8) * FULL).view(1, 1, nq, nk).cuda()

torch.manual_seed(0)
D = 128
for B, S, H in ((2, 8192, 16), (8, 2048, 16)):
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    n = S // 128
    ms = timeit(lambda: dualattn.attention(q, k, v, impl="fast"))
    print(f"B{B} S{S}: dense {4*B*H*S*S*D/ms/1e9:.1f} TFLOP/s ({ms:.3f} ms)", flush=True)
    for dens in (1.0, 0.25):
        stt = states(n, n, dens)
        bs = BlockSparse.from_block_states(stt, 128, 128, S, S)
        pairs = int((stt > 0).sum()) * 128 * 128 * B * H
        ms = timeit(lambda: dualattn.attention(q, k, v, block_sparse=bs, impl="fast"))
        print(f"B{B} S{S}: csr density {dens}: {4*pairs*D/ms/1e9:.1f} TFLOP/s ({ms:.3f} ms), blocks/row {int((stt>0).sum())/n:.1f}", flush=True)

# documents: 10 packed causal docs over 16k tokens (the bench's docs cell), through the public API
from dualattn.bench import doc_lengths
lens = doc_lengths(16384, 10)
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
T, H = 16384, 16
q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
pairs = sum(n * (n + 1) // 2 for n in lens) * H
ms = timeit(lambda: dualattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True, impl="fast"))
print(f"docs {lens}: {4*pairs*D/ms/1e9:.1f} TFLOP/s ({ms:.3f} ms)", flush=True)
