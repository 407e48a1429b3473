"""Tiny Hugging Face models, one per architecture tfport imports, and the comparisons.

Each case builds a randomly initialised ``transformers`` model offline from a config object
(fixed seed), perturbs every parameter (HF initialises norms to 1 and biases to 0, which would hide
a wrong mapping of them), and saves it with ``save_pretrained`` as safetensors.
"""

from __future__ import annotations

import json
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


WINDOW = 4  # sliding window of the cases that have one: shorter than every test prompt
_DEPLOYED = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
# Llama 3.1's RoPE scaled to a 16-token "trained" context, so that positions 0..63 fall in all
# three frequency bands (divided by the factor, interpolated, kept).
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16, "rope_theta": 500000.0}


@dataclass(frozen=True)
class HFCase:
    """One architecture: the transformers class and config fields of its tiny model."""

    name: str
    model_class: str
    config_class: str
    fields: dict = field(default_factory=dict)
    hf_position_ids: bool = True  # HF takes position_ids (we pass them counted from the mask)
    seed: int = 0
    # Rewrite the saved config.json's transformers-5 ``rope_parameters`` as the ``rope_scaling`` +
    # top-level ``rope_theta`` that Llama 3.1/3.2 checkpoints ship.
    legacy_rope: bool = False
    per_target: bool = False  # exported to every target and compared there (test_decoders.py)

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
    # Pythia-style: partial rotary (half of each 32-channel head: 16, what ONNX Runtime's fused
    # kernel needs), parallel residual, per-head fused qkv.
    HFCase("gpt-neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5}), seed=17, per_target=True),
    HFCase("gpt-neox-sequential", "GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, use_parallel_residual=False), seed=18, per_target=True),
    # Phi-3 with longrope trained on 8 positions: prefills of 7 tokens use the short factors,
    # decode steps and chunks past position 8 the long ones; a window of WINDOW tokens.
    HFCase("phi3", "Phi3ForCausalLM", "Phi3Config", dict(
        **_DEPLOYED, sliding_window=WINDOW, original_max_position_embeddings=8, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0, 16.0]}), seed=19, per_target=True),
    # StableLM: LayerNorm, partial rotary (half of 32 channels), q/k/v biases; parallel or not.
    HFCase("stablelm", "StableLmForCausalLM", "StableLmConfig", dict(
        **{**_DEPLOYED, "hidden_size": 128}, use_qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        seed=20, per_target=True),
    HFCase("stablelm-parallel", "StableLmForCausalLM", "StableLmConfig", dict(
        **_DEPLOYED, use_parallel_residual=True), seed=21, per_target=True),
    # Phi-2: one LayerNorm for parallel attention and MLP, partial rotary (16 of 32 channels),
    # biases everywhere including the LM head; GQA (Phi-2 itself is MHA).
    HFCase("phi", "PhiForCausalLM", "PhiConfig", dict(
        **{**_DEPLOYED, "hidden_size": 128}, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        seed=30, per_target=True),
    # StarCoder2: LayerNorms, biased c_fc / c_proj MLP, GQA, a window of WINDOW tokens, untied head.
    HFCase("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", dict(
        **_DEPLOYED, sliding_window=WINDOW, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}), seed=31, per_target=True),
    # OPT: learned positions offset by 2, ReLU; pre-norm (most sizes) and post-norm (350m's).
    HFCase("opt", "OPTForCausalLM", "OPTConfig", dict(
        hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64), seed=22, per_target=True),
    HFCase("opt-post-norm", "OPTForCausalLM", "OPTConfig", dict(
        hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=False), seed=23,
        per_target=True),
    # Falcon: new decoder architecture (GQA, rows grouped per KV head, two parallel norms),
    # Falcon 2's one shared norm, and Falcon 7B's multi-query layout.
    HFCase("falcon-new", "FalconForCausalLM", "FalconConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, bias=True, max_position_embeddings=64), seed=24, per_target=True),
    HFCase("falcon-new-one-norm", "FalconForCausalLM", "FalconConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, num_ln_in_parallel_attn=1, max_position_embeddings=64), seed=25,
        per_target=True),
    HFCase("falcon-7b", "FalconForCausalLM", "FalconConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True, parallel_attn=True,
        max_position_embeddings=64), seed=26, per_target=True),
    # GPT-J: interleaved partial rotary (16 of 32 channels), shared ln_1, biased head.
    HFCase("gptj", "GPTJForCausalLM", "GPTJConfig", dict(
        n_embd=128, n_layer=2, n_head=4, rotary_dim=16, n_positions=64), seed=27, per_target=True),
    # 6 heads: MPT's own slope order (MPT-30B has 56 heads).
    HFCase("mpt-6-heads", "MptForCausalLM", "MptConfig", dict(
        d_model=48, n_layers=2, n_heads=6, max_seq_len=64), hf_position_ids=False, seed=16),
    # ---- the decoders people deploy (issue #12). Head dimension 16 so that every export target,
    # including ONNX Runtime's fused GroupQueryAttention, takes them; sliding windows of WINDOW
    # tokens, shorter than the prompts, so that tests run past the window.
    HFCase("llama3", "LlamaForCausalLM", "LlamaConfig", dict(**_DEPLOYED, rope_parameters=_LLAMA3), seed=7, per_target=True),
    HFCase("llama3-rope-scaling", "LlamaForCausalLM", "LlamaConfig", dict(
        **_DEPLOYED, rope_parameters=_LLAMA3), seed=8, per_target=True, legacy_rope=True),
    # Qwen-style YaRN: factor 4 over a 16-token trained context (the blend covers several channels).
    HFCase("llama-yarn", "LlamaForCausalLM", "LlamaConfig", dict(**_DEPLOYED, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
        seed=28, per_target=True),
    # Dynamic NTK over a 10-token trained context: prefills of 7 are plain RoPE, decode steps and
    # chunks past 10 tokens recompute the base per call.
    HFCase("llama-dynamic", "LlamaForCausalLM", "LlamaConfig", dict(**{**_DEPLOYED, "max_position_embeddings": 10},
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), seed=29, per_target=True),
    HFCase("mistral-window", "MistralForCausalLM", "MistralConfig", dict(
        **_DEPLOYED, sliding_window=WINDOW), seed=9, per_target=True),
    HFCase("qwen2", "Qwen2ForCausalLM", "Qwen2Config", dict(**_DEPLOYED), seed=10, per_target=True),
    HFCase("qwen2-window", "Qwen2ForCausalLM", "Qwen2Config", dict(
        **_DEPLOYED, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), seed=11, per_target=True),
    HFCase("qwen3", "Qwen3ForCausalLM", "Qwen3Config", dict(**_DEPLOYED, head_dim=16), seed=12, per_target=True),
    HFCase("gemma", "GemmaForCausalLM", "GemmaConfig", dict(**_DEPLOYED, head_dim=16), seed=13, per_target=True),
    HFCase("gemma2", "Gemma2ForCausalLM", "Gemma2Config", dict(
        **_DEPLOYED, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0), seed=14, per_target=True),
    HFCase("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        **_DEPLOYED, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}), seed=15, per_target=True),
]}


def build_hf(case: HFCase):
    """The case's transformers model (eager attention, eval mode), randomly initialised."""
    return perturbed_model(case.config_class, case.model_class, case.seed, **SMALL, **case.fields)


def perturbed_model(config_class: str, model_class: str, seed: int, **config_fields):
    """A transformers model (eager attention, eval mode) from ``seed``, every parameter then
    perturbed, so norms and biases are not 1 / 0 and a wrong mapping shows."""
    import transformers

    config = getattr(transformers, config_class)(**config_fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def save_hf(model, directory: Path, case: HFCase | None = None, **options) -> Path:
    model.save_pretrained(directory, **options)
    if case is not None and case.legacy_rope:
        path = directory / "config.json"
        config = json.loads(path.read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
        path.write_text(json.dumps(config))
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
