"""How each position scheme enters an exported graph: one emitter per ``config.position`` value.

The exporter's counterpart of ``tfport.models.positions.POSITION_SCHEMES``: a table added to the
embeddings (sinusoidal, learned), a bias added to the attention scores (ALiBi, T5 relative), or
rotary tables (RoPE; how they are applied is the export target's choice, see ``targets``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from tfport.config import ModelConfig

from .graph import GraphBuilder, to_numpy


class PositionEmitter:
    """One scheme's graph pieces; every hook of this base adds nothing."""

    rotary = False  # queries and keys are rotated (the target emits how)

    def embedding(self, g: GraphBuilder, embed: nn.Module, position_ids: str, name: str) -> str | None:
        """Added to the token embeddings: [B, S, E] from position_ids int64 [B, S], or None."""
        return None

    def bias(self, g: GraphBuilder, stack: nn.Module, attention_mask: str, length: str, causal: bool,
             name: str) -> str | None:
        """Added to the attention bias: float32 [B, H, S, T] from the mask [B, T] and S [1]."""
        return None


class _Table(PositionEmitter):
    """A position table gathered by position and added to the token embeddings."""

    def __init__(self, table: Callable[[nn.Module], torch.Tensor]):
        self.table = table  # Embeddings -> its table [max_positions, E]

    def embedding(self, g, embed, position_ids, name):
        return g.op("Gather", g.weight(f"{name}.positions", to_numpy(self.table(embed))), position_ids,
                    name=f"{name}.positions")


class _Rotary(PositionEmitter):
    rotary = True


class _Alibi(PositionEmitter):
    def bias(self, g, stack, attention_mask, length, causal, name):
        slopes = g.weight(f"{name}.alibi_slopes", to_numpy(stack.alibi_slopes), "float32")
        return g.fn("AlibiBias", attention_mask, length, slopes, name=f"{name}.alibi")


class _Relative(PositionEmitter):
    def bias(self, g, stack, attention_mask, length, causal, name):
        """T5 relative bias; the bucket constants are computed here as PyTorch computes them."""
        config: ModelConfig = stack.config
        buckets = config.relative_buckets if causal else config.relative_buckets // 2
        max_exact = buckets // 2
        table = g.weight(f"{name}.relative_bias", to_numpy(stack.relative_bias.weight))
        return g.fn("RelativePositionBias", attention_mask, length, table, bidirectional=int(not causal),
                    num_buckets=buckets, max_exact=max_exact,
                    log_max_ratio=math.log(config.relative_max_distance / max_exact),
                    name=f"{name}.relative")


POSITION_EMITTERS: dict[str, PositionEmitter] = {
    "sinusoidal": _Table(lambda embed: embed.sinusoidal),
    "learned": _Table(lambda embed: embed.positions.weight), "rope": _Rotary(),
    "alibi": _Alibi(), "relative": _Relative(), "none": PositionEmitter(),
}
