"""attn_implementation="dualattn" in transformers, against the model's own "sdpa" attention.

Tiny models built from a config with random weights (nothing downloaded). transformers is an
optional extra: without it these tests skip.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers not installed (optional extra)")

import dualattn  # noqa: E402
from dualattn.integrations import transformers as hf  # noqa: E402

VOCAB = 96


def _config(cls_name="LlamaConfig", **kw):
    cfg_cls = getattr(transformers, cls_name)
    # a large init scale makes attention matter for the logits (at 0.02 the residual dominates)
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.5)
    base.update(kw)
    return cfg_cls(**base)


def _pair(cfg, model_cls="LlamaForCausalLM", name="dualattn"):
    cls = getattr(transformers, model_cls)
    torch.manual_seed(0)
    # each model gets its own config: _from_config sets _attn_implementation on the config it is given
    ref = cls._from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation=name).eval()
    ours.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == "sdpa" and ours.config._attn_implementation == name
    return ref, ours


class _Counter:
    def __init__(self, monkeypatch):
        self.n = 0
        orig = dualattn.api.run_call

        def counting(call, impl):
            self.n += 1
            return orig(call, impl)
        monkeypatch.setattr(dualattn.api, "run_call", counting)


def _close(a, b):
    # fp32 on both sides; logits are O(10)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_llama_logits_match_sdpa(monkeypatch):
    ref, ours = _pair(_config())
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    calls = _Counter(monkeypatch)
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    assert calls.n == 2  # one call per layer: dualattn really ran
    _close(b, a)
    # and attention matters here: a non-causal model would give different logits
    with torch.no_grad():
        ours.model.layers[0].self_attn.is_causal = False
        c = ours(ids).logits
    assert (c - a).abs().max() > 1e-2


@pytest.mark.parametrize("side", ["left", "right"])
def test_llama_padding_mask(side):
    ref, ours = _pair(_config())
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, 20, dtype=torch.long)
    if side == "left":
        am[0, :6] = 0
        valid = (slice(6, None),)
    else:
        am[0, 13:] = 0
        valid = (slice(0, 13),)
    with torch.no_grad():
        a, b = ref(ids, attention_mask=am).logits, ours(ids, attention_mask=am).logits
    _close(b[1], a[1])
    _close(b[0][valid], a[0][valid])


def test_llama_generate_greedy_with_cache():
    ref, ours = _pair(_config())
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ga = ref.generate(ids, max_new_tokens=8, do_sample=False)
        gb = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(ga, gb)


def test_mistral_sliding_window():
    cfg = _config("MistralConfig", sliding_window=6)
    ref, ours = _pair(cfg, "MistralForCausalLM")
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids).logits
    _close(b, a)


def test_register_named_impl():
    name = hf.register("dualattn_torch_test", impl="torch")
    ref, ours = _pair(_config(num_key_value_heads=4), name=name)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _close(ours(ids).logits, ref(ids).logits)


def test_unsupported_is_refused():
    fwd = hf.make_attention_forward("torch")
    q = torch.randn(1, 2, 4, 8)
    mod = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="dropout"):
        fwd(mod, q, q, q, None, dropout=0.1)
    mask = torch.tensor([True, False, True, True]).expand(1, 1, 4, 4)
    with pytest.raises(NotImplementedError, match="contiguous"):
        fwd(mod, q, q, q, mask)


def test_mask_to_key_ranges():
    m = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    m[0, 0, 0, 1:3] = True
    m[0, 0, 2, 4] = True
    kr = hf.mask_to_key_ranges(m)
    assert kr.shape == (1, 1, 3, 1, 2) and kr.dtype == torch.int32
    assert kr[0, 0, :, 0].tolist() == [[1, 3], [0, 0], [4, 5]]
    add = torch.where(m, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(hf.mask_to_key_ranges(add), kr)


def test_prefill_into_a_static_cache_matches_sdpa():
    # transformers passes no mask for a prefill into a static cache and relies on SDPA's top-left
    # causal; the keys include the cache's unused (zero) tail, which must stay invisible
    ref, ours = _pair(_config())
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        outs = [m(input_ids=ids, past_key_values=transformers.StaticCache(config=m.config, max_cache_len=32),
                  use_cache=True).logits for m in (ref, ours)]
    _close(outs[1], outs[0])


def test_attention_sinks_are_refused():
    fwd = hf.make_attention_forward("torch")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="sinks"):
        fwd(torch.nn.Module(), q, q, q, None, s_aux=torch.zeros(2))
