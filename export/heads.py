"""Emitters of the heads that read a stack's states: the LM head, the sequence classifier, and the
small position helpers the graphs share (positions from a mask, each row's last matching slot).

They mirror ``tfport.models`` (``DecoderLM``'s head, ``encoder.ClassifierHead``) as ``emit`` does
the stacks; the graph builders (``graphs``) put them after the stacks.
"""

from __future__ import annotations

from torch import nn

from tfport.config import ModelConfig

from . import emit
from .graph import GraphBuilder, to_numpy


def token_table(g: GraphBuilder, tokens: nn.Embedding) -> str:
    """The token embedding table [V, E] as a graph value (gathered from quantised rows when the
    graph's quantiser takes the embeddings)."""
    if g.quantizer is not None and g.quantizer.scheme.embeddings:
        return g.quantizer.table(g, "tokens", to_numpy(tokens.weight))
    return g.weight("tokens", to_numpy(tokens.weight))


def lm_head(g: GraphBuilder, x: str, model: nn.Module, table: str) -> str:
    """Logits [B, S, V] from states x [B, S, E]: tied heads read the embedding table [V, E]
    transposed."""
    if model.config.lm_head_scale != 1.0:
        x = g.op("Mul", x, g.const(model.config.lm_head_scale, g.dtype, "lm_head_scale"), name="lm_head.scale")
    if model.config.tie_embeddings:
        head_bias = model.lm_head.bias if getattr(model, "lm_head", None) is not None else None
        logits = emit.project(g, x, table, "lm_head", transposed=True,
                              bias=None if head_bias is None else to_numpy(head_bias))
    else:
        logits = emit.linear(g, x, model.lm_head, "lm_head")
    cap = model.config.final_logit_softcap
    if cap is not None:  # Gemma 2: c * tanh(logits / c), in the model dtype as the reference
        c = g.const(cap, g.dtype, "final_logit_softcap")
        logits = g.op("Mul", g.op("Tanh", g.op("Div", logits, c, name="lm_head.softcap_div")), c,
                      name="lm_head.softcap")
    return logits


def classifier(g: GraphBuilder, states: str, attention_mask: str, head: nn.Module, config: ModelConfig) -> str:
    """Sequence classification logits [B, n_labels] from states [B, S, E]
    (tfport.models.encoder.ClassifierHead)."""
    if head.pooling == "cls":
        pooled = g.op("Gather", states, g.const(0, name="first"), axis=1, name="classifier.first")  # [B, E]
    else:  # mean over real tokens
        weights = g.op("Unsqueeze", g.op("CastLike", attention_mask, states, name="classifier.mask"),
                       g.const([2], name="axis2"), name="classifier.weights")  # [B, S, 1]
        total = g.op("ReduceSum", g.op("Mul", states, weights), g.const([1], name="axis1"), keepdims=0)
        count = g.op("ReduceSum", weights, g.const([1], name="axis1"), keepdims=0)  # [B, 1]
        count = g.op("Max", count, g.const(1.0, g.dtype, "one_f"), name="classifier.count")
        pooled = g.op("Div", total, count, name="classifier.mean")  # [B, E]
    return classifier_head(g, pooled, head, config)


def classifier_head(g: GraphBuilder, pooled: str, head: nn.Module, config: ModelConfig) -> str:
    """Pooled states [B, E] -> logits [B, n_labels] (``ClassifierHead.classify``)."""
    h = emit.linear(g, pooled, head.dense, "classifier.dense")
    if config.classifier.activation == "tanh":
        h = g.op("Tanh", h, name="classifier.act")
    else:
        h = emit.activation(g, h, config.classifier.activation, "classifier.act")
    if head.norm is not None:
        h = emit.norm(g, h, head.norm, "classifier.norm")
    return g.tap("classifier", emit.linear(g, h, head.out, "classifier.out"))


def last_slot(g: GraphBuilder, where: str, slots: str, name: str) -> str:
    """int64 [B, 1]: each row's last slot where ``where`` [B, S] holds, -1 where it never does."""
    return g.op("ReduceMax", g.op("Where", where, slots, g.const(-1, name="none")), g.const([1], name="axis1"),
                keepdims=1, name=f"classifier.{name}")


def mask_positions(g: GraphBuilder, mask: str) -> str:
    """Positions [B, S] that count real tokens: cumsum(mask) - 1, at least 0."""
    counts = g.op("CumSum", mask, g.const(1, name="axis"), name="positions.cumsum")
    return g.op("Max", g.op("Sub", counts, g.const(1, name="one")), g.const(0, name="zero"), name="positions")
