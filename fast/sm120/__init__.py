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
FA2 backward for head dims 32, 64, 96, 128, 192 and 256 (the last two split D), dense/GQA, causal and windows, softcap, key ranges, block-sparse
CSR (k->q rows; deterministic dQ ordered by the CSR's rank lock values), batched and varlen, fp16/bf16,
deterministic mode. ``impl.BACKWARD_ENABLED``
switches it off.
Not served by the forward: kv-cache/decode, Dv != D, head dims not a multiple of 32, fp32.
kv-cache calls go to ``fast-sm120-decode`` (decode.py, decode_impl.py): split-KV flash-decoding with
the query heads of a KV head packed into M, cache_seqlens, paged KV (page size a multiple of 16),
k_new/v_new appended in place, causal/window/softcap, any GQA ratio, head dims 64/128/192/256
(D == Dv), fp16/bf16; CUDA-graph safe. Like fast-sm120, impl="auto" passes over it on sm_90.
"""
from dualattn import dispatch as _dispatch

from .impl import BACKWARD_ENABLED, FastSm120Forward, compile_key, compile_kernel  # noqa: F401

IMPL = _dispatch.register(FastSm120Forward())
TRAIN_IMPL = None
if BACKWARD_ENABLED:
    from .bwd_impl import FastSm120Train
    TRAIN_IMPL = _dispatch.register(FastSm120Train(IMPL))

from .decode_impl import FastSm120Decode  # noqa: E402

DECODE_IMPL = _dispatch.register(FastSm120Decode())
