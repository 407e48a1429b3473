"""OPT (``model_type`` ``opt``) -> decoder.

Learned positions whose table starts at row 2 (OPT offsets position ids by 2; rows 0 and 1 are
never read for real tokens, so the import drops them), ReLU MLP, LayerNorm pre-norm
(``do_layer_norm_before``, every size but 350m) or post-norm, biases as ``enable_bias`` says,
tied head. ``q/k/v_proj`` are stacked into the fused ``qkv`` rows.
"""

from __future__ import annotations

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, refuse, token_ids
from .rules import QKV, Architecture, Rule, Transform, decoder_lm, params

POSITION_OFFSET = 2

# OPT's table [max_positions + 2, E]: position p reads row p + 2.
OFFSET_ROWS = Transform(f"drop the first {POSITION_OFFSET} rows (OPT's position offset)",
                        lambda shape, c: [(shape[0] + POSITION_OFFSET, *shape[1:])],
                        lambda ts, shape, c: ts[0][POSITION_OFFSET:])


def _opt_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    d_model = hf_field(hf, "hidden_size")
    projected = hf.get("word_embed_proj_dim", d_model)
    if projected != d_model:
        refuse(hf, "word_embed_proj_dim", projected, f"its embeddings are projected to hidden_size={d_model} "
               "and back (project_in / project_out), which tfport's stack has no place for")
    if hf.get("layer_norm_elementwise_affine", True) is not True:
        refuse(hf, "layer_norm_elementwise_affine", hf["layer_norm_elementwise_affine"],
               "tfport's LayerNorms have a weight and a bias")
    if hf.get("_remove_final_layer_norm"):
        refuse(hf, "_remove_final_layer_norm", True, "tfport's pre-norm stacks end with a norm")
    vocab_size = hf_field(hf, "vocab_size")
    bias = bool(hf.get("enable_bias", True))
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=hf_field(hf, "num_attention_heads"),
        d_ff=hf_field(hf, "ffn_dim"), n_decoder_layers=hf_field(hf, "num_hidden_layers"),
        norm="layernorm", norm_position="pre" if hf.get("do_layer_norm_before", True) else "post",
        norm_eps=1e-5, activation=hf_activation(hf, hf_field(hf, "activation_function", default="relu")),
        position="learned", max_positions=hf_field(hf, "max_position_embeddings", default=2048),
        attention_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **token_ids(hf, vocab_size))


OPT_LAYER = "model.decoder.layers.{i}"
OPT = Architecture(
    model_types=("opt",),
    classes=("OPTForCausalLM", "OPTModel"),
    base_prefix="model.",
    config=_opt_config,
    rules=decoder_lm(
        OPT_LAYER, "model.decoder.embed_tokens.weight", "model.decoder.final_layer_norm",
        norms=("self_attn_layer_norm", "final_layer_norm"),
        attn=[*params("decoder.layers.{i}.attn.qkv", tuple(f"{OPT_LAYER}.self_attn.{p}_proj" for p in "qkv"),
                      weight=QKV, bias=QKV),
              *params("decoder.layers.{i}.attn.out", f"{OPT_LAYER}.self_attn.out_proj")],
        ffn=[*params("decoder.layers.{i}.ffn.up", f"{OPT_LAYER}.fc1"),
             *params("decoder.layers.{i}.ffn.down", f"{OPT_LAYER}.fc2")],
        extra=[Rule("decoder.embed.positions.weight", ("model.decoder.embed_positions.weight",), OFFSET_ROWS)]),
)
