"""One GGUF architecture's mapping onto a Hugging Face ``model_type``: the entry type of
``architectures.ARCHITECTURES`` (its fields are described in that module's doc)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one GGUF architecture maps onto a Hugging Face ``model_type`` (see the module doc)."""

    name: str                      # general.architecture
    model_type: str                # the HF config's model_type
    hf_class: str                  # the HF config's architectures[0]
    config: dict[str, str]         # "{arch}.<suffix>" metadata suffix -> HF config field
    tensors: dict[str, str]        # GGUF name prefix -> HF name prefix ({i}: layer)
    permuted: dict[str, str] = field(default_factory=dict)  # GGUF prefix -> head-count field
    added: dict[str, float] = field(default_factory=dict)  # GGUF prefix -> constant added
    defaults: dict[str, object] = field(default_factory=dict)  # HF fields GGUF does not store
    # (HF config read so far, GGUF tensor names) -> HF fields llama.cpp infers rather than stores
    derived: Callable[[dict[str, Any], frozenset[str]], dict[str, Any]] | None = None
    refused: dict[str, str] = field(default_factory=dict)  # metadata suffix -> why it is refused
    # GGUF prefix -> (values as stored, HF config) -> values in the HF layout (same shape)
    reshaped: dict[str, Callable[[np.ndarray, dict[str, Any]], np.ndarray]] = field(default_factory=dict)
    transposed: tuple[str, ...] = ()  # GGUF prefixes stored as the transpose of the HF tensor
    # GGUF tensor name whose presence switches the mapping -> the ``tensors`` entries it replaces
    alternatives: dict[str, dict[str, str]] = field(default_factory=dict)
    row_vectors: tuple[str, ...] = ()  # GGUF prefixes of HF [1, E] weights a file may store as [E]

    def tensor_map(self, names: frozenset[str]) -> dict[str, str]:
        """``tensors`` for a file holding the tensors ``names`` (see ``alternatives``)."""
        mapping = dict(self.tensors)
        for marker, replaced in self.alternatives.items():
            if marker in names:
                mapping.update(replaced)
        return mapping

    def hf_name(self, gguf_name: str, names: frozenset[str] = frozenset()) -> tuple[str, str] | None:
        """``(HF tensor name, the matching GGUF prefix)`` in a file holding ``names``, or None if
        unmapped. A stack of experts keeps ``{e}`` in the HF name, for the loader to fill in."""
        for prefix, target in self.tensor_map(names).items():
            pattern = re.escape(prefix).replace(r"\{i\}", r"(?P<i>\d+)") + r"\.(?P<suffix>weight|bias)"
            match = re.fullmatch(pattern, gguf_name)
            if match:
                groups = match.groupdict()
                return target.format(i=groups.get("i"), e="{e}") + "." + groups["suffix"], prefix
        return None
