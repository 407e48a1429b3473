"""Falcon (``model_type`` ``falcon``) -> decoder.

LayerNorm, exact GELU MLP, RoPE, biases as ``bias`` says, tied head. Three attention layouts of
``query_key_value``: the new decoder architecture (Falcon 40B/180B, Falcon 2: GQA, rows grouped
per key/value head as [G queries, key, value]), multi-query (Falcon 7B: [all q | k | v], tfport's
own order) and multi-head (rows per head [q_h, k_h, v_h]). Parallel attention and MLP
(``parallel_attn``; the new architecture always adds them) read ``ln_attn`` / ``ln_mlp``, or
``input_layernorm`` for both.
"""

from __future__ import annotations

import torch

from tfport.config import ModelConfig

from .configs import hf_activation, hf_field, refuse, rope_fields, token_ids
from .rules import COPY, PER_HEAD_QKV, Architecture, Rule, Transform, decoder_lm, params


def _regroup_kv_groups(ts: list[torch.Tensor], shape, c: ModelConfig) -> torch.Tensor:
    hkv, d = c.kv_heads, c.dim_per_head
    g = c.n_heads // hkv
    grouped = ts[0].reshape(hkv, g + 2, d, *shape[1:])  # [Hkv, G + 2, D, (E)]
    q, k, v = grouped[:, :g], grouped[:, g], grouped[:, g + 1]
    return torch.cat([q.reshape(-1, *shape[1:]), k.reshape(-1, *shape[1:]), v.reshape(-1, *shape[1:])])


# New decoder architecture: rows [Hkv, G + 2, D] -> [all q | all k | all v].
KV_GROUP_QKV = Transform("regroup rows [Hkv, G + 2, D] -> [q | k | v]", lambda shape, c: [shape],
                         _regroup_kv_groups)


def _layout(hf: dict) -> str:
    if hf.get("new_decoder_architecture"):
        return "grouped"
    return "multi_query" if hf.get("multi_query", True) else "per_head"


def _falcon_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    if hf.get("alibi"):
        refuse(hf, "alibi", True, "tfport maps Falcon with RoPE only")
    layout = _layout(hf)
    parallel = bool(hf.get("parallel_attn", True))
    if layout == "grouped" and not parallel:
        refuse(hf, "parallel_attn", False, "the new decoder architecture always adds attention and MLP "
               "in parallel")
    d_model = hf_field(hf, "hidden_size")
    n_heads = hf_field(hf, "num_attention_heads", "n_head")  # n_*: configs of the first releases
    kv_heads = {"grouped": hf_field(hf, "num_kv_heads", "n_head_kv", default=n_heads), "multi_query": 1,
                "per_head": n_heads}[layout]
    vocab_size = hf_field(hf, "vocab_size")
    bias = bool(hf.get("bias", False))
    return ModelConfig(
        family="decoder", vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_kv_heads=kv_heads,
        d_ff=hf_field(hf, "ffn_hidden_size", default=4 * d_model), n_decoder_layers=hf_field(hf, "num_hidden_layers", "n_layer"),
        norm="layernorm", norm_position="pre", norm_eps=float(hf_field(hf, "layer_norm_epsilon", default=1e-5)),
        activation=hf_activation(hf, hf_field(hf, "activation", default="gelu")),
        position="rope", max_positions=hf_field(hf, "max_position_embeddings", default=2048),
        **rope_fields(hf, head_dim=d_model // n_heads), parallel_residual=parallel or layout == "grouped",
        attention_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **token_ids(hf, vocab_size))


FALCON_LAYER = "transformer.h.{i}"
_QKV = f"{FALCON_LAYER}.self_attention.query_key_value"


def _qkv_rules(transform: Transform, when) -> list[Rule]:
    return [Rule(r.target, r.sources, r.transform, when)
            for r in params("decoder.layers.{i}.attn.qkv", _QKV, weight=transform, bias=transform)]


def _norm_rules(attn: str, ffn: str, when, if_present: bool = False) -> list[Rule]:
    return [Rule(r.target, r.sources, r.transform, when, if_present)
            for part, source in (("attn_norm", attn), ("ffn_norm", ffn))
            for r in params(f"decoder.layers.{{i}}.{part}", f"{FALCON_LAYER}.{source}")]


def _grouped(c: ModelConfig) -> bool:
    return c.kv_heads not in (1, c.n_heads)


# Parallel blocks have two norms (ln_attn, ln_mlp) or one shared (input_layernorm); the config
# does not say which (num_ln_in_parallel_attn is often unset), the checkpoint's tensors do.
FALCON = Architecture(
    model_types=("falcon",),
    classes=("FalconForCausalLM", "FalconModel"),
    base_prefix="transformer.",
    config=_falcon_config,
    rules=(*_qkv_rules(KV_GROUP_QKV, _grouped),
           *_qkv_rules(PER_HEAD_QKV, lambda c: c.kv_heads == c.n_heads and c.n_heads > 1),
           *_qkv_rules(COPY, lambda c: c.kv_heads == 1),
           *_norm_rules("ln_attn", "ln_mlp", lambda c: c.parallel_residual, if_present=True),
           *_norm_rules("input_layernorm", "input_layernorm", lambda c: c.parallel_residual),
           *_norm_rules("input_layernorm", "post_attention_layernorm", lambda c: not c.parallel_residual),
           *decoder_lm(FALCON_LAYER, "transformer.word_embeddings.weight", "transformer.ln_f",
                       norms=("input_layernorm", "post_attention_layernorm"),
                       attn=[*params("decoder.layers.{i}.attn.out", f"{FALCON_LAYER}.self_attention.dense")],
                       ffn=[*params("decoder.layers.{i}.ffn.up", f"{FALCON_LAYER}.mlp.dense_h_to_4h"),
                            *params("decoder.layers.{i}.ffn.down", f"{FALCON_LAYER}.mlp.dense_4h_to_h")])),
)
