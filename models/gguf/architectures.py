"""GGUF architectures tfport imports: GGUF metadata -> a Hugging Face ``config.json`` dict, and
GGUF tensor names -> Hugging Face tensor names.

Each architecture is one ``GGUFArchitecture`` entry in ``ARCHITECTURES``, keyed by the file's
``general.architecture``. The Hugging Face importer (``tfport.models.hf``) then maps the HF names
onto tfport's modules and checks every key and shape, so an entry only has to say how llama.cpp
renamed things:

* ``config``: ``{arch}.<suffix>`` metadata -> HF config field;
* ``tensors``: GGUF name prefix -> HF name prefix (``{i}`` is the layer index; the ``.weight`` /
  ``.bias`` suffix is carried over);
* ``permuted``: the GGUF prefixes whose rows llama.cpp permuted for its RoPE layout, with the
  config field that holds their head count (the Q rows use the query heads, K the KV heads).

llama.cpp's converter stores Q and K rows of each head as interleaved (even, odd) pairs, the
layout of its rotary kernel; Hugging Face LLaMA rotates the first half of the head against the
second. ``unpermute_rows`` undoes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

# GGUF architectures transformers reads that tfport's Hugging Face importer cannot map yet; an
# entry in ARCHITECTURES (and support in tfport.models.hf) lifts the refusal.
NOT_YET_SUPPORTED = ("qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3",
                     "gemma3n", "phi2", "phi3", "starcoder2", "stablelm", "falcon", "gpt2", "bloom",
                     "mamba", "nemotron", "t5", "t5encoder", "deci", "cohere", "command-r")


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF architecture maps onto a Hugging Face ``model_type`` (see the module doc)."""

    name: str                      # general.architecture
    model_type: str                # the HF config's model_type
    hf_class: str                  # the HF config's architectures[0]
    config: dict[str, str]         # "{arch}.<suffix>" metadata suffix -> HF config field
    tensors: dict[str, str]        # GGUF name prefix -> HF name prefix ({i}: layer)
    permuted: dict[str, str] = field(default_factory=dict)  # GGUF prefix -> head-count field
    defaults: dict[str, object] = field(default_factory=dict)  # HF fields GGUF does not store
    refused: dict[str, str] = field(default_factory=dict)  # metadata suffix -> why it is refused

    def hf_name(self, gguf_name: str) -> tuple[str, str | None] | None:
        """``(HF tensor name, permuting head-count field or None)``, or None if unmapped."""
        for prefix, target in self.tensors.items():
            pattern = re.escape(prefix).replace(r"\{i\}", r"(?P<i>\d+)") + r"\.(?P<suffix>weight|bias)"
            match = re.fullmatch(pattern, gguf_name)
            if match:
                groups = match.groupdict()
                name = target.format(i=groups.get("i")) + "." + groups["suffix"]
                return name, self.permuted.get(prefix)
        return None


LLAMA = GGUFArchitecture(
    name="llama",
    model_type="llama",
    hf_class="LlamaForCausalLM",
    config={
        "context_length": "max_position_embeddings",
        "block_count": "num_hidden_layers",
        "feed_forward_length": "intermediate_size",
        "embedding_length": "hidden_size",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.key_length": "head_dim",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta",
        "vocab_size": "vocab_size",
    },
    tensors={
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
        "blk.{i}.attn_norm": "model.layers.{i}.input_layernorm",
        "blk.{i}.attn_q": "model.layers.{i}.self_attn.q_proj",
        "blk.{i}.attn_k": "model.layers.{i}.self_attn.k_proj",
        "blk.{i}.attn_v": "model.layers.{i}.self_attn.v_proj",
        "blk.{i}.attn_output": "model.layers.{i}.self_attn.o_proj",
        "blk.{i}.ffn_norm": "model.layers.{i}.post_attention_layernorm",
        "blk.{i}.ffn_gate": "model.layers.{i}.mlp.gate_proj",
        "blk.{i}.ffn_up": "model.layers.{i}.mlp.up_proj",
        "blk.{i}.ffn_down": "model.layers.{i}.mlp.down_proj",
    },
    permuted={"blk.{i}.attn_q": "num_attention_heads", "blk.{i}.attn_k": "num_key_value_heads"},
    defaults={"hidden_act": "silu"},
    refused={"expert_count": "mixture-of-experts layers (Mixtral-style) have no tfport module"},
)

ARCHITECTURES: dict[str, GGUFArchitecture] = {arch.name: arch for arch in (LLAMA,)}


def architecture(name: str, origin: str) -> GGUFArchitecture:
    """The entry for ``general.architecture`` = ``name``; a clear error otherwise."""
    if name in ARCHITECTURES:
        return ARCHITECTURES[name]
    if name in NOT_YET_SUPPORTED:
        raise ValueError(f"{origin}: GGUF architecture {name!r} is not supported yet (tfport's "
                         f"Hugging Face importer does not map it); supported: {sorted(ARCHITECTURES)}")
    raise ValueError(f"{origin}: unknown GGUF architecture {name!r}; tfport imports "
                     f"{sorted(ARCHITECTURES)}")


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's RoPE row order of a Q or K weight [H*D, E] (or bias [H*D]).

    Within each head llama.cpp stores rows as (0, D/2), (1, D/2 + 1), ... pairs: viewed as
    [H, D/2, 2, ...] its row (h, j, p) is Hugging Face's row (h, p, j). Swapping those two axes
    back gives [H, 2, D/2, ...], i.e. the first half of the head, then the second.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows over {n_heads} heads: each head needs an "
                         "even number of rows")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
