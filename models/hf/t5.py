"""T5 v1.0 and v1.1 (``model_type`` ``t5``) -> encoder-decoder.

Pre-norm RMSNorm, relative attention bias (one table per stack, from block 0), unscaled attention,
ReLU or gated FFN (``wi`` or ``wi_0``/``wi_1``), head tied to ``shared`` (scaled by d_model^-0.5
when the config ties, as v1.0) or the file's own ``lm_head``.
"""

from __future__ import annotations

from tfport.config import ModelConfig
from tfport.config.positions import RelativeConfig

from .configs import hf_activation, hf_field, refuse, token_ids
from .rules import QKV, Architecture, Rule, concat_rows


def _t5_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """T5 (v1.0 and v1.1): pre-norm RMSNorm, relative attention bias, unscaled attention.

    ``feed_forward_proj`` is ``ACT`` or ``gated-ACT`` ("gated-gelu" is the tanh GELU). The head is
    tied to ``shared`` unless the file holds its own ``lm_head.weight``; the decoder output is
    scaled by d_model^-0.5 before the head when the config ties embeddings (T5 v1.0), as
    transformers does (``scale_decoder_outputs``).
    """
    proj = hf_field(hf, "feed_forward_proj", default="relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        refuse(hf, "feed_forward_proj", proj, "expected 'ACT' or 'gated-ACT'")
    gated = len(parts) == 2
    activation = "gelu_new" if proj == "gated-gelu" else parts[-1]
    d_model, n_heads, d_kv = hf_field(hf, "d_model"), hf_field(hf, "num_heads"), hf_field(hf, "d_kv")
    vocab_size = hf_field(hf, "vocab_size")
    n_layers = hf_field(hf, "num_layers")
    scaled = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    tied = keys is None or "lm_head.weight" not in keys
    ids = token_ids(hf, vocab_size)
    start = hf.get("decoder_start_token_id", ids["pad_token_id"])
    return ModelConfig(
        family="encoder-decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
        head_dim=None if n_heads * d_kv == d_model else d_kv, d_ff=hf_field(hf, "d_ff"),
        n_encoder_layers=n_layers, n_decoder_layers=hf_field(hf, "num_decoder_layers", default=n_layers),
        norm="rmsnorm", norm_position="pre", norm_eps=float(hf_field(hf, "layer_norm_epsilon", default=1e-6)),
        activation=hf_activation(hf, activation), gated_ffn=gated, position="relative",
        relative=RelativeConfig(buckets=hf_field(hf, "relative_attention_num_buckets", default=32),
                                max_distance=hf_field(hf, "relative_attention_max_distance", default=128)),
        # T5 has no position table; relative distances are bucketed up to max_distance, and
        # longer inputs still work -- n_positions (512) is what it was trained on.
        max_positions=hf_field(hf, "n_positions", default=512), attention_bias=False, mlp_bias=False,
        attention_scale=1.0, tie_embeddings=tied, lm_head_scale=d_model**-0.5 if scaled else 1.0,
        decoder_start_token_id=start, **ids)


def _t5_stack(stack: str, hf: str, cross: bool) -> list[Rule]:
    """Rules of one T5 stack: ``{hf}.block.{i}.layer.N`` = self-attention, [cross-attention],
    feed-forward; the relative bias table lives in block 0 and serves every layer."""
    layer, block = f"{stack}.layers.{{i}}", f"{hf}.block.{{i}}"
    attn = f"{block}.layer.0.SelfAttention"
    ffn = f"{block}.layer.{2 if cross else 1}.DenseReluDense"
    rules = [
        Rule(f"{stack}.relative_bias.weight", (f"{hf}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
        Rule(f"{layer}.attn_norm.weight", (f"{block}.layer.0.layer_norm.weight",)),
        Rule(f"{layer}.attn.qkv.weight", tuple(f"{attn}.{p}.weight" for p in "qkv"), QKV),
        Rule(f"{layer}.attn.out.weight", (f"{attn}.o.weight",)),
        Rule(f"{layer}.ffn_norm.weight", (f"{block}.layer.{2 if cross else 1}.layer_norm.weight",)),
        Rule(f"{layer}.ffn.gate.weight", (f"{ffn}.wi_0.weight",)),
        Rule(f"{layer}.ffn.up.weight", (f"{ffn}.wi_1.weight",), when=lambda c: c.gated_ffn),
        Rule(f"{layer}.ffn.up.weight", (f"{ffn}.wi.weight",)),
        Rule(f"{layer}.ffn.down.weight", (f"{ffn}.wo.weight",)),
        Rule(f"{stack}.norm.weight", (f"{hf}.final_layer_norm.weight",)),
    ]
    if cross:
        cross_attn = f"{block}.layer.1.EncDecAttention"
        rules += [
            Rule(f"{layer}.cross_norm.weight", (f"{block}.layer.1.layer_norm.weight",)),
            Rule(f"{layer}.cross_attn.q.weight", (f"{cross_attn}.q.weight",)),
            Rule(f"{layer}.cross_attn.kv.weight", (f"{cross_attn}.k.weight", f"{cross_attn}.v.weight"),
                 concat_rows("kv", "kv")),
            Rule(f"{layer}.cross_attn.out.weight", (f"{cross_attn}.o.weight",)),
        ]
    return rules


T5 = Architecture(
    model_types=("t5",),
    classes=("T5ForConditionalGeneration", "T5Model"),
    base_prefix="",
    config=_t5_config,
    rules=(
        Rule("encoder.embed.tokens.weight", ("shared.weight",)),
        Rule("decoder.embed.tokens.weight", ("decoder.embed_tokens.weight",)),
        *_t5_stack("encoder", "encoder", cross=False),
        *_t5_stack("decoder", "decoder", cross=True),
        Rule("lm_head.weight", ("lm_head.weight",)),
    ),
    duplicates={"encoder.embed_tokens.weight": "shared.weight",
                "decoder.embed_tokens.weight": "shared.weight"},
)
