"""Export a reference module to a directory of ONNX graphs plus ``manifest.json``.

``export_model`` builds each graph of the contract (tfport.contract.graph_specs) from the module's
weights, checks it with ``onnx.checker`` (full check), writes everything to a temporary directory
and renames it into place, so a failed export leaves nothing behind. Graphs whose weights exceed
``external_data_threshold`` bytes keep them in ``<graph>.onnx.data`` beside the graph.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import onnx
from torch import nn
from tqdm.auto import tqdm

from tfport.config import ModelConfig
from tfport.contract import (CHAT_TEMPLATE_FILE, CONFIG_FILE, DTYPES, MANIFEST_FILE, TOKENIZER_FILE, GraphSpec,
                             Manifest, cache_names, graph_specs)
from tfport.dtypes import ONNX_DTYPES, cache_dtype
from tfport.embedding import EmbeddingSettings
from tfport.generation import GenerationDefaults
from tfport.files import atomic_directory, check_output_dir
from tfport.integrity import graph_metadata, record_files

from . import emit
from .calibrate import Calibration, calibrated_scheme
from .graph import GraphBuilder
from .quantize import QuantScheme, fake_quantize, resolve_scheme
from .quantized_graph import WeightQuantizer
from .targets import DEFAULT_TARGET, Target, get_target

log = logging.getLogger(__name__)

MIN_OPSET, MAX_OPSET = 18, 23
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**26  # below protobuf's 2 GiB limit, with room for the graph


def _token_table(g: GraphBuilder, tokens: nn.Embedding) -> str:
    if g.quantizer is not None and g.quantizer.scheme.embeddings:  # gathered from quantised rows
        return g.quantizer.table(g, "tokens", emit._np(tokens.weight))
    return g.weight("tokens", emit._np(tokens.weight))


def _lm_head(g: GraphBuilder, x: str, model: nn.Module, token_table: str) -> str:
    """Logits [B, S, V]: tied heads read the embedding table [V, E] transposed."""
    if model.config.lm_head_scale != 1.0:
        x = g.op("Mul", x, g.const(model.config.lm_head_scale, g.dtype, "lm_head_scale"), name="lm_head.scale")
    if model.config.tie_embeddings:
        head_bias = model.lm_head.bias if getattr(model, "lm_head", None) is not None else None
        logits = emit.project(g, x, token_table, "lm_head", transposed=True,
                              bias=None if head_bias is None else emit._np(head_bias))
    else:
        logits = emit.linear(g, x, model.lm_head, "lm_head")
    cap = model.config.final_logit_softcap
    if cap is not None:  # Gemma 2: c * tanh(logits / c), in the model dtype as the reference
        c = g.const(cap, g.dtype, "final_logit_softcap")
        logits = g.op("Mul", g.op("Tanh", g.op("Div", logits, c, name="lm_head.softcap_div")), c,
                      name="lm_head.softcap")
    return logits


def _declare(g: GraphBuilder, spec: GraphSpec) -> dict[str, str]:
    return {t.name: g.add_input(t) for t in spec.inputs}


def _outputs(g: GraphBuilder, spec: GraphSpec, values: dict[str, str]) -> None:
    for t in spec.outputs:
        g.add_output(values[t.name], t)


def _presents(presents, n_layers: int, kind: str | None) -> dict[str, str]:
    out = {}
    for i in range(n_layers):
        key, value = cache_names(i, "present", kind)
        out[key], out[value] = presents[i]
    return out


def _classifier(g: GraphBuilder, states: str, attention_mask: str, head: nn.Module, config: ModelConfig) -> str:
    """Sequence classification logits [B, n_labels] (tfport.models.encoder.ClassifierHead)."""
    if head.pooling == "cls":
        pooled = g.op("Gather", states, g.const(0, name="first"), axis=1, name="classifier.first")  # [B, E]
    else:  # mean over real tokens
        weights = g.op("Unsqueeze", g.op("CastLike", attention_mask, states, name="classifier.mask"),
                       g.const([2], name="axis2"), name="classifier.weights")  # [B, S, 1]
        total = g.op("ReduceSum", g.op("Mul", states, weights), g.const([1], name="axis1"), keepdims=0)
        count = g.op("ReduceSum", weights, g.const([1], name="axis1"), keepdims=0)  # [B, 1]
        count = g.op("Max", count, g.const(1.0, g.dtype, "one_f"), name="classifier.count")
        pooled = g.op("Div", total, count, name="classifier.mean")  # [B, E]
    return _classifier_head(g, pooled, head, config)


def _classifier_head(g: GraphBuilder, pooled: str, head: nn.Module, config: ModelConfig) -> str:
    """Pooled states [B, E] -> logits [B, n_labels] (``ClassifierHead.classify``)."""
    h = emit.linear(g, pooled, head.dense, "classifier.dense")
    if config.classifier_activation == "tanh":
        h = g.op("Tanh", h, name="classifier.act")
    else:
        h = emit.activation(g, h, config.classifier_activation, "classifier.act")
    if head.norm is not None:
        h = emit.norm(g, h, head.norm, "classifier.norm")
    return g.tap("classifier", emit.linear(g, h, head.out, "classifier.out"))


def build_encoder_graph(model: nn.Module, spec: GraphSpec, dtype: str, target: Target,
                        progress=None, quantization: QuantScheme | None = None) -> GraphBuilder:
    """Encoder graph of an EncoderModel or of an EncoderDecoderLM (which adds cross K/V outputs)."""
    config: ModelConfig = model.config
    g = GraphBuilder("encoder", dtype)
    g.quantizer = _quantizer(target, quantization)
    inputs = _declare(g, spec)
    body = model.encoder
    table = _token_table(g, body.embed.tokens)
    if config.uses_position_ids:
        inputs["position_ids"] = _mask_positions(g, inputs["attention_mask"])
    states, _ = emit.stack(g, body, config, target, inputs, token_table=table, causal=False,
                           progress=progress, name="encoder")
    values = {"last_hidden_state": states}
    if getattr(model, "pooler", None) is not None:
        first = g.op("Gather", states, g.const(0, name="first"), axis=1, name="pooler.first")  # [B, E]
        values["pooler_output"] = g.op("Tanh", emit.linear(g, first, model.pooler, "pooler.dense"), name="pooler")
    if getattr(model, "mlm", None) is not None:
        mlm = model.mlm
        h = emit.activation(g, emit.linear(g, states, mlm.dense, "mlm.dense"), config.activation, "mlm.act")
        h = emit.norm(g, h, mlm.norm, "mlm.norm")
        if config.tie_embeddings:
            values["logits"] = emit.project(g, h, table, "mlm.decoder", bias=emit._np(mlm.decoder.bias),
                                            transposed=True)
        else:
            values["logits"] = emit.linear(g, h, mlm.decoder, "mlm.decoder")
    if getattr(model, "classifier", None) is not None:
        values["class_logits"] = _classifier(g, states, inputs["attention_mask"], model.classifier, config)
    if config.family == "encoder-decoder":
        memories = [emit.cross_memory(g, states, layer.cross_attn, f"decoder.layers.{i}.cross_attn")
                    for i, layer in enumerate(model.decoder.layers)]
        values.update(_presents(memories, config.n_decoder_layers, "encoder"))
    _outputs(g, spec, values)
    return g


def build_decoder_graph(model: nn.Module, spec: GraphSpec, dtype: str, target: Target,
                        progress=None, quantization: QuantScheme | None = None) -> GraphBuilder:
    """Decoder graph of a DecoderLM or EncoderDecoderLM: one graph for prefill and decode."""
    config: ModelConfig = model.config
    seq2seq = config.family == "encoder-decoder"
    kind = "decoder" if seq2seq else None
    g = GraphBuilder("decoder", dtype)
    g.quantizer = _quantizer(target, quantization)
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
    table = _token_table(g, model.decoder.embed.tokens)
    states, presents = emit.stack(g, model.decoder, config, target, inputs, token_table=table,
                                  causal=True, pasts=pasts, memories=memories, progress=progress,
                                  name="decoder")
    if spec.outputs[0].shape[1] == 1:  # logits="last": the head runs on one position per row
        states = target.last_positions(g, states, inputs)
    values = {"logits": _lm_head(g, states, model, table)}
    values.update(_presents(presents, n, kind))
    _outputs(g, spec, values)
    return g


def build_classifier_graph(model: nn.Module, spec: GraphSpec, dtype: str, target: Target,
                           progress=None, quantization: QuantScheme | None = None) -> GraphBuilder:
    """Classifier graph of an EncoderDecoderLM with a classification head
    (``EncoderDecoderLM.classify``): the encoder, the decoder over input_ids shifted right with
    the cross-attention K/V computed in place, the head at each row's last real eos."""
    config: ModelConfig = model.config
    g = GraphBuilder("classifier", dtype)
    g.quantizer = _quantizer(target, quantization)
    inputs = _declare(g, spec)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    table = _token_table(g, model.encoder.embed.tokens)  # both stacks read the one table
    encoder_inputs = dict(inputs)
    if config.uses_position_ids:
        encoder_inputs["position_ids"] = _mask_positions(g, mask)
    states, _ = emit.stack(g, model.encoder, config, target, encoder_inputs, token_table=table, causal=False,
                           progress=progress, name="encoder")
    memories = [emit.cross_memory(g, states, layer.cross_attn, f"decoder.layers.{i}.cross_attn")
                for i, layer in enumerate(model.decoder.layers)]
    # decoder input: [start, ids[:, :-1]] [B, S]; no padding mask (causal attention keeps each
    # eos from later slots), so its positions are the slots 0..S-1
    ones = g.op("Expand", g.const(1, name="one_i64"), g.op("Shape", ids), name="classifier.decoder_mask")
    slots = _mask_positions(g, ones)  # [B, S]: 0..S-1
    real = g.op("Cast", mask, to=onnx.TensorProto.BOOL, name="classifier.real")  # [B, S]
    kept = g.op("Slice", ids, g.const([0], name="zero_1d"), g.const([-1], name="minus_one_1d"),
                g.const([1], name="axis_1d"), name="classifier.drop_last")  # [B, S-1]
    if config.classifier_decoder_start == "last_token":  # mBART: each row's last real token
        start = g.op("GatherElements", ids, _last_slot(g, real, slots, "last_real"), axis=1)  # [B, 1]
        shifted = g.op("Concat", start, kept, axis=1, name="classifier.shift_right")
    else:
        shifted = g.op("Pad", kept, g.const([0, 1, 0, 0], name="shift_pads"),
                       g.const(config.decoder_start_token_id, name="decoder_start"), name="classifier.shift_right")
    decoder_inputs = {"input_ids": shifted, "attention_mask": ones, "encoder_attention_mask": mask}
    if config.uses_position_ids:
        decoder_inputs["position_ids"] = slots
    states, _ = emit.stack(g, model.decoder, config, target, decoder_inputs, token_table=table, causal=True,
                           memories=memories, progress=progress, name="decoder")
    eos = g.op("And", g.op("Equal", ids, g.const(config.eos_token_id, name="eos")), real,
               name="classifier.eos")  # [B, S]
    last = _last_slot(g, eos, slots, "last_eos")  # -1 (the last slot) for a row without eos
    pooled = g.op("GatherND", states, last, batch_dims=1, name="classifier.pool")  # [B, E]
    _outputs(g, spec, {"class_logits": _classifier_head(g, pooled, model.classifier, config)})
    return g


def _last_slot(g: GraphBuilder, where: str, slots: str, name: str) -> str:
    """int64 [B, 1]: each row's last slot where ``where`` [B, S] holds, -1 where it never does."""
    return g.op("ReduceMax", g.op("Where", where, slots, g.const(-1, name="none")), g.const([1], name="axis1"),
                keepdims=1, name=f"classifier.{name}")


def _mask_positions(g: GraphBuilder, mask: str) -> str:
    """Positions [B, S] that count real tokens: cumsum(mask) - 1, at least 0."""
    counts = g.op("CumSum", mask, g.const(1, name="axis"), name="positions.cumsum")
    return g.op("Max", g.op("Sub", counts, g.const(1, name="one")), g.const(0, name="zero"), name="positions")


BUILDERS = {"encoder": build_encoder_graph, "decoder": build_decoder_graph, "classifier": build_classifier_graph}


def _in_compute_dtype(g: GraphBuilder, value: str) -> str:
    """``value`` (a graph input) cast to the compute dtype where it is in another (a KV cache)."""
    if g.value_dtypes.get(value, g.dtype) == g.dtype:
        return value
    return g.op("Cast", value, to=ONNX_DTYPES[g.dtype], name=f"{value}.compute")


def _quantizer(target: Target, quantization: QuantScheme | None) -> WeightQuantizer | None:
    return None if quantization is None else WeightQuantizer(quantization, target)


def _check_options(config: ModelConfig, dtype: str, opset: int, target: Target,
                   kv_dtype: str | None = None) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {list(DTYPES)}")
    if kv_dtype is not None and not config.has_decoder:
        raise ValueError(f"kv_dtype={kv_dtype!r}: family={config.family!r} models have no KV cache "
                         "(leave kv_dtype unset)")
    if kv_dtype is not None and config.n_labels:
        raise ValueError(f"kv_dtype={kv_dtype!r}: a classification export (n_labels={config.n_labels}) "
                         "keeps no KV cache (leave kv_dtype unset)")
    cache_dtype(dtype, kv_dtype)  # ValueError naming kv_dtype
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r}: expected an integer in [{MIN_OPSET}, {MAX_OPSET}] "
                         f"(the function library needs opset 18 or newer)")
    target.check(config, dtype, opset)


def _save_graph(model: onnx.ModelProto, path: Path, threshold: int) -> bool:
    """Save ``model`` to ``path``; weights go to ``path.data`` past ``threshold`` bytes."""
    weight_bytes = sum(t.ByteSize() for t in model.graph.initializer)
    external = weight_bytes > threshold
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return external


def _check_tokenizer(path: Path) -> None:
    """``ValueError`` naming ``tokenizer`` unless ``path`` is a ``tokenizer.json`` of the
    ``tokenizers`` library (read with it when it is installed): the runtime loads it only when
    text is used, long after the export."""
    if not path.is_file():
        raise ValueError(f"tokenizer={str(path)!r}: no such file (expected a tokenizer.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"tokenizer={str(path)!r}: not a tokenizer.json (not JSON: {err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ValueError(f"tokenizer={str(path)!r}: not a tokenizer.json of the 'tokenizers' "
                         "library (no 'model' object)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return
    try:
        Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception type
        raise ValueError(f"tokenizer={str(path)!r}: the 'tokenizers' library cannot read it "
                         f"({err})") from None


def _require_validator() -> None:
    """Fail before anything is written when validation cannot run: it needs ONNX Runtime, which
    the 'export' extra leaves out (onnxruntime and onnxruntime-gpu cannot be installed together,
    so the 'cpu' or 'gpu' extra picks one)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as err:
        raise ModuleNotFoundError(
            f"export validation runs the graphs under ONNX Runtime, which cannot be imported ({err}): "
            "add the 'cpu' or 'gpu' extra (pip install 'tfport[export,cpu]' or 'tfport[export,gpu]'), "
            "or skip validation (--no-validate, validate=False)", name="onnxruntime") from None


def _warn_requantized(quantization: dict) -> None:
    """A warning when ``quantize="keep"`` could not keep every weight matrix's own blocks."""
    if quantization.get("requantized"):
        fallback = quantization["fallback"]
        log.warning("quantize='keep': %d of %d weight products are not stored in a kept GGUF type and "
                    "were re-quantised as %s, blocks of %d (round-to-nearest)", quantization["requantized"],
                    quantization["requantized"] + quantization["kept"], fallback["format"], fallback["block_size"])


def export_model(model: nn.Module, out_dir: str | os.PathLike, *, dtype: str = "float32",
                 opset: int | None = None, target: str | Target = DEFAULT_TARGET, validate: bool = True,
                 tokenizer: str | os.PathLike | None = None, chat_template: str | None = None,
                 embedding: EmbeddingSettings | None = None, generation: GenerationDefaults | None = None,
                 overwrite: bool = False, external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
                 show_progress: bool | None = None, quantize: str | QuantScheme | None = None,
                 block_size: int | None = None, symmetric: bool | None = None, logits: str = "all",
                 kv_dtype: str | None = None, calibration: str | Calibration | None = None,
                 head_bits: int | None = None) -> Manifest:
    """Export ``model`` (a tfport reference module with ``.config``) to ``out_dir``.

    Writes ``manifest.json``, ``config.json``, one ``.onnx`` per graph of the family (and
    ``tokenizer.json`` if given, ``chat_template.jinja`` from the ``chat_template`` text, and
    ``embedding.json`` from ``embedding``: pooling, normalisation and truncation length of a
    sentence encoder, which ``Model.embed_text`` then applies by default).
    ``target`` names an export target (``tfport.export.targets.TARGETS``: "portable" for any ONNX
    runtime, "ort" for ONNX Runtime's fused attention with an in-place KV buffer, "onnx23" for
    ONNX's opset-23 operators) or is a target object. ``opset`` defaults to the target's
    (18; 23 for "onnx23"). With ``validate``, runs ONNX Runtime against the module on fresh
    random inputs (prefill and a decode step with past) and raises if they differ beyond the
    dtype's tolerance (``ModuleNotFoundError`` up front if ONNX Runtime is not installed).
    ``out_dir`` must not exist unless ``overwrite``.

    ``quantize`` ("int4", "int8" or an ``export.quantize.QuantScheme``) stores every weight
    product, the token table and a tied head as blockwise round-to-nearest codes (``block_size``
    values per scale, zero points unless ``symmetric``), lowered by the target
    (``project_quantized``); validation then compares against the module with its weights
    replaced by the dequantised values (``quantize.fake_quantize``). ``calibration`` ("builtin",
    a text file's path or an ``export.calibrate.Calibration``; needs ``tokenizer``) chooses the
    codes with GPTQ on the module's activations over that text instead (same layout);
    ``head_bits`` (8 or 4) quantises the LM head and token table with that many bits.

    ``logits="last"`` makes the decoder return only the logits the next token is picked from
    ([B, 1, V], ``tfport.contract.LOGITS``): a prefill skips the head for the rest of the prompt.

    ``dtype`` "bfloat16" stores the weights as bfloat16 and computes in float32 (ONNX Runtime's
    CPU provider has no bfloat16 kernels for the products; ``tfport.dtypes``). ``kv_dtype``
    ("float32" or "float16"; default float16 for float16 exports, float32 otherwise) is the KV
    cache's dtype: with float16 on a float32 or bfloat16 model, new keys and values are rounded
    to float16 as they enter the cache and attention reads them from it (half the bytes per
    cached token; the target says where the cast happens).
    """
    if validate:
        _require_validator()
    config: ModelConfig = model.config
    target = get_target(target)
    scheme = resolve_scheme(quantize, block_size, symmetric)
    if opset is None:
        opset = target.default_opset if scheme is None else target.quantized_opset(target.default_opset)
    _check_options(config, dtype, opset, target, kv_dtype)
    kv_dtype = cache_dtype(dtype, kv_dtype)
    if scheme is not None:
        if dtype == "bfloat16":
            raise ValueError(f"quantize={scheme.name!r} with dtype='bfloat16': quantised weights replace "
                             "the stored ones and bfloat16 graphs compute in float32; export with "
                             "dtype='float32' (same activations)")
        if scheme.name == "keep":
            from .gguf_keep import check_keep_dtype

            check_keep_dtype(dtype)
        target.check_quantized(scheme, opset)
    out_dir = check_output_dir(out_dir, "out_dir", overwrite)
    if embedding is not None and (config.family != "encoder" or not isinstance(embedding, EmbeddingSettings)):
        raise ValueError(f"embedding={embedding!r}: expected EmbeddingSettings for an encoder-only model "
                         f"(family={config.family!r})")
    if tokenizer is not None:
        _check_tokenizer(Path(tokenizer))
    if calibration is not None or head_bits is not None:  # GPTQ, mixed precision (export/calibrate.py)
        scheme = calibrated_scheme(model, scheme, calibration, tokenizer, dtype, head_bits, show_progress)
    specs = graph_specs(config, dtype, target.layout, logits, kv_dtype)
    manifest = Manifest(config=config, dtype=dtype, opset=opset, target=target.name, layout=target.layout,
                        device_refusals=target.device_refusals(dtype, kv_dtype), kv_dtype=kv_dtype,
                        tokenizer=TOKENIZER_FILE if tokenizer is not None else None,
                        chat_template=CHAT_TEMPLATE_FILE if chat_template is not None else None,
                        graphs=specs, quantization=None if scheme is None else scheme.to_dict(),
                        logits=logits)
    model = model.eval()
    n_layers = config.n_encoder_layers * ("encoder" in specs) + config.n_decoder_layers * ("decoder" in specs) \
        + (config.n_encoder_layers + config.n_decoder_layers) * ("classifier" in specs)
    if show_progress is None:
        show_progress = n_layers * config.d_model * config.d_model > 64 * 2**20
    with atomic_directory(out_dir) as tmp:
        with tqdm(total=n_layers, desc="export", unit="layer", disable=not show_progress) as progress:
            for name, spec in specs.items():
                builder = BUILDERS[name](model, spec, dtype, target, progress, scheme)
                target.finish(builder)
                proto = builder.build(opset, target.bodies, graph_metadata(manifest.settings))
                external = _save_graph(proto, tmp / spec.file, external_data_threshold)
                log.info("wrote %s%s", spec.file, " with external data" if external else "")
        if scheme is not None:  # what the graphs were built with (keep: matrices kept and re-quantised)
            manifest = dataclasses.replace(manifest, quantization=scheme.to_dict())
            _warn_requantized(manifest.quantization)
        (tmp / CONFIG_FILE).write_text(config.to_json() + "\n")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        if chat_template is not None:
            (tmp / CHAT_TEMPLATE_FILE).write_text(chat_template)
        if embedding is not None:
            embedding.write(tmp)
        if generation is not None:  # generation_config.json: stop ids, sampling defaults
            generation.write(tmp)
        # Every file but the manifest itself, external data included, with its size and sha256.
        written = [p.name for p in tmp.iterdir() if p.name != MANIFEST_FILE]
        manifest = dataclasses.replace(manifest, files=record_files(tmp, written))
        manifest.write(tmp)
        if validate:
            from .parity import validate_export
            validate_export(model if scheme is None else fake_quantize(model, scheme, dtype), tmp)
    log.info("exported %s model to %s (%s, opset %d)", config.family, out_dir, dtype, opset)
    return manifest


def export_checkpoint_or_preset(source: str, out_dir: str | os.PathLike, seed: int = 0, **options) -> Manifest:
    """Export a source (see ``tfport.export.source.load_source``); a checkpoint's own
    ``tokenizer.json``, chat template and sentence-transformers pipeline are shipped unless
    ``tokenizer`` / ``chat_template`` / ``embedding`` are given."""
    from .source import load_source

    loaded = load_source(source, seed)
    if options.get("quantize") == "keep":  # the GGUF file's own blocks (export/gguf_keep.py)
        from .gguf_keep import KeptQuantization, check_keep

        check_keep(source, options.get("dtype", "float32"))
        options["quantize"] = KeptQuantization(source)
    if options.get("tokenizer") is None:
        options["tokenizer"] = loaded.tokenizer
    if options.get("chat_template") is None:
        options["chat_template"] = loaded.chat_template
    if options.get("embedding") is None:
        options["embedding"] = loaded.embedding
    if options.get("generation") is None:
        options["generation"] = loaded.generation
    return export_model(loaded.model, out_dir, **options)


__all__ = ["export_model", "export_checkpoint_or_preset", "MANIFEST_FILE"]
