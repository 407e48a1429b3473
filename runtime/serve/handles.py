"""What a request to the scheduler is and what it gets back: ``GenerationRequest`` in, a
``Handle`` out whose events (``Token`` ..., then ``Finished`` or ``Failed``) arrive in order from
the scheduler thread, to a blocking iterator or (``handle.attach(loop)``) an asyncio loop; and the
``Observer`` the scheduler reports to (``metrics.ServeMetrics``)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Union

from ..decoding.engine import LogitsProcessor
from ..request import LIBRARY, Request
from ..sampling import SamplingParams, TokenLogprob, check_bias_ids


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_queue`` requests (HTTP 429)."""


@dataclass
class GenerationRequest:
    """One sequence to generate: ``prompt`` token ids, at most ``max_new_tokens`` new tokens,
    stop at any of ``stop_ids`` (the stop token is reported, then the row ends); ``timeout``
    seconds from submission (None: no limit); ``logprobs``: each ``Token`` carries its
    log-probability and that many alternatives (None: none). The server makes these from a
    checked ``request.Request``; ``check`` checks one made by hand against a scheduler."""

    prompt: Sequence[int]
    max_new_tokens: int = LIBRARY.max_new_tokens
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    timeout: float | None = None
    logprobs: int | None = None
    # This row's own logits processors, after its penalties (a grammar: decoding.grammar).
    processors: tuple[LogitsProcessor, ...] = ()

    def check(self, vocab_size: int, context: int, prompt_limit: int, seq2seq: bool = False) -> None:
        """``ValueError`` naming the field unless this runs in ``context`` positions of a model
        of ``vocab_size`` tokens, with a prompt of at most ``prompt_limit`` tokens: the token
        budget as ``Request.token_budget`` checks a request's, with the same arithmetic."""
        prompt = self.prompt
        if len(prompt) == 0:
            raise ValueError("prompt: expected at least one token")
        bad = [int(t) for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:8]} outside [0, {vocab_size}) (the model's vocab_size)")
        if len(prompt) > prompt_limit:
            raise ValueError(f"prompt: {len(prompt)} tokens, more than the {prompt_limit} positions "
                             f"this server gives a prompt")
        Request(max_new_tokens=self.max_new_tokens, top_logprobs=self.logprobs).token_budget(
            len(prompt), context, seq2seq=seq2seq)
        check_bias_ids(self.params, vocab_size)
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r}: expected a positive number of seconds")


@dataclass(frozen=True)
class Token:
    """A generated token ``id``; ``logprob`` when the request asked for logprobs."""

    id: int
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class Finished:
    """``reason``: "stop" (a stop id), "length" (max_tokens), "cancelled", "timeout"."""

    reason: str


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Union[Token, Finished, Failed]


class Observer(Protocol):
    """What the scheduler reports (``metrics.ServeMetrics`` implements it for Prometheus)."""

    def queue_depth(self, waiting: int, running: int) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def step(self, rows: int, tokens: int, seconds: float) -> None: ...
    def finished(self, reason: str, seconds: float) -> None: ...
    def speculated(self, proposed: int, accepted: int) -> None: ...


class NullObserver:
    def queue_depth(self, waiting, running): pass
    def first_token(self, seconds): pass
    def step(self, rows, tokens, seconds): pass
    def finished(self, reason, seconds): pass
    def speculated(self, proposed, accepted): pass


class Handle:
    """A submitted request: its events, in order, ending with ``Finished`` or ``Failed``."""

    def __init__(self, request: GenerationRequest):
        self.request = request
        self.submitted = time.monotonic()
        self.deadline = None if request.timeout is None else self.submitted + request.timeout
        self.tokens: list[int] = []
        self.proposed = self.accepted = 0  # speculative decoding: draft tokens offered, accepted
        self.cancelled = False
        self.done = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async: asyncio.Queue | None = None
        self._lock = threading.Lock()

    def attach(self, loop: asyncio.AbstractEventLoop) -> "Handle":
        """Deliver events to ``loop`` (iterate with ``async for``); call before ``submit``."""
        self._loop, self._async = loop, asyncio.Queue()
        return self

    def cancel(self) -> None:
        """Stop generating; the row is freed at the next step boundary."""
        self.cancelled = True

    def deliver(self, event: Event) -> None:
        """Hand ``event`` to whoever reads this handle (the scheduler calls it; events after the
        final one are dropped)."""
        with self._lock:
            if self.done:
                return
            if isinstance(event, Token):
                self.tokens.append(event.id)
            else:
                self.done = True
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        else:
            self._queue.put(event)

    def __iter__(self) -> Iterator[Event]:
        assert self._loop is None, "this handle delivers to an asyncio loop: use async for"
        while True:
            event = self._queue.get()
            yield event
            if not isinstance(event, Token):
                return

    async def __aiter__(self) -> AsyncIterator[Event]:
        assert self._async is not None, "call attach(loop) before submit to use async for"
        while True:
            event = await self._async.get()
            yield event
            if not isinstance(event, Token):
                return

    def result(self) -> tuple[list[int], str]:
        """Block until done -> (tokens, finish reason); raises the request's error."""
        for event in self:
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Finished):
                return list(self.tokens), event.reason
        raise AssertionError("unreachable")


def finished(request: GenerationRequest, reason: str,
             loop: asyncio.AbstractEventLoop | None = None) -> Handle:
    """A handle of ``request`` that ended with ``reason`` before it was queued (a completion
    with ``max_tokens`` 0: its prompt scored, nothing generated)."""
    handle = Handle(request) if loop is None else Handle(request).attach(loop)
    handle.deliver(Finished(reason))
    return handle
