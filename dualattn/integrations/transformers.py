"""``attn_implementation="dualattn"`` for Hugging Face transformers (Llama-style models).

    import dualattn.integrations.transformers  # registers "dualattn"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dualattn")

or ``register(name="dualattn_fast", impl="fast")`` for a name bound to one implementation family.

transformers is an optional extra (``pip install dualattn[transformers]``); importing this module
without it raises ImportError saying so.

How masks are handled: the registered name uses transformers' ``sdpa`` mask builder, which returns
``None`` whenever plain causal attention is exact (no padding, no window): then dualattn runs
causal (bottom-right aligned, which is also right for decode and for prefill after a cache), or
non-causal for encoders. Otherwise the boolean ``(B, 1, Sq, Sk)`` mask is turned into dualattn key
ranges (one interval per query row); a mask whose rows are not single intervals is refused.
"""
from __future__ import annotations

from typing import Optional

import torch

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise ImportError("dualattn.integrations.transformers needs the optional dependency 'transformers' "
                      "(pip install 'dualattn[transformers]')") from e

import dualattn
from dualattn import spec as spec_mod

DEFAULT_NAME = "dualattn"


def mask_to_key_ranges(mask: torch.Tensor) -> torch.Tensor:
    """(B|1, H|1, Sq, Sk) visibility (bool, or additive float with 0 = visible) -> key ranges
    (B|1, H|1, Sq, 1, 2) int32, one [lo, hi) interval per row (empty rows give [0, 0))."""
    if mask.dim() != 4:
        raise ValueError(f"attention_mask: expected a 4-D mask (B, H, Sq, Sk), got shape {tuple(mask.shape)}")
    vis = mask if mask.dtype == torch.bool else (mask == 0)
    sk = vis.shape[-1]
    has = vis.any(-1)
    as_int = vis.to(torch.int32)
    lo = torch.where(has, as_int.argmax(-1), 0)
    hi = torch.where(has, sk - as_int.flip(-1).argmax(-1), 0)
    if spec_mod.value_checks_enabled():  # reads values: skipped under torch.compile / graph capture
        if not bool((as_int.sum(-1) == hi - lo).all()):
            raise NotImplementedError("attention_mask: a query row sees keys that are not one contiguous range; "
                                      "dualattn's transformers integration supports causal, padding, sliding-window "
                                      "and chunked masks (one interval per row)")
        if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
            raise NotImplementedError("attention_mask: additive masks with a bias other than 0 / -inf are not supported")
    return torch.stack([lo, hi], -1).unsqueeze(-2).to(torch.int32).contiguous()


def make_attention_forward(impl: str = "auto"):
    """An AttentionInterface function running dualattn with ``impl``."""

    def dualattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                   scaling: Optional[float] = None, dropout: float = 0.0,
                                   softcap: Optional[float] = None, sliding_window: Optional[int] = None,
                                   is_causal: Optional[bool] = None, **kwargs):
        if dropout and dropout > 0:
            raise NotImplementedError("dualattn does not implement attention dropout (got dropout="
                                      f"{dropout}); use model.eval() or attention_dropout=0")
        if kwargs.get("output_attentions"):
            raise NotImplementedError("dualattn never materialises attention probabilities (output_attentions=True); "
                                      "use attn_implementation='eager'")
        for sink in ("s_aux", "sinks"):  # GPT-OSS-style attention sinks: an extra logit per head
            if kwargs.get(sink) is not None:
                raise NotImplementedError(f"dualattn does not implement attention sinks ({sink}); "
                                          "use attn_implementation='eager' or 'sdpa'")
        # transformers: (B, H, S, D); dualattn: (B, S, H, D)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        kw = dict(scale=scaling, softcap=float(softcap or 0.0), impl=impl)
        if attention_mask is None:
            if causal and 1 < q.shape[1] < k.shape[1]:
                # no mask with more keys than queries: transformers means SDPA's top-left causal here
                # (a prefill into a static cache, whose unused tail it leaves unmasked), so query i
                # sees keys 0..i; keys past the last query are never visible
                k, v = k[:, : q.shape[1]], v[:, : q.shape[1]]
            window = (-1, -1)
            if sliding_window is not None and causal:
                # transformers' sliding window of n: key j visible from query i iff i - n < j <= i
                window = (int(sliding_window) - 1, 0)
            out = dualattn.attention(q, k, v, causal=bool(causal), window=window, **kw)
        else:
            # the mask already encodes causality, padding and any window
            kr = mask_to_key_ranges(attention_mask[..., : k.shape[1]])
            out = dualattn.attention(q, k, v, key_ranges=kr, **kw)
        return out, None

    return dualattn_attention_forward


def register(name: str = DEFAULT_NAME, impl: str = "auto") -> str:
    """Register ``attn_implementation=name`` (running dualattn with ``impl``); returns the name."""
    AttentionInterface.register(name, make_attention_forward(impl))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


register()
