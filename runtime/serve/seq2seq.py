"""Encoder-decoder exports (translation, summarisation) on /v1/completions: a scheduler with the
decoder ``Scheduler``'s interface (``submit`` -> ``Handle``s, ``waiting`` / ``running`` /
``alive``, ``start`` / ``stop``), so the server's responses (stops, ``n``, streaming, logprobs,
usage) are the decoders' own.

There is no continuous batching: each sequence runs ``Model.stream`` alone (one row: the encoder
once, then the decoder with cross attention, the export's forced tokens and stop ids) in one of
``max_rows`` worker threads, so its tokens are ``Model.generate``'s for that prompt, seed and
sampling. Up to ``max_queue`` sequences wait for a worker (then ``QueueFull``: 429). Between
tokens a worker ends a sequence that was cancelled (its client went away) or ran past its
timeout.

    scheduler = Seq2SeqScheduler(model, SchedulerLimits(max_rows=4)).start()
    handle, = scheduler.submit([GenerationRequest(prompt=[5, 9, 2], max_new_tokens=16)])
    tokens, reason = handle.result()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

from ..sampling import Logprobs
from .handles import Failed, Finished, GenerationRequest, Handle, NullObserver, Observer, Token
from .errors import ApiError
from .protocol import CompletionRequest
from .request_queue import RequestQueue, stop_reason
from .scheduler import SchedulerLimits

logger = logging.getLogger(__name__)


def refuse_for_seq2seq(body: CompletionRequest) -> None:
    """``ApiError`` 400 naming the field of a completion request an encoder-decoder export cannot
    serve: ``echo`` (its prompt is the encoder's input, not the start of the output) and a
    ``response_format`` other than text (structured output is decoder-only here)."""
    if body.echo:
        raise ApiError(400, "echo: an encoder-decoder export's prompt is its encoder's input, not "
                            "the start of its output; send echo: false", "echo")
    if body.constraint():
        raise ApiError(400, "response_format: structured output is served for decoder-only "
                            "exports; an encoder-decoder export takes {\"type\": \"text\"} only",
                       "response_format")


class Seq2SeqScheduler:
    """Encoder-decoder generation for the server (see the module docstring): ``max_rows``
    sequences at once, each ``Model.stream`` with one row."""

    prefix = None  # no prefix cache (``metrics.ServeMetrics.watch`` reads it)
    speculation = None

    def __init__(self, model, limits: SchedulerLimits = SchedulerLimits(),
                 observer: Observer | None = None):
        if model.config.family != "encoder-decoder":
            raise ValueError(f"Seq2SeqScheduler: family {model.config.family!r}; expected an "
                             "encoder-decoder export (decoders: Scheduler)")
        model.runner("decoder", "serve")  # a classifier-only export has none: an error now
        self.model = model
        self.limits = limits
        self.max_length = min(limits.max_length or model.config.max_positions, model.config.max_positions)
        self.observer = observer or NullObserver()
        self._queue = RequestQueue(limits.max_queue)
        self._running: set[Handle] = set()  # guarded by the queue's lock
        self._threads: list[threading.Thread] = []

    def check(self, request: GenerationRequest) -> None:
        """``ValueError`` naming the field for a request this scheduler cannot run."""
        if request.processors:
            raise ValueError("response_format: structured output is served for decoder-only exports")
        request.check(self.model.config.vocab_size, self.max_length, self.model.config.max_positions,
                      seq2seq=True)

    def submit(self, requests: Sequence[GenerationRequest],
               loop: asyncio.AbstractEventLoop | None = None) -> list[Handle]:
        """Queue requests -> handles, all or none: ``QueueFull`` when the queue has no room for
        all of them, ``ValueError`` for a request ``check`` refuses, ``Stopped`` once stopped."""
        return self._queue.submit(list(requests), self.check, loop)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        """Whether every worker thread runs (started and not stopped or dead)."""
        return bool(self._threads) and all(thread.is_alive() for thread in self._threads)

    def start(self) -> "Seq2SeqScheduler":
        if not self._threads:
            self._threads = [threading.Thread(target=self._work, name=f"tfport-seq2seq-{i}", daemon=True)
                             for i in range(self.limits.max_rows)]
            for thread in self._threads:
                thread.start()
        return self

    def end_now(self) -> None:
        """Take no more requests and end every waiting and running one at once (``Finished``
        "cancelled"); each worker stops after its sequence's current token."""
        with self._queue.cond:
            self._queue.close()
            handles = [*self._queue.take_all(), *self._running]
        for handle in handles:
            handle.cancel()
            handle.deliver(Finished("cancelled"))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after each running sequence's current token; waiting and running requests are
        cancelled."""
        self.end_now()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _work(self) -> None:
        while True:
            with self._queue.cond:  # taken and running at once: ``stop`` cancels it either way
                handle = self._queue.get()
                if handle is None:
                    return
                self._running.add(handle)
            try:
                event = self._generate(handle)
            except Exception as err:  # this request only; the worker carries on
                logger.exception("seq2seq generation failed")
                event = Failed(err)
            finally:
                with self._queue.cond:
                    self._running.discard(handle)
            handle.deliver(event)
            self.observer.finished(event.reason if isinstance(event, Finished) else "error",
                                   time.monotonic() - handle.submitted)

    def _generate(self, handle: Handle) -> Finished:
        """Deliver the sequence's tokens as ``Model.stream`` makes them -> how it ended."""
        request = handle.request
        reason = stop_reason(handle)
        if reason:
            return Finished(reason)
        params = request.params
        logprobs = None if request.logprobs is None else Logprobs(top=request.logprobs)
        steps = self.model.stream(
            [list(request.prompt)], max_new_tokens=request.max_new_tokens, stop_token_ids=request.stop_ids,
            seed=request.seed, logprobs=logprobs,
            **{f.name: getattr(params, f.name) for f in dataclasses.fields(params)})
        start, count, token = time.perf_counter(), 0, None
        for tokens in steps:  # a step's logprobs are recorded when its tokens are yielded
            token = int(tokens[0])
            if count == 0:
                self.observer.first_token(time.monotonic() - handle.submitted)
            else:
                self.observer.step(1, 1, time.perf_counter() - start)
            handle.deliver(Token(token, None if logprobs is None else logprobs.rows[0][count]))
            count, start = count + 1, time.perf_counter()
            reason = stop_reason(handle)
            if reason:
                steps.close()
                return Finished(reason)
        return Finished("stop" if token in request.stop_ids else "length")
