"""GPT-NeoX / Pythia (``model_type`` ``gpt_neox``) -> decoder.

Pre-norm LayerNorm, exact GELU MLP, biases everywhere, partial rotary (``rotary_pct`` /
``partial_rotary_factor``: the first channels of each head, rotate-half), parallel residual
(``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(ln2(x))``), untied ``embed_out`` head.
``query_key_value`` rows are per head ([q_h | k_h | v_h] for each head h), regrouped into tfport's
[all q | all k | all v].
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, rope_fields, rope_parameters, token_ids
from .rules import PER_HEAD_QKV, Architecture, Rule, decoder_lm, params


def _neox_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    vocab_size = hf_field(hf, "vocab_size")
    rope = rope_parameters(hf)
    # Pythia-era configs: rotary_pct and rotary_emb_base at the top level.
    rope.setdefault("partial_rotary_factor", hf.get("rotary_pct", 0.25))  # transformers' default
    rope.setdefault("rope_theta", hf.get("rotary_emb_base", 10000.0))
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=hf_field(hf, "num_hidden_layers"),
        norm="layernorm", norm_position="pre", norm_eps=float(hf_field(hf, "layer_norm_eps", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="gelu")),
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=2048),
        **rope_fields(hf, rope, head_dim=d_model // n_heads),
        parallel_residual=bool(hf.get("use_parallel_residual", True)),
        attention_bias=bias, mlp_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **token_ids(hf, vocab_size))


NEOX_LAYER = "gpt_neox.layers.{i}"
NEOX = Architecture(
    model_types=("gpt_neox",),
    classes=("GPTNeoXForCausalLM", "GPTNeoXModel"),
    base_prefix="gpt_neox.",
    config=_neox_config,
    rules=tuple(rule for rule in decoder_lm(
        NEOX_LAYER, "gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm",
        norms=("input_layernorm", "post_attention_layernorm"),
        attn=[*params("decoder.layers.{i}.attn.qkv", f"{NEOX_LAYER}.attention.query_key_value",
                      weight=PER_HEAD_QKV, bias=PER_HEAD_QKV),
              *params("decoder.layers.{i}.attn.out", f"{NEOX_LAYER}.attention.dense")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{NEOX_LAYER}.mlp.dense_h_to_4h"),
             *params("decoder.layers.{i}.ffn.down", f"{NEOX_LAYER}.mlp.dense_4h_to_h")]
        ) if rule.target != "lm_head.weight") + (Rule("lm_head.weight", ("embed_out.weight",)),),
    ignored={r"gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)":
             "causal mask and rotary buffers older checkpoints saved; recomputed"},
)
