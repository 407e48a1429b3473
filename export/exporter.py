"""Export a reference module to a directory of ONNX graphs plus ``manifest.json``.

``export_model`` checks its ``ExportOptions`` against the model (``options.plan_export``), builds
each graph of the contract (``graphs.BUILDERS``), checks it with ``onnx.checker`` (full check),
writes everything to a temporary directory and renames it into place, so a failed export leaves
nothing behind. Graphs whose weights exceed ``external_data_threshold`` bytes keep them in
``<graph>.onnx.data`` beside the graph.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path

import onnx
from torch import nn
from tqdm.auto import tqdm

from tfport.config import ModelConfig
from tfport.contract import (ACTIVATION_KEY, ACTIVATIONS, CHAT_TEMPLATE_FILE, CONFIG_FILE, EXTERNAL_SUFFIX, MANIFEST_FILE,
                             TOKENIZER_FILE)
from tfport.files import atomic_directory
from tfport.integrity import graph_metadata, record_files
from tfport.manifest import Manifest
from tfport.models.gguf.reader import is_gguf_file
from tfport.models.lazy import is_lazy, materialize_all, streamed

from .calibrate import calibrated_scheme, own_head_block, resolve_calibration
from .graph import Initializers
from .graphs import BUILDERS
from .hessians import AUTO, Calibration
from .memory import check_memory
from .options import ExportOptions, ExportPlan, plan_export
from .quant import INT4, KEEP, get_format
from .quant.keep import FOUR_BIT_SHARE, four_bit_share
from .targets import get_target

log = logging.getLogger(__name__)


def export_model(model: nn.Module, out_dir: str | os.PathLike, options: ExportOptions | None = None) -> Manifest:
    """Export ``model`` (a tfport reference module with ``.config``) to ``out_dir`` as
    ``options`` say (``ExportOptions``; None: float32, target "portable", validated).

    Writes ``manifest.json``, ``config.json``, one ``.onnx`` per graph of the family (and
    ``tokenizer.json`` if given, ``chat_template.jinja`` from the ``chat_template`` text, and
    ``embedding.json`` from ``embedding``: pooling, normalisation and truncation length of a
    sentence encoder, which ``Model.embed_text`` then applies by default).
    ``target`` names an export target (``tfport.export.targets.TARGETS``: "portable" for any ONNX
    runtime, "ort" for ONNX Runtime's fused attention with an in-place KV buffer, "onnx23" for
    ONNX's opset-23 operators) or is a target object. With ``validate``, runs ONNX Runtime
    against the module on fresh random inputs (prefill and a decode step with past) and raises if
    they differ beyond the dtype's tolerance (``ModuleNotFoundError`` up front if ONNX Runtime is
    not installed). ``out_dir`` must not exist unless ``overwrite``.

    ``quantize`` ("int4", "int8" or an ``export.quant.QuantScheme``) stores every weight
    product, the token table and a tied head as blockwise round-to-nearest codes (``block_size``
    values per scale, zero points unless ``symmetric``), lowered by the target
    (``project_quantized``); validation then compares against the module with its weights
    replaced by the dequantised values (the scheme's ``reference``; the other formats are
    ``export.quant.FORMATS``). ``calibration`` ("auto", the default: GPTQ on the built-in text
    for int4 when ``tokenizer`` is given; "none"; "builtin", a text file's path or an
    ``export.calibrate.Calibration``; needs ``tokenizer``) chooses the codes with GPTQ on the
    module's activations over that text instead (same layout);
    ``head_bits`` (8 or 4) quantises the LM head and token table with that many bits, in blocks of
    ``head_block_size`` (default: the largest block size up to ``block_size`` that divides their
    width, ``calibrate.head_block``).

    ``dtype`` "bfloat16" stores the weights as bfloat16 and computes in float32 (ONNX Runtime's
    CPU provider has no bfloat16 kernels for the products; ``tfport.dtypes``). ``kv_dtype``
    ("float32" or "float16"; default float16 for float16 exports, float32 otherwise) is the KV
    cache's dtype: with float16 on a float32 or bfloat16 model, new keys and values are rounded
    to float16 as they enter the cache and attention reads them from it (half the bytes per
    cached token; the target says where the cast happens).
    """
    options = ExportOptions() if options is None else options
    config: ModelConfig = model.config
    plan = plan_export(options, config, out_dir)
    scheme = plan.scheme
    calibration = resolve_calibration(scheme, options.calibration, options.tokenizer)
    check_memory(model, options, scheme, calibrating=calibration is not None)
    if options.max_loss is not None and is_lazy(model):  # the budget search swaps weights in place
        model = materialize_all(model)
    if calibration is not None or options.max_loss is not None:  # its forwards read one module at a time
        with streamed(model):
            scheme = _calibrated(model, plan, options, scheme, calibration)
    else:
        scheme = _calibrated(model, plan, options, scheme, calibration)
    manifest = Manifest(config=config, dtype=options.dtype, opset=plan.opset, target=plan.target.name,
                        layout=plan.target.layout,
                        device_refusals={**plan.target.device_refusals(options.dtype, plan.kv_dtype),
                                         **({} if scheme is None else scheme.device_refusals())},
                        kv_dtype=plan.kv_dtype,
                        tokenizer=TOKENIZER_FILE if options.tokenizer is not None else None,
                        chat_template=CHAT_TEMPLATE_FILE if options.chat_template is not None else None,
                        graphs=plan.specs, quantization=_quantization_entry(scheme, options))
    model = model.eval()
    with atomic_directory(plan.out_dir) as tmp:
        _write_graphs(model, plan, scheme, manifest, tmp)
        if scheme is not None:  # what the graphs were built with (keep: matrices kept and re-quantised)
            manifest = dataclasses.replace(manifest, quantization=_quantization_entry(scheme, options))
            scheme.report()
        _write_files(config, options, tmp)
        # Every file but the manifest itself, external data included, with its size and sha256.
        written = [p.name for p in tmp.iterdir() if p.name != MANIFEST_FILE]
        manifest = dataclasses.replace(manifest, files=record_files(tmp, written))
        manifest.write(tmp)
        if options.validate:
            from .parity import validate_export

            reference = model if scheme is None else scheme.reference(model, options.dtype)
            # a lazy module runs one module's weights at a time, each read again per forward
            with (tqdm(desc="validate: reference modules read", unit="module",
                       disable=not (is_lazy(reference) and _show_progress(options, config))) as bar,
                  streamed(reference, bar.update)):
                validate_export(reference, tmp)
    log.info("exported %s model to %s (%s, opset %d)", config.family, plan.out_dir, options.dtype, plan.opset)
    return manifest


def _quantization_entry(scheme, options: ExportOptions) -> dict | None:
    """The manifest's ``quantization``: the scheme's entry, with ``ACTIVATION_KEY`` when its products' activations are
    not the default int8 (an export of the default is unchanged by the option's existence)."""
    if scheme is None:
        return None
    entry = scheme.to_dict()
    if options.activations not in (None, ACTIVATIONS[0]):
        entry[ACTIVATION_KEY] = options.activations
    return entry


def _calibrated(model: nn.Module, plan: ExportPlan, options: ExportOptions, scheme, calibration):
    """The scheme the graphs are built with: ``scheme`` itself, or with codes chosen ahead (GPTQ,
    mixed precision, the head in its own blocks, the fastest layout within ``max_loss``)."""
    if options.max_loss is not None:  # the fastest layout within the budget, measured
        from .budget import LayoutSearch, choose_layout

        search = LayoutSearch(
            tokenizer=options.tokenizer, loss_text=options.loss_text,
            calibration=Calibration(calibration) if isinstance(calibration, str) else calibration,
            block_size=options.block_size, head_bits=options.head_bits, head_block_size=options.head_block_size,
            scale_dtype=options.dtype, threads=options.calibration_threads)
        scheme = choose_layout(model, scheme, options.max_loss, search, _layout_speed(model, plan))
    elif (calibration is not None or options.head_bits is not None or options.head_block_size is not None
          or own_head_block(model, scheme)):  # GPTQ, mixed precision, the head in other blocks
        scheme = calibrated_scheme(model, scheme, calibration, options.tokenizer, options.dtype,
                                   options.head_bits, options.show_progress, options.calibration_threads,
                                   head_block_size=options.head_block_size)
    return scheme


def _layout_speed(model: nn.Module, plan: ExportPlan):
    """How ``--max-loss`` times a candidate layout (``budget.Speed``): a round-to-nearest export
    of it to a temporary directory (the codes do not change the speed), decoded under the runtime
    (``validate.export_speed``)."""
    def speed(quantize, head_bits: int | None, head_block_size: int | None) -> float:
        from .validate import export_speed

        with tempfile.TemporaryDirectory(prefix="tfport-max-loss-") as tmp:
            out = Path(tmp) / "candidate"
            export_model(model, out, ExportOptions(target=plan.target, quantize=quantize, calibration="none",
                                                   head_bits=head_bits, head_block_size=head_block_size,
                                                   validate=False))
            return export_speed(out)
    return speed


def _write_graphs(model: nn.Module, plan: ExportPlan, scheme, manifest: Manifest, directory: Path) -> None:
    """Build, check and save every graph of ``plan`` into ``directory``."""
    config, specs = model.config, plan.specs
    n_layers = config.n_encoder_layers * ("encoder" in specs) + config.n_decoder_layers * ("decoder" in specs) \
        + (config.n_encoder_layers + config.n_decoder_layers) * ("classifier" in specs)
    with tqdm(total=n_layers, desc="export", unit="layer", disable=not _show_progress(plan.options, config)) as progress:
        for name, spec in specs.items():
            data_file = directory / (spec.file + EXTERNAL_SUFFIX)
            builder = BUILDERS[name](model, spec, plan.options.dtype, plan.target, progress, scheme,
                                     data_file=data_file)
            proto = builder.build(plan.opset, plan.target.bodies, graph_metadata(manifest.settings))
            external = _save_graph(proto, builder.initializers, directory / spec.file,
                                   plan.options.external_data_threshold)
            log.info("wrote %s%s", spec.file, " with external data" if external else "")


def _show_progress(options: ExportOptions, config: ModelConfig) -> bool:
    """Whether to show progress bars: as the options say, else for large models."""
    if options.show_progress is not None:
        return options.show_progress
    return (config.n_encoder_layers + config.n_decoder_layers) * config.d_model ** 2 > 64 * 2**20


def _write_files(config: ModelConfig, options: ExportOptions, directory: Path) -> None:
    """config.json and what the options ship beside the graphs (tokenizer, chat template,
    embedding and generation settings)."""
    (directory / CONFIG_FILE).write_text(config.to_json() + "\n")
    if options.tokenizer is not None:
        shutil.copyfile(options.tokenizer, directory / TOKENIZER_FILE)
    if options.chat_template is not None:
        (directory / CHAT_TEMPLATE_FILE).write_text(options.chat_template)
    if options.embedding is not None:
        options.embedding.write(directory)
    if options.generation is not None:  # generation_config.json: stop ids, sampling defaults
        options.generation.write(directory)


def _save_graph(model: onnx.ModelProto, initializers: Initializers, path: Path, threshold: int) -> bool:
    """Save ``model`` to ``path``, its weights already streamed to ``initializers.data_file``;
    a graph of at most ``threshold`` bytes of weights takes them back inline (one file)."""
    initializers.close()
    external = initializers.weight_bytes > threshold
    if not external:
        initializers.inline()
        model.graph.ClearField("initializer")
        model.graph.initializer.extend(initializers)
    onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return external


def export_checkpoint_or_preset(source: str, out_dir: str | os.PathLike, options: ExportOptions | None = None,
                                seed: int = 0) -> Manifest:
    """Export a source (see ``tfport.export.source.load_source``; ``seed`` for a preset's random
    weights); a checkpoint's own ``tokenizer.json``, chat template, sentence-transformers
    pipeline and generation defaults are shipped unless ``options`` give them, and a format
    bound to its source file (``quantize="keep"``: a GGUF file's own blocks) is bound here."""
    from .source import load_source

    options = ExportOptions() if options is None else options
    if not isinstance(options, ExportOptions):
        raise TypeError(f"options={options!r}: expected an ExportOptions or None")
    loaded = load_source(source, seed, lazy=True)  # each weight read from the file as it is emitted
    options = source_options(options, source)
    filled = {"tokenizer": loaded.tokenizer, "chat_template": loaded.chat_template,
              "embedding": loaded.embedding, "generation": loaded.generation}
    options = options.replace(**{name: value for name, value in filled.items() if getattr(options, name) is None})
    return export_model(loaded.model, out_dir, options)


def source_options(options: ExportOptions, source: str) -> ExportOptions:
    """``options`` as an export of the file ``source`` takes them: ``--quantize int4`` alone (no
    calibration, block, zero point, head or loss option given) of a GGUF file stored mostly in 4-bit
    blocks (``FOUR_BIT_SHARE``) keeps those blocks (``keep``), with mixed activations where the
    target takes them: re-quantising 4-bit weights to 4 bits loses answers the file's own blocks
    keep (docs/quantisation.md#the-defaults); then a format read from the file (``keep``) is bound
    to it."""
    if options.quantize == INT4.name and options.dtype == "float32" and _int4_alone(options) \
            and is_gguf_file(source) and four_bit_share(source) >= FOUR_BIT_SHARE:
        activations = options.activations
        if activations is None and get_target(options.target).per_product_activations:
            activations = "mixed"
        log.info("quantize='int4' of %s, a file of 4-bit blocks: its own blocks are kept (quantize='keep', "
                 "activations=%r; re-quantising 4-bit weights to 4 bits loses answers); calibration='builtin' "
                 "re-quantises them with GPTQ instead", source, activations)
        options = options.replace(quantize=KEEP.name, activations=activations)
    if isinstance(options.quantize, str):  # a format read from the source file (keep: its own blocks)
        bound = get_format(options.quantize).for_source(source, options.dtype)
        if bound is not None:
            options = options.replace(quantize=bound)
    return options


def _int4_alone(options: ExportOptions) -> bool:
    """Whether ``options`` ask for int4 without choosing how its codes are made."""
    return options.calibration == AUTO and options.max_loss is None and all(
        value is None for value in (options.block_size, options.symmetric, options.head_bits, options.head_block_size))


__all__ = ["ExportOptions", "export_model", "export_checkpoint_or_preset", "source_options", "MANIFEST_FILE"]
