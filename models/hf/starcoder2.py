"""StarCoder2 (``model_type`` ``starcoder2``) -> decoder.

LLaMA's tensor names and sequential pre-norm blocks with LayerNorms (weight and bias), a plain
MLP ``c_fc`` -> ``gelu_pytorch_tanh`` -> ``c_proj``, RoPE (rotate-half, whole head), GQA, biases on
every projection as ``use_bias`` says, a ``sliding_window`` on every layer, tied head by default.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, rope_fields, sliding_fields, token_ids
from .llama import LLAMA_LAYER, ROTARY_BUFFERS
from .rules import QKV, Architecture, decoder_lm, params


def _starcoder2_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads")
    head_dim = hf_field(hf, "head_dim", default=d_model // n_heads)
    n_layers = hf_field(hf, "num_hidden_layers")
    vocab_size = hf_field(hf, "vocab_size")
    bias = bool(hf.get("use_bias", True))
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        n_kv_heads=hf_field(hf, "num_key_value_heads", default=2),  # transformers' default
        head_dim=None if head_dim * n_heads == d_model else head_dim,
        d_ff=hf_field(hf, "intermediate_size"), n_decoder_layers=n_layers,
        norm="layernorm", norm_position="pre", norm_eps=float(hf_field(hf, "norm_epsilon", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "hidden_act", default="gelu_pytorch_tanh")),
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=4096),
        **rope_fields(hf, head_dim=head_dim), **sliding_fields(hf, n_layers, all_layers=True),
        attention_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **token_ids(hf, vocab_size))


STARCODER2 = Architecture(
    model_types=("starcoder2",),
    classes=("Starcoder2ForCausalLM", "Starcoder2Model"),
    base_prefix="model.",
    config=_starcoder2_config,
    rules=decoder_lm(
        LLAMA_LAYER, "model.embed_tokens.weight", "model.norm",
        norms=("input_layernorm", "post_attention_layernorm"),
        attn=[*params("decoder.layers.{i}.attn.qkv",
                      tuple(f"{LLAMA_LAYER}.self_attn.{p}_proj" for p in "qkv"), weight=QKV, bias=QKV),
              *params("decoder.layers.{i}.attn.out", f"{LLAMA_LAYER}.self_attn.o_proj")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{LLAMA_LAYER}.mlp.c_fc"),
             *params("decoder.layers.{i}.ffn.down", f"{LLAMA_LAYER}.mlp.c_proj")]),
    ignored=ROTARY_BUFFERS,
)
