"""LLaMA and Mistral (``model_type`` ``llama``, ``mistral``) -> decoder.

Pre-norm RMSNorm, SwiGLU, RoPE (default, linear or llama3 scaling), GQA. ``q/k/v_proj`` are
stacked into the fused ``qkv`` rows [q | k | v]; ``gate/up/down_proj`` -> ``ffn.gate/up/down``;
``lm_head`` tied or not. Mistral's ``sliding_window`` applies to every layer.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, rope_fields, sliding_fields, token_ids
from .rules import QKV, Architecture, Rule, decoder_lm, params


def llama_like_config(hf: dict, *, max_positions: int, activation: str = "silu", **fields) -> ModelConfig:
    """The decoder config every LLaMA-layout family shares (pre-norm RMSNorm, gated FFN, RoPE,
    GQA, optional separate head_dim) from ``hf``; ``fields`` are the family's own ModelConfig
    fields (RoPE, windows, biases, norms ...), ``activation`` its HF activation name."""
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    head_dim = hf_field(hf, "head_dim", default=d_model // n_heads)
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf, "num_key_value_heads", default=n_heads),
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=hf_field(hf, "num_hidden_layers"),
        norm="rmsnorm", norm_position="pre", norm_eps=float(hf_field(hf, "rms_norm_eps", default=1e-6)),
        activation=hf_activation(hf, activation), gated_ffn=True, position="rope",
        max_positions=max_positions, **token_ids(hf, vocab_size), **fields)


def _llama_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """LLaMA and Mistral: pre-norm RMSNorm, SwiGLU, RoPE, GQA."""
    max_positions = hf_field(hf, "max_position_embeddings", default=2048)
    rope = rope_fields(hf)
    if rope["rope"].scaling == "dynamic":  # the context dynamic NTK is meant to reach
        max_positions = int(max_positions * rope["rope"].scaling_factor)
    return llama_like_config(
        hf, max_positions=max_positions, activation=hf_field(hf, "hidden_act", default="silu"), **rope,
        # transformers' Llama has no sliding window: a "sliding_window" in a llama config is unused
        **(sliding_fields(hf, hf_field(hf, "num_hidden_layers"), all_layers=True)
           if hf.get("model_type") != "llama" else {}),
        attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


LLAMA_LAYER = "model.layers.{i}"


def llama_rules(norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm"),
                extra: tuple[Rule, ...] = ()) -> tuple[Rule, ...]:
    """The rules of LLaMA's tensor names (``model.layers.{i}.self_attn.q_proj`` ...), which
    Mistral, Qwen2/3 and Gemma 1/2/3 share; ``norms`` are the pre-attention and pre-FFN norms,
    ``extra`` the family's own tensors (q/k norms, post-sublayer norms)."""
    return decoder_lm(
        LLAMA_LAYER, "model.embed_tokens.weight", "model.norm", norms=norms,
        attn=[*params("decoder.layers.{i}.attn.qkv",
                      tuple(f"{LLAMA_LAYER}.self_attn.{p}_proj" for p in "qkv"), weight=QKV, bias=QKV),
              *params("decoder.layers.{i}.attn.out", f"{LLAMA_LAYER}.self_attn.o_proj")],
        ffn=[rule for p in ("gate", "up", "down")
             for rule in params(f"decoder.layers.{{i}}.ffn.{p}", f"{LLAMA_LAYER}.mlp.{p}_proj")],
        extra=extra)


QK_NORM_RULES = (Rule("decoder.layers.{i}.attn.q_norm.weight", (f"{LLAMA_LAYER}.self_attn.q_norm.weight",)),
                 Rule("decoder.layers.{i}.attn.k_norm.weight", (f"{LLAMA_LAYER}.self_attn.k_norm.weight",)))
ROTARY_BUFFERS = {r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq":
                  "rotary frequencies are recomputed from rope_theta (older checkpoints saved them)"}

LLAMA = Architecture(
    model_types=("llama", "mistral"),
    classes=("LlamaForCausalLM", "LlamaModel", "MistralForCausalLM", "MistralModel"),
    base_prefix="model.",
    config=_llama_config,
    rules=llama_rules(),
    ignored=ROTARY_BUFFERS,
)
