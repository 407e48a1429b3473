"""``tfport export SOURCE --out DIR``: a preset (random weights), a checkpoint or a GGUF file to ONNX."""

from __future__ import annotations

import argparse
import logging

from tfport.contract import DTYPES, KV_DTYPES, LOGITS

from .hessians import AUTO, BUILTIN, DEFAULT_TOKENS, NONE, Calibration
from .exporter import export_checkpoint_or_preset
from .options import MAX_OPSET, MIN_OPSET, ExportOptions
from .quant import BLOCK_SIZES, DEFAULT_BLOCK, FORMATS, GENERATING_INT4_BLOCK, HEAD_BITS, get_format
from .targets import DEFAULT_TARGET, TARGETS

log = logging.getLogger(__name__)


def run_export(args: argparse.Namespace) -> int:
    calibration = args.calibration
    if calibration not in (AUTO, NONE):
        calibration = Calibration(calibration, args.calibration_tokens or DEFAULT_TOKENS)
    elif args.calibration_tokens is not None:
        raise ValueError(f"--calibration-tokens={args.calibration_tokens}: applies with --calibration "
                         f"{BUILTIN} or a text file")
    options = ExportOptions(
        dtype=args.dtype, opset=args.opset, target=args.target, validate=not args.no_validate,
        tokenizer=args.tokenizer, overwrite=args.force, show_progress=None if not args.progress else True,
        quantize=args.quantize, block_size=args.block_size, symmetric=args.symmetric, logits=args.logits,
        kv_dtype=args.kv_dtype, calibration=calibration, head_bits=args.head_bits,
        head_block_size=args.head_block_size, max_loss=args.max_loss,
        loss_text=args.loss_text, calibration_threads=args.calibration_threads)
    manifest = export_checkpoint_or_preset(args.source, args.out, options, seed=args.seed)
    graphs = ", ".join(g.file for g in manifest.graphs.values())
    cache = f", KV cache {manifest.kv_dtype}" if manifest.kv_dtype != manifest.dtype and "decoder" in manifest.graphs else ""
    quantized = "" if manifest.quantization is None else f", {describe_quantization(manifest.quantization)}"
    print(f"exported {manifest.config.family} model to {args.out}: {graphs} "
          f"({manifest.dtype}{cache}, opset {manifest.opset}{quantized})")
    return 0


def describe_quantization(quantization: dict) -> str:
    """One phrase for a manifest's quantisation entry, e.g. "int4 in blocks of 32 (GPTQ)" or
    "keep Q4_K, Q6_K: 120 weight products kept, 1 re-quantised as int8" (its format's ``describe``)."""
    return get_format(quantization["format"], "quantization['format']").describe(quantization)


def quantize_help() -> str:
    """``--quantize``'s help: each format's summary, formats with the same one named together."""
    summaries: dict[str, list[str]] = {}
    for name, fmt in FORMATS.items():
        summaries.setdefault(fmt.summary, []).append(name)
    return "; ".join(f"{'/'.join(names)}: {summary}" for summary, names in summaries.items())


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="export a preset or checkpoint to ONNX",
                              description=__doc__)
    p.add_argument("source", help="preset name (random weights), tfport checkpoint directory, "
                                  "Hugging Face model directory (llama, mistral, gpt2, bert, bloom, mpt, t5) "
                                  "or .gguf file (llama)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--seed", type=int, default=0, help="seed for a preset's random weights")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and activations (default float32); bfloat16 stores the weights as "
                        "bfloat16 and computes in float32 on every provider")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="KV cache dtype of a decoder (default: float16 for --dtype float16, else "
                        "float32); float16 halves the bytes per cached token of a float32 or bfloat16 model")
    p.add_argument("--opset", type=int, default=None,
                   help=f"ONNX opset, {MIN_OPSET}..{MAX_OPSET} (default 18; 23 for --target onnx23)")
    p.add_argument("--target", choices=list(TARGETS), default=DEFAULT_TARGET,
                   help="; ".join(f"{name}: {t.summary}" for name, t in TARGETS.items()))
    p.add_argument("--tokenizer", help="tokenizer.json to ship with the export")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    p.add_argument("--no-validate", action="store_true",
                   help="skip running ONNX Runtime against PyTorch after export")
    p.add_argument("--progress", action="store_true", help="always show the progress bar")
    p.add_argument("--quantize", choices=list(FORMATS), default=None, help=quantize_help())
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=None,
                   help=f"values per scale along each weight row of --quantize int4/int8 (default: "
                        f"{GENERATING_INT4_BLOCK} for int4 of a model that generates, else {DEFAULT_BLOCK})")
    p.add_argument("--calibration", metavar="TEXT", default=AUTO,
                   help=f"how int4/int8 codes are chosen: {AUTO} (default): GPTQ on the built-in text for "
                        f"int4 when the source has a tokenizer, else round-to-nearest; {NONE}: "
                        f"round-to-nearest (no calibration pass; less accurate); {BUILTIN} or a UTF-8 "
                        f"text file: GPTQ on the model's activations over that text (needs the "
                        f"tokenizer); same graph layout either way")
    p.add_argument("--calibration-tokens", type=int, metavar="N",
                   help=f"tokens of the calibration text to read (default {DEFAULT_TOKENS}, or all of a "
                        f"shorter text)")
    p.add_argument("--calibration-threads", type=int, metavar="N",
                   help="weight matrices GPTQ quantises at once, one thread each (default: the machine's "
                        "cores); the codes are the same for any N")
    p.add_argument("--head-bits", type=int, choices=HEAD_BITS,
                   help="bits of the LM head and token table (mixed precision: 8 keeps them int8 while "
                        "the other products are int4; default: as --quantize)")
    p.add_argument("--head-block-size", type=int, choices=BLOCK_SIZES,
                   help="block size of the LM head and token table (default: the largest up to "
                        "--block-size that divides their width, so that a tied table is stored once)")
    p.add_argument("--max-loss", metavar="LOSS",
                   help="choose the fastest --quantize layout (block size, head at 8 bits, int4 with "
                        "its most sensitive layers at int8) whose loss stays within LOSS (e.g. 10%%: "
                        "perplexity increase of a decoder, 1 - minimum cosine of an encoder; kl=0.05: "
                        "a decoder's mean KL divergence from float32 in nats; top1=10%%: its positions "
                        "whose top token is not float32's), "
                        "measuring each candidate's speed and loss here; --block-size / --head-bits "
                        "fix those fields")
    p.add_argument("--loss-text", metavar="FILE",
                   help="text the --max-loss loss is measured on (default: the calibration text)")
    p.add_argument("--logits", choices=LOGITS, default="all",
                   help="decoder logits for every position (all, default) or only the one the next "
                        "token is picked from (last: [B, 1, V]; a prefill skips the head for the rest)")
    p.add_argument("--symmetric", action=argparse.BooleanOptionalAction, default=None,
                   help="--quantize int4/int8 without zero points (codes centred on 0) or, with "
                        "--no-symmetric, with a zero point per block; default: symmetric for int4 of "
                        "a decoder or encoder-decoder (zero points cost ~10%% of decode speed), zero "
                        "points otherwise")
    p.set_defaults(func=run_export)
