"""``tfport bench-serve``: a bounded load test of a server on this machine.

For each concurrency level N, N clients send ``requests`` streamed greedy completions in total
(random ids, exactly ``new_tokens`` new tokens with ``ignore_eos``) over loopback. Prompt lengths
are ``prompt_len`` = (shortest, longest): every prompt that long when they are equal, else each
drawn log-uniformly between them (seeded; the same prompts at every level), as chat traffic mixes
short questions with long pasted documents.
Every response is checked: HTTP 200, the SSE stream ends with ``[DONE]``, ``new_tokens`` ids with
finish reason "length", and the same ids for the same prompt at every level (a row's tokens do not
depend on its neighbours) for a float export that the bench starts. A quantised export's tokens may
differ between levels: ONNX Runtime's ``MatMulNBits`` rounds a step with a single row differently
from one with several (measured 3e-5 logits apart on an AVX2 CPU, 1.25 on another), enough to
change a greedy token now and then; so may another server's (``url``). Those differences are counted
(``differ``), not failed. Reported per level: generated tokens/s over the level's wall time,
p50/p99 time to first token and latency. Level 1 is the one-at-a-time baseline.

The server is started in a child process (``tfport serve`` on 127.0.0.1, a free port) unless
``url`` names one already running on this machine; the whole run stops sending after
``time_limit`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from tfport.flags import positive_int, to_args
from tfport.manifest import Manifest
from tfport.runtime.serve.cli import add_model_options, serve_options

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


@dataclass(frozen=True)
class BenchConfig:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    requests: int = 32
    new_tokens: int = 64
    prompt_len: tuple[int, int] = (16, 16)  # (shortest, longest) prompt tokens
    time_limit: float = 600.0
    seed: int = 0


@dataclass
class LevelResult:
    concurrency: int
    sent: int
    ok: int
    failed: int
    seconds: float
    tokens: int
    tokens_per_s: float
    ttft_p50: float
    ttft_p99: float
    latency_p50: float
    latency_p99: float
    errors: list[str] = field(default_factory=list)
    differ: int = 0  # responses whose tokens differ from the same prompt's at another level (not exact)

    def as_dict(self) -> dict:
        return asdict(self)


def check_loopback(url: str) -> str:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK:
        raise ValueError(f"--url={url!r}: bench-serve targets this machine only (127.0.0.1, "
                         "localhost or ::1)")
    return url.rstrip("/")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str, options, name: str | None, wait: float = 120.0
                 ) -> tuple[subprocess.Popen, str]:
    """``tfport serve`` in a child process on 127.0.0.1 -> (process, base url) once healthy;
    ``options`` (``ServeOptions``) reach it as flags, those at their default left out."""
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "tfport.cli", "serve", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), *to_args(options)]
    if name:
        command += ["--name", name]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tfport serve exited with {process.returncode}: "
                               f"{process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"tfport serve did not become healthy within {wait:g} s")


def parse_prompt_len(text: str) -> tuple[int, int]:
    """``--prompt-len``: "N" (every prompt N tokens) or "MIN-MAX" -> (shortest, longest)."""
    parts = text.split("-")
    if len(parts) > 2 or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--prompt-len={text!r}: expected a positive integer such as 16, or a range "
                         "such as 16-1024")
    shortest, longest = int(parts[0]), int(parts[-1])
    if shortest > longest:
        raise ValueError(f"--prompt-len={text!r}: the range's first length must not exceed its second")
    return shortest, longest


def random_prompts(config: BenchConfig, vocab: int) -> list[list[int]]:
    """``config.requests`` prompts of random ids in [3, vocab), their lengths in
    ``config.prompt_len`` (log-uniform; see the module doc), seeded by ``config.seed``."""
    rng = np.random.default_rng(config.seed)
    shortest, longest = config.prompt_len
    lengths = np.rint(np.exp(rng.uniform(np.log(shortest), np.log(longest), config.requests)))
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in lengths]


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def _one(client, url: str, model: str, prompt: list[int] | str, config: BenchConfig,
               deadline: float, avoid: Sequence[int] = ()) -> tuple[float, float, list, str | None]:
    """One streamed request -> (ttft s, latency s, its tokens, error or None).

    ``prompt`` as token ids: tfport's request (``ignore_eos``; the tokens are the streamed
    ``token_ids``). As text: plain OpenAI fields only, for another server (``--url``): the end
    ids ``avoid`` get a logit bias of -100 instead of ``ignore_eos``, and the tokens are the
    streamed text pieces (a server may hold back a partial character, so the count is
    ``max_tokens`` when the finish reason is "length")."""
    ids_mode = not isinstance(prompt, str)
    body = {"model": model, "prompt": prompt, "max_tokens": config.new_tokens, "temperature": 0,
            "stream": True}
    if ids_mode:
        body["ignore_eos"] = True
    else:
        body["logit_bias"] = {str(i): -100 for i in avoid}
    start = time.perf_counter()
    first = None
    tokens: list = []
    reason = None
    done = False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 timeout=max(1.0, deadline - time.monotonic())) as response:
            if response.status_code != 200:
                return 0.0, 0.0, [], f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return 0.0, 0.0, tokens, f"error event: {chunk['error'].get('message')}"
                for choice in chunk["choices"]:
                    new = choice["token_ids"] if ids_mode else [choice["text"]] if choice.get("text") else []
                    if new and first is None:
                        first = time.perf_counter() - start
                    tokens.extend(new)
                    reason = choice["finish_reason"] or reason
    except Exception as err:  # noqa: BLE001 -- counted as a failed response
        return 0.0, 0.0, tokens, f"{type(err).__name__}: {err}"
    latency = time.perf_counter() - start
    if not done:
        return 0.0, 0.0, tokens, "the stream ended without [DONE]"
    if reason != "length" or (ids_mode and len(tokens) != config.new_tokens):
        return 0.0, 0.0, tokens, f"{len(tokens)} tokens, finish_reason {reason!r}"
    return first or latency, latency, tokens, None


async def _level(url: str, model: str, prompts: list, clients: int,
                 config: BenchConfig, deadline: float, reference: dict[int, list],
                 exact: bool, avoid: Sequence[int] = ()) -> LevelResult:
    import httpx

    todo = list(range(len(prompts)))
    ttfts, latencies, errors = [], [], []
    tokens = sent = differ = 0

    async def worker(client) -> None:
        nonlocal tokens, sent, differ
        while todo and time.monotonic() < deadline:
            index = todo.pop(0)
            sent += 1
            ttft, latency, ids, error = await _one(client, url, model, prompts[index], config,
                                                   deadline, avoid)
            if error is None and reference.setdefault(index, ids) != ids:
                if exact:
                    error = f"prompt {index}: tokens differ from the same prompt at another level"
                else:
                    differ += 1
            if error is None:
                ttfts.append(ttft)
                latencies.append(latency)
                tokens += config.new_tokens  # checked by _one
            else:
                errors.append(error)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        seconds = time.perf_counter() - start
    return LevelResult(clients, sent, len(latencies), len(errors), seconds, tokens,
                       tokens / seconds if seconds else 0.0, _percentile(ttfts, 50),
                       _percentile(ttfts, 99), _percentile(latencies, 50),
                       _percentile(latencies, 99), errors[:10], differ)


def run_bench_serve(model_dir: str | Path, config: BenchConfig, options, url: str | None = None,
                    name: str | None = None) -> list[LevelResult]:
    """Run every concurrency level against ``url`` (or a server started for ``model_dir``).
    Tokens must match across levels only for a float export the bench starts (module doc)."""
    import httpx

    manifest = Manifest.read(Path(model_dir))
    if manifest.config.family != "decoder":
        raise ValueError(f"{model_dir}: bench-serve generates; expected a decoder export")
    need = config.prompt_len[1] + config.new_tokens - 1
    if need > manifest.config.max_positions:
        raise ValueError(f"--prompt-len + --max-new - 1 = {need} exceeds the model's "
                         f"max_positions={manifest.config.max_positions}")
    prompts = random_prompts(config, manifest.config.vocab_size)
    # a quantised export, another server or a batch export (two weights by step size): tokens may differ by level
    exact = url is None and manifest.quantization is None and options.batch_export is None
    avoid: list[int] = []
    if url is not None:  # another server: text prompts, plain OpenAI fields (_one)
        from tfport.generation import GenerationDefaults
        from tfport.runtime.defaults import RequestDefaults
        from tfport.runtime.tokenizer import TextTokenizer
        if manifest.tokenizer is None:
            raise ValueError(f"--url: another server takes text prompts, so {str(model_dir)!r} "
                             "needs a tokenizer (re-export with --tokenizer)")
        tokenizer = TextTokenizer(Path(model_dir) / manifest.tokenizer)
        prompts = [tokenizer.decode(p) for p in prompts]
        avoid = sorted(RequestDefaults(manifest.config, GenerationDefaults.read(model_dir)).stop_ids())
    process = None
    if url is None:
        process, url = start_server(str(model_dir), options, name)
    else:
        url = check_loopback(url)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        deadline = time.monotonic() + config.time_limit
        reference: dict[int, list[int]] = {}
        results = []
        for clients in config.concurrency:
            if time.monotonic() >= deadline:
                break
            results.append(asyncio.run(_level(url, model, prompts, clients, config, deadline,
                                              reference, exact, avoid)))
        return results
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def format_table(results: list[LevelResult]) -> str:
    """A Markdown table; speed-up is against the 1-client (one-at-a-time) level."""
    base = next((r.tokens_per_s for r in results if r.concurrency == 1), None)
    lines = ["| clients | requests ok | tokens/s | vs one-at-a-time | TTFT p50 / p99 (s) | "
             "latency p50 / p99 (s) | failed |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        ratio = f"{r.tokens_per_s / base:.1f}x" if base else "-"
        lines.append(f"| {r.concurrency} | {r.ok}/{r.sent} | {r.tokens_per_s:.0f} | {ratio} | "
                     f"{r.ttft_p50:.3f} / {r.ttft_p99:.3f} | {r.latency_p50:.2f} / "
                     f"{r.latency_p99:.2f} | {r.failed} |")
    for r in results:
        for error in r.errors:
            lines.append(f"  {r.concurrency} clients: {error}")
    for r in results:
        if r.differ:
            lines.append(f"  {r.concurrency} clients: {r.differ} of {r.ok} responses' tokens differ from "
                         "the same prompt's at another level (a quantised export or another server: "
                         "not checked; see tfport.tools.serve_bench)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- the command
def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench-serve``."""
    import fastapi  # noqa: F401  -- a missing 'serve' extra is reported by tfport.cli
    import uvicorn  # noqa: F401

    bench = subparsers.add_parser(
        "bench-serve", help="load-test a server: throughput, time to first token, latency",
        description="Start a server on 127.0.0.1 for DIR (or use --url, loopback only), send "
                    "--requests requests from N concurrent clients per --concurrency level, check "
                    "every response and report tokens/s and p50/p99 TTFT and latency.")
    add_model_options(bench)
    bench.add_argument("--url", help="an already running server on this machine "
                                     "(http://127.0.0.1:PORT); default: start one")
    bench.add_argument("--concurrency", default="1,4,16",
                       help="comma-separated client counts (default 1,4,16)")
    bench.add_argument("--requests", type=positive_int, default=32,
                       help="requests per concurrency level (default 32)")
    bench.add_argument("--max-new", type=positive_int, default=64, dest="new_tokens",
                       help="tokens generated per request (default 64; ignore_eos)")
    bench.add_argument("--prompt-len", default="16", metavar="N|MIN-MAX",
                       help="prompt tokens per request, or a range whose lengths are drawn "
                            "log-uniformly per request, e.g. 16-1024 (default 16)")
    bench.add_argument("--time-limit", type=float, default=600.0,
                       help="seconds for the whole run; stops sending after (default 600)")
    bench.add_argument("--json", help="write the results to this file")
    bench.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    parts = [c.strip() for c in args.concurrency.split(",") if c.strip()]
    if not parts or not all(c.isascii() and c.isdigit() for c in parts):
        raise ValueError(f"--concurrency={args.concurrency!r}: expected positive integers such as 1,4,16")
    levels = [int(c) for c in parts]
    if min(levels) < 1:
        raise ValueError(f"--concurrency={args.concurrency!r}: expected positive integers")
    config = BenchConfig(concurrency=levels, requests=args.requests, new_tokens=args.new_tokens,
                         prompt_len=parse_prompt_len(args.prompt_len), time_limit=args.time_limit)
    results = run_bench_serve(args.model_dirs[0], config, serve_options(args), url=args.url,
                              name=(args.names or [None])[0])
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([r.as_dict() for r in results], out, indent=2)
    failed = sum(r.failed for r in results)
    if failed:
        print(f"{failed} responses failed their checks", flush=True)
    return 1 if failed else 0
