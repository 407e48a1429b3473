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
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from ..chat import chat_format
from ..defaults import OPENAI
from ..model import Model
from ..sampling import SamplingParams
from ..session import SessionSettings
from ..tokenizer import TextStream, TextTokenizer
from .protocol import ApiError, DecodingRequest
from .handles import GenerationRequest, Handle, QueueFull
from .scheduler import Scheduler, SchedulerLimits

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# A completion prompt or an embedding input: a text, texts, token ids or token id lists.
Inputs = Union[str, list[str], list[int], list[list[int]]]


@dataclass(frozen=True)
class ServeOptions:
    """Limits and session settings of a server.

    ``max_rows`` rows decode together per model; ``max_queue`` requests may wait (then 429);
    ``max_tokens`` caps a request's ``max_tokens``; ``timeout`` seconds per request;
    ``max_length`` tokens per row (prompt + generated; default the model's max_positions).
    """

    max_rows: int = 16
    max_queue: int = 256
    max_tokens: int = 4096
    timeout: float = 600.0
    max_length: int | None = None
    provider: str = "cpu"
    threads: int = 0

    def __post_init__(self) -> None:
        for name in ("max_tokens",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r}: expected a positive number of seconds")
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
            self.scheduler = Scheduler(model, options.limits, observer)
        self._embed_lock = threading.Lock()

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
                raise ApiError(400, f"{param}[{index}]: token ids {bad[:8]} outside [0, {vocab})",
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

    def max_tokens(self, requested: int | None, prompt: Sequence[int] | None = None) -> int:
        """A request's ``max_tokens``, at most the server's cap. Left out: OpenAI's 16 for a
        completion; for a chat ``prompt``, as many as the context and the cap allow."""
        if requested is None:
            if prompt is None:
                return min(DEFAULT_COMPLETION_TOKENS, self.options.max_tokens)
            room = self.scheduler.max_length - len(prompt) + 1  # the last token is not fed back
            return max(1, min(self.options.max_tokens, room))
        if requested > self.options.max_tokens:
            raise ApiError(400, f"max_tokens={requested}: more than this server's limit of "
                                f"{self.options.max_tokens} per request", "max_tokens")
        return requested

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
