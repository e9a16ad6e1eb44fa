"""SM120 (consumer Blackwell) kernels: FlashAttention-2 on warp-level mma.sync + cp.async.

The same code runs on SM80/86/89 and SM90, which is where it is tested on a GPU; CI compiles it
for sm_120a (99 KB of shared memory per block). Registered as the "fast-sm120" member of the
"fast" family; the order of registration among the fast kernels decides priority on SM90.

What ``fast-sm120`` serves (forward only; ``can_implement`` refuses the rest with the reason):
batched and varlen (cu_seqlens); fp16/bf16; head dims 32..256 in steps of 32 with Dv == D; GQA/MQA
(KV head indexed in the kernel); bottom-right causal with tile skipping; windows (left/right);
softcap; key ranges (R <= 4 per row); block-sparse CSR (block size a multiple of the kernel tile,
see ``fwd.tile_config``); any sequence lengths; tensors under 2**31 elements.
Not served: backward (needs_grad), kv-cache/decode, Dv != D, head dims not a multiple of 32, fp32.
"""
from dualattn import dispatch as _dispatch

from .impl import FastSm120Forward, compile_key, compile_kernel  # noqa: F401

IMPL = _dispatch.register(FastSm120Forward())
