"""SM120 (consumer Blackwell) kernels: FlashAttention-2 on warp-level mma.sync + cp.async.

The same code runs on SM80/86/89 and SM90, which is where it is tested on a GPU; CI compiles it
for sm_120a (99 KB of shared memory per block). Registered as the "fast-sm120" member of the
"fast" family; the order of registration among the fast kernels decides priority on SM90.

What ``fast-sm120`` serves (inference; ``can_implement`` refuses the rest with the reason):
batched and varlen (cu_seqlens); fp16/bf16; head dims 32..256 in steps of 32 with Dv == D; GQA/MQA
(KV head indexed in the kernel); bottom-right causal with tile skipping; windows (left/right);
softcap; key ranges (R <= 4 per row); block-sparse CSR (block size a multiple of the kernel tile,
see ``fwd.tile_config``); any sequence lengths; tensors under 2**31 elements.
Training calls (needs_grad) go to ``fast-sm120-train`` (bwd.py, bwd_impl.py): the same forward plus an
FA2 backward for head dims 64 and 128, dense/GQA, causal and windows, batched and varlen, fp16/bf16,
deterministic mode; it refuses softcap, key ranges and block-sparse. ``impl.BACKWARD_ENABLED``
switches it off.
Not served: kv-cache/decode, Dv != D, head dims not a multiple of 32, fp32.
"""
from dualattn import dispatch as _dispatch

from .impl import BACKWARD_ENABLED, FastSm120Forward, compile_key, compile_kernel  # noqa: F401

IMPL = _dispatch.register(FastSm120Forward())
TRAIN_IMPL = None
if BACKWARD_ENABLED:
    from .bwd_impl import FastSm120Train
    TRAIN_IMPL = _dispatch.register(FastSm120Train(IMPL))
