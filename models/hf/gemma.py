"""Gemma 1/2/3 (``model_type`` ``gemma``, ``gemma2``, ``gemma3_text``) -> decoder.

LLaMA's tensor names with Gemma's arithmetic: RMSNorm weights stored as w and applied as
``1 + w`` (``norm_weight_offset=1``), token embeddings scaled by sqrt(d_model) in the model dtype,
gated GELU (tanh form), a tied head. Gemma 2 adds ``query_pre_attn_scalar`` (scale
q_p_a_s^-1/2), attention-logit and final-logit soft-capping, norms after each sublayer
(``post_attention_layernorm`` on the attention output, ``pre/post_feedforward_layernorm`` around
the FFN) and sliding-window layers. Gemma 3 adds per-head q/k norms and gives the sliding-window
layers their own RoPE base (``rope_parameters.sliding_attention``, unscaled).
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_field, refuse, rope_fields, rope_parameters, sliding_fields
from .llama import LLAMA_LAYER, QK_NORM_RULES, ROTARY_BUFFERS, llama_like_config, llama_rules
from .rules import Architecture, params


def _gemma_rope(hf: dict) -> dict:
    """Gemma 1/2: one RoPE. Gemma 3: the full-attention layers' (scaled or not) and the
    sliding-window layers' base (``rope.local_theta``), which must be unscaled."""
    params_ = rope_parameters(hf)
    if "full_attention" not in params_:
        if hf.get("model_type") != "gemma3_text":
            return rope_fields(hf, params_)
        # Gemma 3 configs before per-layer-type rope_parameters: rope_theta (+ rope_scaling) for
        # global layers, rope_local_base_freq for the sliding ones.
        params_ = {"full_attention": params_, "sliding_attention": {
            "rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10000.0)}}
    fields = rope_fields(hf, params_["full_attention"], default_theta=1_000_000.0)
    local = params_.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        refuse(hf, "rope_parameters.sliding_attention.rope_type", local.get("rope_type"),
               "tfport gives sliding-window layers an unscaled RoPE of their own base only")
    theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    return {"rope": fields["rope"].replace(local_theta=theta)}


def _gemma_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    model_type = hf.get("model_type")
    version = {"gemma": 1, "gemma2": 2}.get(model_type, 3)
    n_layers = hf_field(hf, "num_hidden_layers")
    # transformers' Gemma 1 reads hidden_act, turning the official releases' legacy "gelu" into the
    # tanh approximation it was meant to be; Gemma 2/3 read hidden_activation.
    act = hf.get("hidden_act") if version == 1 else hf.get("hidden_activation")
    act = act or "gelu_pytorch_tanh"
    if version == 1 and act == "gelu":
        act = "gelu_pytorch_tanh"
    if hf.get("use_bidirectional_attention"):
        refuse(hf, "use_bidirectional_attention", True, "tfport's decoders are causal")
    later = version >= 2
    if later and hf.get("layer_types") is None:  # checkpoints older than transformers' layer_types
        pattern = 2 if version == 2 else int(hf.get("sliding_window_pattern", 6))
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                    for i in range(n_layers)]}
    rope = _gemma_rope(hf)
    window = sliding_fields(hf, n_layers, all_layers=False) if later else {}
    if not window:
        rope = {"rope": rope["rope"].replace(local_theta=None)}
    # transformers' defaults where config.json leaves them out: 256; Gemma 2 caps logits at 30 and
    # attention scores at 50, Gemma 3 caps neither
    scalar = hf.get("query_pre_attn_scalar", 256) if later else None
    caps = (50.0, 30.0) if version == 2 else (None, None)
    return llama_like_config(
        hf, max_positions=hf_field(hf, "max_position_embeddings", default=8192), activation=act,
        norm_weight_offset=1.0, embedding_scale=hf_field(hf, "hidden_size")**0.5,
        **rope, **window, attention_scale=None if scalar is None else float(scalar) ** -0.5,
        attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=False,
        attn_logit_softcap=hf.get("attn_logit_softcapping", caps[0]) if later else None,
        final_logit_softcap=hf.get("final_logit_softcapping", caps[1]) if later else None,
        post_sublayer_norm=later, qk_norm=version == 3,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


GEMMA_RULES = llama_rules()
# Gemma 2/3: input_layernorm -> attention -> post_attention_layernorm (on its output); then
# pre_feedforward_layernorm -> FFN -> post_feedforward_layernorm.
GEMMA2_RULES = llama_rules(
    norms=("input_layernorm", "pre_feedforward_layernorm"),
    extra=(*params("decoder.layers.{i}.attn_post_norm", f"{LLAMA_LAYER}.post_attention_layernorm"),
           *params("decoder.layers.{i}.ffn_post_norm", f"{LLAMA_LAYER}.post_feedforward_layernorm"),
           *QK_NORM_RULES))


def _architecture(model_types, classes, rules) -> Architecture:
    return Architecture(model_types=model_types, classes=classes, base_prefix="model.",
                        config=_gemma_config, rules=rules, ignored=ROTARY_BUFFERS)


GEMMA = _architecture(("gemma",), ("GemmaForCausalLM", "GemmaModel"), GEMMA_RULES)
GEMMA2 = _architecture(("gemma2", "gemma3_text"),
                       ("Gemma2ForCausalLM", "Gemma2Model", "Gemma3ForCausalLM", "Gemma3TextModel"),
                       GEMMA2_RULES)
