"""MPT (``model_type`` ``mpt``) -> decoder.

ALiBi (MPT's slope order, which differs from BLOOM's when the head count is not a power of two), exact GELU, no biases (its LayerNorms' zero biases are filled
in); ``Wqkv`` is already [q | k | v].
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_field, refuse, token_ids
from .rules import ZEROS, Architecture, decoder_lm, params


def _mpt_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """MPT: pre-norm LayerNorm without bias, ALiBi, exact GELU, no biases."""
    attn = hf.get("attn_config") or {}
    n_heads = hf_field(hf, "n_heads")
    checks = [  # (field, value, the value tfport computes, why)
        ("attn_config.alibi", attn.get("alibi", True), True, "tfport maps MPT with ALiBi only"),
        ("attn_config.alibi_bias_max", attn.get("alibi_bias_max", 8), 8,
         "tfport's ALiBi slopes are 2^(-8 i / H)"),
        ("attn_config.attn_type", attn.get("attn_type", "multihead_attention"), "multihead_attention",
         "transformers' MPT (the reference) has multi-head attention only"),
        ("attn_config.clip_qkv", attn.get("clip_qkv"), None, "tfport does not clamp q/k/v"),
        ("attn_config.qk_ln", attn.get("qk_ln", False), False, "tfport has no q/k LayerNorm"),
        ("attn_config.prefix_lm", attn.get("prefix_lm", False), False,
         "a prefix-LM mask is not expressible in tfport"),
        ("no_bias", hf.get("no_bias", True), True, "transformers' MPT (the reference) has no biases"),
        ("logit_scale", hf.get("logit_scale"), None, "transformers' MPT (the reference) ignores it"),
    ]
    for name, value, expected, why in checks:
        if value != expected:
            refuse(hf, name, value, why)
    d_model = hf_field(hf, "d_model")
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        d_ff=4 * d_model,  # transformers' MPT ignores expansion_ratio: its MLP is always 4x
        n_decoder_layers=hf_field(hf, "n_layers"), norm="layernorm", norm_position="pre",
        norm_eps=float(hf_field(hf, "layer_norm_epsilon", default=1e-5)), activation="gelu",
        position="alibi", alibi_slopes="mpt", max_positions=hf_field(hf, "max_seq_len", default=2048),
        attention_bias=False, mlp_bias=False, attention_scale=attn.get("softmax_scale"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **token_ids(hf, vocab_size))


MPT_LAYER = "transformer.blocks.{i}"
MPT = Architecture(
    model_types=("mpt",),
    classes=("MptForCausalLM", "MptModel"),
    base_prefix="transformer.",
    config=_mpt_config,
    rules=decoder_lm(
        MPT_LAYER, "transformer.wte.weight", "transformer.norm_f", norms=("norm_1", "norm_2"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{MPT_LAYER}.attn.Wqkv"),
              *params("decoder.layers.{i}.attn.out", f"{MPT_LAYER}.attn.out_proj")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{MPT_LAYER}.ffn.up_proj"),
             *params("decoder.layers.{i}.ffn.down", f"{MPT_LAYER}.ffn.down_proj")],
        norm_bias=ZEROS),
)
