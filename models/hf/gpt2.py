"""GPT-2 (``model_type`` ``gpt2``) -> decoder.

Pre-norm LayerNorm, learned positions, GELU (tanh form for ``gelu_new``), tied head. Conv1D
weights are [in, out] and get transposed; ``c_attn``'s outputs are already [q | k | v].
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, refuse, token_ids
from .rules import CONV1D, Architecture, Rule, decoder_lm, params


def _gpt2_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """GPT-2: pre-norm LayerNorm, learned positions, GELU (tanh form by default), tied head."""
    if hf.get("scale_attn_by_inverse_layer_idx"):
        refuse(hf, "scale_attn_by_inverse_layer_idx", True,
               "a per-layer attention scale is not expressible in tfport's config")
    if hf.get("add_cross_attention"):
        refuse(hf, "add_cross_attention", True, "tfport's decoder family has no cross-attention")
    d_model = hf_field(hf, "n_embd", "hidden_size")
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model,
        n_heads=hf_field(hf, "n_head", "num_attention_heads"),
        d_ff=hf_field(hf, "n_inner", default=4 * d_model),
        n_decoder_layers=hf_field(hf, "n_layer", "num_hidden_layers"),
        norm="layernorm", norm_position="pre",
        norm_eps=float(hf_field(hf, "layer_norm_epsilon", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "activation_function", default="gelu_new")),
        position="learned", max_positions=hf_field(hf, "n_positions", "n_ctx", default=1024),
        attention_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **token_ids(hf, vocab_size))


GPT2_LAYER = "transformer.h.{i}"
GPT2 = Architecture(
    model_types=("gpt2",),
    classes=("GPT2LMHeadModel", "GPT2Model"),
    base_prefix="transformer.",
    config=_gpt2_config,
    rules=decoder_lm(
        GPT2_LAYER, "transformer.wte.weight", "transformer.ln_f", norms=("ln_1", "ln_2"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{GPT2_LAYER}.attn.c_attn", weight=CONV1D),
              *params("decoder.layers.{i}.attn.out", f"{GPT2_LAYER}.attn.c_proj", weight=CONV1D)],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{GPT2_LAYER}.mlp.c_fc", weight=CONV1D),
             *params("decoder.layers.{i}.ffn.down", f"{GPT2_LAYER}.mlp.c_proj", weight=CONV1D)],
        extra=[Rule("decoder.embed.positions.weight", ("transformer.wpe.weight",))]),
    ignored={r"transformer\.h\.\d+\.attn\.(bias|masked_bias)":
             "causal-mask buffers of older GPT-2 checkpoints; tfport builds masks from attention_mask"},
)
