"""``ServeOptions``: the settings of one ``tfport serve`` (limits, timeouts, security, decoding
and caching), each checked when the options are made, so a bad value is refused at start-up
naming its option."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..decoding.prefix import DEFAULT_MB, PrefixCache
from ..batch_export import AUTO, check_batch_rows
from .batcher import MAX_TOKENS, WINDOW_S
from .exposure import check_origins
from .scheduler import SchedulerLimits

MiB = 1 << 20


@dataclass(frozen=True)
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

    max_rows: int = 16
    max_queue: int = 256
    max_tokens: int = 4096
    timeout: float = 600.0
    max_length: int | None = None
    provider: str = "cpu"
    threads: int = 0
    max_body_bytes: int = 4 * MiB
    max_inputs: int = 2048
    max_messages: int = 2048
    max_prompt_chars: int = 1_000_000  # ~250k tokens of English: more than any context, 1 s to tokenise
    max_prompt_tokens: int | None = None  # None: the model's context
    max_request_tokens: int = 256 * 1024  # 16 rows of a 16k context; 2,048 inputs of 128 tokens
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] | None = None
    speculative: str | None = None  # "lookup" or a draft export's directory (every decoder served)
    draft_tokens: int = 8
    speculative_inexact: bool = False
    batch_export: str | None = None  # another export of the one served model for runs of many rows
    batch_rows: int | str = AUTO  # rows (batch x new tokens) from which runs go to batch_export; "auto": measured
    prefix_cache_mb: int = DEFAULT_MB  # automatic prefix caching per decoder (0: off)
    prefill_chunk: int | None = 256  # tokens of a long prompt prefilled per step while rows decode
    ui: bool = True
    embedding_batch_ms: float = 1000 * WINDOW_S
    embedding_batch_tokens: int = MAX_TOKENS
    header_timeout: float = 10.0
    body_timeout: float = 60.0  # a 4 MiB body at 0.5 Mbit/s
    keep_alive_timeout: float = 5.0  # uvicorn's default
    limit_concurrency: int | None = 1000  # under the usual 1,024 open files, past which accept() fails
    shutdown_timeout: float = 30.0  # Kubernetes' default grace period
    cors_origins: tuple[str, ...] = ()
    docs: bool = True
    metrics: bool = True

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
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        for name in ("timeout", "header_timeout", "body_timeout", "keep_alive_timeout",
                     "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a positive number of seconds")
        if not 0 <= self.embedding_batch_ms <= 1000:
            raise ValueError(f"embedding_batch_ms={self.embedding_batch_ms!r}: expected milliseconds "
                             "in [0, 1000]")
        limit = self.limit_concurrency
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
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
