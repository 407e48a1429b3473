"""What an export is asked for (``ExportOptions``, shared by ``export_model``, the CLI, the bench
and the tests) and the one place those options are checked against a model (``plan_export``).

Every refusal names the option, the value and what was expected, and happens before anything is
written or computed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tfport.config import ModelConfig
from tfport.config.checks import is_int
from tfport.contract import ACTIVATIONS, DTYPES, KV_DTYPES, GraphSpec, graph_specs
from tfport.dtypes import cache_dtype
from tfport.embedding import EmbeddingSettings
from tfport.files import check_output_dir
from tfport.flags import option
from tfport.generation import GenerationDefaults

from .calibrate import check_head_block_size, resolve_threads
from .hessians import AUTO, BUILTIN, NONE, Calibration
from .quant import (BLOCK_SIZES, DEFAULT_BLOCK, FORMATS, GENERATING_INT4_BLOCK, HEAD_BITS, Quantization,
                    layout_formats, resolve_scheme)
from .targets import DEFAULT_TARGET, TARGETS, Target, get_target

MIN_OPSET, MAX_OPSET = 18, 23
# Past this many bytes of weights a graph keeps them in <graph>.onnx.data: ONNX Runtime then reads
# them from that file into the session (1B Q4_0: 1.23 GiB resident against 1.45 GiB from one
# 0.84 GB .onnx, whose protobuf bytes it also holds while loading); far below protobuf's 2 GiB.
EXTERNAL_DATA_THRESHOLD = 256 * 2**20


def quantize_help() -> str:
    """``--quantize``'s help: each format's summary, formats with the same one named together."""
    summaries: dict[str, list[str]] = {}
    for name, fmt in FORMATS.items():
        summaries.setdefault(fmt.summary, []).append(name)
    return "; ".join(f"{'/'.join(names)}: {summary}" for summary, names in summaries.items())


@dataclass(frozen=True)
class ExportOptions:
    """How to export (every field has the default of ``tfport export`` without the flag; the
    flags are made from these fields, ``tfport.flags``).

    ``dtype``: weights and activations ("bfloat16" stores bfloat16 weights and computes in
    float32). ``opset``: None for the target's default (18; 23 for "onnx23"; 21 for a quantised
    portable export). ``target``: a name of ``targets.TARGETS`` or a target object.
    ``validate``: run ONNX Runtime against the module on fresh random inputs after writing.
    ``tokenizer``: a tokenizer.json to ship; ``chat_template``: the template's text;
    ``embedding``: a sentence encoder's pooling settings (encoders only); ``generation``: the
    generation_config.json defaults. ``overwrite``: replace an existing ``out_dir``.
    ``external_data_threshold``: weight bytes past which a graph keeps them in ``.onnx.data``.
    ``show_progress``: None shows the bar for large models. ``quantize``: None, a name of
    ``quant.FORMATS`` ("int4", "int8", "w8a8": int8 weights per channel and activations per
    token, export/quant/w8a8.py) or a scheme (``quant.QuantScheme``, a GGUF
    ``quant.KeptQuantization``), with ``block_size`` and ``symmetric`` for int4 / int8;
    ``calibration`` ("auto": GPTQ on the built-in text for int4 when ``tokenizer`` is given,
    else round-to-nearest; "none": round-to-nearest; "builtin", a text file or a
    ``Calibration``: GPTQ)
    ``head_bits`` (8 or 4) and ``head_block_size`` (default: ``calibrate.head_block``) re-choose
    an int4/int8 quantisation's codes. ``kv_dtype``: the KV cache's dtype (None: float16 for
    float16 exports, else float32). ``max_loss`` (a fraction or "10%") picks the fastest int4 /
    int8 layout whose measured loss on ``loss_text`` (default: the calibration text) is within it
    (``export.budget``); ``block_size`` / ``head_bits`` then fix those fields of the search.
    ``calibration_threads``: weight matrices GPTQ quantises at once, one thread each (None: the
    machine's cores); the codes do not depend on it. ``activations``: what a quantised product
    computes its activations in (``tfport.contract.ACTIVATIONS``): "int8" (ONNX Runtime's fast
    kernel), "float" (float32: only the weights' error; slower, and less memory) or "mixed" (float32
    for the query / key / value and down projections, int8 for the rest; target "ort"); None:
    "int8", except that ``export_checkpoint_or_preset`` makes ``quantize="int4"`` alone of a
    4-bit GGUF file its own blocks on "mixed" (``exporter.source_options``).
    """

    dtype: str = option("float32", choices=DTYPES,
                        help="weights and activations (default {default}); bfloat16 stores the weights as "
                             "bfloat16 and computes in float32 on every provider")
    opset: int | None = option(None, help=f"ONNX opset, {MIN_OPSET}..{MAX_OPSET} (default 18; 23 for "
                                          "--target onnx23)")
    target: str | Target = option(DEFAULT_TARGET, type=str, choices=tuple(TARGETS),
                                  help="; ".join(f"{name}: {t.summary}" for name, t in TARGETS.items()))
    validate: bool = option(True, help="skip running ONNX Runtime against PyTorch after export")
    tokenizer: str | os.PathLike | None = option(None, type=str, help="tokenizer.json to ship with the export")
    chat_template: str | None = option(None, flag=False)
    embedding: EmbeddingSettings | None = option(None, flag=False)
    generation: GenerationDefaults | None = option(None, flag=False)
    overwrite: bool = option(False, flag="--force", help="replace an existing output directory")
    external_data_threshold: int = option(EXTERNAL_DATA_THRESHOLD, flag=False)
    show_progress: bool | None = option(None, flag=False)  # the CLI's --progress: True, else None
    quantize: str | Quantization | None = option(None, type=str, choices=tuple(FORMATS), help=quantize_help())
    block_size: int | None = option(
        None, type=int, choices=BLOCK_SIZES,
        help=f"values per scale along each weight row of --quantize int4/int8 (default: "
             f"{GENERATING_INT4_BLOCK} for int4 of a model that generates, else {DEFAULT_BLOCK})")
    symmetric: bool | None = option(
        None, negatable=True,
        help="--quantize int4/int8 without zero points (codes centred on 0) or, with --no-symmetric, "
             "with a zero point per block; default: symmetric for int4 of a decoder or "
             "encoder-decoder (zero points cost ~10% of decode speed), zero points otherwise")
    kv_dtype: str | None = option(None, choices=KV_DTYPES,
                                  help="KV cache dtype of a decoder (default: float16 for --dtype float16, "
                                       "else float32); float16 halves the bytes per cached token of a "
                                       "float32 or bfloat16 model")
    calibration: str | Calibration | None = option(
        AUTO, type=str, metavar="TEXT",
        help=f"how int4/int8 codes are chosen: {AUTO} (default): GPTQ on the built-in text for int4 when "
             f"the source has a tokenizer, else round-to-nearest; {NONE}: round-to-nearest (no "
             f"calibration pass; less accurate); {BUILTIN} or a UTF-8 text file: GPTQ on the model's "
             f"activations over that text (needs the tokenizer); same graph layout either way")
    head_bits: int | None = option(None, type=int, choices=HEAD_BITS,
                                   help="bits of the LM head and token table (mixed precision: 8 keeps them "
                                        "int8 while the other products are int4; default: as --quantize)")
    head_block_size: int | None = option(None, type=int, choices=BLOCK_SIZES,
                                         help="block size of the LM head and token table (default: the "
                                              "largest up to --block-size that divides their width, so "
                                              "that a tied table is stored once)")
    max_loss: float | str | None = option(
        None, type=str, metavar="LOSS",
        help="choose the fastest --quantize layout (block size, head at 8 bits, int4 with its most "
             "sensitive layers at int8) whose loss stays within LOSS (e.g. 10%: perplexity increase "
             "of a decoder, 1 - minimum cosine of an encoder; kl=0.05: a decoder's mean KL divergence "
             "from float32 in nats; top1=10%: its positions whose top token is not float32's), "
             "measuring each candidate's speed and loss here; --block-size / --head-bits fix those fields")
    loss_text: str | os.PathLike | None = option(None, type=str, metavar="FILE",
                                                 help="text the --max-loss loss is measured on (default: "
                                                      "the calibration text)")
    calibration_threads: int | None = option(None, metavar="N",
                                             help="weight matrices GPTQ quantises at once, one thread each "
                                                  "(default: the machine's cores); the codes are the same "
                                                  "for any N")
    activations: str | None = option(
        None, choices=ACTIVATIONS,
        help="what --quantize's weight products compute their activations in: int8 (default, but mixed "
             "where --quantize int4 keeps a 4-bit GGUF file's own blocks): rounded "
             "per block by ONNX Runtime's fast kernel; float: float32, so only the weights' rounding "
             "differs from the float model (a GGUF file kept with --quantize keep then answers as "
             "its float32 export), at about 0.7x the decode speed (1B shape) and without the int8 "
             "kernel's 1.2x copy of 4-bit weights; mixed (--target ort): float32 for the query/key/value "
             "and down projections, whose inputs carry the outlier channels, int8 for the rest")

    def replace(self, **changes) -> "ExportOptions":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ExportPlan:
    """``ExportOptions`` checked against one model: the target object, the opset and KV cache
    dtype with their defaults filled in, the quantisation scheme (before any calibration), the
    output directory and the graphs to build."""

    options: ExportOptions
    target: Target
    opset: int
    kv_dtype: str
    scheme: Quantization | None
    out_dir: Path
    specs: dict[str, GraphSpec]


def plan_export(options: ExportOptions, config: ModelConfig, out_dir: str | os.PathLike) -> ExportPlan:
    """Check ``options`` for a model of ``config`` written to ``out_dir``; raises ``ValueError``
    (``TypeError`` for a value of the wrong kind, ``ModuleNotFoundError`` when validation cannot
    run) naming the option."""
    if not isinstance(options, ExportOptions):
        raise TypeError(f"options={options!r}: expected an ExportOptions or None")
    if options.validate:
        _require_validator()
    dtype, kv_dtype = options.dtype, options.kv_dtype
    target = get_target(options.target)
    scheme = resolve_scheme(options.quantize, options.block_size, options.symmetric, config.has_decoder)
    activations = options.activations or ACTIVATIONS[0]
    _check_activations(activations, scheme)
    target = target.with_activations(activations)
    opset = options.opset
    if opset is None:
        opset = target.default_opset if scheme is None else scheme.default_opset(target)
    _check_model_options(config, dtype, opset, target, kv_dtype)
    kv_dtype = cache_dtype(dtype, kv_dtype)
    if scheme is not None:
        scheme.check(dtype, target, opset)
    _check_budget(options, scheme)
    _check_head_block(options.head_block_size, scheme)
    resolve_threads(options.calibration_threads)
    out_dir = check_output_dir(out_dir, "out_dir", options.overwrite)
    embedding = options.embedding
    if embedding is not None and (config.family != "encoder" or not isinstance(embedding, EmbeddingSettings)):
        raise ValueError(f"embedding={embedding!r}: expected EmbeddingSettings for an encoder-only model "
                         f"(family={config.family!r})")
    if options.tokenizer is not None:
        _check_tokenizer(Path(options.tokenizer))
    specs = graph_specs(config, dtype, target.layout, kv_dtype)
    return ExportPlan(options, target, opset, kv_dtype, scheme, out_dir, specs)


def _check_model_options(config: ModelConfig, dtype: str, opset: int, target: Target,
                         kv_dtype: str | None = None) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {list(DTYPES)}")
    if kv_dtype is not None and not config.has_decoder:
        raise ValueError(f"kv_dtype={kv_dtype!r}: family={config.family!r} models have no KV cache "
                         "(leave kv_dtype unset)")
    if kv_dtype is not None and config.classifier.n_labels:
        raise ValueError(f"kv_dtype={kv_dtype!r}: a classification export (n_labels={config.classifier.n_labels}) "
                         "keeps no KV cache (leave kv_dtype unset)")
    cache_dtype(dtype, kv_dtype)  # ValueError naming kv_dtype
    if not is_int(opset) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset={opset!r}: expected an integer in [{MIN_OPSET}, {MAX_OPSET}] "
                         f"(the function library needs opset 18 or newer)")
    target.check(config, dtype, opset)


def _check_budget(options: ExportOptions, scheme: Quantization | None) -> None:
    """``max_loss`` / ``loss_text``: a loss budget applies to an int4 or int8 quantisation."""
    if options.max_loss is None:
        if options.loss_text is not None:
            raise ValueError(f"loss_text={str(options.loss_text)!r}: applies with max_loss")
        return
    from .loss import parse_loss

    parse_loss(options.max_loss)
    if scheme is None or not scheme.rechoosable:
        got = "no quantisation" if scheme is None else f"quantize={scheme.name!r}"
        raise ValueError(f"max_loss={options.max_loss!r}: chooses the layout of quantize={layout_formats()}, "
                         f"got {got}")
    if options.loss_text is not None and not Path(options.loss_text).is_file():
        raise ValueError(f"loss_text={str(options.loss_text)!r}: no such file (expected a UTF-8 text)")


def _check_activations(activations: str, scheme: Quantization | None) -> None:
    """``activations``: one of ``ACTIVATIONS``; "float" and "mixed" apply to a quantisation that
    takes them."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: expected one of {list(ACTIVATIONS)}")
    if activations != ACTIVATIONS[0]:
        if scheme is None:
            raise ValueError(f"activations={activations!r}: applies to a quantised export (--quantize); "
                             "without one every product already computes in the export's dtype")
        scheme.check_activations(activations)


def _check_head_block(head_block_size: int | None, scheme: Quantization | None) -> None:
    """``head_block_size``: one of ``BLOCK_SIZES``, for an int4 or int8 quantisation."""
    check_head_block_size(head_block_size)
    if head_block_size is not None and (scheme is None or not scheme.rechoosable):
        got = "no quantisation" if scheme is None else f"quantize={scheme.name!r}, whose layout is its own"
        raise ValueError(f"head_block_size={head_block_size!r}: applies to quantize={layout_formats()}, got {got}")


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
