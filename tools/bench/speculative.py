"""``tfport bench --speculative``: plain against speculative decoding of one export, on two chat
workloads, with the peers on the same prompts, in one run.

- *grounded*: the model rewrites a passage given in the prompt (the package's perplexity text),
  where prompt lookup finds long matches;
- *free*: open chat, where it rarely does (speculation must not cost there).

Each engine decodes greedily; tfport's plain run stops at the export's stop ids and sets the
length every other run generates (peers and speculative runs alike), so all produce the same
number of tokens. Per cell: the median over ``repeats`` timed runs (after one untimed) of the
whole generation, prompt included, as tokens/s; for speculative runs the acceptance rate, the
tokens per target forward and whether the tokens equal plain decoding's. The timed runs repeat
the untimed run's prompt, whose keys and values then come from tfport's prefix caches (the
target's and a draft model's; llama.cpp keeps its last prompt's too), so the figures are close
to decode speed. tfport's engines are timed a second time with their prefix caches off
(``cold``): every run prefills the prompt, the draft model's too, as a first request does.

``chunk_deviation`` measures why a quantised target's speculative tokens can differ: the largest
logit difference between feeding the plain continuation's first tokens as one chunk (what a
verification computes) and one step at a time (what plain decoding computes), per workload.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from .peers import GenaiPeer, LlamaCppPeer, available

logger = logging.getLogger(__name__)

PASSAGE_CHARS = 1200  # of the perplexity text: ~250 tokens for SmolLM2's tokenizer
CHUNK_TOKENS = 8  # chunk_deviation's chunk: the plain continuation's first tokens


def workloads() -> dict[str, list[dict]]:
    """Workload name -> its chat messages."""
    text = (Path(__file__).resolve().parent.parent / "data" / "perplexity.txt").read_text()
    passage = text[:PASSAGE_CHARS].rsplit(". ", 1)[0] + "."
    return {
        "grounded": [{"role": "user", "content": "Rewrite the following passage, keeping every "
                      "sentence and detail:\n\n" + passage}],
        "free": [{"role": "user", "content": "Write a short story about a dragon who learns to cook."}],
    }


def _median_run(run, repeats: int) -> tuple[float, Any]:
    """(median seconds over ``repeats`` timed calls after one untimed, the last call's result)."""
    run()
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


@contextlib.contextmanager
def _cold(models):
    """``models`` (tfport ``Model`` objects) with their prefix caches off, restored after."""
    kept = [(model, model.prefix_cache) for model in models]
    for model, _ in kept:
        model.prefix_cache = None
    try:
        yield
    finally:
        for model, cache in kept:
            model.prefix_cache = cache


def _timed(run, repeats: int, models) -> tuple[float, float, Any]:
    """(median seconds of ``run`` with the prefix caches warm, the same with ``models``' caches
    off, the last warm call's result)."""
    seconds, out = _median_run(run, repeats)
    with _cold(models):
        cold, _ = _median_run(run, repeats)
    return seconds, cold, out


def chunk_deviation(model, ids, tokens) -> float:
    """max |logits of ``tokens`` fed as one chunk - the same fed one step at a time| on top of
    the cache of ``ids`` (int64 [P], [S]); float32 kernels differ by rounding only (SmolLM2
    float32 ~3e-5), int8 activations amplify that (SmolLM2 int4 ~1)."""
    tokens = np.asarray(tokens, np.int64)
    batch = model.decoding.rows(model.runner("decoder", "generate"), 1, len(ids) + len(tokens) + 1,
                                model.config.fill_token_id)
    row, _ = batch.add(np.asarray(ids, np.int64))
    chunk = np.array(batch.extend([tokens])[0]).reshape(len(tokens), -1)  # copies: the buffers are reused
    batch.rewind(row, len(tokens))
    steps = np.stack([np.array(batch.step(tokens[i:i + 1])[0]).reshape(-1) for i in range(len(tokens))])
    batch.remove(row)
    return float(np.abs(chunk - steps).max())


def run_speculative(export: str | Path, drafters: tuple[str, ...], threads: int, repeats: int,
                    max_new_tokens: int, genai: tuple[str, ...] = (), gguf: tuple[str, ...] = ()
                    ) -> dict[str, Any]:
    """Time plain and speculative decoding of ``export`` (``drafters``: "lookup" or draft export
    directories) and the peers on ``workloads()`` -> {"rows": [...], "settings": {...}}."""
    from tfport.runtime import load_model
    from tfport.runtime.chat import chat_format
    from tfport.runtime.decoding import Speculation, SpeculationStats
    from tfport.runtime.decoding.speculative import names_draft_model, open_drafter

    shared = any(map(names_draft_model, drafters))  # a draft takes turns with the target
    model = load_model(export, intra_op_threads=threads, shared_threads=shared)
    fmt = chat_format(model)
    exact = model.manifest.quantization is None  # quantised targets: tokens may differ (reported)
    drafts = {name: open_drafter(name, model, "--speculative") for name in drafters}
    peers = [(f"{GenaiPeer.name} {Path(d).name}", lambda d=d: GenaiPeer(d, threads), "onnxruntime_genai")
             for d in genai] + [(f"{LlamaCppPeer.name} {Path(g).name}", lambda g=g: LlamaCppPeer(g, threads), "llama_cpp")
                                for g in gguf]
    rows = []
    caches = [model, *(draft for draft in drafts.values() if draft != "lookup")]
    for workload, messages in workloads().items():
        ids = fmt.prompt_ids(messages)
        seconds, cold, plain = _timed(lambda: model.generate([ids], max_new_tokens=max_new_tokens,
                                                             stop_token_ids=fmt.stop_ids), repeats, caches)
        count = plain.shape[1]
        base = {"workload": workload, "prompt_tokens": len(ids), "tokens": count}
        rows.append({**base, "engine": "tfport plain", "tokens_per_s": count / seconds,
                     "cold_tokens_per_s": count / cold,
                     "chunk_deviation": chunk_deviation(model, ids, plain[0, :CHUNK_TOKENS])})
        for name, draft in drafts.items():
            stats = SpeculationStats()
            seconds, cold, tokens = _timed(lambda: model.generate(
                [ids], max_new_tokens=count, stop_token_ids=(), speculation=stats,
                speculative=Speculation(draft, exact=exact)), repeats, caches)
            rows.append({**base, "engine": f"tfport {Path(name).name if name != 'lookup' else 'lookup'}",
                         "tokens_per_s": count / seconds, "cold_tokens_per_s": count / cold,
                         "acceptance_rate": stats.acceptance_rate,
                         "tokens_per_forward": stats.tokens_per_forward,
                         "identical": bool(np.array_equal(tokens, plain))})
        for label, make, module in peers:
            missing = available(module)
            if missing:
                rows.append({**base, "engine": label, "skipped": missing})
                continue
            peer = make()
            seconds, timing = _median_run(lambda: peer(np.array([ids]), count - 1), repeats)
            rows.append({**base, "engine": label, "tokens_per_s": count / seconds,
                         "identical": bool(np.array_equal(timing.tokens[0], plain[0]))})
    for row in rows:
        plain_row = next(r for r in rows if r["workload"] == row["workload"] and r["engine"] == "tfport plain")
        if "tokens_per_s" in row:
            row["vs_plain"] = row["tokens_per_s"] / plain_row["tokens_per_s"]
        if "cold_tokens_per_s" in row:
            row["cold_vs_plain"] = row["cold_tokens_per_s"] / plain_row["cold_tokens_per_s"]
    settings = {"export": str(export), "drafters": list(drafters), "threads": threads,
                "repeats": repeats, "max_new_tokens": max_new_tokens, "exact": exact}
    return {"rows": rows, "settings": settings}


def format_speculative(result: dict[str, Any]) -> str:
    """The result as a text table."""
    head = (f"{'workload':<9} {'engine':<34} {'tokens':>6} {'tok/s':>7} {'x plain':>7} "
            f"{'cold':>7} {'x plain':>7} {'accept':>6} {'tok/fwd':>7} {'same':>5}")
    lines = [head, "-" * len(head)]
    for row in result["rows"]:
        if "skipped" in row:
            lines.append(f"{row['workload']:<9} {row['engine']:<34} skipped: {row['skipped']}")
            continue
        accept = f"{row['acceptance_rate']:.0%}" if "acceptance_rate" in row else "-"
        per = f"{row['tokens_per_forward']:.2f}" if "tokens_per_forward" in row else "-"
        same = {True: "yes", False: "NO"}.get(row.get("identical"), "-")
        cold = (f"{row['cold_tokens_per_s']:>7.1f} {row['cold_vs_plain']:>7.2f}" if "cold_tokens_per_s" in row
                else f"{'-':>7} {'-':>7}")
        lines.append(f"{row['workload']:<9} {row['engine']:<34} {row['tokens']:>6} {row['tokens_per_s']:>7.1f} "
                     f"{row['vs_plain']:>7.2f} {cold} {accept:>6} {per:>7} {same:>5}")
    settings = result["settings"]
    lines.extend(f"{row['workload']}: logits of {CHUNK_TOKENS} tokens fed as one chunk vs one step at a time: "
                 f"max difference {row['chunk_deviation']:.2g}" for row in result["rows"] if "chunk_deviation" in row)
    lines.append(f"greedy; {settings['threads']} threads; median of {settings['repeats']} runs; "
                 f"tokens/s over the whole generation (the repeated prompt from the prefix caches; "
                 f"cold: caches off, every run prefills it)"
                 + ("" if settings["exact"] else "; quantised target: speculative tokens may differ"))
    return "\n".join(lines)
