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
import json
import logging
from pathlib import Path

from tfport.flags import add_flags, ascii_int, from_args
from tfport.flags import positive_int as _positive

logger = logging.getLogger(__name__)


def _add_options(parser: argparse.ArgumentParser) -> None:
    """The export directories and the options ``serve`` and ``bench-serve`` share (the
    ``ServeOptions`` fields outside the ``SERVER`` group)."""
    from .options import ServeOptions
    parser.add_argument("model_dirs", metavar="DIR", nargs="+",
                        help="export directories (each served under its directory name)")
    parser.add_argument("--name", action="append", dest="names",
                        help="model id for each DIR, in order (default: the directory name)")
    add_flags(parser, ServeOptions, groups={None})


def _options(args: argparse.Namespace, **values):
    """The ``ServeOptions`` of parsed arguments (``values``: fields set otherwise)."""
    from .options import ServeOptions
    return from_args(ServeOptions, args, **values)


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
    from .options import SERVER, ServeOptions
    add_flags(serve, ServeOptions, groups={SERVER})  # --no-ui, connections, what is exposed
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
    options = _options(args, api_key=_api_key(args), allowed_hosts=_allowed_hosts(args))
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
