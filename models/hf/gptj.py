"""GPT-J (``model_type`` ``gptj``) -> decoder.

Pre-norm LayerNorm shared by the parallel attention and MLP (``ln_1``: tfport's ``ffn_norm`` gets
a copy), partial rotary over the first ``rotary_dim`` channels with the "rotate every two" channel
pairing (``rope.interleaved``), base 10000; no q/k/v/out biases, MLP biases, untied head with a
bias (``lm_head_bias``).
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.rope import RopeConfig

from .configs import hf_activation, hf_field, refuse, token_ids
from .rules import QKV, Architecture, Rule, decoder_lm, params


def _gptj_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    d_model = hf_field(hf, "n_embd")
    n_heads = hf_field(hf, "n_head")
    rotary = hf.get("rotary_dim")
    if rotary is None:
        refuse(hf, "rotary_dim", None, "transformers' GPT-J then derives its frequencies from "
               "n_embd rather than the head dimension; set rotary_dim")
    vocab_size = hf_field(hf, "vocab_size")
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        d_ff=hf.get("n_inner") or 4 * d_model, n_decoder_layers=hf_field(hf, "n_layer"),
        norm="layernorm", norm_position="pre", norm_eps=float(hf_field(hf, "layer_norm_epsilon", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "activation_function", default="gelu_new")),
        position="rope", rope=RopeConfig(theta=10000.0, rotary_dim=int(rotary), interleaved=True),
        max_positions=hf_field(hf, "n_positions", default=2048), parallel_residual=True,
        attention_bias=False, mlp_bias=True, lm_head_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **token_ids(hf, vocab_size))


GPTJ_LAYER = "transformer.h.{i}"
GPTJ = Architecture(
    model_types=("gptj",),
    classes=("GPTJForCausalLM", "GPTJModel"),
    base_prefix="transformer.",
    config=_gptj_config,
    rules=decoder_lm(
        GPTJ_LAYER, "transformer.wte.weight", "transformer.ln_f", norms=("ln_1", "ln_1"),
        attn=[*params("decoder.layers.{i}.attn.qkv", tuple(f"{GPTJ_LAYER}.attn.{p}_proj" for p in "qkv"),
                      weight=QKV, bias=QKV),
              *params("decoder.layers.{i}.attn.out", f"{GPTJ_LAYER}.attn.out_proj")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{GPTJ_LAYER}.mlp.fc_in"),
             *params("decoder.layers.{i}.ffn.down", f"{GPTJ_LAYER}.mlp.fc_out")],
        extra=[Rule("lm_head.bias", ("lm_head.bias",))]),
    ignored={r"transformer\.h\.\d+\.attn\.(bias|masked_bias)": "causal-mask buffers older checkpoints saved"},
)
