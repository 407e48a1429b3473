"""Target "ort": RoPE + attention lowered to ONNX Runtime's ``com.microsoft.GroupQueryAttention``
inside the named function ``ai.tfport.FusedGroupQueryAttention``, with the ``inplace`` cache
layout: one preallocated KV buffer per layer, bound as past and present, written in place.
Decoder-only RoPE models whose head dimension is a multiple of 16."""

from __future__ import annotations

import logging

import numpy as np
from onnxscript import script, values
from onnxscript import opset18 as op

from tfport.config import ModelConfig
from tfport.contract import LAST_LOGITS, MATMULNBITS_ACCURACY, accuracy_level
from tfport.dtypes import COMPUTE_DTYPES, ONNX_DTYPES

from ..functions import tfport
from ..lowering import StackInputs
from ..moe import fused_mixture_of_experts
from ..blocks import pack_nibbles
from ..quant.graph import byte_initializer, offset_product
from .base import PortableTarget
from .onnx23 import rope_cache

log = logging.getLogger(__name__)
msft = values.Opset("com.microsoft", 1)  # ONNX Runtime's contrib operators


@script(tfport, default_opset=op)
def FusedGroupQueryAttention(query, key, value, past_key, past_value, seqlens_k, total_sequence_length,
                             cos_cache, sin_cache, num_heads: int, kv_num_heads: int, scale: float,
                             local_window_size: int, softcap: float, rotary_interleaved: int):
    """RotaryEmbedding + GroupQueryAttention lowered to ONNX Runtime's fused kernel (target "ort").

    PyTorch: as ``GroupQueryAttention`` with RoPE applied to query and key first. query
    [B, S, H*D]; key, value [B, S, Hkv*D] (not rotated), or query the packed [B, S, (H + 2 Hkv) * D]
    with key and value absent (``OrtTarget.attend_qkv`` passes the fused projection so);
    past_key, past_value [B, Hkv, M, D]: a preallocated buffer of M >= P + S slots that the
    runtime binds as both past and present, so
    the new keys/values are written in place (no copy that grows with the context). seqlens_k
    int32 [B] = index of each row's last real token (rows are right-padded); total_sequence_length
    int32 scalar = the longest row's P + S; cos_cache, sin_cache float [max_positions, D/2] =
    cos/sin(position * inv_freq), positions counted from 0 at each row's first token.
    ``local_window_size`` W for sliding-window attention over W keys (query included), -1 for
    none; ``rotary_interleaved`` 1 pairs channels 2i and 2i + 1 (GPT-J); ``softcap`` c > 0 soft-caps the scaled scores (c * tanh(s / c)), 0 for none.
    -> output [B, S, H*D], present_key, present_value [B, Hkv, M, D].
    """
    output, present_key, present_value = msft.GroupQueryAttention(
        query, key, value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache,
        sin_cache, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, do_rotary=1,
        rotary_interleaved=rotary_interleaved, local_window_size=local_window_size, softcap=softcap)
    return output, present_key, present_value


class OrtTarget(PortableTarget):
    name = "ort"
    layout = "inplace"
    summary = "RoPE attention as ONNX Runtime's fused GroupQueryAttention, in-place KV buffer"
    bodies = {"FusedGroupQueryAttention": FusedGroupQueryAttention}
    per_product_activations = True  # MatMulNBits carries its accuracy level

    def check(self, config: ModelConfig, dtype: str, opset: int) -> None:
        if config.family != "decoder":
            raise ValueError(f"target='ort' lowers a decoder-only model's cached self-attention; "
                             f"family={config.family!r} models use target='portable'")
        if config.position != "rope":
            raise ValueError(f"target='ort' fuses RoPE into com.microsoft.GroupQueryAttention; "
                             f"position={config.position!r} models use target='portable'")
        if config.rope.scaling == "dynamic":
            raise ValueError("target='ort': rope.scaling='dynamic' recomputes the frequencies from "
                             "each call's length, and the cos/sin caches GroupQueryAttention reads are "
                             "fixed at export; use target='portable'")
        if config.dim_per_head % 16:
            raise ValueError(f"target='ort': ONNX Runtime's GroupQueryAttention with rotary needs a "
                             f"head dimension that is a multiple of 16, got {config.dim_per_head}")
        if config.rotary_channels % 16:
            raise ValueError(f"target='ort': ONNX Runtime's GroupQueryAttention rotates a number of "
                             f"channels that is a multiple of 16 (its cos cache width a multiple of 8); "
                             f"rope.rotary_dim={config.rope.rotary_dim} is not")

    def device_refusals(self, dtype: str, kv_dtype: str | None = None) -> dict[str, str]:
        """GroupQueryAttention runs in the cache dtype (see ``attend``): float32 has no CUDA kernel."""
        if (kv_dtype or COMPUTE_DTYPES[dtype]) == "float32":  # ORT would run it on the CPU, copying the cache
            return {"cuda": "target 'ort' on CUDA needs a float16 KV cache (ONNX Runtime's CUDA "
                            "GroupQueryAttention has float16/bfloat16 kernels); re-export with "
                            "--dtype float16 or --kv-dtype float16, or use provider='cpu'"}
        return {}

    def attention_dtype(self, compute_dtype, kv_dtype):
        return kv_dtype  # the kernel takes query and cache in one dtype (``attend``)

    def stack_inputs(self, g, stack, config, inputs, causal, name):
        """Masking and RoPE happen inside the kernel, from seqlens_k and the cos/sin tables."""
        cos, sin = rope_cache(g, stack, name)
        ctx = StackInputs(self, rotary=(cos, sin),
                          extra={"seqlens_k": inputs["seqlens_k"],
                                 "total_sequence_length": inputs["total_sequence_length"]})
        if config.rope.local_theta is not None:
            ctx.local_rotary = rope_cache(g, stack, name, local=True)
        if config.rope.scaling == "longrope":  # short or long factors, chosen per call
            longer = g.op("Greater", inputs["total_sequence_length"],
                          g.const(config.rope.original_max_positions, "int32", "trained_context"),
                          name=f"{name}.past_trained_context")
            long = rope_cache(g, stack, name, long=True)
            ctx.rotary = tuple(g.op("Where", longer, lt, st, name=f"{name}.longrope_{i}")
                               for i, (st, lt) in enumerate(zip(ctx.rotary, long)))
        return ctx

    def mixture_of_experts(self, g, x, module, ffn, linear, name):
        """The routed experts as ``com.microsoft.MoE`` (top k experts per token) where it computes
        them exactly (``export.moe.fusable``), the dense form elsewhere."""
        return fused_mixture_of_experts(g, x, module, ffn, linear, name)

    def attend_qkv(self, g, qkv, module, ctx, past, name):
        """The packed projection [B, S, (H + 2 Hkv) * D] straight into the kernel as its query,
        key and value absent, as its docs allow (a Split measured ~8 us a step per layer at batch
        1); with a cache in another dtype it is cast once, not in three parts."""
        return self.attend(g, qkv, "", "", module, ctx, past, name)

    def attend(self, g, q, k, v, module, ctx, past, name):
        """[B, S, N*D] straight into ONNX Runtime's kernel (or the packed ``q`` with ``k`` and
        ``v`` "", ``attend_qkv``); present is the past buffer, updated. The kernel takes query,
        key, value, cache and cos/sin in one dtype: with a cache in another dtype than the
        model's (``--kv-dtype float16`` on a float32 model) they are cast to the cache's, so
        attention runs in it, and its output is cast back."""
        h, hkv, d = module.n_heads, module.kv_heads, module.head_dim
        f = ctx.extra
        rotary = ctx.rotary
        if g.kv_dtype != g.dtype:
            def cast(x: str, part: str) -> str:
                return g.op("Cast", x, to=ONNX_DTYPES[g.kv_dtype], name=f"{name}.{part}_to_cache_dtype")

            if k:  # key and value apart (q and k normalised per head, Qwen3)
                q, k, v = cast(q, "q"), cast(k, "k"), cast(v, "v")
            else:  # the packed product, cast once
                q = cast(q, "qkv")
            rotary = tuple(cast(x, part) for x, part in zip(rotary, ("cos", "sin")))
        # ONNX Runtime's kernel keeps key j for query i when i - j < local_window_size, as tfport's
        # window does (measured against the reference; its docs speak of a "left window").
        window = -1 if ctx.window is None else ctx.window
        out, pk, pv = g.fn("FusedGroupQueryAttention", q, k, v, past[0], past[1], f["seqlens_k"],
                           f["total_sequence_length"], *rotary, num_heads=h,
                           kv_num_heads=hkv, scale=module.scale, local_window_size=window,
                           softcap=module.softcap or 0.0, rotary_interleaved=int(module.interleaved),
                           outputs=3, name=f"{name}.gqa")
        g.declare(out, g.kv_dtype, ["batch", "sequence", h * d])  # com.microsoft: no ONNX schema
        for value in (pk, pv):
            g.declare(value, g.kv_dtype, ["batch", hkv, "max_sequence", d])
        if g.kv_dtype != g.dtype:
            out = g.op("Cast", out, to=ONNX_DTYPES[g.dtype], name=f"{name}.gqa_to_compute_dtype")
        return out, (pk, pv)

    def add_rms_norm(self, g, x, delta, weight, epsilon, name, sum_name):
        """In float32 graphs one ``com.microsoft.SkipSimplifiedLayerNormalization`` (its fourth
        output is the sum, which the next residual reads): ONNX Runtime does not fuse the pair
        itself, and a decode step has two per layer. Other dtypes keep the pair: the kernel's
        float16 rounding differs from ai.tfport.RMSNorm's."""
        if g.dtype != "float32":
            return super().add_rms_norm(g, x, delta, weight, epsilon, name, sum_name)
        normed, summed = g.fresh(f"{name}_out"), g.fresh(f"{sum_name}_out")
        g.op("SkipSimplifiedLayerNormalization", x, delta, weight, outputs=[normed, "", "", summed],
             domain="com.microsoft", epsilon=epsilon, name=f"{sum_name}.skip_norm")
        return normed, summed

    def last_positions(self, g, states, inputs):
        """Rows are right-padded: with ``last_logits``, row b's last new token, at
        min(seqlens_k[b], S - 1) (a prefill: its length - 1; a decode step or a batch-1 chunk on
        a past: S - 1); else every position. One ``GatherElements`` of the positions
        start[b] + [0, n): n = 1 and start = that index, or n = S and start = 0."""
        length = g.op("Shape", inputs["input_ids"], start=1, end=2, name="logits.length")  # [1] = S
        last = inputs[LAST_LOGITS]
        one, zero = g.const([1], name="one"), g.const(0, name="zero_i64")
        index = g.op("Min", g.op("Cast", inputs["seqlens_k"], to=7), g.op("Sub", length, one),
                     name="last_index")  # [B] int64
        start = g.op("Where", last, index, zero, name="logits.start")  # [B]
        count = g.op("Where", last, one, length, name="logits.count")  # [1]
        steps = g.op("Range", zero, g.op("Squeeze", count, g.const([0], name="zero_1d")),
                     g.const(1, name="one_i64"), name="logits.steps")  # [n]
        positions = g.op("Add", g.op("Unsqueeze", start, g.const([1], name="axis_1d")),
                         g.op("Unsqueeze", steps, g.const([0], name="zero_1d")), name="logits.positions")  # [B, n]
        shape = g.op("Concat", g.op("Shape", states, start=0, end=1), count,
                     g.op("Shape", states, start=2, end=3), axis=0)  # [B, n, E]
        positions = g.op("Expand", g.op("Unsqueeze", positions, g.const([2], name="axis_2d")), shape)
        return g.op("GatherElements", states, positions, axis=1, name="logits_positions")  # [B, n, E]

    # ------------------------------------------------------------------- quantised weights
    def check_quantized(self, scheme, opset):
        """MatMulNBits and GatherBlockQuantized are contrib operators: any opset."""

    def quantized_opset(self, opset):
        return opset

    def project_quantized(self, g, x, weight, name, bias=None):
        """``com.microsoft.MatMulNBits``: codes packed per row [N, Kb, block_size * bits / 8]
        uint8, scales [N * Kb], zero points packed like the codes (absent when symmetric: the
        kernel's default 2^(bits-1)). ``accuracy_level`` from the target's ``activations`` and the
        product's name (``tfport.contract.accuracy_level``): 4 lets the CPU kernel quantise them to
        int8 per block (its fast path), 1 keeps them float32 (parity checks the graph at level 0)."""
        n, k = weight.shape
        level = accuracy_level(self.activations, name)
        if level != MATMULNBITS_ACCURACY["int8"] and weight.bits == 8 and not getattr(self, "warned", False):
            self.warned = True  # this target object is this export's own (``with_activations``)
            log.warning("%s [%d, %d] and any other 8-bit product on float activations: ONNX Runtime "
                        "has no float-activation kernel for 8-bit blocks and dequantises the whole "
                        "weight on every call (50-160x the int8-activation time measured at SmolLM2's "
                        "shapes); 4-bit products keep a fast one", name, n, k)
        y = g.op("MatMulNBits", x, *_nbits_storage(g, weight, name), domain="com.microsoft", K=k,
                 N=n, bits=weight.bits, block_size=weight.block_size, accuracy_level=level, name=name)
        if weight.offsets is not None:  # GGUF Q4_1 (zero points 0): + (x summed per block) @ m
            y = g.op("Add", y, offset_product(g, x, weight, name), name=f"{name}.offset_add")
        if bias is not None:
            y = g.op("Add", y, g.weight(f"{name}.bias", bias), name=f"{name}.bias_add")
        return y

    def gather_quantized(self, g, table, ids, name):
        """``com.microsoft.GatherBlockQuantized`` on the rows [V, E * bits / 8]: when E is whole
        blocks, the very codes a tied head's MatMulNBits reads, reshaped (stored once)."""
        v, e = table.shape
        if "gather" not in table.stored:
            if e % table.block_size == 0:
                data = g.op("Reshape", _nbits_codes(g, table, name),
                            g.const([v, e * table.bits // 8], name=f"{name}.rows_shape"), name=f"{name}.rows")
            else:
                data = byte_initializer(g, f"{name}.qrows", _pack(table.codes, table.bits))
            stored = [data, g.weight(f"{name}.row_scales", table.scales.astype("float32"))]  # [V, Eb]
            if not table.symmetric:
                stored.append(byte_initializer(g, f"{name}.row_zero_points", _pack(table.zero_points, table.bits)))
            table.stored["gather"] = tuple(stored)
        data, scales, *zero_points = table.stored["gather"]
        rows = g.op("GatherBlockQuantized", data, ids, scales, *zero_points, domain="com.microsoft",
                    bits=table.bits, block_size=table.block_size, gather_axis=0, quantize_axis=1,
                    name=name)
        if e * table.bits % 8:  # an odd E of 4-bit codes: the rows' padding nibble comes out too
            rows = g.op("Slice", rows, g.const([0], name="zero_1d"), g.const([e], name=f"{name}.width"),
                        g.const([-1], name="minus_one_1d"), name=f"{name}.unpad")
        return rows


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes -> bytes as the contrib operators store them (two 4-bit codes per byte)."""
    return pack_nibbles(codes) if bits == 4 else codes


def _nbits_codes(g, weight, name: str) -> str:
    """MatMulNBits' B [N, Kb, block_size * bits / 8] of ``weight``, stored once per graph (a tied
    table's gather reads the same bytes, reshaped)."""
    if "nbits_codes" not in weight.stored:
        weight.stored["nbits_codes"] = byte_initializer(g, f"{name}.qweight", _pack(weight.padded_codes(), weight.bits))
    return weight.stored["nbits_codes"]


def _nbits_storage(g, weight, name: str) -> tuple[str, ...]:
    """MatMulNBits' B (``_nbits_codes``), scales [N * Kb] and packed zero points
    [N * ceil(Kb * bits / 8)] of ``weight``, stored once per graph."""
    if "nbits" not in weight.stored:
        codes = _nbits_codes(g, weight, name)
        stored = [codes, g.weight(f"{name}.scales", weight.scales.reshape(-1).astype("float32"))]
        if not weight.symmetric:
            stored.append(byte_initializer(g, f"{name}.zero_points",
                                           _pack(weight.zero_points, weight.bits).reshape(-1)))
        weight.stored["nbits"] = tuple(stored)
    return weight.stored["nbits"]
