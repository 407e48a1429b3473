"""``ServeOptions``: the settings of one ``tfport serve`` (limits, timeouts, security, decoding
and caching), each checked when the options are made, so a bad value is refused at start-up
naming its option."""

from __future__ import annotations

from dataclasses import dataclass

from tfport.config.checks import is_int
from tfport.flags import option, positive_int

from ..decoding.prefix import DEFAULT_MB, PrefixCache
from ..batch_export import AUTO, check_batch_rows
from ..session import PROVIDERS
from .batcher import MAX_TOKENS, WINDOW_S
from .exposure import check_origins
from .scheduler import SchedulerLimits

MiB = 1 << 20
SERVER = "server"  # the group of the options of a server process only: `tfport serve`, not bench-serve


def _batch_rows(text: str) -> int | str:
    """``--batch-rows``: "auto" or a positive integer."""
    return text if text == AUTO else positive_int(text)


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """Limits and session settings of a server.

    ``max_rows`` rows decode together per model; ``max_queue`` requests may wait (then 429);
    ``max_tokens`` caps a request's ``max_tokens``; ``timeout`` seconds per request;
    ``max_length`` tokens per row (prompt + generated; default the model's max_positions);
    ``max_body_bytes`` per request body (413 past it); ``max_inputs`` embedding inputs per request
    (OpenAI's 2,048); ``max_messages`` messages per chat; ``max_prompt_chars`` characters per
    prompt (a chat's: all its messages'), refused before it is tokenised; ``max_prompt_tokens``
    tokens per prompt or embedding input once tokenised (None: the model's context);
    ``max_request_tokens`` tokens one request may take (prompt tokens x n + max_tokens x n over
    its prompts; an embedding request's inputs); ``api_key``: the Bearer key every
    request but ``/health`` must carry (None: none asked; never shown in a repr);
    ``allowed_hosts``: the ``Host`` header names answered (ports aside; None: any), against DNS
    rebinding. ``speculative`` decodes every served decoder speculatively ("lookup" or a draft
    export's directory; ``draft_tokens`` at most per step; ``speculative_inexact`` accepts a
    quantised target, see ``decoding.speculative.Speculation``). ``batch_export``: another export
    of the one model served (e.g. ``--quantize w8a8`` beside int4) that runs every step of at
    least ``batch_rows`` rows ("auto": measured at load, ``Model.load``). ``prefix_cache_mb``: MiB of
    keys and values each served decoder keeps for prompts that start alike (automatic prefix
    caching, ``decoding.prefix``; 0: off). ``prefill_chunk``: while rows decode, a longer prompt
    is prefilled this many tokens per step, between decode steps (with the prefix cache, which
    holds the chunks; None: whole). ``ui``: serve the chat page at
    ``/`` (``static/``; ``--no-ui``: off, its routes not mounted). ``embedding_batch_ms``: an
    idle encoder's first embedding request waits this long for others to embed with it, up to
    ``embedding_batch_tokens`` tokens per batch (``batcher``; 0 ms: no wait, requests that
    arrive during a batch still form the next one).

    Connections (``connections``; uvicorn only, not Ray): a request head must arrive within
    ``header_timeout`` seconds and its body within ``body_timeout``; an idle kept-alive connection
    is closed after ``keep_alive_timeout``; past ``limit_concurrency`` open connections or running
    requests, 503 (None: no limit). ``shutdown_timeout``: seconds running requests get to finish
    after SIGTERM (``lifecycle``). ``cors_origins``: the browser origins allowed to call the API
    (``exposure``; ``("*",)``: any; empty: no CORS headers); ``docs`` and ``metrics``: whether
    ``/docs`` (with ``/redoc`` and ``/openapi.json``) and ``/metrics`` are served.
    """

    # The options of `tfport serve` and `bench-serve`, in the order of their --help.
    max_rows: int = option(16, type=positive_int,
                           help="requests decoded together per model (default {default})")
    max_queue: int = option(256, type=positive_int,
                            help="requests waiting for a row before 429 (default {default})")
    max_tokens: int = option(4096, type=positive_int,
                             help="largest max_tokens a request may ask (default {default})")
    max_length: int | None = option(None, type=positive_int,
                                    help="prompt + generated tokens per row (default: the model's "
                                         "max_positions)")
    timeout: float = option(600.0, help="seconds a request may take (default {default:g})")
    provider: str = option("cpu", choices=PROVIDERS, help="where the models run (auto: CUDA if it "
                                                          "works, else the CPU; default {default})")
    threads: int = option(0, help="intra-op threads per model (default: ONNX Runtime's choice)")
    max_body_bytes: int = option(4 * MiB, type=positive_int, metavar="BYTES",
                                 help="largest request body; larger ones get 413 before they are "
                                      "read (default {default:,}: 4 MiB)")
    max_inputs: int = option(2048, flag="--max-embedding-inputs", type=positive_int, metavar="N",
                             help="inputs per /v1/embeddings or /v1/classify request, documents per "
                                  "/v1/rerank, pairs per /v1/score (default {default:,})")
    embedding_batch_ms: float = option(1000 * WINDOW_S, metavar="MS",
                                       help="an idle encoder's first embedding request waits this "
                                            "long for others to embed with it (0-1000; default {default:g})")
    embedding_batch_tokens: int = option(MAX_TOKENS, type=positive_int, metavar="N",
                                         help="tokens embedded together at most, over the requests "
                                              "of one batch (default {default:,})")
    max_messages: int = option(2048, type=positive_int, metavar="N",
                               help="messages per chat request (default {default:,})")
    # ~250k tokens of English: more than any context, 1 s to tokenise
    max_prompt_chars: int = option(1_000_000, type=positive_int, metavar="N",
                                   help="characters per prompt or embedding input (a chat's: all its "
                                        "messages'), refused before tokenising (default {default:,})")
    max_prompt_tokens: int | None = option(None, type=positive_int, metavar="N",
                                           help="tokens per prompt or embedding input once tokenised "
                                                "(default and at most: the model's context)")
    # 16 rows of a 16k context; 2,048 inputs of 128 tokens
    max_request_tokens: int = option(256 * 1024, type=positive_int, metavar="N",
                                     help="tokens one request may take: prompt tokens x n + max_tokens "
                                          "x n over its prompts, or its embedding inputs' tokens "
                                          "(default {default:,})")
    speculative: str | None = option(None, metavar="lookup|DRAFT_DIR",
                                     help="decode every served decoder speculatively: 'lookup' (n-gram "
                                          "matches in the prompt and output) or a draft export with "
                                          "the same vocabulary")
    draft_tokens: int = option(8, type=positive_int, metavar="K",
                               help="most tokens proposed per step (default {default}; adapted)")
    speculative_inexact: bool = option(False, help="speculate on quantised exports too (their tokens "
                                                   "can differ from plain decoding's)")
    batch_export: str | None = option(None, metavar="DIR",
                                      help="another export of the one served model (same target and "
                                           "cache, e.g. --quantize w8a8 beside int4) that runs every "
                                           "step of at least --batch-rows rows: batched decode steps "
                                           "and long prefills")
    batch_rows: int | str = option(AUTO, type=_batch_rows, metavar="auto|N",
                                   help="rows (batch x new tokens) from which a step runs on "
                                        "--batch-export (default {default}: measured when the server "
                                        "starts, where the two exports' speeds cross; `tfport bench "
                                        "--rows-exports` shows them)")
    prefix_cache_mb: int = option(DEFAULT_MB, metavar="MB",
                                  help="MiB of keys and values each decoder keeps for prompts that "
                                       "start alike (automatic prefix caching; 0: off; default {default})")
    prefill_chunk: int | None = option(256, none="0", metavar="TOKENS",
                                       help="while rows decode, prefill a longer prompt this many "
                                            "tokens per step (chunked prefill; needs the prefix cache; "
                                            "0: whole; default {default})")

    # `tfport serve`'s only (connections, what is exposed): bench-serve starts its server without them.
    ui: bool = option(True, group=SERVER, help="do not serve the chat page at / (the API only)")
    header_timeout: float = option(10.0, group=SERVER, metavar="S",
                                   help="seconds a connection may take to send a request's head; "
                                        "then it is closed (default {default:g})")
    body_timeout: float = option(60.0, group=SERVER, metavar="S",  # a 4 MiB body at 0.5 Mbit/s
                                 help="seconds a request's body may take after its head; then the "
                                      "connection is closed (default {default:g})")
    keep_alive_timeout: float = option(5.0, group=SERVER, metavar="S",  # uvicorn's default
                                       help="seconds an idle kept-alive connection stays open "
                                            "(default {default:g})")
    # under the usual 1,024 open files, past which accept() fails
    limit_concurrency: int | None = option(1000, group=SERVER, type=positive_int, metavar="N",
                                           help="open connections or running requests at most; past "
                                                "it new requests get 503 (default {default:,})")
    shutdown_timeout: float = option(30.0, group=SERVER, metavar="S",  # Kubernetes' default grace period
                                     help="after SIGTERM, seconds running requests get to finish "
                                          "before their streams are ended; a second signal exits at "
                                          "once (default {default:g})")
    cors_origins: tuple[str, ...] = option((), group=SERVER, flag="--cors-origin", metavar="ORIGIN",
                                           help="a browser origin allowed to call the API, e.g. "
                                                "https://app.example.com (repeat for more; '*': any; "
                                                "default: none, no CORS headers)")
    docs: bool = option(True, group=SERVER, help="answer 404 for /docs, /redoc and /openapi.json")
    metrics: bool = option(True, group=SERVER, help="answer 404 for /metrics")
    # Not flags: cli.py reads them from --api-key / --api-key-file and --allowed-hosts with --host.
    api_key: str | None = option(None, flag=False, repr=False)
    allowed_hosts: tuple[str, ...] | None = option(None, flag=False)

    def __post_init__(self) -> None:
        check_batch_rows(self.batch_rows)
        if self.batch_export is None and self.batch_rows != AUTO:
            raise ValueError(f"batch_rows={self.batch_rows!r}: applies with batch_export (none given)")
        for name in ("max_tokens", "max_body_bytes", "max_inputs", "max_messages", "draft_tokens",
                     "max_prompt_chars", "max_prompt_tokens", "max_request_tokens",
                     "embedding_batch_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        for name in ("timeout", "header_timeout", "body_timeout", "keep_alive_timeout",
                     "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a positive number of seconds")
        if not 0 <= self.embedding_batch_ms <= 1000:
            raise ValueError(f"embedding_batch_ms={self.embedding_batch_ms!r}: expected milliseconds "
                             "in [0, 1000]")
        limit = self.limit_concurrency
        if limit is not None and (not is_int(limit) or limit < 1):
            raise ValueError(f"limit_concurrency={limit!r}: expected a positive integer, or None "
                             "for no limit")
        check_origins(self.cors_origins)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()
                                         or not self.api_key.isascii()):
            raise ValueError("api_key: expected a non-empty ASCII string")
        if self.allowed_hosts is not None and (
                not isinstance(self.allowed_hosts, tuple) or not self.allowed_hosts
                or not all(isinstance(h, str) and h and h == h.lower() for h in self.allowed_hosts)):
            raise ValueError(f"allowed_hosts={self.allowed_hosts!r}: expected a non-empty tuple of "
                             "lower-case host names, or None for any")
        SchedulerLimits(self.max_rows, self.max_queue, self.max_length, self.prefill_chunk)  # checks those
        PrefixCache.from_mb(self.prefix_cache_mb)  # checks it

    @property
    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_rows, self.max_queue, self.max_length, self.prefill_chunk)
