"""dualattn: FlashAttention with every variant twice — a readable reference and a fast kernel.

    import dualattn
    out = dualattn.attention(q, k, v, causal=True, impl="fast")

See README.md for the API, the implementations and their limits.
"""
from .api import attention, attention_varlen, attention_with_kvcache, explain
from .debug import MismatchError, check_mode, compare, reference_mode
from .masks import segments_to_key_ranges
from .sparse import BlockSparse
from .spec import AttentionSpec, set_value_checks

__version__ = "0.1.0"
__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "explain", "BlockSparse",
           "AttentionSpec", "reference_mode", "check_mode", "compare", "MismatchError",
           "segments_to_key_ranges", "set_value_checks"]
