"""Target "onnx23": the ``ai.tfport`` rotary and attention functions with bodies on ONNX's own
opset-23 ``RotaryEmbedding`` and ``Attention`` operators (same graph I/O as portable; opset 23)."""

from __future__ import annotations

import torch
from onnxscript import script
from onnxscript import opset23 as op23

from tfport.config import ModelConfig
from tfport.models.positions import rope_cos_sin

from ..functions import tfport
from ..graph import GraphBuilder, to_numpy
from .base import PortableTarget

ONNX23_MASK_FLOOR = -32752.0  # half of float16's lowest: finite in every dtype once added to scores


@script(tfport, default_opset=op23)
def RotaryEmbedding23(x, position_ids, cos_cache, sin_cache):
    """Body of ``RotaryEmbedding``: ONNX RotaryEmbedding (opset 23), rotate-half.

    x [B, N, S, D]; position_ids int64 [B, S]; cos_cache, sin_cache [max_positions, D/2] =
    cos/sin(position * inv_freq), built at export exactly as the reference computes them.
    """
    return op23.RotaryEmbedding(x, cos_cache, sin_cache, position_ids, interleaved=0)


@script(tfport, default_opset=op23)
def InterleavedRotaryEmbedding23(x, position_ids, cos_cache, sin_cache):
    """Body of ``InterleavedRotaryEmbedding``: ONNX RotaryEmbedding (opset 23), interleaved."""
    return op23.RotaryEmbedding(x, cos_cache, sin_cache, position_ids, interleaved=1)


@script(tfport, default_opset=op23)
def ScaledDotProductAttention23(query, key, value, bias, scale: float):
    """Body of ``ScaledDotProductAttention``: ONNX Attention (opset 23).

    The additive bias (masks, ALiBi, relative) is clamped at ONNX23_MASK_FLOOR and cast to the
    query dtype (the operator takes a mask of that dtype): masked keys still get zero weight, and a
    fully masked (padding) row stays finite. -> [B, S, H*D].
    """
    mask = op23.CastLike(op23.Max(bias, op23.Constant(value_float=ONNX23_MASK_FLOOR)), query)
    out = op23.Attention(query, key, value, mask, scale=scale)  # [B, H, S, D]
    return op23.Reshape(op23.Transpose(out, perm=[0, 2, 1, 3]), op23.Constant(value_ints=[0, 0, -1]))


@script(tfport, default_opset=op23)
def GroupQueryAttention23(query, key, value, past_key, past_value, bias, scale: float):
    """Body of ``GroupQueryAttention``: ONNX Attention (opset 23) with its KV cache inputs and
    outputs (past followed by the new keys/values); mask as in ScaledDotProductAttention23."""
    mask = op23.CastLike(op23.Max(bias, op23.Constant(value_float=ONNX23_MASK_FLOOR)), query)
    out, present_key, present_value = op23.Attention(query, key, value, mask, past_key, past_value,
                                                     scale=scale)
    output = op23.Reshape(op23.Transpose(out, perm=[0, 2, 1, 3]), op23.Constant(value_ints=[0, 0, -1]))
    return output, present_key, present_value


@script(tfport, default_opset=op23)
def SoftcapScaledDotProductAttention23(query, key, value, bias, scale: float, softcap: float):
    """Body of ``SoftcapScaledDotProductAttention``: ONNX Attention (opset 23) with its
    ``softcap`` (applied to the scaled scores before the mask, as the reference does)."""
    mask = op23.CastLike(op23.Max(bias, op23.Constant(value_float=ONNX23_MASK_FLOOR)), query)
    out = op23.Attention(query, key, value, mask, scale=scale, softcap=softcap)  # [B, H, S, D]
    return op23.Reshape(op23.Transpose(out, perm=[0, 2, 1, 3]), op23.Constant(value_ints=[0, 0, -1]))


@script(tfport, default_opset=op23)
def SoftcapGroupQueryAttention23(query, key, value, past_key, past_value, bias, scale: float, softcap: float):
    """Body of ``SoftcapGroupQueryAttention``: as GroupQueryAttention23 with ``softcap``."""
    mask = op23.CastLike(op23.Max(bias, op23.Constant(value_float=ONNX23_MASK_FLOOR)), query)
    out, present_key, present_value = op23.Attention(query, key, value, mask, past_key, past_value,
                                                     scale=scale, softcap=softcap)
    output = op23.Reshape(op23.Transpose(out, perm=[0, 2, 1, 3]), op23.Constant(value_ints=[0, 0, -1]))
    return output, present_key, present_value


def rope_tables(inv_freq: torch.Tensor, n_positions: int, factor: float = 1.0) -> tuple:
    """cos and sin float32 [n_positions, D/2] exactly as the reference computes them per position
    (times the longrope attention ``factor``)."""
    cos, sin = rope_cos_sin(torch.arange(n_positions)[None], inv_freq, factor)  # [1, 1, N, D/2]
    return to_numpy(cos[0, 0]), to_numpy(sin[0, 0])


def rope_cache(g: GraphBuilder, stack, name: str, local: bool = False, long: bool = False) -> tuple[str, str]:
    """The stack's cos and sin tables as initializers in the compute dtype (float32 for a
    bfloat16 export: they are not weights, and its activations are float32); ``local``: those of
    the sliding-window layers (their own base, Gemma 3); ``long``: longrope's long factors."""
    prefix = "local_" if local else "long_" if long else ""
    factor = 1.0 if local else stack.config.rope.attention_factor
    cos, sin = rope_tables(getattr(stack, f"{prefix}inv_freq"), stack.config.max_positions, factor)
    return g.weight(f"{name}.{prefix}rope_cos", cos, g.dtype), g.weight(f"{name}.{prefix}rope_sin", sin, g.dtype)


class Onnx23Target(PortableTarget):
    name = "onnx23"
    default_opset = 23
    summary = "the ai.tfport functions on ONNX's opset-23 Attention and RotaryEmbedding"
    bodies = {"RotaryEmbedding": RotaryEmbedding23, "InterleavedRotaryEmbedding": InterleavedRotaryEmbedding23,
              "ScaledDotProductAttention": ScaledDotProductAttention23,
              "GroupQueryAttention": GroupQueryAttention23,
              "SoftcapScaledDotProductAttention": SoftcapScaledDotProductAttention23,
              "SoftcapGroupQueryAttention": SoftcapGroupQueryAttention23}

    def check(self, config: ModelConfig, dtype: str, opset: int) -> None:
        if config.rope.scaling == "dynamic":
            raise ValueError("target='onnx23': rope.scaling='dynamic' recomputes the frequencies from "
                             "each call's length, and the cos/sin caches RotaryEmbedding reads are fixed "
                             "at export; use target='portable'")
        if opset != 23:
            raise ValueError(f"opset={opset!r}: target 'onnx23' uses the opset-23 Attention and "
                             "RotaryEmbedding operators, so it needs opset 23")

    scaled_tables = True

    def rotary_tables(self, g, stack, name, local=False, long=False):
        return rope_cache(g, stack, name, local, long)
