"""Tiny Hugging Face models, one per architecture tfport imports, and the comparisons.

Each case builds a randomly initialised ``transformers`` model offline from a config object
(fixed seed), perturbs every parameter (HF initialises norms to 1 and biases to 0, which would hide
a wrong mapping of them), and saves it with ``save_pretrained`` as safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tfport.models.positions import positions_from_mask

# (rtol, atol) for float32 on CPU, tfport vs transformers. Both compute the same function in
# different operation orders: one fused qkv matmul instead of three, RoPE tables and ALiBi formed
# differently (ALiBi as -slope * distance vs slope * key position), softmax over float32 in both.
# Differences are a few float32 ulps per op, amplified a little by two layers.
TOLERANCE = (1e-4, 1e-5)

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)


@dataclass(frozen=True)
class HFCase:
    """One architecture: the transformers class and config fields of its tiny model."""

    name: str
    model_class: str
    config_class: str
    fields: dict = field(default_factory=dict)
    hf_position_ids: bool = True  # HF takes position_ids (we pass them counted from the mask)
    seed: int = 0

    @property
    def decoder(self) -> bool:
        return not self.model_class.startswith("Bert")


CASES = {case.name: case for case in [
    HFCase("llama", "LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    HFCase("llama-mqa-bias-tied", "LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        seed=1),
    HFCase("mistral", "MistralForCausalLM", "MistralConfig", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=None), seed=2),
    HFCase("gpt2", "GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=32, n_layer=2, n_head=4, n_positions=64), seed=3),
    HFCase("bert", "BertForPreTraining", "BertConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64), seed=4),
    # 6 heads: not a power of two, so the Press et al. slopes' second series is exercised.
    HFCase("bloom", "BloomForCausalLM", "BloomConfig", dict(
        hidden_size=48, n_layer=2, n_head=6), hf_position_ids=False, seed=5),
    HFCase("mpt", "MptForCausalLM", "MptConfig", dict(
        d_model=32, n_layers=2, n_heads=4, max_seq_len=64), hf_position_ids=False, seed=6),
]}


def build_hf(case: HFCase):
    """The case's transformers model (eager attention, eval mode), randomly initialised."""
    import transformers

    config = getattr(transformers, case.config_class)(**SMALL, **case.fields)
    config._attn_implementation = "eager"
    torch.manual_seed(case.seed)
    model = getattr(transformers, case.model_class)(config).eval()
    generator = torch.Generator().manual_seed(case.seed + 100)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def save_hf(model, directory: Path, **options) -> Path:
    model.save_pretrained(directory, **options)
    return directory


def batch(padding: str, seed: int, length: int = 6, pad: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask [2, length]; row 0 has ``pad`` padded slots on ``padding``'s side."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    if padding == "left":
        mask[0, :pad] = 0
    elif padding == "right":
        mask[0, length - pad:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def assert_close(actual, expected, real: np.ndarray, what: str) -> None:
    """``actual`` vs ``expected`` [B, S, ...] at the positions where ``real`` [B, S] is true."""
    actual, expected = (np.asarray(x.detach() if isinstance(x, torch.Tensor) else x) for x in (actual, expected))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    rtol, atol = TOLERANCE
    np.testing.assert_allclose(actual[real], expected[real], rtol=rtol, atol=atol, err_msg=what)


def hf_decoder_step(hf, case: HFCase, ids: torch.Tensor, mask: torch.Tensor, cache=None):
    """(logits [B, S, V], cache) of a transformers causal LM for the last ids.shape[1] tokens."""
    kwargs = dict(input_ids=ids, attention_mask=mask, use_cache=True, cache=cache)
    if case.hf_position_ids:
        kwargs["position_ids"] = positions_from_mask(mask, ids.shape[1])
    out = hf(**kwargs)
    return out.logits, out.cache


def hf_layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s (key, value) [B, Hkv, T, D] of a transformers cache."""
    entry = cache.layers[layer]
    return entry.keys, entry.values


def hf_encoder(hf, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """BertForPreTraining's states, pooled output and MLM logits (its NSP head is not used)."""
    base = hf.bert(input_ids=ids, attention_mask=mask, token_type_ids=types, position_ids=position_ids)
    return {"last_hidden_state": base.last_hidden_state, "pooler_output": base.pooler_output,
            "logits": hf.cls.predictions(base.last_hidden_state)}
