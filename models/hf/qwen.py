"""Qwen2/2.5 and Qwen3 (``model_type`` ``qwen2``, ``qwen3``) -> decoder.

LLaMA's layout and tensor names; Qwen2 has biases on q/k/v but not on the output projection,
Qwen3 a per-head RMSNorm on queries and keys before RoPE (``q_norm`` / ``k_norm``) and biases
as ``attention_bias`` says. Sliding windows: ``layer_types`` if the config has it, else the layers
from ``max_window_layers`` on when ``use_sliding_window``.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, rope_fields, sliding_fields, token_ids
from .llama import QK_NORM_RULES, ROTARY_BUFFERS, llama_rules
from .rules import Architecture


def _qwen_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    qwen3 = hf.get("model_type") == "qwen3"
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    head_dim = hf_field(hf, "head_dim", default=d_model // n_heads)
    n_layers = hf_field(hf, "num_hidden_layers")
    vocab_size = hf_field(hf, "vocab_size")
    if hf.get("layer_types") is None and hf.get("use_sliding_window"):
        start = hf_field(hf, "max_window_layers", default=n_layers)
        hf = {**hf, "layer_types": ["sliding_attention" if i >= start else "full_attention"
                                    for i in range(n_layers)]}
    bias = bool(hf.get("attention_bias", False)) if qwen3 else True
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf, "num_key_value_heads", default=n_heads),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=n_layers,
        norm="rmsnorm", norm_position="pre", norm_eps=float(hf_field(hf, "rms_norm_eps", default=1e-6)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="silu")), gated_ffn=True,
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=32768),
        **rope_fields(hf), **sliding_fields(hf, n_layers, all_layers=False),
        attention_bias=bias, attention_out_bias=bias if qwen3 else False, qk_norm=qwen3, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **token_ids(hf, vocab_size))


QWEN = Architecture(
    model_types=("qwen2", "qwen3"),
    classes=("Qwen2ForCausalLM", "Qwen2Model", "Qwen3ForCausalLM", "Qwen3Model"),
    base_prefix="model.",
    config=_qwen_config,
    rules=llama_rules(extra=QK_NORM_RULES),
    ignored=ROTARY_BUFFERS,
)
