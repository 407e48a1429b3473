"""OLMoE (``model_type`` ``olmoe``) -> decoder with a mixture of experts in every layer.

LLaMA's layout (pre-norm RMSNorm, RoPE, GQA, unbiased unless ``attention_bias``), but its q/k
norms (``q_norm`` [H*D], ``k_norm`` [Hkv*D]) each span all heads' channels of the projection,
not one head (``qk_norm_span="all_heads"``), and ``clip_qkv`` (if set) clamps q, k and v after
them. The FFN (``mlp``): a router ``gate`` [N, E] and N SwiGLU experts ``gate_proj`` /
``up_proj`` / ``down_proj`` of width ``intermediate_size``; softmax over the N experts, top
``num_experts_per_tok``, divided by their sum only when ``norm_topk_prob`` (false by default).
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.moe import MoeConfig

from .configs import hf_field, refuse, rope_fields
from .llama import QK_NORM_RULES, ROTARY_BUFFERS, llama_like_config, llama_rules
from .mixtral import expert_rules
from .qwen2_moe import QWEN_PROJECTIONS
from .rules import Architecture


def olmoe_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """The tfport config of an OLMoE ``config.json`` (dict)."""
    d_model, n_heads = hf_field(hf, "hidden_size"), hf_field(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != d_model:
        # transformers sizes q_norm by hidden_size and k_norm by hidden_size / heads * kv heads
        refuse(hf, "head_dim", head_dim, f"expected hidden_size / num_attention_heads = {d_model // n_heads} "
               "(OLMoE's q/k norms are sized from hidden_size)")
    clip = hf.get("clip_qkv")
    bias = bool(hf.get("attention_bias", False))
    return llama_like_config(
        hf, max_positions=hf_field(hf, "max_position_embeddings", default=4096),
        activation=hf_field(hf, "hidden_act", default="silu"), **rope_fields(hf),
        attention_bias=bias, mlp_bias=False, qk_norm=True, qk_norm_span="all_heads",
        qkv_clip=None if clip is None else float(clip),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=MoeConfig(n_experts=hf_field(hf, "num_experts"), top_k=hf_field(hf, "num_experts_per_tok"),
                      d_expert=hf_field(hf, "intermediate_size"), routing="softmax_topk",
                      normalize=bool(hf.get("norm_topk_prob", False))))


OLMOE = Architecture(
    model_types=("olmoe",),
    classes=("OlmoeForCausalLM", "OlmoeModel"),
    base_prefix="model.",
    config=olmoe_config,
    rules=llama_rules(extra=QK_NORM_RULES + expert_rules("mlp", "gate", "experts", QWEN_PROJECTIONS)),
    ignored=ROTARY_BUFFERS,
)
