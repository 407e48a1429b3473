"""Mixtral (``model_type`` ``mixtral``) -> decoder with a mixture of experts in every layer.

LLaMA's attention and norms (GQA, RoPE, a sliding window on every layer when set); the FFN is
``block_sparse_moe``: a router ``gate`` [N, E] and N SwiGLU experts ``w1`` (gate), ``w3`` (up),
``w2`` (down). Routing: softmax over the N experts, top ``num_experts_per_tok``, renormalised
(``tfport.config.moe``). ``router_jitter_noise`` only acts in training.

The checkpoints read are per-expert tensors (``experts.{e}.w1.weight``), as every published
Mixtral and transformers' ``save_pretrained`` write them; transformers 5's fused in-memory layout
(``experts.gate_up_proj`` [N, 2F, E]) is reported as unexpected keys.
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.moe import MoeConfig

from .configs import hf_field, rope_fields, sliding_fields
from .llama import LLAMA_LAYER, ROTARY_BUFFERS, llama_like_config, llama_rules
from .rules import Architecture, Rule


def expert_rules(block: str, router: str, experts: str, names: tuple[str, str, str],
                 shared: str | None = None, shared_gate: str | None = None) -> tuple[Rule, ...]:
    """The rules of a mixture-of-experts block at HF ``{LLAMA_LAYER}.{block}``: its ``router``
    weight's module name, the ``experts`` list's name and each expert's (gate, up, down)
    projection names; a shared expert (same projection names) and its gate, if any."""
    prefix = f"{LLAMA_LAYER}.{block}"
    rules = [Rule("decoder.layers.{i}.ffn.router.weight", (f"{prefix}.{router}.weight",))]
    for part, hf_name in zip(("gate", "up", "down"), names):
        rules.append(Rule(f"decoder.layers.{{i}}.ffn.experts.{{e}}.{part}.weight",
                          (f"{prefix}.{experts}.{{e}}.{hf_name}.weight",)))
        if shared is not None:
            rules.append(Rule(f"decoder.layers.{{i}}.ffn.shared.{part}.weight",
                              (f"{prefix}.{shared}.{hf_name}.weight",)))
    if shared_gate is not None:
        rules.append(Rule("decoder.layers.{i}.ffn.shared_gate.weight", (f"{prefix}.{shared_gate}.weight",)))
    return tuple(rules)


def _mixtral_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    n_layers = hf_field(hf, "num_hidden_layers")
    n_experts = hf_field(hf, "num_local_experts")
    return llama_like_config(
        hf, max_positions=hf_field(hf, "max_position_embeddings", default=32768),
        activation=hf_field(hf, "hidden_act", default="silu"), **rope_fields(hf, default_theta=1e6),
        **sliding_fields(hf, n_layers, all_layers=True), attention_bias=False, mlp_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=MoeConfig(n_experts=n_experts, top_k=hf_field(hf, "num_experts_per_tok"),
                      d_expert=hf_field(hf, "intermediate_size"), routing="softmax_topk", normalize=True))


MIXTRAL = Architecture(
    model_types=("mixtral",),
    classes=("MixtralForCausalLM", "MixtralModel"),
    base_prefix="model.",
    config=_mixtral_config,
    rules=llama_rules(extra=expert_rules("block_sparse_moe", "gate", "experts", ("w1", "w3", "w2"))),
    ignored=ROTARY_BUFFERS,
)
