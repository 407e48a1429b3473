"""Random-weight checkpoints with the exact shapes of the models people deploy (Llama-3.2-1B and
3B, Llama-3.1-8B, Qwen2.5-7B), written tensor by tensor so that writing an 8B file holds one
tensor in memory: a GGUF file in Q4_0, Q8_0 or F16 (quantised blocks written from random bytes with
sane fp16 scales), or a Hugging Face directory with bf16 safetensors.

Real weights of these sizes cannot be downloaded here; what an export, a load or a decode costs
depends on the shapes and the storage type only, so these files measure it. Correctness is
checked on small models (the test suite).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tfport.files import atomic_directory, atomic_file


@dataclass(frozen=True)
class Shape:
    """A decoder's shape as its Hugging Face config gives it."""

    name: str
    arch: str  # GGUF general.architecture / HF model_type
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    rope_theta: float = 500000.0
    context: int = 131072
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        """Parameter count (norms included)."""
        e, kv = self.hidden, self.kv_heads * self.head_dim
        layer = e * e * 2 + e * kv * 2 + 3 * e * self.ffn + 2 * e + (e + 2 * kv) * self.qkv_bias
        return self.layers * layer + self.vocab * e * (1 if self.tied else 2) + e


SHAPES = {shape.name: shape for shape in (
    Shape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, 128256, tied=True),
    Shape("llama-3.2-3b", "llama", 3072, 28, 24, 8, 8192, 128256, tied=True),
    Shape("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, 128256, tied=False),
    Shape("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 152064, tied=False, qkv_bias=True,
          rope_theta=1000000.0, context=32768, norm_eps=1e-6),
    # small enough for the test suite and a quick try of the command
    Shape("test-tiny", "llama", 128, 2, 4, 2, 256, 4096, tied=True),
    Shape("test-100m", "llama", 512, 24, 8, 2, 1536, 32000, tied=False),
)}
FORMATS = ("Q4_0", "Q8_0", "F16", "bf16-safetensors")
# ggml block types: bytes per block of 32 values; where the fp16 scale sits; its magnitude
BLOCKS = {"Q4_0": (18, 0.002), "Q8_0": (34, 0.0002)}


def _tensors(shape: Shape) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, HF name, numpy-order shape [out, in]) of every tensor, in llama.cpp's order."""
    e, kv, f = shape.hidden, shape.kv_heads * shape.head_dim, shape.ffn
    yield "token_embd.weight", "model.embed_tokens.weight", (shape.vocab, e)
    for i in range(shape.layers):
        blk, hf = f"blk.{i}", f"model.layers.{i}"
        yield f"{blk}.attn_norm.weight", f"{hf}.input_layernorm.weight", (e,)
        yield f"{blk}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (e, e)
        yield f"{blk}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv, e)
        yield f"{blk}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv, e)
        if shape.qkv_bias:
            yield f"{blk}.attn_q.bias", f"{hf}.self_attn.q_proj.bias", (e,)
            yield f"{blk}.attn_k.bias", f"{hf}.self_attn.k_proj.bias", (kv,)
            yield f"{blk}.attn_v.bias", f"{hf}.self_attn.v_proj.bias", (kv,)
        yield f"{blk}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (e, e)
        yield f"{blk}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (e,)
        yield f"{blk}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (f, e)
        yield f"{blk}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (f, e)
        yield f"{blk}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (e, f)
    yield "output_norm.weight", "model.norm.weight", (e,)
    if not shape.tied:
        yield "output.weight", "lm_head.weight", (shape.vocab, e)


def _values(dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random float32 values: norms near 1, biases and matrices small (activations stay sane)."""
    if len(dims) == 1:
        return (1.0 + 0.05 * rng.standard_normal(dims)).astype(np.float32)
    return (rng.standard_normal(dims, dtype=np.float32) * (0.5 / np.sqrt(dims[1]))).astype(np.float32)


def _blocks(kind: str, dims: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row]: random ggml blocks of ``kind`` with sane fp16 scales."""
    size, magnitude = BLOCKS[kind]
    rows, cols = dims
    blocks = rng.integers(0, 256, size=(rows * cols // 32, size), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.0, len(blocks)) * magnitude).astype(np.float16)
    blocks[:, 0:2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _tokens(vocab: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of ``vocab`` entries (256 byte tokens, one merged pair, then
    filler pieces), its token types and its one merge: enough for llama.cpp and tfport to load
    it; prompts are token ids."""
    from tfport.models.gguf.tokenizer import byte_alphabet

    byte_tokens = list(byte_alphabet().values())
    merged = byte_tokens[0] + byte_tokens[1]
    tokens = byte_tokens + [merged] + [f"<|piece_{i}|>" for i in range(vocab - len(byte_tokens) - 1)]
    return tokens, [1] * vocab, [f"{byte_tokens[0]} {byte_tokens[1]}"]


def write_gguf(shape: Shape, kind: str, path: str | Path, seed: int = 0) -> Path:
    """A GGUF file of ``shape`` with every matrix stored as ``kind`` (Q4_0, Q8_0 or F16; norms and
    biases F32), written atomically one tensor at a time."""
    import gguf

    if kind not in ("Q4_0", "Q8_0", "F16"):
        raise ValueError(f"kind={kind!r}: expected one of Q4_0, Q8_0, F16")
    rng = np.random.default_rng(seed)
    path = Path(path)
    with atomic_file(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), shape.arch)
        writer.add_name(f"{shape.name} (random weights)")
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.ffn)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.norm_eps)
        writer.add_vocab_size(shape.vocab)
        writer.add_file_type({"Q4_0": 2, "Q8_0": 7, "F16": 1}[kind])
        tokens, types, merges = _tokens(shape.vocab)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(shape.vocab - 2)
        writer.add_eos_token_id(shape.vocab - 1)
        planned = []
        for name, _, dims in _tensors(shape):
            if len(dims) == 1:
                planned.append((name, dims, None))
                writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
            elif kind == "F16":
                planned.append((name, dims, "F16"))
                writer.add_tensor_info(name, dims, np.dtype(np.float16), 2 * dims[0] * dims[1])
            else:
                nbytes = dims[0] * dims[1] // 32 * BLOCKS[kind][0]
                planned.append((name, dims, kind))
                writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType[kind])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, dims, stored in planned:
            if stored is None:
                writer.write_tensor_data(_values(dims, rng))
            elif stored == "F16":
                writer.write_tensor_data(_values(dims, rng).astype(np.float16))
            else:
                writer.write_tensor_data(_blocks(stored, dims, rng))
        writer.close()
    return path


def hf_config(shape: Shape) -> dict:
    """The Hugging Face ``config.json`` of ``shape``."""
    config = {"model_type": shape.arch, "architectures": ["LlamaForCausalLM" if shape.arch == "llama" else "Qwen2ForCausalLM"],
              "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
              "intermediate_size": shape.ffn, "vocab_size": shape.vocab, "tie_word_embeddings": shape.tied,
              "rope_theta": shape.rope_theta, "max_position_embeddings": shape.context,
              "rms_norm_eps": shape.norm_eps, "hidden_act": "silu", "torch_dtype": "bfloat16",
              "bos_token_id": shape.vocab - 2, "eos_token_id": shape.vocab - 1}
    if shape.arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, head_dim=shape.head_dim)
    return config


def write_safetensors(shape: Shape, directory: str | Path, seed: int = 0) -> Path:
    """A Hugging Face directory of ``shape``: ``config.json`` and bf16 ``model.safetensors``,
    written atomically one tensor at a time (the header first, from the shapes)."""
    rng = np.random.default_rng(seed)
    entries, offset = {}, 0
    tensors = list(_tensors(shape))
    for _, hf_name, dims in tensors:
        nbytes = 2 * int(np.prod(dims))
        entries[hf_name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with atomic_directory(Path(directory)) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config(shape), indent=1) + "\n")
        with (tmp / "model.safetensors").open("wb") as handle:
            handle.write(struct.pack("<Q", len(header)))
            handle.write(header)
            for _, _, dims in tensors:
                bits = _values(dims, rng).view(np.uint32)
                bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
                handle.write(bf16.tobytes())
    return Path(directory)
