"""Per-layer emitters: each writes one reference module's computation into a GraphBuilder.

They mirror ``tfport.models`` one to one (same order of operations, same float32 islands), so an
exported graph computes what the PyTorch module computes. Weights of ``nn.Linear`` are stored
transposed ([in, out]) so that ``MatMul(x, W)`` needs no runtime transpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto
from torch import nn

from tfport.config import ModelConfig
from tfport.models.attention import Attention
from tfport.models.layers import Block, FeedForward, RMSNorm
from tfport.models.positions import rope_cos_sin
from tfport.models.stack import Embeddings, Stack

from .graph import GraphBuilder


def _np(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def linear(g: GraphBuilder, x: str, module: nn.Linear, name: str) -> str:
    """x [..., in] -> [..., out]."""
    y = g.op("MatMul", x, g.weight(f"{name}.weight_t", _np(module.weight).T), name=name)
    if module.bias is not None:
        y = g.op("Add", y, g.weight(f"{name}.bias", _np(module.bias)), name=f"{name}.bias_add")
    return y


def norm(g: GraphBuilder, x: str, module: nn.Module, name: str) -> str:
    """LayerNorm (opset 17 LayerNormalization, float32 stash) or ai.tfport.RMSNorm."""
    weight = g.weight(f"{name}.weight", _np(module.weight))
    if isinstance(module, RMSNorm):
        return g.fn("RMSNorm", x, weight, epsilon=float(module.eps), name=name)
    bias = g.weight(f"{name}.bias", _np(module.bias))
    return g.op("LayerNormalization", x, weight, bias, axis=-1, epsilon=float(module.eps),
                stash_type=1, name=name)


def activation(g: GraphBuilder, x: str, kind: str, name: str) -> str:
    """GELU (erf or tanh form), ReLU or SiLU, as in torch.nn.functional (computed in float32)."""
    if kind == "relu":
        return g.op("Relu", x, name=name)
    xf = g.op("Cast", x, to=TensorProto.FLOAT, name=f"{name}.f32")
    if kind == "silu":
        y = g.op("Mul", xf, g.op("Sigmoid", xf, name=f"{name}.sigmoid"), name=name)
    elif kind == "gelu":  # 0.5 x (1 + erf(x / sqrt 2))
        erf = g.op("Erf", g.op("Mul", xf, g.const(np.float32(2 ** -0.5), "float32"), name=f"{name}.scale"))
        y = g.op("Mul", g.op("Mul", xf, g.const(np.float32(0.5), "float32")),
                 g.op("Add", erf, g.const(np.float32(1.0), "float32")), name=name)
    elif kind == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = g.op("Mul", g.op("Mul", xf, xf), xf)
        inner = g.op("Add", xf, g.op("Mul", cube, g.const(np.float32(0.044715), "float32")))
        tanh = g.op("Tanh", g.op("Mul", inner, g.const(np.float32(np.sqrt(2 / np.pi)), "float32")))
        y = g.op("Mul", g.op("Mul", xf, g.const(np.float32(0.5), "float32")),
                 g.op("Add", tanh, g.const(np.float32(1.0), "float32")), name=name)
    else:
        raise ValueError(f"activation={kind!r}: no ONNX emitter")
    return g.op("CastLike", y, x, name=f"{name}.cast")


def feed_forward(g: GraphBuilder, x: str, module: FeedForward, kind: str, name: str) -> str:
    """x [..., E] -> [..., E]. A gated FFN's gate and up projections are one MatMul with the two
    weights side by side ([E, 2F]) and a Split: one read of x, one kernel, as for fused QKV."""
    if module.gate is None:
        return linear(g, activation(g, linear(g, x, module.up, f"{name}.up"), kind, f"{name}.act"),
                      module.down, f"{name}.down")
    weight = np.concatenate([_np(module.gate.weight).T, _np(module.up.weight).T], axis=1)  # [E, 2F]
    fused = g.op("MatMul", x, g.weight(f"{name}.gate_up.weight_t", weight), name=f"{name}.gate_up")
    if module.up.bias is not None:
        bias = np.concatenate([_np(module.gate.bias), _np(module.up.bias)])
        fused = g.op("Add", fused, g.weight(f"{name}.gate_up.bias", bias), name=f"{name}.gate_up.bias_add")
    gate, up = g.op("Split", fused, axis=-1, num_outputs=2, outputs=2, name=f"{name}.split")
    hidden = g.op("Mul", activation(g, gate, kind, f"{name}.act"), up, name=f"{name}.glu")
    return linear(g, hidden, module.down, f"{name}.down")


def heads(g: GraphBuilder, x: str, n: int, head_dim: int, name: str) -> str:
    """[B, S, N*D] -> [B, N, S, D]."""
    shaped = g.op("Reshape", x, g.const([0, 0, n, head_dim], name="heads_shape"), name=f"{name}.reshape")
    return g.op("Transpose", shaped, perm=[0, 2, 1, 3], name=f"{name}.transpose")


@dataclass
class StackInputs:
    """Graph values a stack reads: bias/rope are shared by all layers of the stack."""

    bias: str | None  # float32 [B, 1|H, S, T]
    position_ids: str | None = None  # int64 [B, S] (RoPE)
    inv_freq: str | None = None  # float32 [D/2]
    rope_cache: tuple[str, str] | None = None  # target "onnx23": cos, sin [max_positions, D/2]
    memory_bias: str | None = None  # float32 [B, 1, S, Senc] (cross-attention)
    fused: dict[str, str] | None = None  # target "ort": seqlens_k, total_sequence_length, cos, sin


def self_attention(g: GraphBuilder, x: str, module: Attention, ctx: StackInputs,
                   past: tuple[str, str] | None, name: str) -> tuple[str, tuple[str, str] | None]:
    """Fused QKV, RoPE, attention over past + new keys -> (output [B, S, E], present (k, v))."""
    h, hkv, d = module.n_heads, module.kv_heads, module.head_dim
    qkv = linear(g, x, module.qkv, f"{name}.qkv")  # [B, S, (H + 2 Hkv) D]
    q, k, v = g.op("Split", qkv, g.const([h * d, hkv * d, hkv * d], name="qkv_split"), axis=-1,
                   outputs=3, name=f"{name}.split")
    if ctx.fused is not None:  # [B, S, N*D] straight into ONNX Runtime's kernel
        f = ctx.fused
        out, pk, pv = g.fn("FusedGroupQueryAttention", q, k, v, past[0], past[1], f["seqlens_k"],
                           f["total_sequence_length"], f["cos"], f["sin"], num_heads=h,
                           kv_num_heads=hkv, scale=module.scale, outputs=3, name=f"{name}.gqa")
        g.declare(out, g.dtype, ["batch", "sequence", h * d])  # com.microsoft: no ONNX schema
        for value in (pk, pv):
            g.declare(value, g.dtype, ["batch", hkv, "max_sequence", d])
        g.tap(f"{name}.context", out)
        return g.tap(name, linear(g, out, module.out, f"{name}.out")), (pk, pv)
    q, k, v = heads(g, q, h, d, f"{name}.q"), heads(g, k, hkv, d, f"{name}.k"), heads(g, v, hkv, d, f"{name}.v")
    if ctx.inv_freq is not None or ctx.rope_cache is not None:
        tables = (ctx.inv_freq,) if ctx.rope_cache is None else ctx.rope_cache
        q = g.tap(f"{name}.rotary_q", g.fn("RotaryEmbedding", q, ctx.position_ids, *tables, name=f"{name}.rotary_q"))
        k = g.tap(f"{name}.rotary_k", g.fn("RotaryEmbedding", k, ctx.position_ids, *tables, name=f"{name}.rotary_k"))
    if past is None:
        out = g.fn("ScaledDotProductAttention", q, k, v, ctx.bias, scale=module.scale, name=f"{name}.sdpa")
        present = None
    else:
        out, pk, pv = g.fn("GroupQueryAttention", q, k, v, past[0], past[1], ctx.bias,
                           scale=module.scale, outputs=3, name=f"{name}.gqa")
        present = (pk, pv)
    g.tap(f"{name}.context", out)
    return g.tap(name, linear(g, out, module.out, f"{name}.out")), present


def cross_memory(g: GraphBuilder, states: str, module: Attention, name: str) -> tuple[str, str]:
    """Cross-attention (k, v) [B, Hkv, Senc, D] from encoder states [B, Senc, E]."""
    kv = linear(g, states, module.kv, f"{name}.kv")
    k, v = g.op("Split", kv, axis=-1, num_outputs=2, outputs=2, name=f"{name}.split")
    return heads(g, k, module.kv_heads, module.head_dim, f"{name}.k"), \
        heads(g, v, module.kv_heads, module.head_dim, f"{name}.v")


def cross_attention(g: GraphBuilder, x: str, module: Attention, memory: tuple[str, str],
                    ctx: StackInputs, name: str) -> str:
    q = heads(g, linear(g, x, module.q, f"{name}.q"), module.n_heads, module.head_dim, f"{name}.q")
    out = g.tap(f"{name}.context", g.fn("ScaledDotProductAttention", q, memory[0], memory[1], ctx.memory_bias,
                                         scale=module.scale, name=f"{name}.sdpa"))
    return g.tap(name, linear(g, out, module.out, f"{name}.out"))


def block(g: GraphBuilder, x: str, module: Block, config: ModelConfig, ctx: StackInputs,
          past: tuple[str, str] | None, memory: tuple[str, str] | None, name: str
          ) -> tuple[str, tuple[str, str] | None]:
    """One block, pre- or post-norm -> (states [B, S, E], present (k, v) or None)."""
    present = None

    def residual(x: str, norm_module: nn.Module, f, part: str) -> str:
        if module.pre:
            normed = g.tap(f"{name}.{part}_norm", norm(g, x, norm_module, f"{name}.{part}_norm"))
            return g.op("Add", x, f(normed), name=f"{name}.{part}_residual")
        summed = g.op("Add", x, f(x), name=f"{name}.{part}_residual")
        return g.tap(f"{name}.{part}_norm", norm(g, summed, norm_module, f"{name}.{part}_norm"))

    def attend(h: str) -> str:
        nonlocal present
        out, present = self_attention(g, h, module.attn, ctx, past, f"{name}.attn")
        return out

    x = residual(x, module.attn_norm, attend, "attn")
    if module.cross_attn is not None:
        x = residual(x, module.cross_norm,
                     lambda h: cross_attention(g, h, module.cross_attn, memory, ctx, f"{name}.cross_attn"), "cross")
    x = residual(x, module.ffn_norm, lambda h: g.tap(
        f"{name}.ffn", feed_forward(g, h, module.ffn, config.activation, f"{name}.ffn")), "ffn")
    return g.tap(name, x), present


def embeddings(g: GraphBuilder, module: Embeddings, input_ids: str, position_ids: str | None,
               token_type_ids: str | None, token_table: str, name: str) -> str:
    """Token (+ position table) (+ token type) embeddings, optional norm -> [B, S, E]."""
    x = g.op("Gather", token_table, input_ids, name=f"{name}.tokens")
    table = None
    if module.positions is not None:
        table = module.positions.weight
    elif hasattr(module, "sinusoidal"):
        table = module.sinusoidal
    if table is not None:
        positions = g.op("Gather", g.weight(f"{name}.positions", _np(table)), position_ids, name=f"{name}.positions")
        x = g.op("Add", x, positions, name=f"{name}.add_positions")
    if module.token_types is not None:
        types = g.op("Gather", g.weight(f"{name}.token_types", _np(module.token_types.weight)),
                     token_type_ids, name=f"{name}.token_types")
        x = g.op("Add", x, types, name=f"{name}.add_token_types")
    if module.norm is not None:
        x = norm(g, x, module.norm, f"{name}.norm")
    return x


def relative_bias(g: GraphBuilder, module: Stack, attention_mask: str, length: str, causal: bool,
                  name: str) -> str:
    """T5 relative bias [B, H, S, T]; bucket constants computed here as PyTorch computes them."""
    config = module.config
    buckets = config.relative_buckets if causal else config.relative_buckets // 2
    max_exact = buckets // 2
    table = g.weight(f"{name}.relative_bias", _np(module.relative_bias.weight))
    return g.fn("RelativePositionBias", attention_mask, length, table, bidirectional=int(not causal),
                num_buckets=buckets, max_exact=max_exact,
                log_max_ratio=math.log(config.relative_max_distance / max_exact), name=f"{name}.relative")


def stack(g: GraphBuilder, module: Stack, config: ModelConfig, *, input_ids: str, attention_mask: str,
          position_ids: str | None, token_table: str, causal: bool, token_type_ids: str | None = None,
          pasts: list[tuple[str, str]] | None = None, memories: list[tuple[str, str]] | None = None,
          encoder_attention_mask: str | None = None, fused: dict[str, str] | None = None,
          rope_cache: bool = False, progress=None, name: str = "stack"
          ) -> tuple[str, list[tuple[str, str] | None]]:
    """Embeddings, masks/positions shared by all layers, the blocks and the final norm.

    ``fused`` (target "ort") holds the seqlens_k / total_sequence_length inputs: masking and
    RoPE then happen inside ONNX Runtime's GroupQueryAttention, from cos/sin tables built here;
    ``rope_cache`` (target "onnx23") gives RotaryEmbedding those tables instead of inv_freq.
    Returns (states [B, S, E] in the model dtype, per-layer present (k, v) or None).
    """
    if fused is not None:
        cos, sin = rope_tables(module.inv_freq, module.config.max_positions)
        ctx = StackInputs(bias=None, fused=dict(fused, cos=g.weight(f"{name}.rope_cos", cos),
                                                 sin=g.weight(f"{name}.rope_sin", sin)))
        return _layers(g, module, config, ctx, input_ids, position_ids, token_type_ids, token_table,
                       pasts, memories, progress, name)
    length = g.op("Shape", input_ids, start=1, end=2, name=f"{name}.query_length")  # [1] = S
    bias = g.fn("AttentionBias", attention_mask, length, causal=int(causal), name=f"{name}.mask")
    if config.position == "alibi":
        slopes = g.weight(f"{name}.alibi_slopes", _np(module.alibi_slopes), "float32")
        alibi = g.fn("AlibiBias", attention_mask, length, slopes, name=f"{name}.alibi")
        bias = g.op("Add", bias, alibi, name=f"{name}.mask_alibi")  # [B, H, S, T]
    if config.position == "relative":
        bias = g.op("Add", bias, relative_bias(g, module, attention_mask, length, causal, name),
                    name=f"{name}.mask_relative")  # [B, H, S, T]
    ctx = StackInputs(bias=bias)
    if config.position == "rope":
        ctx.position_ids = position_ids
        if rope_cache:
            cos, sin = rope_tables(module.inv_freq, config.max_positions)
            ctx.rope_cache = (g.weight(f"{name}.rope_cos", cos), g.weight(f"{name}.rope_sin", sin))
        else:
            ctx.inv_freq = g.weight(f"{name}.inv_freq", _np(module.inv_freq), "float32")
    if memories is not None:
        ctx.memory_bias = g.fn("AttentionBias", encoder_attention_mask, length, causal=0, name=f"{name}.cross_mask")
    g.tap(f"{name}.bias", bias, "float32")
    return _layers(g, module, config, ctx, input_ids, position_ids, token_type_ids, token_table,
                   pasts, memories, progress, name)


def rope_tables(inv_freq, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [n_positions, D/2] exactly as the reference computes them per position."""
    cos, sin = rope_cos_sin(torch.arange(n_positions)[None], inv_freq)  # [1, 1, N, D/2]
    return _np(cos[0, 0]), _np(sin[0, 0])


def _layers(g: GraphBuilder, module: Stack, config: ModelConfig, ctx: StackInputs, input_ids: str,
            position_ids: str | None, token_type_ids: str | None, token_table: str, pasts, memories,
            progress, name: str) -> tuple[str, list[tuple[str, str] | None]]:
    x = g.tap(f"{name}.embed", embeddings(g, module.embed, input_ids, position_ids, token_type_ids,
                                          token_table, f"{name}.embed"))
    presents = []
    for i, layer in enumerate(module.layers):
        past = pasts[i] if pasts is not None else None
        memory = memories[i] if memories is not None else None
        x, present = block(g, x, layer, config, ctx, past, memory, f"{name}.layers.{i}")
        presents.append(present)
        if progress is not None:
            progress.update(1)
    if module.norm is not None:
        x = g.tap(f"{name}.norm", norm(g, x, module.norm, f"{name}.norm"))
    return x, presents
