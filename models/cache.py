"""The reference KV cache: one (key, value) pair per layer, each [B, Hkv, T, D]."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    """Per-layer keys and values; ``layers[i] = (key, value)``, each [B, Hkv, T, D]."""

    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Cached sequence length T (0 when empty)."""
        return self.layers[0][0].shape[2] if self.layers else 0

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.layers[index] if index < len(self.layers) else None
