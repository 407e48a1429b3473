"""What automatic prefix caching (``tfport.runtime.decoding.prefix``) saves in a multi-turn chat:
time to first token (TTFT) of every turn with the model's prefix cache off and on, and whether
the two produce the same tokens.

The conversation opens with a passage of the package's perplexity text (``--history-tokens``
of it, ~1,000 by default) and a request to summarise it, then asks ``--turns`` - 1 short follow-up
questions; every turn resends the whole conversation (the chat template's rendering), as a chat
client does. Each turn runs with the cache off, then on, on the same prompt (greedy, at most
``--reply-tokens`` tokens, stopped at the template's end of turn); the off run's reply is the
next turn's history. TTFT is the time from the request to its first token (the prefill and
one pick), on one thread of ONNX Runtime's choice.

    python -m tfport.tools.bench.prefix out/smollm2-int4 [--turns 8] [--history-tokens 1000]
        [--reply-tokens 24] [--json prefix.json]

A single run on a shared machine is noisy: compare the ratio of turns >= 2, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

QUESTIONS = ["Which sentence of it matters most, and why?", "Say that again in one sentence.",
             "What would a sceptic object?", "Give it a title.", "Which word is the hardest?",
             "Summarise your previous answer.", "What is left out?", "Name one follow-up question."]


def conversation_start(tokenizer, history_tokens: int) -> str:
    """The first user message: ~``history_tokens`` tokens of the perplexity text, then a request."""
    text = (Path(__file__).resolve().parent.parent / "data" / "perplexity.txt").read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)[:history_tokens]
    return tokenizer.decode(ids) + "\n\nSummarise this passage."


def timed_reply(model, prompt: list[int], reply_tokens: int, stops: tuple[int, ...]) -> tuple[float, list[int]]:
    """(seconds to the first token, the reply's tokens) of one greedy request."""
    start = time.perf_counter()
    steps = model.stream([prompt], max_new_tokens=reply_tokens, stop_token_ids=stops, temperature=0)
    tokens = [int(next(steps)[0])]
    ttft = time.perf_counter() - start
    tokens += [int(step[0]) for step in steps]
    return ttft, tokens


def run(model_dir: str, turns: int = 8, history_tokens: int = 1000, reply_tokens: int = 24,
        cache_mb: int = 256) -> dict[str, Any]:
    """Every turn with the cache off and on -> {"turns": [per turn: prompt tokens, TTFT off/on,
    tokens reused, identical], "ratio": median TTFT off / on over turns >= 2, "identical"}."""
    from tfport.runtime import load_model
    from tfport.runtime.chat import chat_format
    from tfport.runtime.decoding.prefix import PrefixCache

    model = load_model(model_dir)
    fmt = chat_format(model)
    cache = PrefixCache.from_mb(cache_mb)
    messages = [{"role": "user", "content": conversation_start(fmt.tokenizer, history_tokens)}]
    rows = []
    for turn in range(turns):
        prompt = fmt.prompt_ids(messages)
        model.prefix_cache = None
        off, expected = timed_reply(model, prompt, reply_tokens, fmt.stop_ids)
        model.prefix_cache = cache
        reused = cache.hit_tokens
        on, tokens = timed_reply(model, prompt, reply_tokens, fmt.stop_ids)
        rows.append({"turn": turn + 1, "prompt_tokens": len(prompt), "ttft_off_s": off, "ttft_on_s": on,
                     "reused_tokens": cache.hit_tokens - reused, "identical": tokens == expected})
        logger.info("turn %d: %d prompt tokens, TTFT %.1f ms off, %.1f ms on (%d reused)", turn + 1,
                    len(prompt), off * 1e3, on * 1e3, rows[-1]["reused_tokens"])
        reply = fmt.tokenizer.decode([t for t in expected if t not in fmt.stop_ids])
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]}]
    later = rows[1:]
    ratio = statistics.median(r["ttft_off_s"] / r["ttft_on_s"] for r in later) if later else None
    return {"model": str(model_dir), "turns": rows, "ratio": ratio,
            "identical": all(r["identical"] for r in rows), "cache_mb": cache_mb}


def report(results: dict[str, Any]) -> str:
    lines = ["| turn | prompt tokens | reused | TTFT off (ms) | TTFT on (ms) | off / on | same tokens |",
             "|---:|---:|---:|---:|---:|---:|:--:|"]
    for r in results["turns"]:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['reused_tokens']} | {r['ttft_off_s'] * 1e3:.1f} "
                     f"| {r['ttft_on_s'] * 1e3:.1f} | {r['ttft_off_s'] / r['ttft_on_s']:.1f}x "
                     f"| {'yes' if r['identical'] else 'NO'} |")
    if results["ratio"] is not None:
        lines.append(f"\nmedian TTFT off / on, turns >= 2: {results['ratio']:.1f}x; identical tokens: "
                     f"{'yes' if results['identical'] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfport.tools.bench.prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="a decoder export with a chat template and tokenizer")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--history-tokens", type=int, default=1000,
                        help="tokens of the opening passage (default 1000)")
    parser.add_argument("--reply-tokens", type=int, default=24, help="most tokens per reply (default 24)")
    parser.add_argument("--cache-mb", type=int, default=256, help="the prefix cache's MiB (default 256)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(args.model_dir, args.turns, args.history_tokens, args.reply_tokens, args.cache_mb)
    print(report(results))
    if args.json is not None:
        tmp = args.json.with_suffix(args.json.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=2))
        tmp.replace(args.json)
    return 0 if results["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
