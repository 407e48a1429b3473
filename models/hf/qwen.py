"""Qwen2/2.5 and Qwen3 (``model_type`` ``qwen2``, ``qwen3``) -> decoder.

LLaMA's layout and tensor names; Qwen2 has biases on q/k/v but not on the output projection,
Qwen3 a per-head RMSNorm on queries and keys before RoPE (``q_norm`` / ``k_norm``) and biases
as ``attention_bias`` says. Sliding windows: ``layer_types`` if the config has it, else the layers
from ``max_window_layers`` on when ``use_sliding_window``.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_field, rope_fields, sliding_fields
from .llama import QK_NORM_RULES, ROTARY_BUFFERS, llama_like_config, llama_rules
from .rules import Architecture


def _qwen_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    qwen3 = hf.get("model_type") == "qwen3"
    n_layers = hf_field(hf, "num_hidden_layers")
    if hf.get("layer_types") is None and hf.get("use_sliding_window"):
        start = hf_field(hf, "max_window_layers", default=n_layers)
        hf = {**hf, "layer_types": ["sliding_attention" if i >= start else "full_attention"
                                    for i in range(n_layers)]}
    bias = bool(hf.get("attention_bias", False)) if qwen3 else True
    return llama_like_config(
        hf, max_positions=hf_field(hf, "max_position_embeddings", default=32768),
        activation=hf_field(hf, "hidden_act", default="silu"),
        **rope_fields(hf), **sliding_fields(hf, n_layers, all_layers=False),
        attention_bias=bias, attention_out_bias=bias if qwen3 else False, qk_norm=qwen3, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


QWEN = Architecture(
    model_types=("qwen2", "qwen3"),
    classes=("Qwen2ForCausalLM", "Qwen2Model", "Qwen3ForCausalLM", "Qwen3Model"),
    base_prefix="model.",
    config=_qwen_config,
    rules=llama_rules(extra=QK_NORM_RULES),
    ignored=ROTARY_BUFFERS,
)
