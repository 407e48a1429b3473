"""Import a GGUF checkpoint: its metadata as a Hugging Face config dict, its tensors under Hugging
Face names (dequantised to float32, Q/K rows un-permuted), then the strict Hugging Face importer.

    checkpoint = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    checkpoint.model            # tfport reference module (eval mode)
    checkpoint.tokenizer_json   # tokenizer.json text built from the GGUF vocabulary
    checkpoint.chat_template    # tokenizer.chat_template, or None
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .architectures import GGUFArchitecture, architecture, unpermute_rows
from .reader import GGUFFile, Shape

log = logging.getLogger(__name__)

# tokenizer.ggml.<key> -> HF config field
TOKEN_IDS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
             "padding_token_id": "pad_token_id"}
ROPE_SCALING_NONE = ("none", None)


def _scalar(file: GGUFFile, key: str, value: Any) -> Any:
    if isinstance(value, list):  # e.g. a per-layer head count
        if len(set(value)) != 1:
            raise ValueError(f"{file.path.name}: {key}={value} differs between layers; tfport's "
                             "config holds one value for all layers")
        value = value[0]
    return value


def hf_config(file: GGUFFile, arch: GGUFArchitecture) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict that ``file``'s metadata describes."""
    md, prefix = file.metadata, arch.name + "."
    for suffix, why in arch.refused.items():
        if md.get(prefix + suffix):
            raise ValueError(f"{file.path.name}: {prefix}{suffix}={md[prefix + suffix]!r} is not "
                             f"supported: {why}")
    if md.get(prefix + "attention.causal", True) is not True:  # llama.cpp's flag of bidirectional embedders
        raise ValueError(f"{file.path.name}: {prefix}attention.causal={md[prefix + 'attention.causal']!r} is "
                         "not supported: tfport's decoders attend causally")
    config: dict[str, Any] = {"model_type": arch.model_type, "architectures": [arch.hf_class],
                              **arch.defaults}
    for suffix, name in arch.config.items():
        if prefix + suffix in md:
            config[name] = _scalar(file, prefix + suffix, md[prefix + suffix])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in md:
        config["vocab_size"] = len(md["tokenizer.ggml.tokens"])
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    rotary = md.get(prefix + "rope.dimension_count")
    if rotary is not None and heads and hidden:
        head_dim = config.get("head_dim", hidden // heads)
        if rotary != head_dim:  # the HF importer refuses partial rotary with the reason
            config["partial_rotary_factor"] = rotary / head_dim
    kind = md.get(prefix + "rope.scaling.type")
    if kind not in ROPE_SCALING_NONE:
        config["rope_scaling"] = {"rope_type": kind, "factor": md.get(prefix + "rope.scaling.factor")}
    names = set(file.tensor_names())
    config["tie_word_embeddings"] = "output.weight" not in names
    config["attention_bias"] = "blk.0.attn_q.bias" in names
    config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    for key, name in TOKEN_IDS.items():
        if f"tokenizer.ggml.{key}" in md:
            config[name] = md[f"tokenizer.ggml.{key}"]
    if arch.derived is not None:
        for name, value in arch.derived(config, frozenset(names)).items():
            config.setdefault(name, value)
    return config


class GGUFTensors:
    """The tensors of a GGUF file under Hugging Face names, as the HF importer reads them:
    ``keys()``, ``in``, ``shape(name)``, ``get(name)`` (float32 torch tensor), ``where(name)``."""

    def __init__(self, file: GGUFFile, arch: GGUFArchitecture, config: dict[str, Any]):
        self.file = file
        # HF name -> (GGUF name, heads to un-permute over or None, constant to subtract)
        self._source: dict[str, tuple[str, int | None, float]] = {}
        unmapped = []
        for name in file.tensor_names():
            mapped = arch.hf_name(name)
            if mapped is None:
                unmapped.append(f"{name} {list(file.shape(name))}")
                continue
            hf_name, prefix = mapped
            heads_field, heads = arch.permuted.get(prefix), None
            if heads_field is not None:
                if heads_field not in config:
                    raise ValueError(f"{file.path.name}: {name} needs {heads_field} to un-permute "
                                     "its rows, and the metadata does not give it")
                heads = int(config[heads_field])
            self._source[hf_name] = (name, heads, arch.added.get(prefix, 0.0))
        if unmapped:
            raise ValueError(f"{file.path.name}: tensor(s) {unmapped[:12]} have no counterpart in "
                             f"tfport's {arch.name!r} mapping (known: {sorted(arch.tensors)})")

    def keys(self) -> frozenset[str]:
        return frozenset(self._source)

    def __contains__(self, name: str) -> bool:
        return name in self._source

    def where(self, name: str) -> str:
        gguf_name = self._source[name][0]
        return f"{self.file.path.name}: {gguf_name} ({self.file.tensor_type(gguf_name)})"

    def shape(self, name: str) -> Shape:
        return self.file.shape(self._source[name][0])

    def get(self, name: str) -> torch.Tensor:
        gguf_name, heads, added = self._source[name]
        values = self.file.dequantize(gguf_name)
        if heads is not None:
            values = unpermute_rows(values, heads)
        if added:
            values = values - np.float32(added)
        return torch.from_numpy(values)


@dataclass
class GGUFCheckpoint:
    """What a GGUF file holds, imported: the module, tokenizer.json text, chat template."""

    model: nn.Module
    tokenizer_json: str | None
    chat_template: str | None
    hf_config: dict[str, Any]


def read_gguf(path: str | os.PathLike) -> tuple[GGUFFile, GGUFArchitecture, dict[str, Any], GGUFTensors]:
    """Open ``path`` and check it: architecture, tensor types, names -> (file, entry, HF config,
    tensor source)."""
    file = GGUFFile(path)
    arch = architecture(file.architecture, file.path.name)
    file.check_types()
    config = hf_config(file, arch)
    return file, arch, config, GGUFTensors(file, arch, config)


def load_gguf(path: str | os.PathLike, tokenizer: bool = True) -> GGUFCheckpoint:
    """Import the GGUF checkpoint at ``path`` (see the module doc). Raises ``ValueError`` naming
    the architecture, tensor type or tensor that tfport cannot import."""
    from tfport.models.hf import load_from_tensors

    file, arch, config, tensors = read_gguf(path)
    model = load_from_tensors(config, tensors, str(file.path))
    text = None
    if tokenizer and "tokenizer.ggml.model" in file.metadata:
        from .tokenizer import tokenizer_json
        text = tokenizer_json(file.metadata, file.path.name)
    log.info("imported GGUF %s (%s, %d tensors)", file.path.name, arch.name, len(tensors.keys()))
    return GGUFCheckpoint(model, text, file.metadata.get("tokenizer.chat_template"), config)
