"""How each position scheme enters an exported graph: one emitter per ``config.position`` value.

The exporter's counterpart of ``tfport.models.positions.POSITION_SCHEMES``: a table added to the
embeddings (sinusoidal, learned), a bias added to the attention scores (ALiBi, T5 relative),
rotary tables (RoPE; how they are applied is the export target's choice, see ``targets``), or a
bias each layer computes from its queries and keys (DeBERTa's disentangled attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tfport.config import ModelConfig
from tfport.models.disentangled import relative_projections
from tfport.models.lazy import materialized, read_weight

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

    def content_bias(self, g: GraphBuilder, stack: nn.Module, attention_mask: str, length: str,
                     name: str) -> "DisentangledGraphBias | None":
        """The stack's values of a bias that depends on each layer's queries and keys, as an
        object whose ``bias(g, attn, q, k, name)`` emits it (float32 [B, H, S, T]), or None."""
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
        buckets = config.relative.buckets if causal else config.relative.buckets // 2
        max_exact = buckets // 2
        table = g.weight(f"{name}.relative_bias", to_numpy(stack.relative_bias.weight))
        return g.fn("RelativePositionBias", attention_mask, length, table, bidirectional=int(not causal),
                    num_buckets=buckets, max_exact=max_exact,
                    log_max_ratio=math.log(config.relative.max_distance / max_exact),
                    name=f"{name}.relative")


@dataclass
class DisentangledGraphBias:
    """DeBERTa's disentangled terms in a graph: the stack's row index [S, T] (a graph value), its
    normalised relative embeddings [2R, E] (computed once at export by the reference's norm) and
    the configured terms; ``bias`` emits one layer's (``ai.tfport.DisentangledBias``)."""

    index: str
    relative: torch.Tensor
    terms: tuple[str, ...]

    def bias(self, g: GraphBuilder, attn: nn.Module, q: str, k: str, name: str) -> str:
        """float32 [B, H, S, T] for q [B, H, S, D] and k [B, H, T, D] of ``attn`` (an Attention).
        Qr and Kr [H, 2R, D] are stored: the layer's q/k rows applied to the relative embeddings,
        with the dequantised rows under quantisation (the values the graph's products use)."""
        weight = torch.from_numpy(read_weight(attn.qkv.weight))
        if g.quantizer is not None:
            rows = g.quantizer.scheme.quantize(weight.numpy(), g.dtype).dequantize()
            weight = torch.from_numpy(rows.astype("float32"))
        bias = None if attn.qkv.bias is None else torch.from_numpy(read_weight(attn.qkv.bias))
        with torch.no_grad():
            pos_query, pos_key = relative_projections(self.relative, weight, bias, attn.n_heads, attn.head_dim)
        if "p2c" in self.terms:
            pos_query = g.weight(f"{name}.pos_query", to_numpy(pos_query))  # [H, 2R, D]
        if "c2p" in self.terms:
            pos_key = g.weight(f"{name}.pos_key", to_numpy(pos_key))
        if set(self.terms) == {"c2p", "p2c"}:
            return g.fn("DisentangledBias", q, k, pos_query, pos_key, self.index, scale=float(attn.scale),
                        name=name)
        scale = g.const(float(attn.scale), "float32", f"{name}.scale")
        if self.terms == ("c2p",):
            term = g.fn("DisentangledScores", q, pos_key, self.index, name=f"{name}.c2p")
        else:  # p2c alone: key_t . Qr[index[s, t]], gathered over [T, S] and transposed
            flipped = g.op("Transpose", self.index, perm=[1, 0], name=f"{name}.index_t")
            term = g.op("Transpose", g.fn("DisentangledScores", k, pos_query, flipped, name=f"{name}.p2c"),
                        perm=[0, 1, 3, 2], name=f"{name}.p2c_t")
        return g.op("Mul", term, scale, name=name)


class _Disentangled(PositionEmitter):
    def content_bias(self, g, stack, attention_mask, length, name):
        table = g.weight(f"{name}.relative_index", stack.relative_index.numpy(), "int64")  # [2M + 1]
        index = g.fn("DisentangledIndex", attention_mask, length, table, name=f"{name}.disentangled_index")
        with torch.no_grad(), materialized(stack.relative_norm):  # a lazy module's norm weights, read now
            relative = stack.relative_norm(torch.from_numpy(read_weight(stack.relative_embeddings.weight)))  # [2R, E]
        return DisentangledGraphBias(index, relative, stack.config.disentangled.effective_terms)


POSITION_EMITTERS: dict[str, PositionEmitter] = {
    "sinusoidal": _Table(lambda embed: embed.sinusoidal),
    "learned": _Table(lambda embed: embed.positions.weight), "rope": _Rotary(),
    "alibi": _Alibi(), "relative": _Relative(), "disentangled": _Disentangled(), "none": PositionEmitter(),
}
