"""The graphs of an export, one builder per graph of the contract (``tfport.contract.graph_specs``):
each declares the spec's inputs, emits the stacks (``emit``) and heads (``heads``) of the module,
and exposes the spec's outputs. Which graphs a model has is the contract's; how attention and the
cache are lowered is the target's.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from torch import nn

from tfport.config import ModelConfig
from tfport.contract import GraphSpec, cache_names
from tfport.dtypes import ONNX_DTYPES

from . import emit
from .graph import GraphBuilder, to_numpy
from .heads import classifier, classifier_head, last_slot, lm_head, mask_positions, token_table
from .lowering import Target
from .quant import Quantization


def build_encoder_graph(model: nn.Module, spec: GraphSpec, dtype: str, target: Target,
                        progress=None, quantization: Quantization | None = None,
                        data_file: Path | None = None) -> GraphBuilder:
    """Encoder graph of an EncoderModel or of an EncoderDecoderLM (which adds cross K/V outputs)."""
    config: ModelConfig = model.config
    g = _builder("encoder", dtype, target, quantization, data_file)
    inputs = _declare(g, spec)
    body = model.encoder
    table = token_table(g, body.embed.tokens)
    if config.uses_position_ids:
        inputs["position_ids"] = mask_positions(g, inputs["attention_mask"])
    states, _ = emit.stack(g, body, config, target, inputs, token_table=table, progress=progress, name="encoder")
    values = {"last_hidden_state": states}
    if getattr(model, "pooler", None) is not None:
        first = g.op("Gather", states, g.const(0, name="first"), axis=1, name="pooler.first")  # [B, E]
        values["pooler_output"] = g.op("Tanh", emit.linear(g, first, model.pooler, "pooler.dense"), name="pooler")
    if getattr(model, "mlm", None) is not None:
        mlm = model.mlm
        h = emit.activation(g, emit.linear(g, states, mlm.dense, "mlm.dense"), config.activation, "mlm.act")
        h = emit.norm(g, h, mlm.norm, "mlm.norm")
        if config.tie_embeddings:
            values["logits"] = emit.project(g, h, table, "mlm.decoder", bias=to_numpy(mlm.decoder.bias),
                                            transposed=True)
        else:
            values["logits"] = emit.linear(g, h, mlm.decoder, "mlm.decoder")
    if getattr(model, "classifier", None) is not None:
        values["class_logits"] = classifier(g, states, inputs["attention_mask"], model.classifier, config)
    if config.family == "encoder-decoder":
        memories = [emit.cross_memory(g, states, layer.cross_attn, f"decoder.layers.{i}.cross_attn")
                    for i, layer in enumerate(model.decoder.layers)]
        values.update(_presents(memories, config.n_decoder_layers, "encoder"))
    _outputs(g, spec, values)
    return g


def build_decoder_graph(model: nn.Module, spec: GraphSpec, dtype: str, target: Target,
                        progress=None, quantization: Quantization | None = None,
                        data_file: Path | None = None) -> GraphBuilder:
    """Decoder graph of a DecoderLM or EncoderDecoderLM: one graph for prefill and decode."""
    config: ModelConfig = model.config
    seq2seq = config.family == "encoder-decoder"
    kind = "decoder" if seq2seq else None
    g = _builder("decoder", dtype, target, quantization, data_file)
    inputs = _declare(g, spec)
    n = config.n_decoder_layers
    # The self-attention cache is handed to the target in its own dtype (the target decides where
    # it is cast); the cross-attention K/V are read in the compute dtype.
    g.kv_dtype = spec.input(cache_names(0, "past_key_values", kind)[0]).dtype
    pasts = [tuple(inputs[name] for name in cache_names(i, "past_key_values", kind)) for i in range(n)]
    memories = None
    if seq2seq:
        memories = [tuple(_in_compute_dtype(g, inputs[name]) for name in cache_names(i, "past_key_values", "encoder"))
                    for i in range(n)]
    table = token_table(g, model.decoder.embed.tokens)
    states, presents = emit.stack(g, model.decoder, config, target, inputs, token_table=table,
                                  pasts=pasts, memories=memories, progress=progress, name="decoder")
    # the head runs on each row's last new token alone when the ``last_logits`` input says so
    values = {"logits": lm_head(g, target.last_positions(g, states, inputs), model, table)}
    values.update(_presents(presents, n, kind))
    _outputs(g, spec, values)
    return g


def build_classifier_graph(model: nn.Module, spec: GraphSpec, dtype: str, target: Target,
                           progress=None, quantization: Quantization | None = None,
                        data_file: Path | None = None) -> GraphBuilder:
    """Classifier graph of an EncoderDecoderLM with a classification head
    (``EncoderDecoderLM.classify``): the encoder, the decoder over input_ids shifted right with
    the cross-attention K/V computed in place, the head at each row's last real eos."""
    config: ModelConfig = model.config
    g = _builder("classifier", dtype, target, quantization, data_file)
    inputs = _declare(g, spec)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    table = token_table(g, model.encoder.embed.tokens)  # both stacks read the one table
    encoder_inputs = dict(inputs)
    if config.uses_position_ids:
        encoder_inputs["position_ids"] = mask_positions(g, mask)
    states, _ = emit.stack(g, model.encoder, config, target, encoder_inputs, token_table=table,
                           progress=progress, name="encoder")
    memories = [emit.cross_memory(g, states, layer.cross_attn, f"decoder.layers.{i}.cross_attn")
                for i, layer in enumerate(model.decoder.layers)]
    # decoder input: [start, ids[:, :-1]] [B, S]; no padding mask (causal attention keeps each
    # eos from later slots), so its positions are the slots 0..S-1
    ones = g.op("Expand", g.const(1, name="one_i64"), g.op("Shape", ids), name="classifier.decoder_mask")
    slots = mask_positions(g, ones)  # [B, S]: 0..S-1
    real = g.op("Cast", mask, to=onnx.TensorProto.BOOL, name="classifier.real")  # [B, S]
    kept = g.op("Slice", ids, g.const([0], name="zero_1d"), g.const([-1], name="minus_one_1d"),
                g.const([1], name="axis_1d"), name="classifier.drop_last")  # [B, S-1]
    if config.classifier.decoder_start == "last_token":  # mBART: each row's last real token
        start = g.op("GatherElements", ids, last_slot(g, real, slots, "last_real"), axis=1)  # [B, 1]
        shifted = g.op("Concat", start, kept, axis=1, name="classifier.shift_right")
    else:
        shifted = g.op("Pad", kept, g.const([0, 1, 0, 0], name="shift_pads"),
                       g.const(config.decoder_start_token_id, name="decoder_start"), name="classifier.shift_right")
    decoder_inputs = {"input_ids": shifted, "attention_mask": ones, "encoder_attention_mask": mask}
    if config.uses_position_ids:
        decoder_inputs["position_ids"] = slots
    states, _ = emit.stack(g, model.decoder, config, target, decoder_inputs, token_table=table,
                           memories=memories, progress=progress, name="decoder")
    eos = g.op("And", g.op("Equal", ids, g.const(config.eos_token_id, name="eos")), real,
               name="classifier.eos")  # [B, S]
    last = last_slot(g, eos, slots, "last_eos")  # -1 (the last slot) for a row without eos
    pooled = g.op("GatherND", states, last, batch_dims=1, name="classifier.pool")  # [B, E]
    _outputs(g, spec, {"class_logits": classifier_head(g, pooled, model.classifier, config)})
    return g


BUILDERS = {"encoder": build_encoder_graph, "decoder": build_decoder_graph, "classifier": build_classifier_graph}


def _builder(name: str, dtype: str, target: Target, quantization: Quantization | None,
             data_file: Path | None) -> GraphBuilder:
    g = GraphBuilder(name, dtype, data_file)
    g.quantizer = None if quantization is None else quantization.graph_quantizer(target)
    return g


def _declare(g: GraphBuilder, spec: GraphSpec) -> dict[str, str]:
    return {t.name: g.add_input(t) for t in spec.inputs}


def _outputs(g: GraphBuilder, spec: GraphSpec, values: dict[str, str]) -> None:
    for t in spec.outputs:
        g.add_output(values[t.name], t)


def _presents(presents, n_layers: int, kind: str | None) -> dict[str, str]:
    """Per-layer (k, v) -> {contract output name: value}."""
    out = {}
    for i in range(n_layers):
        key, value = cache_names(i, "present", kind)
        out[key], out[value] = presents[i]
    return out


def _in_compute_dtype(g: GraphBuilder, value: str) -> str:
    """``value`` (a graph input) cast to the compute dtype where it is in another (a KV cache)."""
    if g.value_dtypes.get(value, g.dtype) == g.dtype:
        return value
    return g.op("Cast", value, to=ONNX_DTYPES[g.dtype], name=f"{value}.compute")
