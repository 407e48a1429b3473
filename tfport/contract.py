"""The I/O contract between exported graphs and the runtime.

The exporter declares its graphs' inputs and outputs from ``graph_specs`` and writes a
``manifest.json`` beside them (``tfport.manifest``); the runtime reads the manifest and checks each
session against the same specs, so neither side needs anything from the other's Python code.

Graphs per family (dims are named as in the ONNX files):

* ``encoder``  -- ``input_ids`` int64 [batch, sequence], ``attention_mask`` int64 [batch, sequence],
  ``token_type_ids`` int64 [batch, sequence] (if the config has token types) ->
  ``last_hidden_state`` float32 [batch, sequence, E], ``pooler_output`` float32 [batch, E] (if
  pooler), ``logits`` float32 [batch, sequence, V] (if MLM head), ``class_logits`` float32
  [batch, n_labels] (if a sequence classification head); for encoder-decoder models also
  ``present.{i}.encoder.key|value`` [batch, Hkv, sequence, D]: the cross-attention K/V, computed
  once per request.
* ``decoder``  -- ``input_ids`` int64 [batch, sequence], ``attention_mask`` int64
  [batch, total_sequence], ``position_ids`` int64 [batch, sequence] (sinusoidal, learned, RoPE),
  ``past_key_values.{i}.key|value`` [batch, Hkv, past_sequence, D], ``last_logits`` bool
  scalar -> ``logits`` float32 [batch, positions, V] (every position, positions = sequence; or
  with ``last_logits`` each row's last new token's alone, positions = 1: a prefill runs the
  head once per row), ``present.{i}.key|value`` [batch, Hkv, total_sequence, D].
  For encoder-decoder models the self-attention cache is ``...{i}.decoder.key|value``, and the
  graph also takes ``encoder_attention_mask`` int64 [batch, encoder_sequence] and
  ``past_key_values.{i}.encoder.key|value`` [batch, Hkv, encoder_sequence, D].
* ``classifier`` -- the whole export of an encoder-decoder with a sequence classification head
  (``n_labels``; BART's ``ForSequenceClassification``), which does not generate: ``input_ids``
  int64 [batch, sequence], ``attention_mask`` int64 [batch, sequence] (right-padded; each row
  holds ``eos_token_id``) -> ``class_logits`` float32 [batch, n_labels]. Encoder, decoder over
  the ids shifted right, head at each row's last eos, in one graph.

User-facing outputs are float32 whatever the export dtype; KV caches are in the export's cache
dtype (``kv_dtype``: by default float16 for float16 exports, float32 otherwise;
``tfport.dtypes.CACHE_DTYPES``).

How a decoder graph takes its KV cache is its *cache layout* (``LAYOUTS``); each export target
(tfport.export.targets) picks one, the manifest records it, and the runtime picks its decode
strategy from it (tfport.runtime.decoding):

* ``concat`` -- the I/O above: ``present`` = ``past`` followed by the new tokens (every family).
* ``inplace`` (decoder-only) -- prompts are right-padded and described by ``seqlens_k`` int32
  [batch] (index of each row's last real token, past included) and ``total_sequence_length``
  int32 scalar (the longest row's total length) instead of ``attention_mask``; positions come from
  ``seqlens_k``; ``past_key_values.{i}.key|value`` and ``present.{i}.key|value`` are the same
  preallocated buffer [batch, Hkv, max_sequence, D], which the runtime binds to both and the
  graph updates in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import ModelConfig
from .dtypes import CACHE_DTYPES, COMPUTE_DTYPES, cache_dtype

# The files of an export directory besides its graphs (``tfport.manifest.Manifest.required_files``).
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
EXTERNAL_SUFFIX = ".data"  # <graph>.onnx.data: a graph's external weights
DTYPES = tuple(COMPUTE_DTYPES)  # export dtypes: float32, float16, bfloat16 (weights stored bfloat16)
KV_DTYPES = tuple(dict.fromkeys(d for allowed in CACHE_DTYPES.values() for d in allowed))


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, element type and shape (ints or symbolic dim names)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphSpec:
    name: str
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs]}


def cache_names(layer: int, prefix: str, kind: str | None = None) -> tuple[str, str]:
    """Names of one layer's key and value cache, e.g. ``past_key_values.0.decoder.key``.

    ``prefix`` is ``"past_key_values"`` or ``"present"``; ``kind`` is None for decoder-only
    models, ``"decoder"`` (self-attention) or ``"encoder"`` (cross-attention) for seq2seq.
    """
    middle = f"{layer}." if kind is None else f"{layer}.{kind}."
    return f"{prefix}.{middle}key", f"{prefix}.{middle}value"


def _cache_specs(config: ModelConfig, n_layers: int, prefix: str, kind: str | None,
                 length: str, dtype: str) -> list[TensorSpec]:
    shape = ("batch", config.kv_heads, length, config.dim_per_head)
    specs = []
    for layer in range(n_layers):
        specs += [TensorSpec(name, dtype, shape) for name in cache_names(layer, prefix, kind)]
    return specs


def _ids(name: str, length: str) -> TensorSpec:
    return TensorSpec(name, "int64", ("batch", length))


# The decoder's bool scalar input choosing its logits' positions: false, every new token's
# [B, S, V]; true, each row's last new token's [B, 1, V] (the one the next token is picked
# from: S - 1 in layout "concat", whose prompts are left-padded; the row's own last in
# "inplace"), so a prefill that only picks the next token runs the head once per row.
LAST_LOGITS = "last_logits"


def _next_token_logits(config: ModelConfig) -> TensorSpec:
    """A decoder's logits: [B, S, V], or [B, 1, V] with ``last_logits`` (``LAST_LOGITS``)."""
    return TensorSpec("logits", "float32", ("batch", "positions", config.vocab_size))


def _concat_decoder(config: ModelConfig, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Layout "concat": attention mask (+ position ids) in, present = past + new tokens out."""
    seq2seq = config.family == "encoder-decoder"
    kind = "decoder" if seq2seq else None
    n = config.n_decoder_layers
    inputs = [_ids("input_ids", "sequence"), _ids("attention_mask", "total_sequence")]
    if seq2seq:
        inputs.append(_ids("encoder_attention_mask", "encoder_sequence"))
    if config.uses_position_ids:
        inputs.append(_ids("position_ids", "sequence"))
    inputs += _cache_specs(config, n, "past_key_values", kind, "past_sequence", dtype)
    if seq2seq:
        inputs += _cache_specs(config, n, "past_key_values", "encoder", "encoder_sequence", dtype)
    inputs.append(TensorSpec(LAST_LOGITS, "bool", ()))
    outputs = [_next_token_logits(config)] + _cache_specs(config, n, "present", kind, "total_sequence", dtype)
    return inputs, outputs


def _inplace_decoder(config: ModelConfig, dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Layout "inplace": seqlens_k / total_sequence_length in, one buffer as past and present."""
    n = config.n_decoder_layers
    inputs = [_ids("input_ids", "sequence"), TensorSpec("seqlens_k", "int32", ("batch",)),
              TensorSpec("total_sequence_length", "int32", ())]
    inputs += _cache_specs(config, n, "past_key_values", None, "max_sequence", dtype)
    inputs.append(TensorSpec(LAST_LOGITS, "bool", ()))
    outputs = [_next_token_logits(config)] + _cache_specs(config, n, "present", None, "max_sequence", dtype)
    return inputs, outputs


@dataclass(frozen=True)
class CacheLayout:
    """How a decoder graph takes its KV cache: one object per layout, registered in ``LAYOUTS``.

    ``decoder_io(config, kv_dtype)`` -> the decoder graph's (inputs, outputs) TensorSpecs;
    ``padding`` is the side prompts of different lengths are padded on ("left": every row's last
    new token is at S - 1; "right": at its own last real position); ``decoder_only`` refuses
    encoder-decoder configs. The export target that emits a layout names it (``Target.layout``),
    the manifest records it, and the runtime decodes by it (``tfport.runtime.decoding``).
    """

    name: str
    decoder_io: Callable[[ModelConfig, str], tuple[list[TensorSpec], list[TensorSpec]]]
    padding: str = "left"
    decoder_only: bool = False

    def __post_init__(self) -> None:
        if self.padding not in ("left", "right"):
            raise ValueError(f"CacheLayout.padding={self.padding!r}: expected 'left' or 'right'")

    def decoder_specs(self, config: ModelConfig, kv_dtype: str) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The decoder graph's (inputs, outputs) for ``config`` with caches in ``kv_dtype``."""
        if self.decoder_only and config.family != "decoder":
            raise ValueError(f"cache layout {self.name!r} is for decoder-only models, not "
                             f"family={config.family!r}")
        return self.decoder_io(config, kv_dtype)

    def last_positions(self, query_mask: np.ndarray) -> np.ndarray:
        """int [B]: each row's last real new token in ``query_mask`` [B, S] bool, the position a
        decoder returns with ``last_logits``: S - 1 when left-padded, else the row's own last."""
        batch, new = query_mask.shape
        if self.padding == "left":
            return np.full(batch, new - 1)
        return new - 1 - np.argmax(query_mask[:, ::-1], axis=1)


# Cache layout name -> its CacheLayout (register_layout adds one).
LAYOUTS: dict[str, CacheLayout] = {}


def register_layout(layout: CacheLayout) -> CacheLayout:
    """Add ``layout`` to ``LAYOUTS`` (``ValueError`` for a name already taken)."""
    if layout.name in LAYOUTS:
        raise ValueError(f"cache layout {layout.name!r} is already registered")
    LAYOUTS[layout.name] = layout
    return layout


CONCAT = register_layout(CacheLayout("concat", _concat_decoder, padding="left"))
INPLACE = register_layout(CacheLayout("inplace", _inplace_decoder, padding="right", decoder_only=True))


# What a quantised weight product computes its activations in (``tfport export --activations``;
# the manifest's ``quantization[ACTIVATION_KEY]``, absent for the default "int8"): "int8" rounds
# them per block (ONNX Runtime's MatMulNBits at accuracy level 4, its fast kernel, which repacks
# 4-bit weights at 1.2x their bytes), "float" keeps them float32 (level 1: only the weights' own
# error; the weights stay the size they are stored at), "mixed" keeps them float32 for the
# products named in FLOAT_PRODUCTS (those whose inputs carry a transformer's outlier channels:
# the attention's query / key / value projections and the feed-forward's down projection) and
# int8 for the rest.
ACTIVATIONS = ("int8", "float", "mixed")
MATMULNBITS_ACCURACY = {"int8": 4, "float": 1}
FLOAT_PRODUCTS = ("qkv", "q", "kv", "down")  # the last part of a product's graph name


def accuracy_level(activations: str, product: str) -> int:
    """MatMulNBits ``accuracy_level`` of the product named ``product`` in the graph (e.g.
    "decoder.layers.3.ffn.down") in an export whose ``activations`` is one of ACTIVATIONS."""
    if activations == "mixed":
        activations = "float" if product.rsplit(".", 1)[-1] in FLOAT_PRODUCTS else "int8"
    return MATMULNBITS_ACCURACY[activations]


ACTIVATION_KEY = "activation_type"  # (w8a8's entry describes its own under "activations")
# The ONNX Runtime session config entry that sets the accuracy level ONNX Runtime fuses a
# DequantizeLinear + MatMul pair (target "portable") into MatMulNBits with (default 4).
QDQ_ACCURACY_CONFIG = "session.qdq_matmulnbits_accuracy_level"


def graph_specs(config: ModelConfig, dtype: str = "float32", layout: str = "concat",
                kv_dtype: str | None = None) -> dict[str, GraphSpec]:
    """The graphs an export of ``config`` contains, keyed ``"encoder"`` / ``"decoder"`` (or
    ``"classifier"`` alone: an encoder-decoder with ``n_labels``); caches are in ``kv_dtype``
    (None: the export dtype's default, ``tfport.dtypes.cache_dtype``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {list(DTYPES)}")
    cache = cache_dtype(dtype, kv_dtype)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {sorted(LAYOUTS)}")
    graphs: dict[str, GraphSpec] = {}
    if config.family == "encoder-decoder" and config.classifier.n_labels:  # classifies, does not generate
        inputs = (_ids("input_ids", "sequence"), _ids("attention_mask", "sequence"))
        outputs = (TensorSpec("class_logits", "float32", ("batch", config.classifier.n_labels)),)
        return {"classifier": GraphSpec("classifier", "classifier.onnx", inputs, outputs)}
    if config.has_encoder:
        inputs = [_ids("input_ids", "sequence"), _ids("attention_mask", "sequence")]
        if config.type_vocab_size:
            inputs.append(_ids("token_type_ids", "sequence"))
        outputs = [TensorSpec("last_hidden_state", "float32", ("batch", "sequence", config.d_model))]
        if config.pooler:
            outputs.append(TensorSpec("pooler_output", "float32", ("batch", config.d_model)))
        if config.mlm_head:
            outputs.append(TensorSpec("logits", "float32", ("batch", "sequence", config.vocab_size)))
        if config.classifier.n_labels:  # sequence classification head
            outputs.append(TensorSpec("class_logits", "float32", ("batch", config.classifier.n_labels)))
        if config.family == "encoder-decoder":
            outputs += _cache_specs(config, config.n_decoder_layers, "present", "encoder",
                                    "sequence", cache)
        graphs["encoder"] = GraphSpec("encoder", "encoder.onnx", tuple(inputs), tuple(outputs))
    if config.has_decoder:
        inputs, outputs = LAYOUTS[layout].decoder_specs(config, cache)
        graphs["decoder"] = GraphSpec("decoder", "decoder.onnx", tuple(inputs), tuple(outputs))
    return graphs
