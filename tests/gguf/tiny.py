"""Tiny GGUF files written with gguf-py's ``GGUFWriter``: a LLaMA-architecture model with random
weights in one ggml type, and a SentencePiece-style (``llama`` tokenizer model) vocabulary.

Row lengths (the dims each weight is quantised along, ``in_features``) are 256: a multiple of the
legacy blocks (32 values) and of the K-quant super-blocks (256). Q and K are written the way
llama.cpp's converter writes them: rows permuted per head by ``permute_rows`` below (written
here from llama.cpp's description, independently of tfport's ``unpermute_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

E, FF, H, HKV, LAYERS = 256, 256, 4, 2, 2  # head dim 64
D = E // H
# K-quant block layouts (ggml's block_qN_K): bytes per 256 values, and the offsets of the fp16
# super-block scales (d, then dmin where the type has one) with a magnitude keeping values ~0.1.
K_BLOCKS = {"Q2_K": (84, (80, 82), 2e-3), "Q3_K": (110, (108,), 6e-4),
            "Q4_K": (144, (0, 2), 1e-4), "Q5_K": (176, (0, 2), 5e-5), "Q6_K": (210, (208,), 2e-5)}


def random_super_blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row]: random K-quant blocks of a [rows, cols] tensor (gguf-py cannot
    quantise to the K-quants) with sane fp16 super-block scales; every byte pattern is a valid
    block of quants and sub-block scales."""
    size, scales, magnitude = K_BLOCKS[kind]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for offset in scales:
        half = (rng.uniform(0.5, 1.0, len(blocks)) * magnitude).astype(np.float16)
        blocks[:, offset:offset + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

# A SentencePiece-style vocabulary: unk, bos, eos, the 256 byte tokens, chat control tokens, a
# user-defined token, then pieces with decreasing scores (no merges in the file: they are
# implied by the scores).
PIECES = ["\u2581", "e", "t", "h", "a", "o", "n", "i", "s", "r", "l", "d", "1", "2", "3", "0",
          "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581in", "er", "on", "\u2581o", "an",
          "\u2581s", "re", "\u2581h", "\u2581he", "st", "\u2581an", "\u2581and", "at", "en",
          "ll", "\u2581th", "12", "\u25811", "es", "or", "is", "\u2581is", "it", "\u2581it", "\u2581\u2581",
          "\u2581\u2581\u2581", "nd", "ar", "al", "\u00e9", "\u2581caf\u00e9", "ca", "f", "c"]
CONTROL = ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
USER_DEFINED = ["<tool>"]
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER, TYPE_BYTE = 1, 2, 3, 4, 6


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + CONTROL + USER_DEFINED
    types = [TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL] + [TYPE_BYTE] * 256 + \
        [TYPE_CONTROL] * len(CONTROL) + [TYPE_USER] * len(USER_DEFINED)
    scores = [0.0] * len(tokens)
    tokens += PIECES
    types += [TYPE_NORMAL] * len(PIECES)
    scores += [-float(i) for i in range(len(PIECES))]
    return tokens, scores, types


def permute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order: within each head, row j of the first half and row j of the
    second half become neighbours (2j, 2j + 1)."""
    rows = weight.shape[0]
    head = rows // n_heads
    out = np.empty_like(weight)
    for h in range(n_heads):
        for j in range(head // 2):
            out[h * head + 2 * j] = weight[h * head + j]
            out[h * head + 2 * j + 1] = weight[h * head + head // 2 + j]
    return out


@dataclass
class TinyGGUF:
    path: Path
    weights: dict[str, np.ndarray]  # Hugging Face name -> float32 values before quantisation
    stored: dict[str, tuple[str, np.ndarray]]  # GGUF name -> (ggml type, stored array)


def hf_weights(vocab: int, seed: int, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, E, scale=0.5),
           "model.norm.weight": 1 + w(E, scale=0.1)}
    if not tied:
        out["lm_head.weight"] = w(vocab, E)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": 1 + w(E, scale=0.1),
            p + "post_attention_layernorm.weight": 1 + w(E, scale=0.1),
            p + "self_attn.q_proj.weight": w(H * D, E), p + "self_attn.k_proj.weight": w(HKV * D, E),
            p + "self_attn.v_proj.weight": w(HKV * D, E), p + "self_attn.o_proj.weight": w(E, H * D),
            p + "mlp.gate_proj.weight": w(FF, E), p + "mlp.up_proj.weight": w(FF, E),
            p + "mlp.down_proj.weight": w(E, FF)})
    return out


GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face LLaMA tensor name (written out for the test)."""
    stem = hf_name.rsplit(".", 1)[0]
    if stem in GGUF_NAMES:
        return GGUF_NAMES[stem] + ".weight"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}.weight"


def write_tiny_llama(path: Path, encode, weight_type: str, *, seed: int = 0, tied: bool = False,
                     architecture: str = "llama", extra_tensors: dict | None = None,
                     tensor_types: dict[str, str] | None = None, extra_metadata: dict | None = None) -> TinyGGUF:
    """Write a tiny LLaMA GGUF; ``encode(values float32 [R, C], type) -> stored array`` stores
    every 2-D weight (norms stay F32, as llama.cpp keeps them) as ``weight_type``, or as
    ``tensor_types[part]`` for a tensor whose GGUF name contains ``part`` (e.g. {"attn_v": "Q6_K"}, as
    llama.cpp's Q4_K_M mixes types)."""
    import gguf

    tokens, scores, types = sentencepiece_vocab()
    weights = hf_weights(len(tokens), seed, tied)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(E)
    writer.add_feed_forward_length(FF)
    writer.add_head_count(H)
    writer.add_head_count_kv(HKV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(D)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_metadata or {}).items():  # bool / int / float / str values
        add = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}
        add[type(value)](key, value)
    stored = {}
    for name, values in weights.items():
        target = gguf_name(name)
        if "q_proj" in name:
            values = permute_rows(values, H)
        elif "k_proj" in name:
            values = permute_rows(values, HKV)
        kind = next((k for part, k in (tensor_types or {}).items() if part in target), weight_type)
        kind = kind if values.ndim == 2 else "F32"
        data = encode(values, kind)
        stored[target] = (kind, data)
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    for target, (kind, data) in (extra_tensors or {}).items():
        writer.add_tensor(target, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, weights, stored)
