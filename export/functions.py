"""tfport's ONNX function library, written in onnxscript, in the custom domain ``ai.tfport``.

Exported graphs call these as nodes (``ai.tfport.RotaryEmbedding`` ...) and carry their bodies as
model-local functions, so a viewer shows one rotary / ALiBi / attention node per use that opens
into its body, and a backend with a fused kernel can swap the node for it.

Deliberate numeric choices, shared with the PyTorch reference (tfport.models):

* Masked attention entries get the float32 minimum (finite), not -inf: a fully masked row (a
  padded query) softmaxes to a uniform distribution instead of NaN, and padding rows stay finite.
* Scores, the additive bias and the softmax are float32 for every model dtype, so an fp16 model
  cannot overflow ``score + bias`` to -inf.
* Rotary angles, cos and sin are computed in float32 from int64 positions.

Shape legend: B batch, S new tokens, P past length, T = P + S, H query heads, Hkv key/value
heads, G = H / Hkv, D head dim, E model dim.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnxscript import BOOL, FLOAT, INT64, script, values
from onnxscript import opset18 as op
from onnxscript.values import OnnxFunction

DOMAIN = "ai.tfport"
DOMAIN_VERSION = 1
tfport = values.Opset(DOMAIN, DOMAIN_VERSION)

MASK_VALUE = float(np.finfo(np.float32).min)


@script(tfport, default_opset=op)
def AttentionBias(attention_mask, query_length, causal: int, window: int):
    """Additive float32 attention bias [B, 1, S, T] from a 0/1 padding mask.

    PyTorch: ``tfport.models.masks.attention_bias(attention_mask, S, causal, window or None)``.
    attention_mask int64 [B, T] (1 = real token); query_length int64 [1] = S, the queries being the
    last S of the T positions. Entry (b, s, t) is 0 when key t is real, if ``causal`` not after
    query s (absolute index T - S + s), and if ``window`` W > 0 (sliding-window attention) fewer
    than W positions before the query when ``causal``, at most W // 2 positions away on either
    side otherwise, positions counting real tokens (cumsum(mask) - 1, at least 0); otherwise the
    finite float32 minimum (see module doc). ``window`` 0 means no window.
    """
    total = op.Squeeze(op.Shape(attention_mask, start=1, end=2))
    length = op.Squeeze(query_length)
    one = op.Constant(value_int=1)
    key_index = op.Unsqueeze(op.Range(op.Constant(value_int=0), total, one), op.Constant(value_ints=[0]))  # [1, T]
    query_index = op.Unsqueeze(op.Range(op.Sub(total, length), total, one), op.Constant(value_ints=[1]))  # [S, 1]
    not_causal = op.Not(op.Cast(op.Constant(value_int=causal), to=BOOL.dtype))
    in_order = op.Or(op.LessOrEqual(key_index, query_index), not_causal)  # [S, T]
    real_key = op.Unsqueeze(op.Cast(attention_mask, to=BOOL.dtype), op.Constant(value_ints=[1, 2]))  # [B, 1, 1, T]
    counts = op.CumSum(attention_mask, op.Constant(value_int=1))
    position = op.Max(op.Sub(counts, op.Constant(value_int=1)), op.Constant(value_int=0))  # [B, T]
    # Gathered (not sliced) at the query slots, clamped at 0, so that the shape is [B, S] even
    # where S exceeds T (cross-attention masks, which have no window).
    query_slots = op.Max(op.Range(op.Sub(total, length), total, one), op.Constant(value_int=0))  # [S]
    query_position = op.Gather(position, query_slots, axis=1)  # [B, S]
    distance = op.Sub(op.Unsqueeze(query_position, op.Constant(value_ints=[2])),
                      op.Unsqueeze(position, op.Constant(value_ints=[1])))  # [B, S, T]
    width = op.Constant(value_int=window)
    before = op.Less(distance, width)  # causal: W keys up to the query
    around = op.LessOrEqual(op.Abs(distance), op.Div(width, op.Constant(value_int=2)))  # two-sided
    in_window = op.Or(op.And(not_causal, around), op.And(op.Not(not_causal), before))  # [B, S, T]
    near = op.Or(in_window, op.LessOrEqual(width, op.Constant(value_int=0)))
    keep = op.And(op.And(real_key, in_order), op.Unsqueeze(near, op.Constant(value_ints=[1])))  # [B, 1, S, T]
    return op.Where(keep, op.Constant(value_float=0.0), op.Constant(value_float=MASK_VALUE))


@script(tfport, default_opset=op)
def AlibiBias(attention_mask, query_length, slopes):
    """ALiBi bias float32 [B, H, S, T] = -slope_h * |pos(query) - pos(key)| (Press et al., 2022).

    PyTorch: ``tfport.models.positions.alibi_bias``. Positions count the real tokens before each
    slot (cumsum of the mask - 1, clamped at 0), so left padding does not shift distances.
    attention_mask int64 [B, T]; query_length int64 [1]; slopes float32 [H].
    """
    counts = op.CumSum(attention_mask, op.Constant(value_int=1))
    key_pos = op.Cast(op.Max(op.Sub(counts, op.Constant(value_int=1)), op.Constant(value_int=0)),
                      to=FLOAT.dtype)  # [B, T]
    total = op.Shape(attention_mask, start=1, end=2)
    query_pos = op.Slice(key_pos, op.Sub(total, query_length), total, op.Constant(value_ints=[1]))  # [B, S]
    distance = op.Abs(op.Sub(op.Unsqueeze(query_pos, op.Constant(value_ints=[2])),
                             op.Unsqueeze(key_pos, op.Constant(value_ints=[1]))))  # [B, S, T]
    slope = op.Unsqueeze(op.Neg(slopes), op.Constant(value_ints=[0, 2, 3]))  # [1, H, 1, 1]
    return op.Mul(slope, op.Unsqueeze(distance, op.Constant(value_ints=[1])))  # [B, H, S, T]


@script(tfport, default_opset=op)
def RelativePositionBias(attention_mask, query_length, table, bidirectional: int, num_buckets: int,
                         max_exact: int, log_max_ratio: float):
    """T5 relative attention bias float32 [B, H, S, T] (Raffel et al., 2020).

    PyTorch: ``tfport.models.positions.relative_bias``. attention_mask int64 [B, T];
    query_length int64 [1]; table [buckets, H]. Relative position = pos(key) - pos(query), with
    positions counted over real tokens. ``num_buckets`` is the table size, halved when
    ``bidirectional`` (keys after the query use the upper half); distances below ``max_exact``
    get their own bucket, larger ones share log-spaced buckets up to the max distance
    (``log_max_ratio`` = log(max_distance / max_exact), computed in double like PyTorch's).
    """
    counts = op.CumSum(attention_mask, op.Constant(value_int=1))
    key_pos = op.Max(op.Sub(counts, op.Constant(value_int=1)), op.Constant(value_int=0))  # [B, T]
    total = op.Shape(attention_mask, start=1, end=2)
    query_pos = op.Slice(key_pos, op.Sub(total, query_length), total, op.Constant(value_ints=[1]))  # [B, S]
    relative = op.Sub(op.Unsqueeze(key_pos, op.Constant(value_ints=[1])),
                      op.Unsqueeze(query_pos, op.Constant(value_ints=[2])))  # [B, S, T]
    two_sided = op.Cast(op.Constant(value_int=bidirectional), to=BOOL.dtype)
    zero = op.Constant(value_int=0)
    buckets = op.Constant(value_int=num_buckets)
    exact = op.Constant(value_int=max_exact)
    offset = op.Where(two_sided, op.Mul(op.Cast(op.Greater(relative, zero), to=INT64.dtype), buckets), zero)
    distance = op.Where(two_sided, op.Abs(relative), op.Max(op.Neg(relative), zero))
    ratio = op.Div(op.Log(op.Div(op.Cast(op.Max(distance, op.Constant(value_int=1)), to=FLOAT.dtype),
                                 op.Cast(exact, to=FLOAT.dtype))),
                   op.Constant(value_float=log_max_ratio))
    large = op.Add(exact, op.Cast(op.Mul(ratio, op.Cast(op.Sub(buckets, exact), to=FLOAT.dtype)), to=INT64.dtype))
    large = op.Min(large, op.Sub(buckets, op.Constant(value_int=1)))
    bucket = op.Add(offset, op.Where(op.Less(distance, exact), distance, large))  # [B, S, T]
    bias = op.Transpose(op.Gather(table, bucket), perm=[0, 3, 1, 2])  # [B, H, S, T]
    return op.Cast(bias, to=FLOAT.dtype)


@script(tfport, default_opset=op)
def DisentangledIndex(attention_mask, query_length, table):
    """Rows of DeBERTa's relative embeddings int64 [S, T]: which row query s reads for key t.

    PyTorch: ``tfport.models.disentangled.relative_index(table, S, T)``. attention_mask [B, T]
    (only its length T is read); query_length int64 [1] = S, the last S of the T slots; table
    int64 [2M + 1] (``tfport.models.disentangled.index_table``: the row of each relative position
    in [-M, M], its log buckets computed at export as the reference computes them). Entry (s, t)
    = table[clip(i - t, -M, M) + M] with i = T - S + s: slot indices, as transformers numbers
    them (for real tokens, the same differences as mask-counted positions under left or right
    padding; padded keys are masked anyway).
    """
    total = op.Squeeze(op.Shape(attention_mask, start=1, end=2))
    length = op.Squeeze(query_length)
    one = op.Constant(value_int=1)
    limit = op.Div(op.Sub(op.Squeeze(op.Shape(table)), one), op.Constant(value_int=2))  # M
    query = op.Unsqueeze(op.Range(op.Sub(total, length), total, one), op.Constant(value_ints=[1]))  # [S, 1]
    key = op.Unsqueeze(op.Range(op.Constant(value_int=0), total, one), op.Constant(value_ints=[0]))  # [1, T]
    relative = op.Min(op.Max(op.Sub(query, key), op.Neg(limit)), limit)  # [S, T]
    return op.Gather(table, op.Add(relative, limit))


@script(tfport, default_opset=op)
def DisentangledScores(content, positions, index):
    """One disentangled term, float32 [B, H, N, M]: entry (n, m) = content_n . positions[index[n, m]].

    PyTorch: ``tfport.models.disentangled.relative_scores``. content [B, H, N, D] (model dtype);
    positions [H, 2R, D]; index int64 [N, M]. The N x 2R products are one MatMul in the model
    dtype (cast to float32 after, as the reference), then gathered. DeBERTa's c2p is
    ``DisentangledScores(query, Kr, index)``; its p2c is ``DisentangledScores(key, Qr, index^T)``
    transposed.
    """
    scores = op.Cast(op.MatMul(content, op.Transpose(positions, perm=[0, 2, 1])), to=FLOAT.dtype)  # [B, H, N, 2R]
    shape = op.Concat(op.Shape(scores, start=0, end=2), op.Shape(index), axis=0)  # [B, H, N, M]
    return op.GatherElements(scores, op.Expand(index, shape), axis=3)


@script(tfport, default_opset=op)
def DisentangledBias(query, key, pos_query, pos_key, index, scale: float):
    """DeBERTa's disentangled attention bias float32 [B, H, S, T] = (c2p + p2c) * scale
    (He et al., 2021), added to the scaled scores q k^T * scale.

    PyTorch: ``tfport.models.disentangled.DisentangledBias.bias`` with both terms. query
    [B, H, S, D]; key [B, H, T, D]; pos_query, pos_key [H, 2R, D] = the layer's query and key
    projections of the normalised relative embeddings (Qr, Kr: weights only, so the exporter
    computes them once, with the reference's function, from the weights the graph's products
    use); index int64 [S, T] (``DisentangledIndex``). c2p(s, t) = query_s . Kr[index[s, t]];
    p2c(s, t) = key_t . Qr[index[s, t]] (DeBERTa gathers p2c at the transposed relative position,
    whose bucket is the negated one, so both terms read the same row).
    """
    c2p = DisentangledScores(query, pos_key, index)  # [B, H, S, T]
    p2c = op.Transpose(DisentangledScores(key, pos_query, op.Transpose(index, perm=[1, 0])),
                       perm=[0, 1, 3, 2])  # [B, H, T, S] -> [B, H, S, T]
    return op.Mul(op.Add(c2p, p2c), op.Constant(value_float=scale))


@script(tfport, default_opset=op)
def RotaryEmbedding(x, position_ids, inv_freq):
    """Rotary position embedding (RoPE, Su et al., 2021), "rotate half" channel pairing.

    PyTorch: ``apply_rope(x, *rope_cos_sin(position_ids, inv_freq))``. x [B, N, S, D];
    position_ids int64 [B, S]; inv_freq float32 [D/2] (scaling already folded in). Channel i is
    rotated with channel i + D/2 by angle position * inv_freq[i]; computed in float32.
    """
    positions = op.Unsqueeze(op.Cast(position_ids, to=FLOAT.dtype), op.Constant(value_ints=[1, 3]))  # [B, 1, S, 1]
    angles = op.Mul(positions, inv_freq)  # [B, 1, S, D/2]
    cos = op.Cos(angles)
    sin = op.Sin(angles)
    first, second = op.Split(op.Cast(x, to=FLOAT.dtype), axis=-1, num_outputs=2)  # [B, N, S, D/2] each
    rotated = op.Concat(op.Sub(op.Mul(first, cos), op.Mul(second, sin)),
                        op.Add(op.Mul(second, cos), op.Mul(first, sin)), axis=-1)
    return op.CastLike(rotated, x)


@script(tfport, default_opset=op)
def InterleavedRotaryEmbedding(x, position_ids, inv_freq):
    """Rotary position embedding with GPT-J's "rotate every two" pairing: channel 2i is rotated
    with channel 2i + 1 by angle position * inv_freq[i]; computed in float32.

    PyTorch: ``apply_rope(x, *rope_cos_sin(position_ids, inv_freq), interleaved=True)``.
    x [B, N, S, D]; position_ids int64 [B, S]; inv_freq float32 [D/2].
    """
    positions = op.Unsqueeze(op.Cast(position_ids, to=FLOAT.dtype), op.Constant(value_ints=[1, 3]))  # [B, 1, S, 1]
    angles = op.Mul(positions, inv_freq)  # [B, 1, S, D/2]
    cos = op.Unsqueeze(op.Cos(angles), op.Constant(value_ints=[-1]))  # [B, 1, S, D/2, 1]
    sin = op.Unsqueeze(op.Sin(angles), op.Constant(value_ints=[-1]))
    shape = op.Shape(x)
    pairs = op.Reshape(op.Cast(x, to=FLOAT.dtype), op.Constant(value_ints=[0, 0, 0, -1, 2]))  # [B, N, S, D/2, 2]
    first, second = op.Split(pairs, axis=-1, num_outputs=2)  # [B, N, S, D/2, 1] each
    rotated = op.Concat(op.Sub(op.Mul(first, cos), op.Mul(second, sin)),
                        op.Add(op.Mul(second, cos), op.Mul(first, sin)), axis=-1)  # [B, N, S, D/2, 2]
    return op.CastLike(op.Reshape(rotated, shape), x)


@script(tfport, default_opset=op)
def GroupedScores(query, key, scale: float):
    """Scaled attention scores float32 [B, H, S, T] = query key^T * scale, with H query heads
    over Hkv key heads: query heads are grouped [B, Hkv, G, S, D] and keys broadcast over G
    (MHA: G = 1; MQA: Hkv = 1), never copied. query [B, H, S, D]; key [B, Hkv, T, D]."""
    zero = op.Constant(value_ints=[0])
    rest = op.Constant(value_ints=[-1])
    heads = op.Shape(query, start=1, end=2)
    kv_heads = op.Shape(key, start=1, end=2)
    length = op.Shape(query, start=2, end=3)
    grouped = op.Reshape(query, op.Concat(zero, kv_heads, op.Div(heads, kv_heads), length, rest,
                                          axis=0))  # [B, Hkv, G, S, D]
    keys_t = op.Unsqueeze(op.Transpose(key, perm=[0, 1, 3, 2]), op.Constant(value_ints=[2]))  # [B, Hkv, 1, D, T]
    scores = op.Cast(op.MatMul(grouped, keys_t), to=FLOAT.dtype)  # [B, Hkv, G, S, T]
    scores = op.Reshape(scores, op.Concat(zero, heads, length, rest, axis=0))  # [B, H, S, T]
    return op.Mul(scores, op.Constant(value_float=scale))


@script(tfport, default_opset=op)
def GroupedContext(scores, value, query):
    """softmax(scores) value -> [B, S, H*D]: scores float32 [B, H, S, T] (scaled, bias added);
    value [B, Hkv, T, D] broadcast over each group of G query heads; the probabilities are cast
    to the query's dtype (query [B, H, S, D] gives the dtype and the output shape)."""
    zero = op.Constant(value_ints=[0])
    rest = op.Constant(value_ints=[-1])
    heads = op.Shape(query, start=1, end=2)
    kv_heads = op.Shape(value, start=1, end=2)
    length = op.Shape(query, start=2, end=3)
    probs = op.CastLike(op.Softmax(scores, axis=-1), query)
    probs = op.Reshape(probs, op.Concat(zero, kv_heads, op.Div(heads, kv_heads), length, rest,
                                        axis=0))  # [B, Hkv, G, S, T]
    out = op.MatMul(probs, op.Unsqueeze(value, op.Constant(value_ints=[2])))  # [B, Hkv, G, S, D]
    out = op.Transpose(op.Reshape(out, op.Shape(query)), perm=[0, 2, 1, 3])  # [B, S, H, D]
    return op.Reshape(out, op.Concat(zero, zero, rest, axis=0))  # [B, S, H*D]


@script(tfport, default_opset=op)
def ScaledDotProductAttention(query, key, value, bias, scale: float):
    """softmax(query key^T * scale + bias) value, with H query heads over Hkv key/value heads.

    PyTorch: ``tfport.models.attention.grouped_attention``. query [B, H, S, D]; key, value
    [B, Hkv, T, D]; bias float32 [B, 1 or H, S, T] -> [B, S, H*D]. Query heads are grouped
    [B, Hkv, G, S, D] and key/value broadcast over G (MHA: G = 1; MQA: Hkv = 1), never copied.
    Scores, bias and softmax are float32.
    """
    return GroupedContext(op.Add(GroupedScores(query, key, scale=scale), bias), value, query)


@script(tfport, default_opset=op)
def SoftcapScaledDotProductAttention(query, key, value, bias, scale: float, softcap: float):
    """``ScaledDotProductAttention`` with Gemma 2's attention-logit soft-capping: the scaled
    float32 scores s become softcap * tanh(s / softcap) before the bias is added (so masked
    entries stay at the float32 minimum). PyTorch: ``grouped_attention(..., softcap=softcap)``.
    query [B, H, S, D]; key, value [B, Hkv, T, D]; bias float32 [B, 1 or H, S, T] -> [B, S, H*D].
    """
    cap = op.Constant(value_float=softcap)
    capped = op.Mul(op.Tanh(op.Div(GroupedScores(query, key, scale=scale), cap)), cap)
    return GroupedContext(op.Add(capped, bias), value, query)


@script(tfport, default_opset=op)
def GroupQueryAttention(query, key, value, past_key, past_value, bias, scale: float):
    """Causal/padded self-attention over a KV cache (MHA, GQA or MQA by the head counts).

    PyTorch: ``tfport.models.attention.Attention.forward`` after the projections. query
    [B, H, S, D]; key, value [B, Hkv, S, D] (new tokens); past_key, past_value [B, Hkv, P, D];
    bias float32 [B, 1 or H, S, P+S] (masks, ALiBi) -> output [B, S, H*D], present_key and
    present_value [B, Hkv, P+S, D] (past followed by the new tokens).
    """
    present_key = op.Concat(past_key, key, axis=2)
    present_value = op.Concat(past_value, value, axis=2)
    output = ScaledDotProductAttention(query, present_key, present_value, bias, scale=scale)
    return output, present_key, present_value


@script(tfport, default_opset=op)
def SoftcapGroupQueryAttention(query, key, value, past_key, past_value, bias, scale: float, softcap: float):
    """``GroupQueryAttention`` whose scores are soft-capped as in
    ``SoftcapScaledDotProductAttention`` (Gemma 2). Shapes as ``GroupQueryAttention``."""
    present_key = op.Concat(past_key, key, axis=2)
    present_value = op.Concat(past_value, value, axis=2)
    output = SoftcapScaledDotProductAttention(query, present_key, present_value, bias, scale=scale,
                                              softcap=softcap)
    return output, present_key, present_value


@script(tfport, default_opset=op)
def RMSNorm(x, weight, epsilon: float):
    """x / sqrt(mean(x^2, last axis) + epsilon) * weight, in float32. x [..., E]; weight [E].

    PyTorch: ``tfport.models.layers.RMSNorm``. Written as Pow -> ReduceMean -> Add -> Sqrt -> Div
    -> Mul, the pattern ONNX Runtime fuses into one SimplifiedLayerNormalization kernel (and, with
    the residual Add before it, SkipSimplifiedLayerNormalization).
    """
    xf = op.Cast(x, to=FLOAT.dtype)
    mean_square = op.ReduceMean(op.Pow(xf, op.Constant(value_float=2.0)), op.Constant(value_ints=[-1]),
                                keepdims=1)
    normed = op.Div(xf, op.Sqrt(op.Add(mean_square, op.Constant(value_float=epsilon))))
    return op.Mul(op.CastLike(normed, x), weight)


@script(tfport, default_opset=op)
def SoftmaxTopKRouting(logits, top_k, normalize: int):
    """Mixture-of-experts routing weights float32 [B, S, N]: softmax over the N experts, the top
    k kept (divided by their sum when ``normalize`` is 1), zero elsewhere (Mixtral, Qwen2/3-MoE).

    PyTorch: ``tfport.models.moe.routing_weights(logits, k, "softmax_topk", normalize)``.
    logits [B, S, N] (any float dtype; float32 from here); top_k int64 [1] = k.
    """
    probs = op.Softmax(op.Cast(logits, to=FLOAT.dtype), axis=-1)
    top, index = op.TopK(probs, top_k, axis=-1)  # [B, S, k]
    total = op.ReduceSum(top, op.Constant(value_ints=[-1]), keepdims=1)  # [B, S, 1]
    flag = op.Cast(op.Constant(value_int=normalize), to=BOOL.dtype)
    top = op.Div(top, op.Where(flag, total, op.Constant(value_float=1.0)))
    return op.ScatterElements(op.Expand(op.Constant(value_float=0.0), op.Shape(probs)), index, top, axis=-1)


@script(tfport, default_opset=op)
def TopKSoftmaxRouting(logits, top_k):
    """Mixture-of-experts routing weights float32 [B, S, N]: the top k logits, softmax over
    those k, zero elsewhere (gpt-oss).

    PyTorch: ``tfport.models.moe.routing_weights(logits, k, "topk_softmax", normalize)``.
    logits [B, S, N]; top_k int64 [1] = k.
    """
    logits = op.Cast(logits, to=FLOAT.dtype)
    top, index = op.TopK(logits, top_k, axis=-1)  # [B, S, k]
    weights = op.Softmax(top, axis=-1)
    return op.ScatterElements(op.Expand(op.Constant(value_float=0.0), op.Shape(logits)), index, weights, axis=-1)


FUNCTIONS = (AttentionBias, AlibiBias, RelativePositionBias, RotaryEmbedding, InterleavedRotaryEmbedding,
             GroupedScores, GroupedContext, ScaledDotProductAttention, SoftcapScaledDotProductAttention, GroupQueryAttention, SoftcapGroupQueryAttention, RMSNorm,
             DisentangledIndex, DisentangledScores, DisentangledBias, SoftmaxTopKRouting, TopKSoftmaxRouting)


def function_protos(opset: int, bodies: Mapping[str, OnnxFunction]) -> list[onnx.FunctionProto]:
    """The library's FunctionProtos, their standard-domain import set to ``opset``.

    ``bodies`` (an export target's) maps a function name to the onnxscript function that
    implements it: a library function's name gets that body instead, a new name adds a function.
    The portable bodies use only operators whose semantics are unchanged from opset 18 up to the
    newest opset onnx knows, so re-stamping the version keeps them valid for a model of that
    opset; a target whose bodies need a newer opset refuses older ones itself.
    """
    protos = []
    for name, body in {**{f.name: f for f in FUNCTIONS}, **bodies}.items():
        proto = body.to_function_proto()
        proto.name = name
        for entry in proto.opset_import:
            if entry.domain == "":
                entry.version = opset
        protos.append(proto)
    return protos
