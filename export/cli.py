"""``tfport export SOURCE --out DIR``: a preset (random weights), a checkpoint or a GGUF file to ONNX."""

from __future__ import annotations

import argparse
import logging

from tfport.contract import ACTIVATION_KEY, FLOAT_PRODUCTS
from tfport.flags import add_flags, from_args

from .hessians import AUTO, BUILTIN, DEFAULT_TOKENS, NONE, Calibration
from .exporter import export_checkpoint_or_preset
from .options import ExportOptions
from .quant import get_format

log = logging.getLogger(__name__)


def run_export(args: argparse.Namespace) -> int:
    calibration = args.calibration
    if calibration not in (AUTO, NONE):
        calibration = Calibration(calibration, args.calibration_tokens or DEFAULT_TOKENS)
    elif args.calibration_tokens is not None:
        raise ValueError(f"--calibration-tokens={args.calibration_tokens}: applies with --calibration "
                         f"{BUILTIN} or a text file")
    options = from_args(ExportOptions, args, calibration=calibration,
                        show_progress=True if args.progress else None)
    manifest = export_checkpoint_or_preset(args.source, args.out, options, seed=args.seed)
    graphs = ", ".join(g.file for g in manifest.graphs.values())
    cache = f", KV cache {manifest.kv_dtype}" if manifest.kv_dtype != manifest.dtype and "decoder" in manifest.graphs else ""
    quantized = "" if manifest.quantization is None else f", {describe_quantization(manifest.quantization)}"
    print(f"exported {manifest.config.family} model to {args.out}: {graphs} "
          f"({manifest.dtype}{cache}, opset {manifest.opset}{quantized})")
    return 0


def describe_quantization(quantization: dict) -> str:
    """One phrase for a manifest's quantisation entry, e.g. "int4 in blocks of 32 (GPTQ)" or
    "keep Q4_K, Q6_K: 120 weight products kept, 1 re-quantised as int8" (its format's ``describe``),
    then what its activations compute in when they are not int8."""
    text = get_format(quantization["format"], "quantization['format']").describe(quantization)
    activations = quantization.get(ACTIVATION_KEY)
    if activations == "mixed":
        return f"{text}; float activations for the {'/'.join(FLOAT_PRODUCTS)} products, int8 for the rest"
    return text if activations is None else f"{text}; {activations} activations"


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="export a preset or checkpoint to ONNX",
                              description=__doc__)
    p.add_argument("source", help="preset name (random weights), tfport checkpoint directory, "
                                  "Hugging Face model directory (llama, mistral, gpt2, bert, bloom, mpt, t5) "
                                  "or .gguf file (llama)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--seed", type=int, default=0, help="seed for a preset's random weights")
    p.add_argument("--progress", action="store_true", help="always show the progress bar")
    p.add_argument("--calibration-tokens", type=int, metavar="N",
                   help=f"tokens of the calibration text to read (default {DEFAULT_TOKENS}, or all of a "
                        f"shorter text)")
    add_flags(p, ExportOptions)  # one flag per ExportOptions field (tfport.flags)
    p.set_defaults(func=run_export)
