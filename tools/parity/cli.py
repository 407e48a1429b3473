"""``tfport parity DIR --against SOURCE``: an export against its PyTorch reference, per provider.

Prints one row per case and graph (max abs / max rel difference, argmax agreement on logits) and,
for a failing case, the first layer and piece that diverges. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tfport.contract import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from tfport.export.parity import CASES, Runner, first_divergence, localize
from tfport.export.quant import fake_quantize, get_format
from tfport.export.source import load_source
from tfport.export.validate import cuda_available
from tfport.files import write_text_atomic
from tfport.manifest import Manifest


def reference_scheme(quantization: dict, against: str, model=None, tokenizer=None, calibration=None,
                     dtype: str = "float32"):
    """The quantisation a manifest records, to fake-quantise the reference with: a calibrated or
    mixed-precision one (export/calibrate.py) is recomputed from ``model`` with ``tokenizer`` and
    the calibration text (``calibration``: the file, unless it was the built-in text); any other
    is its format's (``QuantFormat.from_manifest``; ``against``: the source a GGUF file's kept
    blocks are read from)."""
    if "sha256" in quantization:
        from tfport.export.calibrate import recorded_scheme

        return recorded_scheme(quantization, model, tokenizer, dtype, calibration)
    return get_format(quantization["format"], "quantization['format']").from_manifest(quantization, against)


def print_accuracy(model_dir, model, tokenizer) -> None:
    """The quantised export as shipped against the unquantised module: on the fixed text (needs
    logits='all' and a tokenizer) perplexity, the KL divergence from the module's next-token
    distributions and top-token agreement; greedy agreement on a few prompts; and, with a chat
    template, the share of the chat questions answered as the module answers them."""
    import numpy as np
    import torch

    from tfport.models.generate import generate
    from tfport.runtime import load_model

    from . import accuracy

    runtime = load_model(model_dir)
    if tokenizer is None or runtime.config.family != "decoder":
        print("accuracy: needs a decoder with a tokenizer; skipped")
        return
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    ids = np.array(tok.encode(accuracy.PERPLEXITY_TEXT.read_text()).ids, dtype=np.int64)[:runtime.config.max_positions]
    reference_logits = accuracy.reference_logits(model, ids)
    reference = accuracy.perplexity(reference_logits, ids)
    logits = accuracy.export_logits(model_dir, ids)
    quantized, divergence = accuracy.perplexity(logits, ids), accuracy.divergence(reference_logits, logits)
    prompts = [tok.encode(t).ids for t in ACCURACY_PROMPTS]
    expected = np.stack([generate(model, torch.tensor([p]), max_new_tokens=32)[0].numpy() for p in prompts])
    # greedy, unpenalised and unforced whatever the export's generation_config.json says, as the reference
    got = runtime.generate(prompts, max_new_tokens=32, stop_token_ids=(), temperature=0.0,
                           repetition_penalty=1.0, forced_bos_token_id=(), forced_eos_token_id=())
    answers = None
    if (Path(model_dir) / (runtime.manifest.chat_template or CHAT_TEMPLATE_FILE)).is_file():
        fmt = accuracy.export_chat_format(model_dir)
        chat = accuracy.chat_prompts(fmt)
        answers = accuracy.answer_agreement(accuracy.reference_answers(model, chat, fmt.stop_ids),
                                            accuracy.export_answers(model_dir, chat, fmt.stop_ids))
    print(accuracy.HEADER)
    print(accuracy.AccuracyRow("unquantised (PyTorch)", reference, 1.0, None).describe())
    print(accuracy.AccuracyRow(f"export ({model_dir})"[:28], quantized, quantized / reference,
                               accuracy.first_divergence(expected, got), divergence, answers).describe())
    print(f"KL: mean KL divergence (nats) of the next-token distributions from the module's; top-1: positions "
          f"with its top token ({len(ids)} tokens of {accuracy.PERPLEXITY_TEXT.name}); answers: of "
          f"{len(accuracy.CHAT_QUESTIONS)} chat questions, greedy answers equal to its own"
          + ("" if answers is not None else " (no chat template: not measured)"))
    print()


ACCURACY_PROMPTS = ["The capital of France is", "Once upon a time, a little robot",
                    "def fibonacci(n):", "The three primary colors are"]


def run_parity(args: argparse.Namespace) -> int:
    manifest = Manifest.read(args.model_dir)
    source = load_source(args.against, args.seed, "--against")
    model = source.model
    if model.config != manifest.config:
        raise ValueError(f"--against={args.against!r}: its config differs from the export's "
                         f"({args.model_dir}/config.json)")
    if args.calibration is not None and "sha256" not in (manifest.quantization or {}):
        raise ValueError(f"--calibration={args.calibration!r}: the export at {args.model_dir} was not "
                         "calibrated (its manifest records no calibration text)")
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    if not providers:
        raise ValueError(f"--providers={args.providers!r}: expected one or more of cpu, cuda")
    for provider in providers:
        if provider not in ("cpu", "cuda"):
            raise ValueError(f"--providers: {provider!r} is not one of cpu, cuda")
    shipped = Path(args.model_dir) / TOKENIZER_FILE  # the tokenizer the export was made (calibrated) with
    tokenizer = shipped if shipped.is_file() else source.tokenizer
    if args.accuracy:
        print_accuracy(args.model_dir, model, tokenizer)
    if manifest.quantization:
        # The exact check: the module with the export's dequantised weights.
        scheme = reference_scheme(manifest.quantization, args.against, model, tokenizer, args.calibration,
                                  manifest.dtype)
        model = fake_quantize(model, scheme, manifest.dtype)
    rows, failed, checked = [], False, 0
    header = f"{'case':<18} {'graph':<8} {'provider':<8} {'max_abs':>10} {'max_rel':>10} {'tokens':>7}  status"
    print(header)
    print("-" * len(header))
    for provider in providers:
        if provider == "cuda":
            usable, reason = cuda_available()
            if not usable:
                print(f"{'(all)':<18} {'-':<8} {'cuda':<8} {'':>10} {'':>10} {'':>7}  skipped: {reason}")
                rows.append({"provider": "cuda", "skipped": reason})
                continue
        runner = Runner(model, args.model_dir, provider)
        checked += 1
        for case in CASES:
            for result in runner.run(case):
                worst_abs = max(d.max_abs for d in result.diffs)
                worst_rel = max(d.max_rel for d in result.diffs)
                agreement = [d.token_agreement for d in result.diffs if d.token_agreement is not None]
                tokens = f"{min(agreement):.0%}" if agreement else "-"
                status = "ok" if result.ok else "MISMATCH"
                row = {"case": result.case.label, "graph": result.graph, "provider": provider,
                       "max_abs": worst_abs, "max_rel": worst_rel,
                       "token_agreement": min(agreement) if agreement else None, "ok": result.ok,
                       "diffs": [d.to_dict() for d in result.diffs]}
                if not result.ok:
                    failed = True
                    row["first_divergence"] = first_divergence(localize(runner, case))
                    status += f": {row['first_divergence']}"
                rows.append(row)
                print(f"{result.case.label:<18} {result.graph:<8} {provider:<8} {worst_abs:>10.3g} "
                      f"{worst_rel:>10.3g} {tokens:>7}  {status}")
    if args.json:
        report = {"model_dir": str(args.model_dir), "dtype": manifest.dtype,
                  "target": manifest.target, "rows": rows}
        write_text_atomic(args.json, json.dumps(report, indent=2) + "\n")
    if not checked:
        raise RuntimeError(f"--providers={args.providers!r}: none of them could run here, so nothing "
                           "was checked")
    return 1 if failed else 0


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("parity", help="compare an export with its PyTorch reference",
                              description=__doc__)
    p.add_argument("model_dir", help="directory made by 'tfport export'")
    p.add_argument("--against", required=True,
                   help="reference: checkpoint directory (tfport or Hugging Face) or preset name")
    p.add_argument("--seed", type=int, default=0, help="seed when --against is a preset")
    p.add_argument("--providers", default="cpu", help="comma-separated: cpu,cuda")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--accuracy", action="store_true",
                   help="also the export's perplexity on a fixed text and greedy agreement against the "
                        "unquantised --against (for a quantised export, parity itself compares with "
                        "the fake-quantised module: the same dequantised weights)")
    p.add_argument("--calibration", metavar="FILE",
                   help="the text file a calibrated export was calibrated on (to recompute its "
                        "quantised weights; not needed for the built-in text)")
    p.set_defaults(func=run_parity)
