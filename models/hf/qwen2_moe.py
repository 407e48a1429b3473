"""Qwen1.5-MoE / Qwen2-MoE and Qwen3-MoE (``model_type`` ``qwen2_moe``, ``qwen3_moe``) -> decoder
with a mixture of experts in some layers.

Qwen2's (Qwen3's) attention and norms. Layer i's FFN is the mixture of experts unless i is in
``mlp_only_layers`` or (i + 1) is not a multiple of ``decoder_sparse_step``; the others keep a
dense SwiGLU of width ``intermediate_size``. The mixture (``mlp``): a router ``gate`` [N, E],
N SwiGLU experts of width ``moe_intermediate_size``; softmax over the N experts, top
``num_experts_per_tok``, divided by their sum when ``norm_topk_prob``. Qwen2-MoE adds a shared
expert (width ``shared_expert_intermediate_size``) scaled by sigmoid(``shared_expert_gate``).
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.checks import is_int
from tfport.config.moe import MoeConfig

from .configs import hf_field, refuse, rope_fields, sliding_fields
from .llama import QK_NORM_RULES, ROTARY_BUFFERS, llama_like_config, llama_rules
from .mixtral import expert_rules
from .rules import Architecture

QWEN_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def moe_layers(hf: dict, n_layers: int) -> tuple[int, ...]:
    """The layers whose FFN is the mixture of experts, as transformers' Qwen MoE decoders pick
    them: not in ``mlp_only_layers``, and (i + 1) a multiple of ``decoder_sparse_step``."""
    step = hf_field(hf, "decoder_sparse_step", default=1)
    dense = hf.get("mlp_only_layers") or []
    if not is_int(step) or step < 1:
        refuse(hf, "decoder_sparse_step", step, "expected a positive integer")
    return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)


def _qwen_moe_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    qwen3 = hf.get("model_type") == "qwen3_moe"
    n_layers = hf_field(hf, "num_hidden_layers")
    layers = moe_layers(hf, n_layers)
    n_experts = hf_field(hf, "num_experts", "num_local_experts")  # Qwen3-MoE writes the latter
    shared = 0 if qwen3 else hf_field(hf, "shared_expert_intermediate_size", default=0)
    moe = MoeConfig(n_experts=n_experts, top_k=hf_field(hf, "num_experts_per_tok"),
                    d_expert=hf_field(hf, "moe_intermediate_size"), routing="softmax_topk",
                    normalize=bool(hf.get("norm_topk_prob", False)), shared_d_ff=shared,
                    shared_gate=shared > 0, layers=None if len(layers) == n_layers else layers) \
        if n_experts and layers else MoeConfig()
    # Qwen2-MoE: biased q/k/v (``qkv_bias``), unbiased output; Qwen3-MoE: ``attention_bias``, q/k norms.
    bias = bool(hf.get("attention_bias", False)) if qwen3 else bool(hf.get("qkv_bias", True))
    return llama_like_config(
        hf, max_positions=hf_field(hf, "max_position_embeddings", default=32768),
        activation=hf_field(hf, "hidden_act", default="silu"), **rope_fields(hf),
        # Qwen2-MoE writes ``layer_types``; Qwen3-MoE's window (if any) covers every layer
        **sliding_fields(hf, n_layers, all_layers=qwen3),
        attention_bias=bias, attention_out_bias=bias if qwen3 else False, qk_norm=qwen3, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe)


QWEN_MOE = Architecture(
    model_types=("qwen2_moe", "qwen3_moe"),
    classes=("Qwen2MoeForCausalLM", "Qwen2MoeModel", "Qwen3MoeForCausalLM", "Qwen3MoeModel"),
    base_prefix="model.",
    config=_qwen_moe_config,
    rules=llama_rules(extra=QK_NORM_RULES + expert_rules(
        "mlp", "gate", "experts", QWEN_PROJECTIONS, shared="shared_expert", shared_gate="shared_expert_gate")),
    ignored=ROTARY_BUFFERS,
)
