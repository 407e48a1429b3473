"""What the emitters and the export targets share: the ``Target`` protocol and the values a
target hands every layer of a stack (``StackInputs``).

The emitters (``emit``) write a module's computation and ask the target, through this protocol,
how to lower the parts that differ between runtimes (masks and rotary tables, rotary + attention,
residual sums with the RMSNorm that reads them, quantised products); the targets
(``targets.*``) implement it. Both sides import this module and neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from onnxscript.values import OnnxFunction
from torch import nn

from tfport.config import ModelConfig

from .graph import GraphBuilder
from .moe import Emitter


def heads(g: GraphBuilder, x: str, n: int, head_dim: int, name: str) -> str:
    """[B, S, N*D] -> [B, N, S, D]."""
    shaped = g.op("Reshape", x, g.const([0, 0, n, head_dim], name="heads_shape"), name=f"{name}.reshape")
    return g.op("Transpose", shaped, perm=[0, 2, 1, 3], name=f"{name}.transpose")


def split_qkv(g: GraphBuilder, qkv: str, module: nn.Module, name: str) -> tuple[str, str, str]:
    """The fused projection [B, S, (H + 2 Hkv) D] -> q [B, S, H*D], k and v [B, S, Hkv*D]."""
    h, hkv, d = module.n_heads, module.kv_heads, module.head_dim
    q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d], name="qkv_split"), axis=-1,
                   outputs=3, name=f"{name}.split")
    return q, k, v


@dataclass
class StackInputs:
    """Graph values every layer of a stack reads, made once per stack by the export target."""

    target: Target
    bias: str | None = None  # float32 [B, 1|H, S, T]: masks and position bias
    position_ids: str | None = None  # int64 [B, S]
    rotary: tuple[str, ...] = ()  # the target's rotary tables (inv_freq, or cos and sin)
    memory_bias: str | None = None  # float32 [B, 1, S, Senc] (cross-attention)
    extra: dict[str, str] = field(default_factory=dict)  # target-specific graph values
    # The sliding-window layers' bias and rotary tables (config.window, config.rope.local_theta).
    local_bias: str | None = None
    local_rotary: tuple[str, ...] = ()
    window: int | None = None  # set on the view a sliding-window layer reads (see ``layer``)
    # A bias each layer computes from its queries and keys (positions.DisentangledGraphBias), or None.
    content_bias: object | None = None

    def layer(self, config: ModelConfig, index: int) -> "StackInputs":
        """What layer ``index`` reads: the stack's values, or for a sliding-window layer its
        windowed bias, its rotary tables and ``window``."""
        if not config.is_local(index):
            return self
        return replace(self, bias=self.local_bias, rotary=self.local_rotary or self.rotary,
                       window=config.window.size)


class Target(Protocol):
    """An export target: a lowering of rotary embedding and attention with its cache layout
    (``targets.base.PortableTarget`` is the reference implementation; subclass it)."""

    name: str
    layout: str  # tfport.contract.LAYOUTS: the decoder graph's cache inputs and outputs
    default_opset: int
    summary: str
    bodies: Mapping[str, OnnxFunction]  # function name -> body replacing or adding to the library
    activations: str  # tfport.contract.ACTIVATIONS: what quantised products compute activations in

    def with_activations(self, activations: str) -> "Target": ...

    # ------------------------------------------------------------------ what it refuses
    def check(self, config: ModelConfig, dtype: str, opset: int) -> None: ...
    def check_quantized(self, scheme, opset: int) -> None: ...
    def quantized_opset(self, opset: int) -> int: ...
    def device_refusals(self, dtype: str, kv_dtype: str | None = None) -> dict[str, str]: ...
    def attention_dtype(self, compute_dtype: str, kv_dtype: str) -> str: ...

    # ------------------------------------------------------------------ emission hooks
    def stack_inputs(self, g: GraphBuilder, stack: nn.Module, config: ModelConfig,
                     inputs: dict[str, str], causal: bool, name: str) -> StackInputs: ...

    def attend_qkv(self, g: GraphBuilder, qkv: str, module: nn.Module, ctx: StackInputs,
                   past: tuple[str, str] | None, name: str) -> tuple[str, tuple[str, str] | None]: ...

    def attend(self, g: GraphBuilder, q: str, k: str, v: str, module: nn.Module, ctx: StackInputs,
               past: tuple[str, str] | None, name: str) -> tuple[str, tuple[str, str] | None]: ...

    def add_rms_norm(self, g: GraphBuilder, x: str, delta: str, weight: str, epsilon: float, name: str,
                     sum_name: str) -> tuple[str, str]: ...

    def last_positions(self, g: GraphBuilder, states: str, inputs: dict[str, str]) -> str: ...

    def mixture_of_experts(self, g: GraphBuilder, x: str, module: nn.Module, ffn: Emitter, linear: Emitter,
                           name: str) -> str: ...

    def project_quantized(self, g: GraphBuilder, x: str, weight, name: str, bias=None) -> str: ...
    def gather_quantized(self, g: GraphBuilder, table, ids: str, name: str) -> str: ...
