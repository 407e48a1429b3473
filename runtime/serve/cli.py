"""``tfport serve``; the export directories and options it shares with ``tfport bench-serve``
(``tfport.tools.serve_bench``).

    tfport serve out/dec [out/minilm ...] [--host 127.0.0.1] [--port 8000] [--max-rows 16]
    tfport serve out/dec --ray [--replicas 2]          # Ray Serve: proxy + replica routing
    tfport serve out/dec --ray --min-replicas 1 --max-replicas 4   # Serve's autoscaler
    tfport serve out/dec --host 0.0.0.0 --api-key-file key.txt   # exposed: a key is needed

Needs the ``serve`` extra (``--ray``: ``serve-ray``); no torch.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tfport.flags import add_flags, ascii_int, from_args
from tfport.flags import positive_int as _positive

logger = logging.getLogger(__name__)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The export directories and the options ``serve`` and ``bench-serve`` share (the
    ``ServeOptions`` fields outside the ``SERVER`` group)."""
    from .options import ServeOptions
    parser.add_argument("model_dirs", metavar="DIR", nargs="+",
                        help="export directories (each served under its directory name)")
    parser.add_argument("--name", action="append", dest="names",
                        help="model id for each DIR, in order (default: the directory name)")
    add_flags(parser, ServeOptions, groups={None})


def serve_options(args: argparse.Namespace, **values):
    """The ``ServeOptions`` of parsed arguments (``values``: fields set otherwise)."""
    from .options import ServeOptions
    return from_args(ServeOptions, args, **values)


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve``."""
    import fastapi  # noqa: F401  -- a missing 'serve' extra is reported by tfport.cli
    import uvicorn  # noqa: F401

    serve = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve exports over HTTP: /v1/completions, /v1/chat/completions, "
                    "/v1/embeddings, /v1/rerank, /v1/score, /v1/classify, /v1/models, /health, /metrics.")
    add_model_options(serve)
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
    options = serve_options(args, api_key=_api_key(args), allowed_hosts=_allowed_hosts(args))
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

