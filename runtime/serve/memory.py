"""Memory given back after big requests.

A big request (a megabyte prompt, 2,048 embeddings) makes the tokenizer and the JSON encoder
allocate hundreds of megabytes in the worker threads. Freed, most of it stays in glibc's
per-thread heaps, so the server's resident memory ratchets up to its largest request and stays
there. ``TrimMemory`` counts each request's body and response bytes and, after one that moved at
least ``TRIM_BYTES``, asks glibc to hand its free pages back (``malloc_trim(0)``, in a worker
thread, one at a time). Where the C library has no ``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
from collections.abc import Callable

import anyio

logger = logging.getLogger(__name__)

TRIM_BYTES = 256 * 1024  # request + response bytes of a request after which the heap is trimmed


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_trimming = threading.Lock()


def release_memory() -> bool:
    """Hand the C heap's free pages back to the system; False where that cannot be done, or
    while another thread is already doing it."""
    trim = _malloc_trim()
    if trim is None or not _trimming.acquire(blocking=False):
        return False
    try:
        trim(0)
    finally:
        _trimming.release()
    return True


class TrimMemory:
    """ASGI middleware: ``release_memory`` once an HTTP request whose body and response together
    reached ``threshold`` bytes has been answered."""

    def __init__(self, app, threshold: int = TRIM_BYTES):
        self.app = app
        self.threshold = threshold

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        moved = 0

        async def counted_receive():
            nonlocal moved
            message = await receive()
            moved += len(message.get("body", b""))
            return message

        async def counted_send(message):
            nonlocal moved
            moved += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counted_receive, counted_send)
        finally:
            if moved >= self.threshold:
                with anyio.CancelScope(shield=True):  # also after a client that went away
                    await anyio.to_thread.run_sync(release_memory)
