"""BLOOM (``model_type`` ``bloom``) -> decoder.

ALiBi, LayerNorm after the word embeddings, tanh GELU, tied head. ``query_key_value`` rows are per
head [H, 3, D] and are regrouped into [3, H, D] = [q | k | v].
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_field, refuse, token_ids
from .rules import PER_HEAD_QKV, Architecture, decoder_lm, params


def _bloom_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """BLOOM: pre-norm LayerNorm, ALiBi, LayerNorm after the word embeddings, tanh GELU."""
    if hf.get("apply_residual_connection_post_layernorm"):
        refuse(hf, "apply_residual_connection_post_layernorm", True,
               "residuals taken after the norm are not expressible in tfport's Block")
    d_model = hf_field(hf, "hidden_size", "n_embed")
    vocab_size = hf_field(hf, "vocab_size")
    # BLOOM's config has no length (ALiBi has no table); 2048 is what BLOOM was trained on.
    max_positions = hf_field(hf, "seq_length", "max_position_embeddings", default=2048)
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model,
        n_heads=hf_field(hf, "n_head", "num_attention_heads"), d_ff=4 * d_model,
        n_decoder_layers=hf_field(hf, "n_layer", "num_hidden_layers"), norm="layernorm",
        norm_position="pre", norm_eps=float(hf_field(hf, "layer_norm_epsilon", default=1e-5)),
        activation="gelu_tanh", position="alibi", max_positions=max_positions,
        embedding_norm=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **token_ids(hf, vocab_size))


BLOOM_LAYER = "transformer.h.{i}"
BLOOM = Architecture(
    model_types=("bloom",),
    classes=("BloomForCausalLM", "BloomModel"),
    base_prefix="transformer.",
    config=_bloom_config,
    rules=decoder_lm(
        BLOOM_LAYER, "transformer.word_embeddings.weight", "transformer.ln_f",
        norms=("input_layernorm", "post_attention_layernorm"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{BLOOM_LAYER}.self_attention.query_key_value",
                      weight=PER_HEAD_QKV, bias=PER_HEAD_QKV),
              *params("decoder.layers.{i}.attn.out", f"{BLOOM_LAYER}.self_attention.dense")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{BLOOM_LAYER}.mlp.dense_h_to_4h"),
             *params("decoder.layers.{i}.ffn.down", f"{BLOOM_LAYER}.mlp.dense_4h_to_h")],
        extra=params("decoder.embed.norm", "transformer.word_embeddings_layernorm")),
)
