"""The models one server holds, and how an API request becomes library calls.

A ``ServedModel`` is one export directory: its ``Model``, its continuous-batching ``Scheduler``
(decoders) and the conversions from request fields to the library's arguments. What the model
computes is decided by the library alone, as for ``tfport generate`` / ``chat`` / ``embed``:
sampling defaults by ``Model.sampling`` (request > generation_config.json > greedy), stop ids by
``Model.stop_ids``, chat prompts and end-of-turn ids by ``tfport.runtime.chat``, forced tokens by
the scheduler (``Model.forced_tokens``), embeddings by ``Model.embed_text`` for texts (the
export's truncation, lower-casing, pooling and normalisation) and ``Model.embed`` for token ids
(the export's pooling and normalisation).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np

from ..chat import chat_format
from ..decoding.speculative import Speculation
from ..defaults import OPENAI
from ..model import Model
from ..sampling import SamplingParams
from ..session import SessionSettings
from ..tokenizer import TextStream, TextTokenizer
from .protocol import ApiError, ChatRequest, CompletionRequest, DecodingRequest, check_text, quote
from .handles import GenerationRequest, Handle, QueueFull
from .scheduler import Scheduler, SchedulerLimits

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MiB = 1 << 20
# A completion prompt or an embedding input: a text, texts, token ids or token id lists.
Inputs = Union[str, list[str], list[int], list[list[int]]]


@dataclass(frozen=True)
class ServeOptions:
    """Limits and session settings of a server.

    ``max_rows`` rows decode together per model; ``max_queue`` requests may wait (then 429);
    ``max_tokens`` caps a request's ``max_tokens``; ``timeout`` seconds per request;
    ``max_length`` tokens per row (prompt + generated; default the model's max_positions);
    ``max_body_bytes`` per request body (413 past it); ``max_inputs`` embedding inputs per request
    (OpenAI's 2,048); ``max_messages`` messages per chat; ``api_key``: the Bearer key every
    request but ``/health`` must carry (None: none asked; never shown in a repr);
    ``allowed_hosts``: the ``Host`` header names answered (ports aside; None: any), against DNS
    rebinding. ``speculative`` decodes every served decoder speculatively ("lookup" or a draft
    export's directory; ``draft_tokens`` at most per step; ``speculative_inexact`` accepts a
    quantised target, see ``decoding.speculative.Speculation``).
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
    api_key: str | None = field(default=None, repr=False)
    allowed_hosts: tuple[str, ...] | None = None
    speculative: str | None = None  # "lookup" or a draft export's directory (every decoder served)
    draft_tokens: int = 8
    speculative_inexact: bool = False

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_body_bytes", "max_inputs", "max_messages", "draft_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r}: expected a positive number of seconds")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()
                                         or not self.api_key.isascii()):
            raise ValueError("api_key: expected a non-empty ASCII string")
        if self.allowed_hosts is not None and (
                not isinstance(self.allowed_hosts, tuple) or not self.allowed_hosts
                or not all(isinstance(h, str) and h and h == h.lower() for h in self.allowed_hosts)):
            raise ValueError(f"allowed_hosts={self.allowed_hosts!r}: expected a non-empty tuple of "
                             "lower-case host names, or None for any")
        SchedulerLimits(self.max_rows, self.max_queue, self.max_length)  # checks those

    @property
    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(self.max_rows, self.max_queue, self.max_length)


class ServedModel:
    """One export behind the server: ``name`` is its id in the API."""

    def __init__(self, name: str, model: Model, options: ServeOptions, observer=None):
        self.name = name
        self.model = model
        self.options = options
        self.family = model.config.family
        self.scheduler: Scheduler | None = None
        if self.family == "decoder":
            self.scheduler = Scheduler(model, options.limits, observer, self._speculation())
        self._embed_lock = threading.Lock()

    def _speculation(self) -> Speculation | None:
        """The scheduler's speculation from the options (a draft export opened once, with the
        target's session settings)."""
        drafter = self.options.speculative
        if drafter is None:
            return None
        if drafter != "lookup":
            if not Path(drafter).is_dir():
                raise ValueError(f"speculative={drafter!r}: expected 'lookup' or the directory of a "
                                 "draft decoder export")
            drafter = Model.load(drafter, settings=self.model.settings)
        return Speculation(drafter, self.options.draft_tokens, exact=not self.options.speculative_inexact)

    @property
    def speculates(self) -> bool:
        return self.scheduler is not None and self.scheduler.speculation is not None

    @classmethod
    def load(cls, directory: str | Path, options: ServeOptions, name: str | None = None,
             observer_for=None) -> "ServedModel":
        settings = SessionSettings(provider=options.provider, intra_op_threads=options.threads)
        model = Model.load(directory, settings=settings)
        if model.config.family == "encoder-decoder":
            raise ValueError(f"{directory}: encoder-decoder exports are not served (the scheduler "
                             "batches decoder-only rows; embeddings need an encoder)")
        name = name or Path(directory).resolve().name
        return cls(name, model, options, observer_for(name) if observer_for else None)

    def start(self) -> None:
        if self.scheduler is not None:
            self.scheduler.start()

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()

    def health(self) -> dict:
        """``family``; for a decoder also its ``running`` and ``waiting`` rows and whether its
        scheduler thread is ``alive``."""
        if self.scheduler is None:
            return {"family": self.family}
        return {"family": self.family, "running": self.scheduler.running,
                "waiting": self.scheduler.waiting, "alive": self.scheduler.alive}

    def require(self, family: str, endpoint: str) -> None:
        if self.family != family:
            kind = {"decoder": "a decoder", "encoder": "an encoder"}[family]
            raise ApiError(400, f"model {self.name!r} is a {self.family} export; {endpoint} needs "
                                f"{kind} export", "model")

    # ------------------------------------------------------------------------------ token ids
    def _tokenizer(self, param: str) -> TextTokenizer:
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ApiError(400, f"{param}: model {self.name!r} has no tokenizer.json; send token ids "
                                "instead of text", param)
        return tokenizer

    def prompts(self, prompt: Inputs, param: str = "prompt") -> list[list[int]]:
        """A completion prompt / embedding input -> token id lists: a str, a list of str, a list
        of ids or a list of id lists."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, f"{param}: expected at least one prompt", param)
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        rows = []
        for index, item in enumerate(prompt):
            if isinstance(item, str):
                item = self._tokenizer(param).encode(item)
            if not item:
                raise ApiError(400, f"{param}[{index}]: empty; expected at least one token", param)
            rows.append([int(t) for t in item])
        vocab = self.model.config.vocab_size
        for index, row in enumerate(rows):
            bad = [t for t in row if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"{param}[{index}]: token ids {quote(bad)} outside [0, {vocab})",
                               param)
        return rows

    def chat(self, messages: list[dict]) -> tuple[list[int], tuple[int, ...]]:
        """Prompt ids of ``messages`` rendered with the export's chat template, and the ids that
        end the assistant's turn (``tfport.runtime.chat``, as ``Model.chat`` takes them)."""
        try:
            fmt = chat_format(self.model)
            return fmt.prompt_ids(messages), fmt.stop_ids
        except (ValueError, TypeError) as err:
            raise ApiError(400, str(err), "messages") from None

    def text_stream(self) -> TextStream | None:
        tokenizer = self.model.tokenizer
        return None if tokenizer is None else TextStream(tokenizer)

    # ----------------------------------------------------------------------------- generation
    def stop_ids(self, ignore_eos: bool, extra: Sequence[int] | None,
                 defaults: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """The ids that end a row: ``defaults`` (None: ``Model.stop_ids``'s, those of
        ``Model.generate``) unless ``ignore_eos``, plus the request's ``stop_token_ids``."""
        ids = () if ignore_eos else (self.model.stop_ids() if defaults is None else defaults)
        if extra:
            try:
                extra = self.model.stop_ids(extra)
            except (ValueError, TypeError) as err:
                raise ApiError(400, str(err), "stop_token_ids") from None
            ids = tuple(dict.fromkeys([*ids, *extra]))
        return ids

    def sampling(self, body: DecodingRequest) -> SamplingParams:
        """The request's sampling; the fields it leaves out from the export's
        generation_config.json where it samples, else OpenAI's defaults (temperature 1), resolved
        where ``Model.generate`` resolves its own (``RequestDefaults.sampling``)."""
        top_k = 0 if body.top_k == -1 else body.top_k  # vLLM's -1: keep all, as 0 does
        try:
            return SamplingParams(**self.model.defaults.sampling(body.temperature, top_k, body.top_p,
                                                                 unsaid=OPENAI))
        except ValueError as err:
            raise ApiError(400, str(err), str(err).split("=")[0]) from None

    def max_tokens(self, body: DecodingRequest, prompts: list[list[int]], prompt_param: str,
                   default: int | None = None) -> int:
        """New tokens per row: what the request asks (``max_tokens``, or a chat's
        ``max_completion_tokens``), else ``default`` (None: as many as the context and the cap
        allow). ``ApiError`` naming the field the client sent when it is over the server's cap
        or the context left after the longest prompt (``prompt_param`` when no token is left)."""
        requested, param = body.token_budget()
        cap, context = self.options.max_tokens, self.scheduler.max_length
        longest = max(len(p) for p in prompts)
        if longest > context:
            raise ApiError(400, f"{prompt_param}: {longest} tokens, more than this server's context "
                                f"of {context}", prompt_param)
        room = context - longest + 1  # the last token is not fed back
        if requested is None and default is None:
            return min(cap, room)
        tokens = min(default, cap) if requested is None else requested
        if tokens > cap:
            raise ApiError(400, f"{param}={quote(tokens)}: more than this server's limit of {cap} "
                                "per request (--max-tokens)", param)
        if tokens > room:
            raise ApiError(400, f"{param}={tokens}: a prompt of {longest} tokens leaves room for "
                                f"{room} in this server's context of {context}; lower {param} to "
                                f"at most {room}", param)
        return tokens

    def completion_inputs(self, body: CompletionRequest
                          ) -> tuple[list[list[int]], int, tuple[int, ...]]:
        """A completion request -> (prompt ids, max_tokens, stop ids); ``ApiError`` 400 for a
        request that cannot run. Tokenises: call it in a worker thread."""
        check_text(body, "")
        body.refuse_unsupported()
        prompts = self.prompts(body.prompt)
        stop_ids = self.stop_ids(body.ignore_eos, body.stop_token_ids)
        return prompts, self.max_tokens(body, prompts, "prompt", DEFAULT_COMPLETION_TOKENS), stop_ids

    def chat_inputs(self, body: ChatRequest) -> tuple[list[list[int]], int, tuple[int, ...]]:
        """A chat request -> ([prompt ids], max_tokens, stop ids): the messages rendered with
        the export's template, stops at its end of turn. Tokenises: call it in a worker thread."""
        if len(body.messages) > self.options.max_messages:
            raise ApiError(400, f"messages: {len(body.messages):,} messages, more than this "
                                f"server's limit of {self.options.max_messages:,} per chat "
                                "(--max-messages)", "messages")
        check_text(body, "")
        body.refuse_unsupported()
        messages = [{**m.model_dump(exclude_none=True), "content": m.text(i)}
                    for i, m in enumerate(body.messages)]
        prompt, turn_ends = self.chat(messages)
        stop_ids = self.stop_ids(body.ignore_eos, body.stop_token_ids, turn_ends)
        return [prompt], self.max_tokens(body, [prompt], "messages"), stop_ids

    def submit(self, prompts: list[list[int]], body: DecodingRequest, max_tokens: int,
               stop_ids: tuple[int, ...], loop: asyncio.AbstractEventLoop) -> list[Handle]:
        """Queue ``body.n`` sequences per prompt (each its own seed, ``seed + i``) -> handles
        delivering to ``loop``; ``ApiError`` 400 for a request that cannot run, 429 when the
        queue is full."""
        params = self.sampling(body)
        count = len(prompts) * body.n
        if count > self.options.max_queue:
            raise ApiError(400, f"n: {len(prompts)} prompt(s) x n={body.n} = {count} sequences, more "
                                f"than this server's queue of {self.options.max_queue}", "n")
        rows = [prompt for prompt in prompts for _ in range(body.n)]
        requests = [GenerationRequest(prompt, max_tokens, params,
                                      None if body.seed is None else body.seed + index, stop_ids,
                                      self.options.timeout) for index, prompt in enumerate(rows)]
        try:
            return self.scheduler.submit(requests, loop=loop)
        except QueueFull as err:
            raise ApiError(429, str(err), code="queue_full") from None
        except ValueError as err:
            raise ApiError(400, str(err), "max_tokens" if "max_tokens" in str(err) else "prompt") from None

    # ----------------------------------------------------------------------------- embeddings
    def embed(self, inputs: Inputs) -> tuple[np.ndarray, int]:
        """Sentence embeddings float32 [B, E] of an embedding ``input`` and the tokens it took:
        texts as ``Model.embed_text`` embeds them, token ids as ``Model.embed`` does, both with
        the export's settings (``tfport embed``). Runs in a worker thread; one batch at a time
        per model."""
        count = 1 if isinstance(inputs, str) or all(isinstance(t, int) for t in inputs) else len(inputs)
        if count > self.options.max_inputs:
            raise ApiError(400, f"input: {count:,} inputs, more than this server's limit of "
                                f"{self.options.max_inputs:,} per request (--max-embedding-inputs)",
                           "input")
        texts = [inputs] if isinstance(inputs, str) else inputs
        with self._embed_lock:
            try:
                if texts and all(isinstance(t, str) for t in texts):
                    self._tokenizer("input")
                    encoded = self.model.encode_texts(texts, method="embeddings")
                    tokens = sum(len(ids) for ids in encoded.ids)
                    return self.model.embed_encoded(encoded, progress=False), tokens
                rows = self.prompts(inputs, "input")
                return self.model.embed(rows), sum(len(row) for row in rows)
            except (ValueError, TypeError) as err:
                raise ApiError(400, f"input: {err}", "input") from None
