"""Phi-3 / Phi-3.5 / Phi-4-mini (``model_type`` ``phi3``) -> decoder.

LLaMA's arithmetic with fused weights: ``qkv_proj`` rows are already [q | k | v]; ``gate_up_proj``
rows are [gate | up], split into ``ffn.gate`` and ``ffn.up``. RoPE: default or longrope (short and
long factors switched by the call's length, the attention factor on cos and sin; the legacy type
names ``su`` and ``yarn`` mean longrope here, as transformers reads them), partial rotary
(Phi-4-mini). ``sliding_window`` applies to every layer.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, rope_fields, rope_parameters, sliding_fields, token_ids
from .llama import ROTARY_BUFFERS
from .rules import Architecture, decoder_lm, half_rows, params

PHI3_LAYER = "model.layers.{i}"


def _phi3_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    head_dim = hf_field(hf, "head_dim", default=d_model // n_heads)
    n_layers = hf_field(hf, "num_hidden_layers")
    vocab_size = hf_field(hf, "vocab_size")
    rope = rope_parameters(hf)
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        rope["rope_type"] = "longrope"
    # transformers' Phi3Config sets the RoPE parameters' original length from its top-level field
    # (default 4096), whatever the rope parameters themselves say
    rope["original_max_position_embeddings"] = hf_field(hf, "original_max_position_embeddings", default=4096)
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf, "num_key_value_heads", default=n_heads),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=n_layers,
        norm="rmsnorm", norm_position="pre", norm_eps=float(hf_field(hf, "rms_norm_eps", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="silu")), gated_ffn=True,
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=4096),
        **rope_fields(hf, rope, head_dim=head_dim), **sliding_fields(hf, n_layers, all_layers=True),
        attention_bias=False, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **token_ids(hf, vocab_size))


PHI3 = Architecture(
    model_types=("phi3",),
    classes=("Phi3ForCausalLM", "Phi3Model"),
    base_prefix="model.",
    config=_phi3_config,
    rules=decoder_lm(
        PHI3_LAYER, "model.embed_tokens.weight", "model.norm",
        norms=("input_layernorm", "post_attention_layernorm"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{PHI3_LAYER}.self_attn.qkv_proj"),
              *params("decoder.layers.{i}.attn.out", f"{PHI3_LAYER}.self_attn.o_proj")],
        ffn=[*params("decoder.layers.{i}.ffn.gate", f"{PHI3_LAYER}.mlp.gate_up_proj", weight=half_rows(0)),
             *params("decoder.layers.{i}.ffn.up", f"{PHI3_LAYER}.mlp.gate_up_proj", weight=half_rows(1)),
             *params("decoder.layers.{i}.ffn.down", f"{PHI3_LAYER}.mlp.down_proj")]),
    ignored=ROTARY_BUFFERS,
)
