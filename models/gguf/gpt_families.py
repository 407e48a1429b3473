"""The GGUF architectures with their own tensor names and a fused or transposed attention:
GPT-2 (transposed Conv1D weights), BLOOM and Falcon (fused QKV regrouped by llama.cpp's
converter), MPT (fused QKV as it is). Entries of ``architectures.ARCHITECTURES``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .entry import GGUFArchitecture

# GPT-2: the converter transposes the Conv1D weights ([in, out] in HF) to [out, in], and writes
# the tied head as its own copy of the token embeddings (output), which is kept as the head (a
# quantised file may store it in another type than token_embd).
GPT2_LAYER = "transformer.h.{i}"
GPT2 = GGUFArchitecture(
    name="gpt2", model_type="gpt2", hf_class="GPT2LMHeadModel",
    config={"context_length": "n_positions", "block_count": "n_layer", "embedding_length": "n_embd",
            "feed_forward_length": "n_inner", "attention.head_count": "n_head",
            "attention.layer_norm_epsilon": "layer_norm_epsilon"},
    tensors={"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head",
             "blk.{i}.attn_norm": f"{GPT2_LAYER}.ln_1", "blk.{i}.attn_qkv": f"{GPT2_LAYER}.attn.c_attn",
             "blk.{i}.attn_output": f"{GPT2_LAYER}.attn.c_proj", "blk.{i}.ffn_norm": f"{GPT2_LAYER}.ln_2",
             "blk.{i}.ffn_up": f"{GPT2_LAYER}.mlp.c_fc", "blk.{i}.ffn_down": f"{GPT2_LAYER}.mlp.c_proj"},
    transposed=("blk.{i}.attn_qkv", "blk.{i}.attn_output", "blk.{i}.ffn_up", "blk.{i}.ffn_down"),
    defaults={"activation_function": "gelu_new"},
)


def bloom_qkv(values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """BLOOM's fused QKV rows back to per-head order: the converter stored [3, H, D] (all q, all
    k, all v); BLOOM's query_key_value is [H, 3, D]."""
    heads = int(config["n_head"])
    per_head = values.reshape(3, heads, -1, *values.shape[1:])  # [3, H, D, (E)]
    return per_head.swapaxes(0, 1).reshape(values.shape)      # [H, 3, D, (E)]


# BLOOM: fused QKV regrouped by the converter; LayerNorm after the embeddings (token_embd_norm);
# the head written as a copy of the embeddings, kept as the head.
BLOOM_LAYER = "transformer.h.{i}"
BLOOM = GGUFArchitecture(
    name="bloom", model_type="bloom", hf_class="BloomForCausalLM",
    config={"context_length": "seq_length", "block_count": "n_layer", "embedding_length": "hidden_size",
            "attention.head_count": "n_head", "attention.layer_norm_epsilon": "layer_norm_epsilon"},
    tensors={"token_embd": "transformer.word_embeddings",
             "token_embd_norm": "transformer.word_embeddings_layernorm",
             "output_norm": "transformer.ln_f", "output": "lm_head",
             "blk.{i}.attn_norm": f"{BLOOM_LAYER}.input_layernorm",
             "blk.{i}.attn_qkv": f"{BLOOM_LAYER}.self_attention.query_key_value",
             "blk.{i}.attn_output": f"{BLOOM_LAYER}.self_attention.dense",
             "blk.{i}.ffn_norm": f"{BLOOM_LAYER}.post_attention_layernorm",
             "blk.{i}.ffn_up": f"{BLOOM_LAYER}.mlp.dense_h_to_4h",
             "blk.{i}.ffn_down": f"{BLOOM_LAYER}.mlp.dense_4h_to_h"},
    reshaped={"blk.{i}.attn_qkv": bloom_qkv},
)


def mpt_attention(config: dict[str, Any], names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """MPT's ``attn_config`` from attention.max_alibi_bias (0: no ALiBi) and
    attention.clamp_kqv, read into flat fields first."""
    bias = config.get("alibi_bias_max", 8.0)
    attn = {"alibi": bias > 0, "alibi_bias_max": bias, "clip_qkv": config.get("clip_qkv")}
    return {"attn_config": attn}


# MPT: names only (Wqkv is [q | k | v] on both sides); ALiBi's maximum bias in the metadata.
# feed_forward_length is not read: transformers' MPT always has a 4x MLP.
MPT_LAYER = "transformer.blocks.{i}"
MPT = GGUFArchitecture(
    name="mpt", model_type="mpt", hf_class="MptForCausalLM",
    config={"context_length": "max_seq_len", "block_count": "n_layers", "embedding_length": "d_model",
            "attention.head_count": "n_heads", "attention.layer_norm_epsilon": "layer_norm_epsilon",
            "attention.max_alibi_bias": "alibi_bias_max", "attention.clamp_kqv": "clip_qkv"},
    tensors={"token_embd": "transformer.wte", "output_norm": "transformer.norm_f", "output": "lm_head",
             "blk.{i}.attn_norm": f"{MPT_LAYER}.norm_1", "blk.{i}.attn_qkv": f"{MPT_LAYER}.attn.Wqkv",
             "blk.{i}.attn_output": f"{MPT_LAYER}.attn.out_proj", "blk.{i}.ffn_norm": f"{MPT_LAYER}.norm_2",
             "blk.{i}.ffn_up": f"{MPT_LAYER}.ffn.up_proj", "blk.{i}.ffn_down": f"{MPT_LAYER}.ffn.down_proj"},
    derived=mpt_attention,
)


def falcon_layout(config: dict[str, Any], names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Falcon's attention layout, which llama.cpp tells by the KV head count and the tensors: one
    KV head and one norm is Falcon 7B (multi-query, parallel); otherwise the new decoder
    architecture (GQA; a second norm attn_norm_2 in 40B / 180B). Biases where the file has them."""
    bias = "blk.0.attn_qkv.bias" in names
    if config.get("num_kv_heads", 1) == 1 and "blk.0.attn_norm_2.weight" not in names:
        return {"new_decoder_architecture": False, "multi_query": True, "parallel_attn": True,
                "num_kv_heads": 1, "bias": bias}
    return {"new_decoder_architecture": True, "bias": bias}


def falcon_qkv(values: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """The new decoder architecture's fused QKV rows back to Falcon's order: the converter
    stored [all q | all k | all v] ([H + 2 Hkv, D]); Falcon groups them per KV head,
    [Hkv, G + 2, D] = (G queries, key, value) per group. One KV head: the same order."""
    heads, kv = int(config["num_attention_heads"]), int(config.get("num_kv_heads", 1))
    if kv == 1:
        return values
    rest = values.shape[1:]
    rows = values.reshape(heads + 2 * kv, -1, *rest)                  # [H + 2 Hkv, D, (E)]
    q = rows[:heads].reshape(kv, heads // kv, *rows.shape[1:])        # [Hkv, G, D, (E)]
    k = rows[heads:heads + kv].reshape(kv, 1, *rows.shape[1:])        # [Hkv, 1, D, (E)]
    v = rows[heads + kv:].reshape(kv, 1, *rows.shape[1:])             # [Hkv, 1, D, (E)]
    return np.concatenate([q, k, v], axis=1).reshape(values.shape)   # [Hkv, G + 2, D, (E)]


FALCON_LAYER = "transformer.h.{i}"
FALCON = GGUFArchitecture(
    name="falcon", model_type="falcon", hf_class="FalconForCausalLM",
    config={"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
            "embedding_length": "hidden_size", "feed_forward_length": "ffn_hidden_size",
            "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_kv_heads",
            "attention.layer_norm_epsilon": "layer_norm_epsilon", "rope.freq_base": "rope_theta"},
    tensors={"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f",
             "output": "lm_head", "blk.{i}.attn_norm": f"{FALCON_LAYER}.input_layernorm",
             "blk.{i}.attn_qkv": f"{FALCON_LAYER}.self_attention.query_key_value",
             "blk.{i}.attn_output": f"{FALCON_LAYER}.self_attention.dense",
             "blk.{i}.ffn_up": f"{FALCON_LAYER}.mlp.dense_h_to_4h",
             "blk.{i}.ffn_down": f"{FALCON_LAYER}.mlp.dense_4h_to_h"},
    # Falcon 40B / 180B: gguf-py names ln_attn attn_norm_2 and ln_mlp attn_norm
    alternatives={"blk.0.attn_norm_2.weight": {"blk.{i}.attn_norm": f"{FALCON_LAYER}.ln_mlp",
                                               "blk.{i}.attn_norm_2": f"{FALCON_LAYER}.ln_attn"}},
    reshaped={"blk.{i}.attn_qkv": falcon_qkv},
    derived=falcon_layout,
)
