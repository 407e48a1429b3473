"""What an export target is: a lowering of rotary embedding and attention, with its cache layout.

A target owns everything that differs between lowerings: which cache layout the decoder graph
uses (``tfport.contract.LAYOUTS``: its extra inputs and outputs, and through the manifest the
runtime's decode strategy), how the values shared by a stack's layers are made (masks, rotary
tables), how rotary + attention are emitted, which ``ai.tfport`` function bodies the graphs carry,
and what it refuses. ``PortableTarget`` is the reference lowering; the others override parts.
"""

from __future__ import annotations

from collections.abc import Mapping

from onnxscript.values import OnnxFunction
from torch import nn

from tfport.config import ModelConfig

from ..emit import StackInputs, heads
from ..graph import GraphBuilder, to_numpy
from ..positions import POSITION_EMITTERS


class PortableTarget:
    """Standard ONNX operators (opset 18-23) and the ``ai.tfport`` functions: any ONNX runtime,
    every family and option; the decoder concatenates past and new keys (layout ``concat``)."""

    name = "portable"
    layout = "concat"
    default_opset = 18
    summary = "standard ONNX ops and the ai.tfport functions; any ONNX runtime"
    bodies: Mapping[str, OnnxFunction] = {}  # function name -> body replacing or adding to the library

    def check(self, config: ModelConfig, dtype: str, opset: int) -> None:
        """Raise ``ValueError`` naming the option and the reason if this target cannot export it."""

    def device_refusals(self, dtype: str) -> dict[str, str]:
        """Devices this target's graphs of ``dtype`` must not run on -> the reason (manifest)."""
        return {}

    # ------------------------------------------------------------------------------ emission
    def stack_inputs(self, g: GraphBuilder, stack: nn.Module, config: ModelConfig,
                     inputs: dict[str, str], causal: bool, name: str) -> StackInputs:
        """The values every layer of ``stack`` reads: the additive bias [B, 1|H, S, T] from the
        mask and the position scheme, rotary tables, the cross-attention bias."""
        length = g.op("Shape", inputs["input_ids"], start=1, end=2, name=f"{name}.query_length")  # [1] = S
        mask = inputs["attention_mask"]
        scheme = POSITION_EMITTERS[config.position]
        bias = g.fn("AttentionBias", mask, length, causal=int(causal), name=f"{name}.mask")
        position_bias = scheme.bias(g, stack, mask, length, causal, name)
        if position_bias is not None:
            bias = g.op("Add", bias, position_bias, name=f"{name}.mask_{config.position}")  # [B, H, S, T]
        ctx = StackInputs(self, bias=g.tap(f"{name}.bias", bias, "float32"),
                          position_ids=inputs.get("position_ids"))
        if scheme.rotary:
            ctx.rotary = self.rotary_tables(g, stack, name)
        if "encoder_attention_mask" in inputs:
            ctx.memory_bias = g.fn("AttentionBias", inputs["encoder_attention_mask"], length, causal=0,
                                   name=f"{name}.cross_mask")
        return ctx

    def rotary_tables(self, g: GraphBuilder, stack: nn.Module, name: str) -> tuple[str, ...]:
        """The tables ``RotaryEmbedding`` takes after x and position_ids: inv_freq float32 [D/2]."""
        return (g.weight(f"{name}.inv_freq", to_numpy(stack.inv_freq), "float32"),)

    def attend(self, g: GraphBuilder, q: str, k: str, v: str, module: nn.Module, ctx: StackInputs,
               past: tuple[str, str] | None, name: str) -> tuple[str, tuple[str, str] | None]:
        """q [B, S, H*D], k and v [B, S, Hkv*D] (projected, not rotated) -> (context [B, S, H*D],
        present (k, v) or None without a cache)."""
        h, hkv, d = module.n_heads, module.kv_heads, module.head_dim
        q, k, v = heads(g, q, h, d, f"{name}.q"), heads(g, k, hkv, d, f"{name}.k"), heads(g, v, hkv, d, f"{name}.v")
        if ctx.rotary:
            q = g.tap(f"{name}.rotary_q", g.fn("RotaryEmbedding", q, ctx.position_ids, *ctx.rotary,
                                               name=f"{name}.rotary_q"))
            k = g.tap(f"{name}.rotary_k", g.fn("RotaryEmbedding", k, ctx.position_ids, *ctx.rotary,
                                               name=f"{name}.rotary_k"))
        if past is None:
            return g.fn("ScaledDotProductAttention", q, k, v, ctx.bias, scale=module.scale,
                        name=f"{name}.sdpa"), None
        out, pk, pv = g.fn("GroupQueryAttention", q, k, v, past[0], past[1], ctx.bias,
                           scale=module.scale, outputs=3, name=f"{name}.gqa")
        return out, (pk, pv)
