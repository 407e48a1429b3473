"""What constrained decoding costs (``tfport.runtime.decoding.grammar``), on one decoder export:

- per token: the grammar processor's time (advance the llguidance matcher by the last token,
  compute the mask, apply it to the logits [V]) against one plain decode step of the same export
  (batch 1, greedy, the step after a short chat prompt); the target is under 10% of a SmolLM2-135M
  int4 step;
- per schema: the one-off compile (schema -> grammar -> matcher), on a cache miss and on a hit,
  and the export's llguidance tokenizer (built once per export and process).

    python -m tfport.tools.bench.grammar out/smollm2-int4 [--tokens 64] [--json grammar.json]

Timings are medians over the tokens of one generation (per token) or over ``--repeats`` runs
(compile); on a shared machine they are noisy: compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PROMPT = [{"role": "user", "content": "Extract the person as JSON: 'Maria Lopez, 34, is a nurse in Madrid. "
                                      "Her languages: Spanish, English.'"}]
PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "job": {"type": "string"}, "city": {"type": "string"},
                         "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
          "required": ["name", "age", "job", "city", "languages"]}


def schemas() -> dict[str, dict]:
    """Name -> a JSON schema of growing size: the extraction task, a nested order, 60 fields."""
    item = {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "price": {"type": "number", "minimum": 0, "multipleOf": 0.01}}}
    order = {"type": "object", "additionalProperties": False, "required": ["id", "items", "status"],
             "properties": {"id": {"type": "integer"}, "status": {"enum": ["new", "paid", "shipped"]},
                            "customer": PERSON, "items": {"type": "array", "items": item, "maxItems": 20}}}
    kinds = [{"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "boolean"},
             {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}}]
    wide = {"type": "object", "additionalProperties": False,
            "properties": {f"field_{i}": kinds[i % len(kinds)] for i in range(60)}}
    return {"person": PERSON, "order": order, "wide-60": wide}


def _median_seconds(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _step_seconds(model, prompt: list[int], stops: tuple[int, ...], tokens: int,
                  **constraint: Any) -> tuple[float, list[int]]:
    """(median seconds between consecutive tokens of one greedy stream, the tokens): one decode
    step each, the constraint's processor included when given."""
    stamps, out = [], []
    for step in model.stream([prompt], max_new_tokens=tokens, temperature=0.0, stop_token_ids=stops,
                             **constraint):
        stamps.append(time.perf_counter())
        out.append(int(step[0]))
    return float(np.median(np.diff(stamps))) if len(stamps) > 2 else float("nan"), out


def run_grammar(export: str | Path, tokens: int = 64, repeats: int = 5, threads: int = 0) -> dict[str, Any]:
    """Measure ``export`` (a decoder with a tokenizer and a chat template) -> {"per_token": ...,
    "compile": [...], "settings": ...}."""
    from tfport.runtime import load_model
    from tfport.runtime.chat import chat_format
    from tfport.runtime.decoding import grammar

    model = load_model(export, intra_op_threads=threads, verify="none")
    fmt = chat_format(model)
    prompt = fmt.prompt_ids(PROMPT)
    stops = fmt.stop_ids
    vocab = model.config.vocab_size

    start = time.perf_counter()
    grammar.compile_constraint(model.tokenizer, vocab, regex="warm-up")  # builds the llguidance tokenizer
    tokenizer_seconds = time.perf_counter() - start

    _step_seconds(model, prompt, stops, 4)  # warm-up
    plain, _ = _step_seconds(model, prompt, stops, tokens)
    constrained, path = _step_seconds(model, prompt, stops, tokens, json_schema=PERSON)
    # The processor alone, replayed along the constrained path on logits of the export's width
    # (with the copy the engine makes before its processors change them in place).
    processor = grammar.compile_constraint(model.tokenizer, vocab, json_schema=PERSON).processor(stops)
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    mask_times = []
    for step in range(len(path)):
        begin = time.perf_counter()
        processor(path[:step], logits.copy())
        mask_times.append(time.perf_counter() - begin)
    mask = float(np.median(mask_times))

    compiles = []
    for name, schema in schemas().items():
        def miss(schema=schema):
            # A fresh key each time (a title llguidance ignores): a cache miss, compiled.
            grammar.compile_constraint(model.tokenizer, vocab,
                                       json_schema={**schema, "title": f"bench-{time.perf_counter_ns()}"})
        hit = _median_seconds(lambda schema=schema: grammar.compile_constraint(model.tokenizer, vocab,
                                                                               json_schema=schema), repeats)
        compiles.append({"schema": name, "chars": len(json.dumps(schema)),
                         "miss_ms": 1e3 * _median_seconds(miss, repeats), "hit_ms": 1e3 * hit})
    return {"per_token": {"plain_step_ms": 1e3 * plain, "constrained_step_ms": 1e3 * constrained,
                          "mask_us_median": 1e6 * mask,
                          "mask_us_p90": 1e6 * float(np.percentile(mask_times, 90)),
                          "mask_share_of_step": mask / plain, "tokens": len(path),
                          "output": model.tokenizer.decode([t for t in path if t not in stops])},
            "compile": compiles, "tokenizer_build_s": tokenizer_seconds,
            "settings": {"export": str(export), "threads": threads, "repeats": repeats, "vocab_size": vocab}}


def format_grammar(result: dict[str, Any]) -> str:
    """The measurements as two Markdown tables."""
    t = result["per_token"]
    lines = ["| per token | value |", "| --- | --- |",
             f"| plain decode step (median) | {t['plain_step_ms']:.2f} ms |",
             f"| constrained decode step (median) | {t['constrained_step_ms']:.2f} ms |",
             f"| grammar processor (median / p90) | {t['mask_us_median']:.0f} / {t['mask_us_p90']:.0f} us |",
             f"| processor / plain step | {100 * t['mask_share_of_step']:.1f}% (target < 10%) |",
             "", "| schema | chars | compile, cache miss | cache hit |", "| --- | --- | --- | --- |"]
    lines += [f"| {c['schema']} | {c['chars']} | {c['miss_ms']:.2f} ms | {c['hit_ms']:.3f} ms |"
              for c in result["compile"]]
    lines += ["", f"llguidance tokenizer, once per export: {result['tokenizer_build_s']:.2f} s",
              f"constrained output ({t['tokens']} tokens): {t['output']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfport.tools.bench.grammar",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="a decoder export with tokenizer.json and a chat template")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per timed generation (default 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed compiles per schema (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (default: ONNX Runtime's)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    result = run_grammar(args.export, args.tokens, args.repeats, args.threads)
    print(format_grammar(result))
    if args.json:
        path = Path(args.json)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(result, indent=2))
        partial.replace(path)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
