"""Per-layer emitters: each writes one reference module's computation into a GraphBuilder.

They mirror ``tfport.models`` one to one (same order of operations, same float32 islands), so an
exported graph computes what the PyTorch module computes. Every product with a weight matrix goes
through ``project`` (the one place where weight dtype, layout and quantisation are decided).
Position schemes come from ``positions.POSITION_EMITTERS``; how masks, rotary embedding,
attention and a residual sum with the RMSNorm reading it are lowered is the export target's,
asked through ``lowering.Target`` (the emitters never import a target).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto
from torch import nn

from tfport.config import ModelConfig
from tfport.models.attention import Attention
from tfport.models.layers import Block, FeedForward, RMSNorm
from tfport.models.moe import MixtureOfExperts
from tfport.models.stack import Embeddings, Stack

from .graph import GraphBuilder, to_numpy
from .lowering import StackInputs, Target, heads, split_qkv
from .positions import POSITION_EMITTERS

_np = to_numpy


def project(g: GraphBuilder, x: str, weight: np.ndarray | str, name: str, *,
            bias: np.ndarray | None = None, transposed: bool = False) -> str:
    """x [..., in] @ W [in, out] (+ bias [out]) -> [..., out]: every weight product of an export.

    ``weight`` is an array [in, out] (stored as an initializer, in the graph dtype) or the name of
    an initializer already in the graph; ``transposed`` says that stored one is [out, in] (a tied
    embedding table read as the output head) and is transposed in the graph, not copied.
    """
    quantizer = getattr(g, "quantizer", None)  # export/quant: the scheme's graph_quantizer, or None
    if quantizer is not None and (not isinstance(weight, str) or quantizer.owns(weight)):
        return quantizer.project(g, x, weight, name, bias=bias, transposed=transposed)
    if not isinstance(weight, str):
        weight = g.weight(f"{name}.weight_t", weight)
    if transposed:
        weight = g.op("Transpose", weight, perm=[1, 0], name=f"{name}.weight_t")
    y = g.op("MatMul", x, weight, name=name)
    if bias is not None:
        y = g.op("Add", y, g.weight(f"{name}.bias", bias), name=f"{name}.bias_add")
    return y


def gather_rows(g: GraphBuilder, table: str, ids: str, name: str) -> str:
    """Rows ``ids`` [B, S] of an embedding table [V, E] -> [B, S, E]; a table quantised by
    ``g.quantizer`` is gathered from its quantised rows as the export target lowers it."""
    quantizer = getattr(g, "quantizer", None)
    if quantizer is not None and quantizer.owns(table):
        return quantizer.gather(g, table, ids, name)
    return g.op("Gather", table, ids, name=name)


def linear(g: GraphBuilder, x: str, module: nn.Linear, name: str) -> str:
    """An ``nn.Linear``: x [..., in] -> [..., out] (its weight stored transposed, [in, out])."""
    bias = _np(module.bias) if module.bias is not None else None
    return project(g, x, _np(module.weight).T, name, bias=bias)


def norm(g: GraphBuilder, x: str, module: nn.Module, name: str) -> str:
    """LayerNorm (opset 17 LayerNormalization, float32 stash) or ai.tfport.RMSNorm (a weight
    offset, Gemma's ``1 + w``, is folded into the stored weight); an ``nn.Identity`` (layer 0's
    attention norm when ``config.first_attn_norm`` is false) returns x."""
    if isinstance(module, nn.Identity):
        return x
    weight = _norm_weight(g, module, name)
    if isinstance(module, RMSNorm):
        return g.fn("RMSNorm", x, weight, epsilon=float(module.eps), name=name)
    bias = g.weight(f"{name}.bias", _np(module.bias))
    return g.op("LayerNormalization", x, weight, bias, axis=-1, epsilon=float(module.eps),
                stash_type=1, name=name)


def _norm_weight(g: GraphBuilder, module: nn.Module, name: str) -> str:
    return g.weight(f"{name}.weight", _np(module.weight) + getattr(module, "offset", 0.0))


@dataclass(frozen=True)
class Residual:
    """The residual stream x + delta [B, S, E] with the Add not emitted yet (``delta`` None: x
    itself), so that the norm reading the sum next is lowered together with it
    (``Target.add_rms_norm``). ``taps`` are the reference points the sum stands for."""

    x: str
    delta: str | None = None
    add_name: str = ""
    taps: tuple[str, ...] = ()


def settle(g: GraphBuilder, stream: Residual) -> str:
    """The stream as one value: its Add emitted (and tapped) if still pending."""
    if stream.delta is None:
        return stream.x
    return _tapped(g, stream, g.op("Add", stream.x, stream.delta, name=stream.add_name))


def normed(g: GraphBuilder, target: Target, stream: Residual, module: nn.Module, name: str) -> tuple[str, str]:
    """(module(stream), the stream's value): a pending residual sum and the RMSNorm reading it
    go to the target as one (ONNX Runtime has a fused kernel for the pair)."""
    if stream.delta is None:
        return norm(g, stream.x, module, name), stream.x
    if not isinstance(module, RMSNorm):
        summed = settle(g, stream)
        return norm(g, summed, module, name), summed
    out, summed = target.add_rms_norm(g, stream.x, stream.delta, _norm_weight(g, module, name),
                                      float(module.eps), name, stream.add_name)
    return out, _tapped(g, stream, summed)


def _tapped(g: GraphBuilder, stream: Residual, value: str) -> str:
    for point in stream.taps:
        g.tap(point, value)
    return value


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
    bias = None
    if module.up.bias is not None:
        bias = np.concatenate([_np(module.gate.bias), _np(module.up.bias)])
    fused = project(g, x, weight, f"{name}.gate_up", bias=bias)
    gate, up = g.op("Split", fused, axis=-1, num_outputs=2, outputs=2, name=f"{name}.split")
    hidden = g.op("Mul", activation(g, gate, kind, f"{name}.act"), up, name=f"{name}.glu")
    return linear(g, hidden, module.down, f"{name}.down")


def ffn_sublayer(g: GraphBuilder, target: Target, x: str, module: nn.Module, kind: str, name: str) -> str:
    """A block's FFN x [..., E] -> [..., E]: a feed-forward, or a mixture of them as the target
    lowers it (``Target.mixture_of_experts``, given this module's FFN and linear emitters)."""
    if isinstance(module, MixtureOfExperts):
        return target.mixture_of_experts(g, x, module, lambda h, m, n: feed_forward(g, h, m, kind, n),
                                         lambda h, m, n: linear(g, h, m, n), name)
    return feed_forward(g, x, module, kind, name)


def head_norm(g: GraphBuilder, x: str, module: nn.Module, n: int, head_dim: int, name: str) -> str:
    """Per-head RMSNorm over D of x [B, S, N*D] (Qwen3 / Gemma 3 q and k norms) -> [B, S, N*D]."""
    shaped = g.op("Reshape", x, g.const([0, 0, n, head_dim], name="heads_shape"), name=f"{name}.reshape")
    normed = norm(g, shaped, module, name)  # [B, S, N, D]
    return g.op("Reshape", normed, g.const([0, 0, -1], name="merge_heads"), name=f"{name}.merge")


def _clipped(g: GraphBuilder, x: str, module: Attention, name: str) -> str:
    """x clamped to [-c, c] for ``module.qkv_clip`` c (OLMoE's ``clip_qkv``), else x: elementwise,
    so the packed q|k|v product is clamped whole where no norm reads it first."""
    if module.qkv_clip is None:
        return x
    c = module.qkv_clip
    return g.op("Clip", x, g.const(-c, g.dtype, "qkv_clip_min"), g.const(c, g.dtype, "qkv_clip_max"),
                name=f"{name}.clip")


def self_attention(g: GraphBuilder, x: str, module: Attention, ctx: StackInputs,
                   past: tuple[str, str] | None, name: str) -> tuple[str, tuple[str, str] | None]:
    """Fused QKV projection (q/k norms, per head or over all heads; the q/k/v clamp), then
    rotary + attention as the target lowers them -> (output [B, S, E], present (k, v) or None)."""
    h, hkv, d = module.n_heads, module.kv_heads, module.head_dim
    qkv = linear(g, x, module.qkv, f"{name}.qkv")  # [B, S, (H + 2 Hkv) D]
    if module.q_norm is None:  # the target splits the packed product, or reads it whole
        out, present = ctx.target.attend_qkv(g, _clipped(g, qkv, module, f"{name}.qkv"), module, ctx, past, name)
    else:
        q, k, v = split_qkv(g, qkv, module, name)  # [B, S, N*D] each
        if module.qk_norm_per_head:
            q = head_norm(g, q, module.q_norm, h, d, f"{name}.q_norm")
            k = head_norm(g, k, module.k_norm, hkv, d, f"{name}.k_norm")
        else:  # OLMoE: one norm over all heads' channels
            q, k = norm(g, q, module.q_norm, f"{name}.q_norm"), norm(g, k, module.k_norm, f"{name}.k_norm")
        q, k, v = (_clipped(g, t, module, f"{name}.{part}") for t, part in zip((q, k, v), "qkv"))
        out, present = ctx.target.attend(g, q, k, v, module, ctx, past, name)
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


def block(g: GraphBuilder, stream: Residual, module: Block, config: ModelConfig, ctx: StackInputs,
          past: tuple[str, str] | None, memory: tuple[str, str] | None, name: str
          ) -> tuple[Residual, tuple[str, str] | None]:
    """One block, pre- or post-norm -> (states [B, S, E] as a residual stream whose last Add may
    be pending, present (k, v) or None)."""
    present = None
    target = ctx.target

    def residual(stream: Residual, norm_module: nn.Module, f, part: str) -> Residual:
        if module.pre:
            normed_x, x = normed(g, target, stream, norm_module, f"{name}.{part}_norm")
            out = f(g.tap(f"{name}.{part}_norm", normed_x))
            post = getattr(module, f"{part}_post_norm", None)
            if post is not None:  # Gemma 2/3: the sublayer's output is normalised too
                out = g.tap(f"{name}.{part}_post_norm", norm(g, out, post, f"{name}.{part}_post_norm"))
            if module.residual_scale != 1.0:  # Granite's residual_multiplier, in the model dtype
                out = g.op("Mul", out, g.const(module.residual_scale, g.dtype, "residual_scale"),
                           name=f"{name}.{part}_scale")
            return Residual(x, out, f"{name}.{part}_residual")
        x = settle(g, stream)
        out, _ = normed(g, target, Residual(x, f(x), f"{name}.{part}_residual"), norm_module,
                        f"{name}.{part}_norm")
        return Residual(g.tap(f"{name}.{part}_norm", out))

    def attend(h: str) -> str:
        nonlocal present
        out, present = self_attention(g, h, module.attn, ctx, past, f"{name}.attn")
        return out

    if module.parallel:  # x + attn(attn_norm(x)) + ffn(ffn_norm(x)), as the reference adds them
        x = settle(g, stream)
        attn_in = g.tap(f"{name}.attn_norm", norm(g, x, module.attn_norm, f"{name}.attn_norm"))
        ffn_in = g.tap(f"{name}.ffn_norm", norm(g, x, module.ffn_norm, f"{name}.ffn_norm"))
        x = g.op("Add", x, attend(attn_in), name=f"{name}.attn_residual")
        ffn = g.tap(f"{name}.ffn", ffn_sublayer(g, target, ffn_in, module.ffn, config.activation, f"{name}.ffn"))
        return Residual(x, ffn, f"{name}.ffn_residual", (name,)), present
    stream = residual(stream, module.attn_norm, attend, "attn")
    if module.cross_attn is not None:
        stream = residual(stream, module.cross_norm,
                          lambda h: cross_attention(g, h, module.cross_attn, memory, ctx, f"{name}.cross_attn"),
                          "cross")
    stream = residual(stream, module.ffn_norm, lambda h: g.tap(
        f"{name}.ffn", ffn_sublayer(g, target, h, module.ffn, config.activation, f"{name}.ffn")), "ffn")
    if stream.delta is None:
        return Residual(g.tap(name, stream.x)), present
    return Residual(stream.x, stream.delta, stream.add_name, (name,)), present


def embeddings(g: GraphBuilder, target: Target, module: Embeddings, config: ModelConfig, input_ids: str,
               position_ids: str | None, token_type_ids: str | None, token_table: str, name: str) -> str:
    """Token (+ position table) (+ token type) embeddings, optional norm -> [B, S, E]."""
    x = gather_rows(g, token_table, input_ids, f"{name}.tokens")
    if module.scale != 1.0:  # Gemma: sqrt(E) in the model dtype, as the reference rounds it
        x = g.op("Mul", x, g.const(module.scale, g.dtype, "embedding_scale"), name=f"{name}.scale")
    stream = Residual(x)  # the last addend stays pending for the norm
    positions = POSITION_EMITTERS[config.position].embedding(g, module, position_ids, name)
    if positions is not None:
        stream = Residual(x, positions, f"{name}.add_positions")
    if module.token_types is not None:
        x = settle(g, stream)
        types = g.op("Gather", g.weight(f"{name}.token_types", _np(module.token_types.weight)),
                     token_type_ids, name=f"{name}.token_types")
        stream = Residual(x, types, f"{name}.add_token_types")
    if module.norm is None:
        return settle(g, stream)
    return normed(g, target, stream, module.norm, f"{name}.norm")[0]


def stack(g: GraphBuilder, module: Stack, config: ModelConfig, target: Target, inputs: dict[str, str], *,
          token_table: str, pasts: list[tuple[str, str]] | None = None,
          memories: list[tuple[str, str]] | None = None, progress=None, name: str = "stack"
          ) -> tuple[str, list[tuple[str, str] | None]]:
    """Embeddings, the values all layers share (made by ``target``), the blocks, the final norm.

    ``inputs`` are the graph's inputs by contract name (``input_ids``, ``attention_mask``,
    ``position_ids``, ``token_type_ids``, ``encoder_attention_mask``, a layout's own ...).
    Causal or not as the module is (``module.causal``).
    Returns (states [B, S, E] in the model dtype, per-layer present (k, v) or None).
    """
    ctx = target.stack_inputs(g, module, config, inputs, module.causal, name)
    x = g.tap(f"{name}.embed", embeddings(g, target, module.embed, config, inputs["input_ids"],
                                          inputs.get("position_ids"), inputs.get("token_type_ids"), token_table,
                                          f"{name}.embed"))
    stream, presents = Residual(x), []
    for i, layer in enumerate(module.layers):
        past = pasts[i] if pasts is not None else None
        memory = memories[i] if memories is not None else None
        stream, present = block(g, stream, layer, config, ctx.layer(config, i), past, memory, f"{name}.layers.{i}")
        presents.append(present)
        if progress is not None:
            progress.update(1)
    if module.norm is None:
        return settle(g, stream), presents
    return g.tap(f"{name}.norm", normed(g, target, stream, module.norm, f"{name}.norm")[0]), presents
