"""impl="triton": readable FlashAttention-2 style Triton kernels for every variant.

Files (each kernel has a header saying what it computes and its grid):

* ``common``   the element predicate, block ranges, scores in the log2 domain, the dot helper
* ``configs``  the tile table (the whole autotuning space, written down)
* ``launch``   host-side argument preparation shared by the launchers
* ``forward``  forward: output + LSE (batched, varlen; GQA, causal, windows, softcap, key
               ranges, block-sparse CSR)
* ``backward`` delta preprocess, dK/dV pass, dQ pass (no atomics: deterministic by construction)
* ``decode``   kv-cache: append k_new/v_new, split-KV flash-decoding, combine

On a machine without a GPU the kernels run under Triton's interpreter on CPU tensors:
``TRITON_INTERPRET=1`` must be set before this package is imported (``triton.jit`` decides at
decoration time whether a kernel is compiled or interpreted).
"""
from __future__ import annotations

import torch

from dualattn import dispatch

from . import backward, decode, forward  # noqa: F401  (kernels are built here, once)
from .common import KERNELS_INTERPRETED


class TritonImpl:
    name = "triton"
    family = "triton"

    def can_implement(self, spec):
        if spec.device_type == "cuda":
            if not torch.cuda.is_available():
                return "tensors are on CUDA but no CUDA device is available"
        elif spec.device_type == "cpu":
            if not KERNELS_INTERPRETED:
                return ("no CUDA device and TRITON_INTERPRET != '1' when dualattn.reference.triton was imported "
                        "(the Triton CPU interpreter is off)")
        else:
            return f"device type {spec.device_type!r} is not supported (CUDA, or CPU under TRITON_INTERPRET=1)"
        if spec.block_size is not None:
            bm, bn = spec.block_size
            if bm % 16 or bn % 16:
                return f"block-sparse block size {spec.block_size}: the Triton kernels need multiples of 16"
        if spec.mode == "kvcache":
            if spec.needs_grad:
                return "no backward through the kv-cache path"
            if spec.paged and spec.page_size % 16:
                return f"page size {spec.page_size}: the Triton decode kernel needs a multiple of 16"
        return None

    def forward(self, call):
        if call.spec.mode == "kvcache":
            return decode.attention_decode(call)
        return forward.attention_forward(call)

    def backward(self, call, out, lse, dout):
        # deterministic=True needs nothing here: no kernel of the backward uses atomics, so every
        # run sums in the same order and dQ, dK, dV are bitwise identical across runs.
        return backward.attention_backward(call, out, lse, dout)


IMPL = dispatch.register(TritonImpl())
