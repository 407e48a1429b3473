"""Granite-MoE (``model_type`` ``granitemoe``) -> decoder with a mixture of experts in every layer.

LLaMA's layout (pre-norm RMSNorm, RoPE, GQA) with Granite's four multipliers, each an existing
config field: ``embedding_multiplier`` scales the token embeddings (``embedding_scale``),
``attention_multiplier`` is the softmax scale (``attention_scale``, in place of 1/sqrt(D)),
``residual_multiplier`` scales each sublayer's output before its residual add
(``residual_scale``), and the logits are divided by ``logits_scaling`` (``lm_head_scale`` =
1 / logits_scaling on the final states: the head has no bias, so this is the same product).

The FFN (``block_sparse_moe``): a router ``router.layer`` [N, E]; top ``num_experts_per_tok``
logits, softmax over those k (``routing="topk_softmax"``); N SwiGLU experts of width
``intermediate_size`` stored stacked: ``input_linear`` [N, 2F, E] (each expert's gate rows, then
its up rows) and ``output_linear`` [N, E, F].
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.moe import MoeConfig

from .configs import hf_field, refuse, rope_fields
from .llama import LLAMA_LAYER, ROTARY_BUFFERS, llama_like_config, llama_rules
from .rules import Architecture, Rule, half_rows

_MOE = f"{LLAMA_LAYER}.block_sparse_moe"
_EXPERT = "decoder.layers.{i}.ffn.experts.{e}"


def _multiplier(hf: dict, name: str) -> float:
    value = hf_field(hf, name, default=1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        refuse(hf, name, value, "expected a positive number")
    return float(value)


def granitemoe_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """The tfport config of a Granite-MoE ``config.json`` (dict)."""
    bias = bool(hf.get("attention_bias", False))
    return llama_like_config(
        hf, max_positions=hf_field(hf, "max_position_embeddings", default=2048),
        activation=hf_field(hf, "hidden_act", default="silu"), **rope_fields(hf),
        attention_bias=bias, mlp_bias=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        embedding_scale=_multiplier(hf, "embedding_multiplier"),
        attention_scale=_multiplier(hf, "attention_multiplier"),
        residual_scale=_multiplier(hf, "residual_multiplier"),
        lm_head_scale=1.0 / _multiplier(hf, "logits_scaling"),
        moe=MoeConfig(n_experts=hf_field(hf, "num_local_experts"), top_k=hf_field(hf, "num_experts_per_tok"),
                      d_expert=hf_field(hf, "intermediate_size"), routing="topk_softmax"))


GRANITE_MOE = Architecture(
    model_types=("granitemoe",),
    classes=("GraniteMoeForCausalLM", "GraniteMoeModel"),
    base_prefix="model.",
    config=granitemoe_config,
    rules=llama_rules(extra=(
        Rule("decoder.layers.{i}.ffn.router.weight", (f"{_MOE}.router.layer.weight",)),
        Rule(f"{_EXPERT}.gate.weight", (f"{_MOE}.input_linear.weight",), half_rows(0), stacked=True),
        Rule(f"{_EXPERT}.up.weight", (f"{_MOE}.input_linear.weight",), half_rows(1), stacked=True),
        Rule(f"{_EXPERT}.down.weight", (f"{_MOE}.output_linear.weight",), stacked=True),
    )),
    ignored=ROTARY_BUFFERS,
)
