"""``tfport serve`` and ``tfport bench-serve``.

    tfport serve out/dec [out/minilm ...] [--host 127.0.0.1] [--port 8000] [--max-rows 16]
    tfport serve out/dec --ray [--replicas 2]          # Ray Serve: proxy + replica routing
    tfport serve out/dec --ray --min-replicas 1 --max-replicas 4   # Serve's autoscaler
    tfport serve out/dec --host 0.0.0.0 --api-key-file key.txt   # exposed: a key is needed
    tfport bench-serve out/dec --concurrency 1,4,16 --requests 32 --max-tokens 64

Needs the ``serve`` extra (``--ray``: ``serve-ray``); no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from ..cli import ascii_int
from ..cli import positive_int as _positive
from ..session import PROVIDERS

logger = logging.getLogger(__name__)


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dirs", metavar="DIR", nargs="+",
                        help="export directories (each served under its directory name)")
    parser.add_argument("--name", action="append", dest="names",
                        help="model id for each DIR, in order (default: the directory name)")
    parser.add_argument("--max-rows", type=_positive, default=16,
                        help="requests decoded together per model (default 16)")
    parser.add_argument("--max-queue", type=_positive, default=256,
                        help="requests waiting for a row before 429 (default 256)")
    parser.add_argument("--max-tokens", type=_positive, default=4096,
                        help="largest max_tokens a request may ask (default 4096)")
    parser.add_argument("--max-length", type=_positive, default=None,
                        help="prompt + generated tokens per row (default: the model's max_positions)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a request may take (default 600)")
    parser.add_argument("--provider", choices=PROVIDERS, default="cpu")
    parser.add_argument("--threads", type=ascii_int, default=0,
                        help="intra-op threads per model (default: ONNX Runtime's choice)")
    from .options import ServeOptions
    limits = ServeOptions()
    parser.add_argument("--max-body-bytes", type=_positive, default=limits.max_body_bytes, metavar="BYTES",
                        help="largest request body; larger ones get 413 before they are read "
                             f"(default {limits.max_body_bytes:,}: 4 MiB)")
    parser.add_argument("--max-embedding-inputs", type=_positive, default=limits.max_inputs,
                        dest="max_inputs", metavar="N",
                        help=f"inputs per /v1/embeddings or /v1/classify request, documents per "
                             f"/v1/rerank, pairs per /v1/score (default {limits.max_inputs:,})")
    parser.add_argument("--embedding-batch-ms", type=float, default=limits.embedding_batch_ms, metavar="MS",
                        help="an idle encoder's first embedding request waits this long for others "
                             f"to embed with it (0-1000; default {limits.embedding_batch_ms:g})")
    parser.add_argument("--embedding-batch-tokens", type=_positive, default=limits.embedding_batch_tokens,
                        metavar="N", help="tokens embedded together at most, over the requests of "
                                          f"one batch (default {limits.embedding_batch_tokens:,})")
    parser.add_argument("--max-messages", type=_positive, default=limits.max_messages, metavar="N",
                        help=f"messages per chat request (default {limits.max_messages:,})")
    parser.add_argument("--max-prompt-chars", type=_positive, default=limits.max_prompt_chars,
                        metavar="N", help="characters per prompt or embedding input (a chat's: all "
                                          "its messages'), refused before tokenising "
                                          f"(default {limits.max_prompt_chars:,})")
    parser.add_argument("--max-prompt-tokens", type=_positive, default=None, metavar="N",
                        help="tokens per prompt or embedding input once tokenised (default and "
                             "at most: the model's context)")
    parser.add_argument("--max-request-tokens", type=_positive, default=limits.max_request_tokens,
                        metavar="N", help="tokens one request may take: prompt tokens x n + "
                                          "max_tokens x n over its prompts, or its embedding "
                                          f"inputs' tokens (default {limits.max_request_tokens:,})")
    parser.add_argument("--speculative", metavar="lookup|DRAFT_DIR", default=None,
                        help="decode every served decoder speculatively: 'lookup' (n-gram matches in "
                             "the prompt and output) or a draft export with the same vocabulary")
    parser.add_argument("--draft-tokens", type=_positive, default=limits.draft_tokens, metavar="K",
                        help=f"most tokens proposed per step (default {limits.draft_tokens}; adapted)")
    parser.add_argument("--speculative-inexact", action="store_true",
                        help="speculate on quantised exports too (their tokens can differ from "
                             "plain decoding's)")
    parser.add_argument("--batch-export", metavar="DIR", default=None,
                        help="another export of the one served model (same target and cache, e.g. "
                             "--quantize w8a8 beside int4) that runs every step of at least "
                             "--batch-rows rows: batched decode steps and long prefills")
    parser.add_argument("--batch-rows", type=_batch_rows, default=limits.batch_rows, metavar="auto|N",
                        help="rows (batch x new tokens) from which a step runs on --batch-export "
                             "(default auto: measured when the server starts, where the two "
                             "exports' speeds cross; `tfport bench --rows-exports` shows them)")
    parser.add_argument("--prefix-cache-mb", type=ascii_int, default=limits.prefix_cache_mb, metavar="MB",
                        help="MiB of keys and values each decoder keeps for prompts that start "
                             "alike (automatic prefix caching; 0: off; default "
                             f"{limits.prefix_cache_mb})")
    parser.add_argument("--prefill-chunk", type=ascii_int, default=limits.prefill_chunk, metavar="TOKENS",
                        help="while rows decode, prefill a longer prompt this many tokens per step "
                             "(chunked prefill; needs the prefix cache; 0: whole; default "
                             f"{limits.prefill_chunk})")


def _batch_rows(text: str) -> int | str:
    return text if text == "auto" else _positive(text)


def _options(args: argparse.Namespace):
    from .options import ServeOptions
    return ServeOptions(max_rows=args.max_rows, max_queue=args.max_queue,
                        max_tokens=args.max_tokens, timeout=args.timeout,
                        max_length=args.max_length, provider=args.provider, threads=args.threads,
                        max_body_bytes=args.max_body_bytes, max_inputs=args.max_inputs,
                        max_messages=args.max_messages, max_prompt_chars=args.max_prompt_chars,
                        max_prompt_tokens=args.max_prompt_tokens,
                        max_request_tokens=args.max_request_tokens, speculative=args.speculative,
                        draft_tokens=args.draft_tokens, speculative_inexact=args.speculative_inexact,
                        batch_export=args.batch_export, batch_rows=args.batch_rows,
                        prefix_cache_mb=args.prefix_cache_mb, prefill_chunk=args.prefill_chunk or None,
                        embedding_batch_ms=args.embedding_batch_ms,
                        embedding_batch_tokens=args.embedding_batch_tokens)


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` and ``bench-serve``."""
    import fastapi  # noqa: F401  -- a missing 'serve' extra is reported by tfport.cli
    import uvicorn  # noqa: F401

    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve exports over HTTP: /v1/completions, /v1/chat/completions, "
                    "/v1/embeddings, /v1/rerank, /v1/score, /v1/classify, /v1/models, /health, /metrics.")
    _add_options(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1; another address needs --api-key "
                            "or --api-key-file, or --insecure)")
    keys = serve.add_mutually_exclusive_group()
    keys.add_argument("--api-key", metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on every request but /health and "
                           "the chat page's files (visible to other users in the process list: prefer --api-key-file)")
    keys.add_argument("--api-key-file", metavar="PATH",
                      help="as --api-key, the key read from this file (surrounding space stripped)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback --host without an API key")
    serve.add_argument("--allowed-hosts", metavar="NAMES",
                       help="comma-separated Host header names to answer ('*': any; default: "
                            "--host and the loopback names, any for 0.0.0.0 or ::)")
    serve.add_argument("--port", type=_port, default=8000, help="port to bind, 0-65535 (default 8000)")
    serve.add_argument("--ray", action="store_true",
                       help="deploy on Ray Serve (extra 'serve-ray'); joins a running cluster "
                            "(RAY_ADDRESS) or starts a local one")
    serve.add_argument("--replicas", type=_positive, default=None, metavar="N",
                       help="Ray Serve replicas, a fixed count (with --ray; default 1)")
    serve.add_argument("--min-replicas", type=ascii_int, default=None, metavar="N",
                       help="with --ray and --max-replicas: Serve's autoscaler keeps N to M "
                            "replicas, adding one while each holds more than --max-rows requests "
                            "(0: none while idle)")
    serve.add_argument("--max-replicas", type=_positive, default=None, metavar="M",
                       help="the autoscaler's most replicas (with --ray and --min-replicas)")
    serve.add_argument("--no-ui", dest="ui", action="store_false",
                       help="do not serve the chat page at / (the API only)")
    _add_network_options(serve)
    serve.set_defaults(func=run_serve)

    bench = subparsers.add_parser(
        "bench-serve", help="load-test a server: throughput, time to first token, latency",
        description="Start a server on 127.0.0.1 for DIR (or use --url, loopback only), send "
                    "--requests requests from N concurrent clients per --concurrency level, check "
                    "every response and report tokens/s and p50/p99 TTFT and latency.")
    _add_options(bench)
    bench.add_argument("--url", help="an already running server on this machine "
                                     "(http://127.0.0.1:PORT); default: start one")
    bench.add_argument("--concurrency", default="1,4,16",
                       help="comma-separated client counts (default 1,4,16)")
    bench.add_argument("--requests", type=_positive, default=32,
                       help="requests per concurrency level (default 32)")
    bench.add_argument("--max-new", type=_positive, default=64, dest="new_tokens",
                       help="tokens generated per request (default 64; ignore_eos)")
    bench.add_argument("--prompt-len", default="16", metavar="N|MIN-MAX",
                       help="prompt tokens per request, or a range whose lengths are drawn "
                            "log-uniformly per request, e.g. 16-1024 (default 16)")
    bench.add_argument("--time-limit", type=float, default=600.0,
                       help="seconds for the whole run; stops sending after (default 600)")
    bench.add_argument("--json", help="write the results to this file")
    bench.set_defaults(func=run_bench)


def _add_network_options(serve: argparse.ArgumentParser) -> None:
    """Connections, browsers, endpoints and shutdown (``connections``, ``exposure``, ``lifecycle``)."""
    from .options import ServeOptions
    default = ServeOptions()
    serve.add_argument("--header-timeout", type=float, default=default.header_timeout, metavar="S",
                       help="seconds a connection may take to send a request's head; then it is "
                            f"closed (default {default.header_timeout:g})")
    serve.add_argument("--body-timeout", type=float, default=default.body_timeout, metavar="S",
                       help="seconds a request's body may take after its head; then the connection "
                            f"is closed (default {default.body_timeout:g})")
    serve.add_argument("--keep-alive-timeout", type=float, default=default.keep_alive_timeout,
                       metavar="S", help="seconds an idle kept-alive connection stays open "
                                         f"(default {default.keep_alive_timeout:g})")
    serve.add_argument("--limit-concurrency", type=_positive, default=default.limit_concurrency,
                       metavar="N", help="open connections or running requests at most; past it "
                                         f"new requests get 503 (default {default.limit_concurrency:,})")
    serve.add_argument("--shutdown-timeout", type=float, default=default.shutdown_timeout,
                       metavar="S", help="after SIGTERM, seconds running requests get to finish "
                                         "before their streams are ended; a second signal exits "
                                         f"at once (default {default.shutdown_timeout:g})")
    serve.add_argument("--cors-origin", action="append", dest="cors_origins", metavar="ORIGIN",
                       help="a browser origin allowed to call the API, e.g. https://app.example.com "
                            "(repeat for more; '*': any; default: none, no CORS headers)")
    serve.add_argument("--no-docs", dest="docs", action="store_false",
                       help="answer 404 for /docs, /redoc and /openapi.json")
    serve.add_argument("--no-metrics", dest="metrics", action="store_false",
                       help="answer 404 for /metrics")


def _network(args: argparse.Namespace) -> dict:
    """The ``ServeOptions`` fields of ``_add_network_options``' options."""
    return {"header_timeout": args.header_timeout, "body_timeout": args.body_timeout,
            "keep_alive_timeout": args.keep_alive_timeout, "limit_concurrency": args.limit_concurrency,
            "shutdown_timeout": args.shutdown_timeout, "cors_origins": tuple(args.cors_origins or ()),
            "docs": args.docs, "metrics": args.metrics}


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is None:
        return args.api_key
    key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
    if not key:
        raise ValueError(f"--api-key-file={args.api_key_file!r}: the file is empty")
    return key


def _allowed_hosts(args: argparse.Namespace) -> tuple[str, ...] | None:
    from .guards import default_allowed_hosts
    if args.allowed_hosts is None:
        return default_allowed_hosts(args.host)
    names = tuple(name.strip().lower() for name in args.allowed_hosts.split(",") if name.strip())
    if not names:
        raise ValueError(f"--allowed-hosts={args.allowed_hosts!r}: expected names, or '*' for any")
    return None if "*" in names else names


def run_serve(args: argparse.Namespace) -> int:
    from .guards import is_loopback
    options = dataclasses.replace(_options(args), api_key=_api_key(args),
                                  allowed_hosts=_allowed_hosts(args), ui=args.ui, **_network(args))
    if not is_loopback(args.host) and options.api_key is None and not args.insecure:
        raise ValueError(f"--host={args.host!r}: serving beyond this machine without an API key "
                         "lets anyone who can reach it use the models; give --api-key-file (or "
                         "--api-key), or --insecure to do it anyway")
    if not is_loopback(args.host) and options.api_key is None:
        logger.warning("serving on %s without an API key (--insecure)", args.host)
    if args.ray:
        from .ray_serve import Replicas, run_ray
        replicas = Replicas.from_options(args.replicas, args.min_replicas, args.max_replicas)
        return run_ray(args.model_dirs, options, names=args.names, host=args.host,
                       port=args.port, replicas=replicas)
    if (args.replicas, args.min_replicas, args.max_replicas) != (None, None, None):
        raise ValueError("--replicas, --min-replicas, --max-replicas: need --ray (one process "
                         "serves one replica)")
    from .app import ServerState
    from .lifecycle import serve
    state = ServerState.load(args.model_dirs, options, args.names)  # bad exports: an error, before uvicorn
    serve(state, args.host, args.port)
    return 0


def _port(text: str) -> int:
    try:
        port = ascii_int(text)
    except argparse.ArgumentTypeError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port={text!r}: expected an integer in [0, 65535]")
    return port


def run_bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, format_table, parse_prompt_len, run_bench_serve
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one line per request
    parts = [c.strip() for c in args.concurrency.split(",") if c.strip()]
    if not parts or not all(c.isascii() and c.isdigit() for c in parts):
        raise ValueError(f"--concurrency={args.concurrency!r}: expected positive integers such as 1,4,16")
    levels = [int(c) for c in parts]
    if min(levels) < 1:
        raise ValueError(f"--concurrency={args.concurrency!r}: expected positive integers")
    config = BenchConfig(concurrency=levels, requests=args.requests, new_tokens=args.new_tokens,
                         prompt_len=parse_prompt_len(args.prompt_len), time_limit=args.time_limit)
    results = run_bench_serve(args.model_dirs[0], config, _options(args), url=args.url,
                              name=(args.names or [None])[0])
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([r.as_dict() for r in results], out, indent=2)
    failed = sum(r.failed for r in results)
    if failed:
        print(f"{failed} responses failed their checks", flush=True)
    return 1 if failed else 0
