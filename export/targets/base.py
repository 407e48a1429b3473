"""What an export target is: a lowering of rotary embedding and attention, with its cache layout.

A target owns everything that differs between lowerings: which cache layout the decoder graph
uses (``tfport.contract.LAYOUTS``: its extra inputs and outputs, and through the manifest the
runtime's decode strategy), how the values shared by a stack's layers are made (masks, rotary
tables), how rotary + attention are emitted, which ``ai.tfport`` function bodies the graphs carry,
and what it refuses. ``PortableTarget`` is the reference lowering; the others override parts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np

from onnxscript.values import OnnxFunction
from torch import nn

from tfport.config import ModelConfig
from tfport.contract import ACTIVATIONS, LAST_LOGITS
from tfport.dtypes import ONNX_DTYPES

from ..graph import GraphBuilder, to_numpy
from ..lowering import StackInputs, heads, split_qkv
from ..moe import Emitter, mixture_of_experts
from ..positions import POSITION_EMITTERS
from ..blocks import BlockQuantized
from ..quant.graph import int_initializer, offset_product

QUANTIZED_MIN_OPSET = 21  # DequantizeLinear with block_size and int4/uint4 codes


class PortableTarget:
    """Standard ONNX operators (opset 18-23) and the ``ai.tfport`` functions: any ONNX runtime,
    every family and option; the decoder concatenates past and new keys (layout ``concat``)."""

    name = "portable"
    layout = "concat"
    default_opset = 18
    summary = "standard ONNX ops and the ai.tfport functions; any ONNX runtime"
    bodies: Mapping[str, OnnxFunction] = {}  # function name -> body replacing or adding to the library
    # What quantised products compute their activations in (tfport.contract.ACTIVATIONS): a
    # lowering to MatMulNBits sets its accuracy level from it (``with_activations``).
    activations = ACTIVATIONS[0]
    # Whether each product carries its own accuracy level (MatMulNBits written by the target);
    # a DequantizeLinear + MatMul pair takes the one level ONNX Runtime fuses a session's with.
    per_product_activations = False

    def with_activations(self, activations: str) -> "PortableTarget":
        """This target lowering quantised products with ``activations`` (itself when unchanged)."""
        if activations == self.activations:
            return self
        if activations == "mixed" and not self.per_product_activations:
            raise ValueError(f"activations='mixed' with target={self.name!r}: its quantised products are "
                             "DequantizeLinear + MatMul, which ONNX Runtime fuses at one accuracy level per "
                             "session; --target ort writes a level per product")
        target = copy.copy(self)
        target.activations = activations
        return target

    def check(self, config: ModelConfig, dtype: str, opset: int) -> None:
        """Raise ``ValueError`` naming the option and the reason if this target cannot export it."""

    def device_refusals(self, dtype: str, kv_dtype: str | None = None) -> dict[str, str]:
        """Devices this target's graphs of ``dtype`` with a ``kv_dtype`` KV cache (None: the
        dtype's default) must not run on -> the reason (manifest)."""
        return {}

    def attention_dtype(self, compute_dtype: str, kv_dtype: str) -> str:
        """The dtype self-attention over the cache computes in, for ``compute_dtype`` activations:
        here the compute dtype (the cache is cast to it, ``attend``)."""
        return compute_dtype

    def check_quantized(self, scheme, opset: int) -> None:
        """Raise ``ValueError`` if this target cannot lower ``scheme`` (export/quant/blockwise.py)
        at ``opset``: the portable lowering uses ONNX's blocked DequantizeLinear (opset 21)."""
        if opset < QUANTIZED_MIN_OPSET:
            raise ValueError(f"opset={opset!r}: target {self.name!r} lowers a quantised weight as a "
                             f"blocked DequantizeLinear with {scheme.name} codes, which needs opset "
                             f"{QUANTIZED_MIN_OPSET} or newer (omit --opset to get it)")

    def quantized_opset(self, opset: int) -> int:
        """The default opset of a quantised export of this target."""
        return max(opset, QUANTIZED_MIN_OPSET)

    # ------------------------------------------------------------------------------ emission
    def stack_inputs(self, g: GraphBuilder, stack: nn.Module, config: ModelConfig,
                     inputs: dict[str, str], causal: bool, name: str) -> StackInputs:
        """The values every layer of ``stack`` reads: the additive bias [B, 1|H, S, T] from the
        mask and the position scheme, rotary tables, the cross-attention bias."""
        length = g.op("Shape", inputs["input_ids"], start=1, end=2, name=f"{name}.query_length")  # [1] = S
        mask = inputs["attention_mask"]
        scheme = POSITION_EMITTERS[config.position]
        position_bias = scheme.bias(g, stack, mask, length, causal, name)

        def layer_bias(window: int, part: str) -> str:
            bias = g.fn("AttentionBias", mask, length, causal=int(causal), window=window, name=f"{name}.{part}")
            if position_bias is not None:
                bias = g.op("Add", bias, position_bias, name=f"{name}.{part}_{config.position}")  # [B, H, S, T]
            return bias

        ctx = StackInputs(self, bias=g.tap(f"{name}.bias", layer_bias(0, "mask"), "float32"),
                          position_ids=inputs.get("position_ids"))
        if config.window.size is not None:
            ctx.local_bias = g.tap(f"{name}.local_bias", layer_bias(config.window.size, "local_mask"),
                                   "float32")
        if scheme.rotary:
            ctx.rotary = self.rotary_tables(g, stack, name)
            if config.rope.scaling == "dynamic":  # frequencies from this call's length
                ctx.rotary = (self.dynamic_inv_freq(g, config, inputs, ctx.rotary[0], name),)
            if config.rope.scaling == "longrope":  # short or long factors, chosen per call
                longer = self.past_trained_context(g, config, inputs, name)
                long = self.rotary_tables(g, stack, name, long=True)
                ctx.rotary = tuple(g.op("Where", longer, lt, st, name=f"{name}.longrope_{i}")
                                   for i, (st, lt) in enumerate(zip(ctx.rotary, long)))
            if config.rope.local_theta is not None:
                ctx.local_rotary = self.rotary_tables(g, stack, name, local=True)
        ctx.content_bias = scheme.content_bias(g, stack, mask, length, name)  # DeBERTa's, or None
        if "encoder_attention_mask" in inputs:
            ctx.memory_bias = g.fn("AttentionBias", inputs["encoder_attention_mask"], length, causal=0,
                                   window=0, name=f"{name}.cross_mask")
        return ctx

    def past_trained_context(self, g: GraphBuilder, config: ModelConfig, inputs: dict[str, str], name: str) -> str:
        """bool scalar: this call's longest row runs past ``rope_original_max_positions``
        (max(position_ids) + 1 > it), which switches longrope to its long factors."""
        longest = g.op("ReduceMax", inputs["position_ids"], keepdims=0, name=f"{name}.max_position")
        return g.op("Greater", longest, g.const(config.rope.original_max_positions - 1, name="trained_context"),
                    name=f"{name}.past_trained_context")

    def dynamic_inv_freq(self, g: GraphBuilder, config: ModelConfig, inputs: dict[str, str], inv_freq: str,
                         name: str) -> str:
        """Dynamic NTK inv_freq float32 [R/2]: ``inv_freq`` while n = max(position_ids) + 1 <= L,
        else 1 / (theta (factor n / L - factor + 1)^(R/(R-2)))^(2i/R) (as the reference)."""
        dim, factor, context = config.rotary_channels, config.rope.scaling_factor, config.rope.original_max_positions
        f32 = lambda v, n: g.const(np.float32(v), "float32", n)  # noqa: E731
        longest = g.op("Add", g.op("ReduceMax", inputs["position_ids"], keepdims=0), g.const(1, name="one_i64"))
        n = g.op("Cast", longest, to=1, name=f"{name}.dynamic_length")  # float32 scalar
        growth = g.op("Pow", g.op("Sub", g.op("Mul", n, f32(factor / context, "dynamic_slope")),
                                  f32(factor - 1, "dynamic_offset")), f32(dim / (dim - 2), "dynamic_power"))
        base = g.op("Mul", f32(config.rope.theta, "rope_theta"), growth)
        exponents = f32(np.arange(0, dim, 2, dtype=np.float32) / dim, "rope_exponents")
        scaled = g.op("Reciprocal", g.op("Pow", base, exponents), name=f"{name}.dynamic_inv_freq")
        longer = g.op("Greater", longest, g.const(context, name="trained_context_len"))
        return g.op("Where", longer, scaled, inv_freq, name=f"{name}.dynamic_select")

    scaled_tables = False  # whether rotary_tables already carry rope_attention_factor

    def rotary_tables(self, g: GraphBuilder, stack: nn.Module, name: str, local: bool = False,
                      long: bool = False) -> tuple[str, ...]:
        """The tables ``RotaryEmbedding`` takes after x and position_ids: inv_freq float32 [D/2]
        (``local``: the sliding-window layers' own, Gemma 3; ``long``: longrope's long factors)."""
        prefix = "local_" if local else "long_" if long else ""
        return (g.weight(f"{name}.{prefix}inv_freq", to_numpy(getattr(stack, f"{prefix}inv_freq")), "float32"),)

    def rotate(self, g: GraphBuilder, x: str, module: nn.Module, ctx: StackInputs, name: str) -> str:
        """RoPE on x [B, N, S, D]; with partial rotary (R = ``module.rotary_dim`` < D) only the
        first R channels go through ``RotaryEmbedding`` and the rest are concatenated back."""
        rotary, d = module.rotary_dim, module.head_dim

        def rope(part: str) -> str:
            function = "InterleavedRotaryEmbedding" if module.interleaved else "RotaryEmbedding"
            out = g.fn(function, part, ctx.position_ids, *ctx.rotary, name=name)
            if module.rope_factor != 1.0 and not self.scaled_tables:  # = cos and sin times the factor
                out = g.op("Mul", out, g.const(module.rope_factor, g.dtype, "rope_attention_factor"),
                           name=f"{name}.factor")
            return out

        if rotary == d:
            return rope(x)
        part, rest = g.op("Split", x, g.const([rotary, d - rotary], name=f"rotary_split_{rotary}"), axis=-1,
                          outputs=2, name=f"{name}.split")  # [B, N, S, R], [B, N, S, D - R]
        return g.op("Concat", rope(part), rest, axis=-1, name=f"{name}.concat")

    def attend_qkv(self, g: GraphBuilder, qkv: str, module: nn.Module, ctx: StackInputs,
                   past: tuple[str, str] | None, name: str) -> tuple[str, tuple[str, str] | None]:
        """The fused projection qkv [B, S, (H + 2 Hkv) D] (no q/k norms) -> as ``attend``: split
        into q, k and v here; a target whose kernel reads the packed product takes it whole."""
        return self.attend(g, *split_qkv(g, qkv, module, name), module, ctx, past, name)

    def attend(self, g: GraphBuilder, q: str, k: str, v: str, module: nn.Module, ctx: StackInputs,
               past: tuple[str, str] | None, name: str) -> tuple[str, tuple[str, str] | None]:
        """q [B, S, H*D], k and v [B, S, Hkv*D] (projected, not rotated) -> (context [B, S, H*D],
        present (k, v) or None without a cache)."""
        h, hkv, d = module.n_heads, module.kv_heads, module.head_dim
        q, k, v = heads(g, q, h, d, f"{name}.q"), heads(g, k, hkv, d, f"{name}.k"), heads(g, v, hkv, d, f"{name}.v")
        if ctx.rotary:
            q = g.tap(f"{name}.rotary_q", self.rotate(g, q, module, ctx, f"{name}.rotary_q"))
            k = g.tap(f"{name}.rotary_k", self.rotate(g, k, module, ctx, f"{name}.rotary_k"))
        bias = ctx.bias
        if ctx.content_bias is not None:  # DeBERTa: terms from these queries and keys
            term = g.tap(f"{name}.content_term", ctx.content_bias.bias(g, module, q, k, f"{name}.disentangled"),
                         "float32")
            bias = g.op("Add", bias, term, name=f"{name}.content_bias")  # [B, H, S, T]
        # Soft-capped scores (Gemma 2) have their own functions, so other graphs pay nothing for them.
        capped = {"softcap": module.softcap} if module.softcap is not None else {}
        prefix = "Softcap" if capped else ""
        if past is None:
            return g.fn(f"{prefix}ScaledDotProductAttention", q, k, v, bias, scale=module.scale,
                        **capped, name=f"{name}.sdpa"), None
        if g.kv_dtype != g.dtype:  # a cache in its own dtype (--kv-dtype float16 on a float32 model)
            present = self.append_to_cache(g, k, v, past, name)
            k, v = (g.op("Cast", p, to=ONNX_DTYPES[g.dtype], name=f"{name}.cache_read") for p in present)
            return g.fn(f"{prefix}ScaledDotProductAttention", q, k, v, bias, scale=module.scale,
                        **capped, name=f"{name}.sdpa"), present
        out, pk, pv = g.fn(f"{prefix}GroupQueryAttention", q, k, v, past[0], past[1], bias,
                           scale=module.scale, **capped, outputs=3, name=f"{name}.gqa")
        return out, (pk, pv)

    def append_to_cache(self, g: GraphBuilder, k: str, v: str, past: tuple[str, str], name: str
                        ) -> tuple[str, str]:
        """New keys and values [B, Hkv, S, D] cast to the cache dtype ``g.kv_dtype`` (rounded as
        they enter the cache) and appended to the past [B, Hkv, P, D] in it -> present
        [B, Hkv, P+S, D]. Attention then reads the present cast back, so a step attends to the
        values later steps read, and the copy of the past is in the cache's smaller dtype."""
        present = []
        for new, old, part in ((k, past[0], "key"), (v, past[1], "value")):
            stored = g.op("Cast", new, to=ONNX_DTYPES[g.kv_dtype], name=f"{name}.{part}_to_cache")
            joined = g.op("Concat", old, stored, axis=2, name=f"{name}.present_{part}")  # [B, Hkv, P+S, D]
            present.append(g.set_dtype(joined, g.kv_dtype))
        return present[0], present[1]

    def add_rms_norm(self, g: GraphBuilder, x: str, delta: str, weight: str, epsilon: float, name: str,
                     sum_name: str) -> tuple[str, str]:
        """A residual sum and the RMSNorm that reads it next: (RMSNorm(x + delta) [B, S, E],
        x + delta [B, S, E]); here an ``Add`` and ``ai.tfport.RMSNorm``."""
        summed = g.op("Add", x, delta, name=sum_name)
        return g.fn("RMSNorm", summed, weight, epsilon=epsilon, name=name), summed

    def mixture_of_experts(self, g: GraphBuilder, x: str, module: nn.Module, ffn: Emitter, linear: Emitter,
                           name: str) -> str:
        """A mixture-of-experts FFN x [B, S, E] -> [B, S, E] (``export.moe``): every expert on
        every token, weighted by the dense routing weights; ``ffn`` and ``linear`` emit an
        expert and the router as the block's own FFN and projections."""
        return mixture_of_experts(g, x, module, ffn, linear, name)

    def last_positions(self, g: GraphBuilder, states: str, inputs: dict[str, str]) -> str:
        """states [B, S, E] -> the positions the head runs on: [B, 1, E] at the one the next
        token is picked from when the ``last_logits`` input is true (S - 1 in layout "concat",
        whose prompts are left-padded), else all of them [B, S, E]."""
        start = g.op("Where", inputs[LAST_LOGITS], g.const([-1], name="last_start"),
                     g.const([0], name="first_start"), name="logits_start")  # [1]
        return g.op("Slice", states, start, g.const([2**62], name="last_end"),
                    g.const([1], name="last_axis"), name="logits_positions")

    # ------------------------------------------------------------------- quantised weights
    def project_quantized(self, g: GraphBuilder, x: str, weight: BlockQuantized, name: str,
                          bias=None) -> str:
        """x [..., K] @ W -> [..., N] for ``weight`` quantised in rows [N, K]: ONNX
        ``DequantizeLinear`` (opset 21, blocks of ``block_size`` along axis 0 of W [K, N]; int4 /
        int8 codes when symmetric, uint4 / uint8 with zero points otherwise) feeding ``MatMul``.
        ONNX Runtime's CPU provider fuses the pair into its ``MatMulNBits`` kernel."""
        if "kn" not in weight.stored:
            signed = weight.symmetric
            codes = (weight.signed_codes() if signed else weight.codes).T  # [K, N]
            stored = [int_initializer(g, f"{name}.qweight", codes, weight.bits, signed),
                      g.weight(f"{name}.scales", weight.scales.T.astype("float32"))]  # [Kb, N]
            if not signed:
                stored.append(int_initializer(g, f"{name}.zero_points", weight.zero_points.T,
                                              weight.bits, False))
            weight.stored["kn"] = tuple(stored)
        w = g.op("DequantizeLinear", *weight.stored["kn"], axis=0, block_size=weight.block_size,
                 name=f"{name}.dequantize")  # [K, N], graph dtype
        y = g.op("MatMul", x, w, name=name)
        if weight.offsets is not None:  # GGUF Q4_1: + x @ (block minimum spread over its rows)
            y = g.op("Add", y, offset_product(g, x, weight, name), name=f"{name}.offset_add")
        if bias is not None:
            y = g.op("Add", y, g.weight(f"{name}.bias", bias), name=f"{name}.bias_add")
        return y

    def gather_quantized(self, g: GraphBuilder, table: BlockQuantized, ids: str, name: str) -> str:
        """Rows ``ids`` [B, S] of a quantised table [V, E] -> [B, S, E]: ``Gather`` of the codes,
        scales (and zero points) of those rows, then a blocked ``DequantizeLinear`` along E. ONNX's
        Gather takes no int4, so the gathered codes are stored one per byte (int8 / uint8)."""
        if "rows" not in table.stored:
            signed = table.symmetric
            stored = [int_initializer(g, f"{name}.qrows", table.signed_codes() if signed else table.codes,
                                      8, signed),
                      g.weight(f"{name}.row_scales", table.scales.astype("float32"))]  # [V, Eb]
            if not signed:
                stored.append(int_initializer(g, f"{name}.row_zero_points", table.zero_points, 8, False))
            table.stored["rows"] = tuple(stored)
        gathered = [g.op("Gather", value, ids, name=f"{name}.gather") for value in table.stored["rows"]]
        return g.op("DequantizeLinear", *gathered, axis=-1, block_size=table.block_size,
                    name=f"{name}.dequantize")  # [B, S, E]
