"""Embeddings batched across concurrent requests (dynamic batching, as Text Embeddings Inference
does): the token rows of requests that arrive together are embedded in one library call, and each
request gets its own rows' vectors back.

When the model is idle, the first request waits up to ``window_s`` (``--embedding-batch-ms``)
for others, or until ``max_tokens`` (``--embedding-batch-tokens``) tokens wait; then the waiting
requests, in arrival order and up to ``max_tokens`` tokens (at least one request, however long),
are embedded together in a worker thread. Requests that arrive meanwhile form the next batch,
which starts as soon as that one ends. One batch runs at a time per model.

A row's vector does not depend on the rows it is batched with (``Model.embed_encoded`` pads
each batch and pools over real tokens only), so batched vectors are the solo ones up to float
rounding.

    batcher = EmbeddingBatcher(lambda encoded: model.embed_encoded(encoded, progress=False))
    vectors = await batcher.embed(model.encode_texts(["a text", "another"]))   # float32 [2, E]
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np

from tfport.config.checks import is_int

from ..texts import EncodedTexts

logger = logging.getLogger(__name__)

WINDOW_S = 0.005  # the first request's wait for company: well under one small batch's cost
MAX_TOKENS = 16384  # tokens per batch: 128 inputs of 128 tokens


class EmbeddingBatcher:
    """Merges concurrent ``embed`` calls into calls of ``embed_rows`` (``EncodedTexts`` ->
    float32 [B, E], run in a worker thread): see the module docstring. ``batches`` counts the
    calls made."""

    def __init__(self, embed_rows: Callable[[EncodedTexts], np.ndarray], window_s: float = WINDOW_S,
                 max_tokens: int = MAX_TOKENS):
        if not window_s >= 0:
            raise ValueError(f"window_s={window_s!r}: expected a number of seconds >= 0")
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: expected a positive integer")
        self.embed_rows = embed_rows
        self.window_s = window_s
        self.max_tokens = max_tokens
        self.batches = 0
        self._pending: list[tuple[EncodedTexts, asyncio.Future]] = []
        self._tokens = 0  # waiting in _pending
        self._full: asyncio.Event | None = None  # set when _pending holds max_tokens
        self._task: asyncio.Task | None = None

    async def embed(self, encoded: EncodedTexts) -> np.ndarray:
        """The vectors float32 [len(encoded.ids), E] of one request's rows, embedded with the
        rows of the requests that arrive with it; raises what embedding the batch raised."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((encoded, future))
        self._tokens += _tokens(encoded)
        if self._task is None or self._task.done():
            self._full = asyncio.Event()
            self._task = loop.create_task(self._run())
        if self._tokens >= self.max_tokens and self._full is not None:
            self._full.set()
        return await future

    async def _run(self) -> None:
        """Wait for company (the window), then embed batches until none waits."""
        try:
            await asyncio.wait_for(self._full.wait(), self.window_s)
        except asyncio.TimeoutError:
            pass
        self._full = None
        while self._pending:
            batch = self._take()
            merged = EncodedTexts([row for encoded, _ in batch for row in encoded.ids],
                                  [row for encoded, _ in batch for row in encoded.type_ids],
                                  [flag for encoded, _ in batch for flag in encoded.truncated])
            self.batches += 1
            try:
                vectors = await asyncio.to_thread(self.embed_rows, merged)
            except Exception as err:  # every request of the batch gets it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(err)
                continue
            start = 0
            for encoded, future in batch:
                end = start + len(encoded.ids)
                if not future.done():  # a request whose client went away is cancelled
                    future.set_result(vectors[start:end])
                start = end

    def _take(self) -> list[tuple[EncodedTexts, asyncio.Future]]:
        """The waiting requests, oldest first, up to ``max_tokens`` tokens (at least one)."""
        count, tokens = 0, 0
        for encoded, _ in self._pending:
            size = _tokens(encoded)
            if count and tokens + size > self.max_tokens:
                break
            count, tokens = count + 1, tokens + size
        batch, self._pending = self._pending[:count], self._pending[count:]
        self._tokens -= tokens
        return batch


def _tokens(encoded: EncodedTexts) -> int:
    return sum(len(row) for row in encoded.ids)
