"""SM120 (consumer Blackwell) kernels: FlashAttention-2 on warp-level mma.sync + cp.async.

The same code runs on SM80/86/89 and SM90, which is where it is tested on a GPU; CI compiles it
for sm_120a (99 KB of shared memory per block). Registered as the "fast-sm120" member of the
"fast" family; the order of registration among the fast kernels decides priority on SM90.
"""
from dualattn import dispatch as _dispatch

from .impl import FastSm120Forward, compile_key, compile_kernel  # noqa: F401

IMPL = _dispatch.register(FastSm120Forward())
