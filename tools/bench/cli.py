"""``tfport bench`` and ``python -m tfport.tools.bench``: options -> settings -> run -> report."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tfport.dtypes import COMPUTE_DTYPES

from .compare import QUANTIZED_FORMATS
from .measurement import DEFAULT, PROVIDERS, QUICK, BenchSettings
from .report import format_table, write_json, write_plot
from .run import run_benchmark


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


# CLI option -> BenchSettings field; unset options take the defaults (or QUICK's with --quick).
_OPTIONS = {"preset": "preset", "batch": "batches", "contexts": "contexts",
            "new_tokens": "new_tokens", "repeats": "repeats", "threads": "threads",
            "targets": "targets", "provider": "provider", "seed": "seed",
            "read_mib": "read_mib", "gemv_mib": "gemv_mib", "settle_ms": "settle_ms", "dtype": "dtype"}


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    base = QUICK if args.quick else DEFAULT
    changes = {fld: getattr(args, opt) for opt, fld in _OPTIONS.items()
               if getattr(args, opt) is not None}
    if args.no_torch:
        changes["torch"] = False
    return dataclasses.replace(base, **changes)


def run_bench(args: argparse.Namespace) -> int:
    if args.rows or args.rows_exports:
        from .rows import run_rows_cli

        return run_rows_cli(args)
    if args.embed:
        from .embed import run_embed_cli

        return run_embed_cli(args)
    settings = settings_from_args(args)
    if args.pareto or args.layouts or args.text or args.metric:
        return _run_pareto(args, settings)
    if args.speculative or args.export:
        return _run_speculative(args, settings)
    if args.source or args.quantize or args.genai or args.llama_cpp or args.thread_sweep:
        return _run_compare(args, settings)
    result = run_benchmark(settings)
    if args.plot:
        result.plot = write_plot(result, args.plot)
    print(format_table(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    return 0


def _run_compare(args: argparse.Namespace, settings) -> int:
    """``--source`` / ``--quantize`` / peers: the engine comparison (``compare``), batch 1."""
    import json

    from tfport.files import write_text_atomic

    from .compare import format_compare, run_compare

    if not args.batch:
        settings = dataclasses.replace(settings, batches=(1,))
    if settings.batches != (1,):
        raise ValueError(f"--batch {settings.batches}: the engine comparison runs batch 1")
    if not args.contexts:
        settings = dataclasses.replace(settings, contexts=(16,))
    if not args.targets:
        settings = dataclasses.replace(settings, targets=("ort",))
    result = run_compare(settings, args.source or settings.preset, args.quantize or (),
                         tuple(args.genai or ()), tuple(args.llama_cpp or ()), args.thread_sweep,
                         args.peer_threads or ())
    print(format_compare(result))
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _run_pareto(args: argparse.Namespace, settings) -> int:
    """``--pareto``: tokens/s against accuracy (KL, top-1, answers, perplexity) for tfport's layouts
    and the peers."""
    import json

    from tfport.files import write_text_atomic

    from .pareto import DEFAULT_LAYOUTS, format_pareto, run_pareto, write_svg

    if not args.pareto:
        raise ValueError("--layouts, --text and --metric apply with --pareto")
    if not args.source:
        raise ValueError("--pareto needs --source (a model with a tokenizer: HF directory or .gguf)")
    settings = dataclasses.replace(settings, batches=(1,), contexts=args.contexts or (16,),
                                   new_tokens=args.new_tokens or 64, targets=args.targets or ("ort",))
    result = run_pareto(settings, args.source, args.layouts or DEFAULT_LAYOUTS, tuple(args.genai or ()),
                        tuple(args.llama_cpp or ()), args.text, metric=args.metric or "kl")
    print(format_pareto(result))
    if args.plot:
        print(f"wrote {write_svg(result, args.plot)}")
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _run_speculative(args: argparse.Namespace, settings) -> int:
    """``--speculative`` with ``--export``: plain vs speculative decoding and the peers."""
    import json

    from tfport.files import write_text_atomic

    from .speculative import format_speculative, run_speculative

    if not args.speculative or not args.export:
        raise ValueError("--speculative and --export go together: the drafters (lookup or draft "
                         "export directories) and the export to time")
    steps = args.new_tokens if args.new_tokens is not None else 128
    result = run_speculative(args.export, args.speculative, settings.threads, settings.repeats, steps,
                             tuple(args.genai or ()), tuple(args.llama_cpp or ()))
    print(format_speculative(result))
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``tfport bench``."""
    p = subparsers.add_parser(
        "bench", help="decode speed vs PyTorch and the memory-bandwidth roofline",
        description="``tfport bench``: decode speed of an export, against the PyTorch reference "
                    "and the roofline.",  # the first paragraph of the package's docstring
        epilog=f"defaults: preset {DEFAULT.preset}, batch {DEFAULT.batches}, contexts "
               f"{DEFAULT.contexts}, {DEFAULT.new_tokens} new tokens, {DEFAULT.repeats} repeats, "
               f"{DEFAULT.threads} threads; --quick: preset {QUICK.preset}, batch "
               f"{QUICK.batches}, contexts {QUICK.contexts}, {QUICK.new_tokens} new tokens, "
               f"{QUICK.repeats} repeat, small bandwidth buffers (seconds; speeds mean nothing)")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long run on a tiny preset (CI; options given still apply)")
    p.add_argument("--preset", help="decoder preset to build (random weights from --seed)")
    p.add_argument("--batch", type=_int_list, help="batch sizes, comma-separated (e.g. 1,8)")
    p.add_argument("--contexts", type=_int_list,
                   help="prompt lengths = tokens cached when the timed steps run (e.g. 64,256,1024)")
    p.add_argument("--new-tokens", type=int, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, help="timed runs per cell (medians are reported)")
    p.add_argument("--threads", type=int,
                   help="ONNX Runtime intra-op threads = torch threads = bandwidth threads")
    p.add_argument("--targets", type=_name_list,
                   help="export targets, comma-separated (portable, ort); one export each")
    p.add_argument("--provider", choices=PROVIDERS, help="ONNX Runtime execution provider")
    p.add_argument("--dtype", choices=list(COMPUTE_DTYPES),
                   help="every export's dtype and the PyTorch side's (default float32)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference side")
    p.add_argument("--seed", type=int, help="seed of the weights and the prompts")
    p.add_argument("--read-mib", type=int, help="numpy read kernel's array, MiB (>= 512)")
    p.add_argument("--gemv-mib", type=int, help="ORT GEMV's weight, MiB")
    p.add_argument("--settle-ms", type=int,
                   help="pause before each timed run, ms (default 200; the side before may still spin)")
    p.add_argument("--json", help="write the results as JSON here (atomically)")
    compare = p.add_argument_group(
        "engine comparison (batch 1, one prompt length; any of these options selects it)")
    compare.add_argument("--source", help="model to export: preset, checkpoint, HF directory or .gguf")
    compare.add_argument("--quantize", type=_name_list,
                         help=f"quantised exports besides fp32, comma-separated among {','.join(QUANTIZED_FORMATS)} "
                              "(int4 and int8 symmetric, -asym with zero points; keep: a .gguf source's own blocks)")
    compare.add_argument("--genai", action="append",
                         help="an onnxruntime-genai model directory (its builder's output) to time "
                              "on the same prompt, threads set to --threads (repeatable)")
    compare.add_argument("--llama-cpp", action="append",
                         help="a GGUF file to time under llama.cpp (llama-cpp-python; repeatable)")
    compare.add_argument("--peer-threads", type=_int_list,
                         help="time each peer at each of these thread counts (default: --threads)")
    compare.add_argument("--thread-sweep", action="store_true",
                         help="also time the fp32 export under the default thread policy, 1 and 2 threads")
    spec = p.add_argument_group("speculative decoding (one export, two chat workloads; --genai / "
                                "--llama-cpp add peers, --new-tokens caps the replies)")
    spec.add_argument("--speculative", type=_name_list, metavar="lookup[,DRAFT_DIR...]",
                      help="drafters to time against plain decoding")
    spec.add_argument("--export", metavar="DIR", help="the decoder export (with a chat template) to time")
    rows = p.add_argument_group("products by row count (issue 24; --batch sets the rows, --threads, "
                                "--repeats, --contexts, --new-tokens, --settle-ms, --seed, --json apply)")
    rows.add_argument("--rows", action="store_true",
                      help="time each weight-product candidate (float, MatMulNBits levels, int8 GEMM) "
                           "on SmolLM2's shapes by rows")
    rows.add_argument("--rows-exports", type=_name_list, metavar="DIR[,DIR...]",
                      help="time these exports' decode steps by rows (batch 1, 2, 4, 8, 16)")
    embed = p.add_argument_group("encoder throughput (--batch sets the batch sizes, --contexts the sentence "
                                 "length; --repeats, --threads, --settle-ms, --seed, --json apply)")
    embed.add_argument("--embed", type=_name_list, metavar="DIR[,DIR...]",
                       help="sentences/s of these encoder exports' embeddings (default batches 1 and 32, "
                            "64 sentences of 20 tokens per run)")
    pareto = p.add_argument_group(
        "accuracy vs speed (--pareto --source SRC; --genai / --llama-cpp add the peers' points)")
    pareto.add_argument("--pareto", action="store_true",
                        help="decode tokens/s against accuracy for tfport's quantised layouts and the "
                             "peers' files of the same weights, one run: held-out perplexity, KL divergence "
                             "from float32 and top-token agreement, chat answers equal to float32's; "
                             "--plot writes an SVG")
    pareto.add_argument("--layouts", type=_name_list,
                        help="tfport layouts: default, int8, w8a8, keep (a .gguf source's own blocks), "
                             "{rtn|gptq}{block}-{sym|zp}[-h8][-hb{block}], each optionally ending in -float "
                             "or -mixed (those activations, as tfport export --activations) (default default,gptq32-sym-h8,gptq64-sym-h8,gptq128-sym,rtn32-sym,int8)")
    pareto.add_argument("--text", help="held-out text for perplexity, KL and top-1 (default "
                                       "export/data/perplexity.txt)")
    pareto.add_argument("--metric", choices=("kl", "perplexity", "top1"),
                        help="the accuracy the front, the peer matches and --plot's axis use (default kl: "
                             "mean KL divergence from float32)")
    p.add_argument("--plot", help="plot step time vs context here (needs matplotlib); with --pareto, "
                                  "an SVG of tokens/s against --metric")
    p.set_defaults(func=run_bench)


def main(argv: list[str] | None = None) -> int:
    """``python -m tfport.tools.bench [options]``: the same as ``tfport bench [options]``."""
    from tfport.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])
