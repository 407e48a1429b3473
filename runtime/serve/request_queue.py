"""The bounded queue of requests waiting for a scheduler to take them: a row of the batch
(``scheduler.Scheduler``) or a worker thread (``seq2seq.Seq2SeqScheduler``), and why a waiting or
running request ends early (``stop_reason``).

    queue = RequestQueue(max_queue=64)
    handles = queue.submit(requests, check)   # all or none: ValueError, QueueFull, Stopped
    handle = queue.get()                      # a worker: the first one, blocking; None once stopped
    queue.close(); left = queue.take_all()    # stopping: no more requests, and those still waiting
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Sequence

from .handles import GenerationRequest, Handle, QueueFull


class Stopped(RuntimeError):
    """The scheduler is stopped and takes no more requests (HTTP 503: the server is stopping)."""


def stop_reason(handle: Handle, now: float | None = None) -> str | None:
    """Why ``handle``'s request ends at time ``now`` (``time.monotonic``; None: now) without
    finishing: "cancelled" (its client went away), "timeout" (past its deadline), else None."""
    if handle.cancelled:
        return "cancelled"
    now = time.monotonic() if now is None else now
    if handle.deadline is not None and now >= handle.deadline:
        return "timeout"
    return None


class RequestQueue:
    """Handles in submission order, at most ``max_queue`` of them; ``cond`` guards the queue and
    wakes the threads that wait on it (a caller may hold it around several calls: it is
    reentrant)."""

    def __init__(self, max_queue: int):
        self.max_queue = max_queue
        self.cond = threading.Condition()
        self.stopping = False
        self._handles: collections.deque[Handle] = collections.deque()

    def __len__(self) -> int:
        return len(self._handles)

    def submit(self, requests: Sequence[GenerationRequest], check: Callable[[GenerationRequest], None],
               loop: asyncio.AbstractEventLoop | None = None) -> list[Handle]:
        """``check`` every request, then queue a handle for each (delivering to ``loop`` when
        given), all or none: ``check``'s ``ValueError``, ``QueueFull`` when there is no room
        for all of them, ``Stopped`` once ``close``d."""
        for request in requests:
            check(request)
        handles = [Handle(r) if loop is None else Handle(r).attach(loop) for r in requests]
        with self.cond:
            if self.stopping:
                raise Stopped("the server is stopping and takes no more requests")
            if len(self._handles) + len(handles) > self.max_queue:
                raise QueueFull(f"{len(self._handles)} requests are waiting (max_queue="
                                f"{self.max_queue}); retry later")
            self._handles.extend(handles)
            self.cond.notify_all()
        return handles

    def wait(self, idle: bool = True) -> bool:
        """Block while nothing waits, if the caller is ``idle`` -> False once ``close``d."""
        with self.cond:
            while idle and not self.stopping and not self._handles:
                self.cond.wait()
            return not self.stopping

    def get(self) -> Handle | None:
        """Take the first handle, waiting for one -> None once ``close``d."""
        with self.cond:
            while not self.stopping and not self._handles:
                self.cond.wait()
            return None if self.stopping else self._handles.popleft()

    def first(self) -> Handle | None:
        """The first handle, left in the queue, or None."""
        with self.cond:
            return self._handles[0] if self._handles else None

    def take_first(self, handle: Handle) -> bool:
        """Take ``handle`` off the queue if it is still first -> whether it was (not when the
        queue was emptied by ``take_all`` meanwhile)."""
        with self.cond:
            if not self._handles or self._handles[0] is not handle:
                return False
            self._handles.popleft()
            return True

    def close(self) -> None:
        """Take no more requests, and wake every waiting thread."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def waiting(self) -> list[Handle]:
        """The handles in the queue, left there."""
        with self.cond:
            return list(self._handles)

    def take_all(self) -> list[Handle]:
        """Empty the queue -> the handles that were in it."""
        with self.cond:
            handles = list(self._handles)
            self._handles.clear()
            return handles
