"""LLaMA and Mistral (``model_type`` ``llama``, ``mistral``) -> decoder.

Pre-norm RMSNorm, SwiGLU, RoPE (default, or linear scaling), GQA. ``q/k/v_proj`` are stacked into
the fused ``qkv`` rows [q | k | v]; ``gate/up/down_proj`` -> ``ffn.gate/up/down``; ``lm_head``
tied or not. Mistral's sliding window caps ``max_positions`` (tfport has no sliding-window mask).
"""

from __future__ import annotations

import logging

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, rope_fields, token_ids
from .rules import QKV, Architecture, decoder_lm, params

log = logging.getLogger(__name__)


def _llama_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """LLaMA and Mistral: pre-norm RMSNorm, SwiGLU, RoPE, GQA."""
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    head_dim = hf_field(hf, "head_dim", default=d_model // n_heads)
    max_positions = hf_field(hf, "max_position_embeddings", default=2048)
    window = hf.get("sliding_window")
    if window is not None and window < max_positions:
        # Within `window` tokens sliding-window attention is plain causal attention; tfport has no
        # sliding-window mask, so the model is exact only up to there.
        log.warning("config.json: sliding_window=%d < max_position_embeddings=%d; tfport has no "
                    "sliding-window attention, max_positions is capped at %d", window,
                    max_positions, window)
        max_positions = window
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf, "num_key_value_heads", default=n_heads),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=hf_field(hf, "num_hidden_layers"),
        norm="rmsnorm", norm_position="pre", norm_eps=float(hf_field(hf, "rms_norm_eps", default=1e-6)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="silu")), gated_ffn=True,
        position="rope", max_positions=max_positions, **rope_fields(hf),
        attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **token_ids(hf, vocab_size))


LLAMA_LAYER = "model.layers.{i}"
LLAMA = Architecture(
    model_types=("llama", "mistral"),
    classes=("LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "MistralModel"),
    base_prefix="model.",
    config=_llama_config,
    rules=decoder_lm(
        LLAMA_LAYER, "model.embed_tokens.weight", "model.norm",
        norms=("input_layernorm", "post_attention_layernorm"),
        attn=[*params("decoder.layers.{i}.attn.qkv",
                      tuple(f"{LLAMA_LAYER}.self_attn.{p}_proj" for p in "qkv"), weight=QKV, bias=QKV),
              *params("decoder.layers.{i}.attn.out", f"{LLAMA_LAYER}.self_attn.o_proj")],
        ffn=[rule for p in ("gate", "up", "down")
             for rule in params(f"decoder.layers.{{i}}.ffn.{p}", f"{LLAMA_LAYER}.mlp.{p}_proj")]),
    ignored={r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq":
             "rotary frequencies are recomputed from rope_theta (older checkpoints saved them)"},
)
