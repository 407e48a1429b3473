"""Tiny GGUF files written from tiny transformers models, the way llama.cpp's converter writes them.

Tensor names come from gguf-py's ``TensorNameMap`` (the table llama.cpp's converter uses), not
from tfport's mapping; the converter's arithmetic is written out here: Gemma's norm weights
stored as 1 + w, Gemma 1/2's head dropped (tied), no Q/K permutation (only LLaMA's converter
permutes). Metadata: the ``{arch}.*`` keys the converter writes for each family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..hf.cases import HFCase, build_hf

# transformers config fields -> (GGUFWriter method); only those the case's config sets.
METADATA = {
    "max_position_embeddings": "add_context_length", "num_hidden_layers": "add_block_count",
    "hidden_size": "add_embedding_length", "intermediate_size": "add_feed_forward_length",
    "num_attention_heads": "add_head_count", "num_key_value_heads": "add_head_count_kv",
    "rms_norm_eps": "add_layer_norm_rms_eps", "layer_norm_eps": "add_layer_norm_eps",
}


@dataclass(frozen=True)
class GGUFCase:
    """One tiny file: the GGUF architecture, its source transformers model, how it is stored."""

    name: str
    arch: str                       # general.architecture
    source: HFCase                  # the transformers model the file is written from
    weight_type: str = "F32"        # 2-D weights; F16 rounds the source model first (exact)
    # None: transformers' GGUF loader reads the file as the source model computes; else why not
    # (the file is then compared with the source model only).
    transformers_differs: str | None = None
    metadata: dict = field(default_factory=dict)  # extra "{arch}.<suffix>" -> value


@dataclass
class Written:
    path: Path
    hf: torch.nn.Module             # the source model (eval, float32)


def _rope(config) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("full_attention", params)


def write_from_hf(case: GGUFCase, directory: Path) -> Written:
    import gguf

    hf = build_hf(case.source)
    config = hf.config
    if case.weight_type == "F16":  # the file stores what the source model computes with
        with torch.no_grad():
            for p in hf.parameters():
                if p.ndim == 2:
                    p.copy_(p.half().float())
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == case.arch)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    path = directory / f"{case.name}.gguf"
    writer = gguf.GGUFWriter(str(path), case.arch)
    writer.add_name(case.name)
    for hf_field, method in METADATA.items():
        if getattr(config, hf_field, None) is not None:
            getattr(writer, method)(getattr(config, hf_field))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = _rope(config)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(config, "sliding_window", None) is not None:
        writer.add_sliding_window(config.sliding_window)
    for key, value in case.metadata.items():
        if isinstance(value, str):
            writer.add_string(f"{case.arch}.{key}", value)
        else:
            writer.add_float32(f"{case.arch}.{key}", value)
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    gemma = case.arch.startswith("gemma")
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        target = names.get_name(stem)
        assert target is not None, (case.arch, name)
        values = tensor.detach().float().numpy()
        if gemma and stem.endswith("norm"):
            values = values + np.float32(1.0)
        kind = case.weight_type if values.ndim == 2 else "F32"
        data = values.astype(np.float16) if kind == "F16" else values
        writer.add_tensor(f"{target}.{suffix}", data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Written(path, hf)
