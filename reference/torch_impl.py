"""impl="torch": the oracle served as an implementation (fp32 math, any device, every variant)."""
from __future__ import annotations

import torch

from dualattn import dispatch
from .torch_ref import attention_ref


def append_kv_inplace(call) -> None:
    """Write k_new / v_new into the cache at positions cache_seqlens[b] .. + S_new (FlashAttention's
    kv-cache semantics; cache_seqlens itself is not advanced)."""
    if call.k_new is None:
        return
    spec = call.spec
    n_new = call.k_new.shape[1]
    for b, start in enumerate(call.cache_seqlens.tolist()):
        pos = torch.arange(start, start + n_new, device=call.q.device)
        if spec.paged:
            ps = spec.page_size
            pages = call.page_table[b, (pos // ps).long()].long()
            call.k[pages, pos % ps] = call.k_new[b]
            call.v[pages, pos % ps] = call.v_new[b]
        else:
            call.k[b, start:start + n_new] = call.k_new[b]
            call.v[b, start:start + n_new] = call.v_new[b]


class TorchImpl:
    name = "torch"
    family = "torch"

    def can_implement(self, spec):
        if spec.mode == "kvcache" and spec.needs_grad:
            return "no backward through the kv-cache path"
        return None

    def _compute_dtype(self, spec):
        return torch.float64 if spec.dtype == torch.float64 else torch.float32

    def forward(self, call):
        spec = call.spec
        if spec.mode == "kvcache":
            # attend first over (cache ++ new) without touching the cache, then append: same result
            r = attention_ref(call, self._compute_dtype(spec))
            append_kv_inplace(call)
        else:
            r = attention_ref(call, self._compute_dtype(spec))
        return r.out.to(spec.dtype), r.lse.float()

    def backward(self, call, out, lse, dout):
        r = attention_ref(call, self._compute_dtype(call.spec), dout)
        dt = call.spec.dtype
        return r.dq.to(dt), r.dk.to(dt), r.dv.to(dt)


dispatch.register(TorchImpl())
