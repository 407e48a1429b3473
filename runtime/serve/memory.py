"""Memory given back after big requests.

A big request (a megabyte prompt, 2,048 embeddings) makes the tokenizer and the JSON encoder
allocate hundreds of megabytes in the worker threads. Freed, most of it stays in glibc's
per-thread heaps, so the server's resident memory ratchets up to its largest request and stays
there. ``TrimMemory`` counts each request's body and response bytes and, after one that moved at
least ``TRIM_BYTES``, asks glibc to hand its free pages back (``malloc_trim(0)``, in a worker
thread, one at a time). Where the C library has no ``malloc_trim`` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import logging

import anyio

from tfport.heap import release_memory

logger = logging.getLogger(__name__)

TRIM_BYTES = 256 * 1024  # request + response bytes of a request after which the heap is trimmed


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
