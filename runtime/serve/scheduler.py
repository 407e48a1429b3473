"""Continuous batching: one scheduler thread per decoder model.

Requests wait in a bounded queue. At every step boundary the scheduler retires rows that are
finished, cancelled or past their deadline, admits waiting requests into free rows (each prompt
prefilled alone, its first token sampled from the prefill's logits), then runs one decode step for
all live rows together and samples each row's next token with that row's own parameters and random
generator: the ``decoding.loop.DecodeLoop`` that ``Model.generate`` runs too, here admitting rows
as they free up. A row's tokens therefore do not depend on what else is in the batch: greedy rows
get their solo result.

    scheduler = Scheduler(model, SchedulerLimits(max_rows=16, max_queue=64))
    scheduler.start()
    handle = scheduler.submit(GenerationRequest(prompt=[1, 5, 7], max_new_tokens=16))
    for event in handle:                       # Token(id) ..., then Finished(reason) or Failed
        ...
    scheduler.stop()

Events reach a handle from the scheduler thread; ``handle.attach(loop)`` delivers them to an
asyncio loop instead (``async for event in handle``). ``handle.cancel()`` (a client that went away)
frees the row at the next step boundary. An exception while prefilling fails that request only;
one in a decode step fails the rows of that step, and the scheduler carries on with fresh state;
NaN logits fail their row only. The export's forced tokens (``generation_config.json``'s
``forced_bos_token_id`` / ``forced_eos_token_id``) are forced as ``Model.generate`` forces them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tfport.config.checks import is_int

from ..decoding.loop import Advanced, DecodeLoop, LiveRow
from ..decoding.prefix import PrefixCache
from ..decoding.rows import RowBatch
from ..decoding.speculative import Speculation, SpeculationStats, Speculator, check_speculative, drafter_for
from ..defaults import sequence_states
from .handles import (Event, Failed, Finished, GenerationRequest, Handle, Observer, QueueFull,  # noqa: F401
                      Token, NullObserver)
from .request_queue import RequestQueue, stop_reason

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerLimits:
    """``max_rows``: requests decoded together; ``max_queue``: requests waiting for a row;
    ``max_length``: prompt + generated tokens per row (the KV buffer's slots; default the model's
    ``max_positions``); ``prefill_chunk``: while rows decode, a prompt longer than this is
    prefilled this many tokens per step (chunked prefill, with a prefix cache; None: whole)."""

    max_rows: int = 16
    max_queue: int = 256
    max_length: int | None = None
    prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_queue"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 2):
            raise ValueError(f"max_length={self.max_length!r}: expected an integer >= 2 or None")
        chunk = self.prefill_chunk
        if chunk is not None and (not is_int(chunk) or chunk < 1):
            raise ValueError(f"prefill_chunk={chunk!r}: expected a positive integer or None")


class Scheduler:
    """Continuous batching over one decoder ``Model`` (see the module docstring). With a
    ``prefix`` cache, each prompt starts from its longest cached prefix (``decoding.prefix``)."""

    def __init__(self, model, limits: SchedulerLimits = SchedulerLimits(),
                 observer: Observer | None = None, speculation: Speculation | None = None,
                 prefix: PrefixCache | None = None):
        runner = model.runner("decoder", "serve")
        if model.config.family != "decoder":
            raise ValueError(f"Scheduler: family {model.config.family!r} is not batched per row; "
                             "serve decoder-only exports")
        self.model = model
        self.runner = runner
        self.limits = limits
        self.max_length = min(limits.max_length or model.config.max_positions,
                              model.config.max_positions)
        self.observer = observer or NullObserver()
        self._make_batch = model.decoding.rows
        # Speculative decoding (decoding.speculative): every step verifies each row's proposals.
        self.speculation = speculation
        # Automatic prefix caching (decoding.prefix): a prompt starts from its longest cached prefix.
        self.prefix = prefix
        if prefix is not None and limits.prefill_chunk is not None and limits.prefill_chunk < prefix.block_size:
            raise ValueError(f"prefill_chunk={limits.prefill_chunk}: expected at least the prefix "
                             f"cache's block of {prefix.block_size} tokens")
        self._drafter = None if speculation is None else drafter_for(speculation.drafter, model)
        self.speculation_stats = SpeculationStats()
        self.loop = self._new_loop()
        self._queue = RequestQueue(limits.max_queue)
        self._thread: threading.Thread | None = None

    def _new_loop(self) -> DecodeLoop:
        """An empty row batch and the ``DecodeLoop`` over it (``Model.generate``'s loop), each
        live row keyed by its request's handle."""
        batch = self._make_batch(self.runner, self.limits.max_rows, self.max_length,
                                 self.model.config.fill_token_id, prefix=self.prefix)
        speculator = None
        if self.speculation is not None:
            check_speculative(self.model, self.speculation)
            speculator = Speculator(batch, self.runner, self.speculation, self._drafter, self.speculation_stats)
        return DecodeLoop(batch, speculator)

    @property
    def batch(self) -> RowBatch:
        return self.loop.batch

    # ------------------------------------------------------------------------------ public API
    def check(self, request: GenerationRequest) -> None:
        """``ValueError`` naming the field for a request this scheduler cannot run."""
        request.check(self.model.config.vocab_size, self.max_length, self.max_length)

    def submit(self, requests: GenerationRequest | Sequence[GenerationRequest],
               loop: asyncio.AbstractEventLoop | None = None) -> Handle | list[Handle]:
        """Queue request(s) -> handle(s), all or none: ``QueueFull`` when the queue has no room
        for all of them, ``ValueError`` for a request ``check`` refuses, ``Stopped`` once stopped."""
        single = isinstance(requests, GenerationRequest)
        handles = self._queue.submit([requests] if single else list(requests), self.check, loop)
        self.observer.queue_depth(len(self._queue), len(self.loop.live))
        return handles[0] if single else handles

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self.loop.live)

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread is running (started and not stopped or dead)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tfport-scheduler", daemon=True)
            self._thread.start()
        return self

    def end_now(self) -> None:
        """Take no more requests and end every waiting and live one at once (``Finished``
        "cancelled"), without waiting for the step under way: a stream's last event goes out
        now, not after a long prefill. Any thread may call it; ``stop`` then joins the thread
        (the rows' later tokens are dropped) and counts the requests it ended."""
        self._queue.close()
        with self._queue.cond:
            handles = [*self._queue.waiting(), *(live.key for live in list(self.loop.live))]
        for handle in handles:
            handle.deliver(Finished("cancelled"))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; waiting and live requests are cancelled."""
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._queue.cond:
            handles = [*self._queue.take_all(), *(live.key for live in self.loop.live)]
            self.loop.live = []  # the counts (/health, the gauges) read 0 once stopped
        now = time.monotonic()
        for handle in handles:
            handle.deliver(Finished("cancelled"))
            self.observer.finished("cancelled", now - handle.submitted)  # counted like any ending

    # ------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        while self._queue.wait(idle=not self.loop.live):  # only this thread changes the live rows
            try:
                self.run_once()
            except Exception:  # never lose the thread: a bug here fails the live rows only
                logger.exception("scheduler step failed")
                self._fail_live(RuntimeError("internal error in the scheduler"))

    def run_once(self) -> None:
        """One step boundary: retire, admit, decode one token (or a verified run) for every
        live row."""
        now = time.monotonic()
        for live in list(self.loop.live):
            reason = stop_reason(live.key, now)
            if reason:
                self._retire(live, Finished(reason))
        self._admit(now)
        self.observer.queue_depth(len(self._queue), len(self.loop.live))
        if not self.loop.live:
            return
        start = time.perf_counter()
        try:
            results = self.loop.step()
        except Exception as err:
            logger.exception("decode step failed")
            self._fail_live(err)
            return
        self.observer.step(len(results), sum(len(result.tokens) for result in results),
                           time.perf_counter() - start)
        for result in results:
            if self.loop.speculator is not None:
                result.live.key.proposed += result.proposed
                result.live.key.accepted += result.accepted
                self.observer.speculated(result.proposed, result.accepted)
            self._deliver(result)

    def _admit(self, now: float) -> None:
        while len(self.loop.live) < self.limits.max_rows:
            handle = self._queue.first()
            if handle is None:
                return
            reason = stop_reason(handle, now)
            if reason is None and self._prefill_chunk(handle):
                return  # one chunk of its prompt this step; it stays first in the queue
            if not self._queue.take_first(handle):  # stopped meanwhile
                continue
            if reason:
                handle.deliver(Finished(reason))
                self.observer.finished(reason, time.monotonic() - handle.submitted)
                continue
            request = handle.request
            try:
                row, logits = self.batch.add(np.asarray(request.prompt, dtype=np.int64))
            except Exception as err:  # this request only; the batch is unchanged
                logger.exception("prefill failed")
                handle.deliver(Failed(err))
                self.observer.finished("error", time.monotonic() - handle.submitted)
                continue
            forced = self.model.forced_tokens(max_new_tokens=request.max_new_tokens,
                                              one_token_start=len(request.prompt) == 1)
            state, = sequence_states(1, request.params, request.seed, request.max_new_tokens,
                                     request.stop_ids, forced, request.processors, prompts=[request.prompt],
                                     vocab_size=self.model.config.vocab_size,
                                     logprobs=request.logprobs)
            self.observer.first_token(time.monotonic() - handle.submitted)
            result, = self.loop.start([row], logits[None], [state], [request.prompt], [handle])
            self._deliver(result)

    def _prefill_chunk(self, handle: Handle) -> bool:
        """Chunked prefill: while rows decode, prefill one chunk of a prompt that has more than
        ``prefill_chunk`` tokens left into the prefix cache -> whether it did (False: admit it
        now, its prefill starting from the chunks cached so far)."""
        budget = self.limits.prefill_chunk
        if budget is None or self.prefix is None or not self.loop.live:
            return False
        prompt = np.asarray(handle.request.prompt, dtype=np.int64)
        before = self.prefix.cached_length(prompt)
        if prompt.size - before <= budget:
            return False
        try:
            return self.batch.prefill_chunk(prompt, budget) > before  # no progress: prefill it whole
        except Exception:  # its own prefill will fail it (or succeed) as an unchunked one would
            logger.exception("chunked prefill failed")
            return False

    def _deliver(self, result: Advanced) -> None:
        """Report the tokens ``result`` pushed (with their logprobs when asked), then retire the
        row if it failed or ended."""
        live, count = result.live, len(result.tokens)
        scores = live.state.token_logprobs[-count:] if count and live.state.logprobs is not None else []
        for n, token in enumerate(result.tokens):
            live.key.deliver(Token(token, scores[n] if scores else None))
        if result.error is not None:
            self._retire(live, Failed(result.error))
        elif live.state.finish:
            self._retire(live, Finished(live.state.finish))

    def _retire(self, live: LiveRow, event: Event) -> None:
        self.loop.remove(live)
        live.key.deliver(event)
        reason = event.reason if isinstance(event, Finished) else "error"
        self.observer.finished(reason, time.monotonic() - live.key.submitted)

    def _fail_live(self, err: BaseException) -> None:
        """Fail every live row and start over with an empty batch."""
        for live in self.loop.live:
            live.key.deliver(Failed(err))
            self.observer.finished("error", time.monotonic() - live.key.submitted)
        self.loop = self._new_loop()
