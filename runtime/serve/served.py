"""The models one server holds: an export directory each, with its scheduler (decoders) and what
turns requests into token ids and token ids back into text."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..model import Model
from ..session import SessionSettings
from ..tokenizer import TextStream, TextTokenizer
from .protocol import ApiError
from .scheduler import Scheduler, SchedulerLimits


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


def chat_prompt(model: Model, messages: list[dict]) -> tuple[list[int], tuple[int, ...]]:
    """Prompt ids of ``messages`` rendered with the export's chat template, and the ids that end
    the assistant's turn (``tfport.runtime.chat``)."""
    from ..chat import chat_format
    fmt = chat_format(model)
    return fmt.prompt_ids(messages), fmt.stop_ids


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

    @property
    def tokenizer(self) -> TextTokenizer | None:
        return self.model.tokenizer

    def require(self, family: str, endpoint: str) -> None:
        if self.family != family:
            kind = {"decoder": "a decoder", "encoder": "an encoder"}[family]
            raise ApiError(400, f"model {self.name!r} is a {self.family} export; {endpoint} needs "
                                f"{kind} export", "model")

    def prompts(self, prompt, param: str = "prompt") -> list[list[int]]:
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
                tokenizer = self.tokenizer
                if tokenizer is None:
                    raise ApiError(400, f"{param}: model {self.name!r} has no tokenizer.json; send "
                                        "token ids instead of text", param)
                item = tokenizer.encode(item)
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
        try:
            return chat_prompt(self.model, messages)
        except (ValueError, TypeError) as err:
            raise ApiError(400, str(err), "messages") from None

    def stop_ids(self, ignore_eos: bool, extra: Sequence[int] | None,
                 defaults: tuple[int, ...] | None = None) -> tuple[int, ...]:
        ids = () if ignore_eos else (defaults if defaults is not None else self.model.stop_ids())
        if extra:
            vocab = self.model.config.vocab_size
            bad = [i for i in extra if not 0 <= i < vocab]
            if bad:
                raise ApiError(400, f"stop_token_ids: {bad} outside [0, {vocab})", "stop_token_ids")
            ids = tuple(dict.fromkeys([*ids, *extra]))
        return ids

    def text_stream(self) -> TextStream | None:
        tokenizer = self.tokenizer
        return None if tokenizer is None else TextStream(tokenizer)

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        """Mean-pooled, L2-normalised sentence embeddings float32 [B, E] (runs in a worker
        thread; one batch at a time per model)."""
        with self._embed_lock:
            return self.model.embed(rows, pooling="mean", normalize=True)


class StopText:
    """Text pieces in, text out up to the first ``stop`` string: a piece is held back while the
    text's end could be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything pushed
        self.shown = 0  # characters returned so far
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        if self.stops:
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._show(min(hits))
        return self._show(len(self.text) - self.hold)

    def finish(self) -> str:
        return "" if self.stopped else self._show(len(self.text))

    def _show(self, end: int) -> str:
        if end <= self.shown:
            return ""
        out, self.shown = self.text[self.shown:end], end
        return out
