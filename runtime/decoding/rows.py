"""Decoding with rows that come and go: the per-row interface continuous batching needs.

A layout's ``strategy`` runs one fixed batch from prefill to the end. A server instead keeps a
running batch whose rows are independent requests at different positions: a new request is
prefilled into a free row at a step boundary, every step advances all live rows by one token,
and a finished row is released at once. Each cache layout's module has its ``RowBatch``
(``decoding_for(layout).rows``):

    batch = decoding_for(layout).rows(runner, capacity=16, max_length=512, pad_token_id=0)
    row, logits = batch.add(prompt)        # prompt int64 [S] -> its last logits [V]
    logits = batch.step(tokens)            # tokens int64 [n] for batch.rows, in order -> [n, V]
    batch.remove(row)                      # frees the row; the others keep their state

Speculative decoding feeds several tokens per row and forgets the rejected ones:

    logits = batch.extend(chunks)          # chunks[b] int64 [S_b] for rows[b] -> [S_b, V] each
    batch.rewind(row, count)               # forget the last ``count`` tokens of the row's cache

A row's tokens do not depend on its neighbours: each prompt is prefilled alone (batch 1), and a
decode step sees only the row's own cache (masked padding or its own ``seqlens_k``).

With a ``PrefixCache`` (``rows(..., prefix=cache)``, ``decoding.prefix``), ``add`` starts the
row from the longest cached prefix of its prompt and prefills only the rest; the prompt's blocks
are kept after its prefill, and the row's prompt and fed tokens when it is removed. A long
prompt can be prefilled in chunks between steps (``prefill_chunk``), the cache holding them.
Decoder-only exports; seq2seq (cross-attention inputs per row) is not batched here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(eq=False)
class Row:
    """One live sequence of a ``RowBatch``: ``index`` is its position in ``batch.rows`` (it moves
    down when an earlier row leaves), ``length`` the tokens in its cache, ``tokens`` their ids
    (those fed so far: its first ``length`` are the cache's)."""

    index: int
    length: int
    tokens: list[int] = field(default_factory=list, repr=False)
    # concat layout: the prompt's cache until it is merged into the batch, name -> [1, Hkv, S, D]
    pending: dict[str, np.ndarray] | None = field(default=None, repr=False)


class RowBatch(Protocol):
    rows: list[Row]
    capacity: int
    max_length: int
    def add(self, prompt: np.ndarray) -> tuple[Row, np.ndarray]:
        """Prefill ``prompt`` int64 [S] into a free row -> (the row, last logits float32 [V])."""
        ...

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per live row (int64 [n], ordered as ``rows``) -> logits [n, V]."""
        ...

    def remove(self, row: Row) -> None:
        """Release ``row``; the other rows keep their caches."""
        ...

    def extend(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        """Feed ``chunks[b]`` (int64 [S_b], S_b >= 1) on top of ``rows[b]``'s cache -> each
        row's logits float32 [S_b, V] (position i: after its chunk's token i). Needs an export
        whose decoder returns every position's logits (``logits="all"``)."""
        ...

    def rewind(self, row: Row, count: int) -> None:
        """Forget the last ``count`` tokens of ``row``'s cache (rejected proposals)."""
        ...

    def prefill_chunk(self, prompt: np.ndarray, budget: int) -> int:
        """Chunked prefill: up to ``budget`` more tokens of ``prompt`` int64 [S] computed into
        the prefix cache (``prefix.cache_chunk``) on a free row, which stays free -> the prompt's
        tokens now cached (0 without a prefix cache). ``add(prompt)`` then prefills the rest."""
        ...


def check_prompt(batch: RowBatch, prompt: np.ndarray) -> np.ndarray:
    prompt = np.asarray(prompt, dtype=np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt: expected a non-empty int64 [S], got shape {prompt.shape}")
    if prompt.size > batch.max_length:
        raise ValueError(f"prompt: {prompt.size} tokens, more than max_length={batch.max_length}")
    if len(batch.rows) >= batch.capacity:
        raise RuntimeError(f"no free row: all {batch.capacity} are live")
    return prompt


def check_chunks(batch: RowBatch, chunks: list[np.ndarray]) -> list[np.ndarray]:
    """``chunks`` checked for ``batch.extend``: one non-empty int64 [S_b] per live row that fits
    in the row's ``max_length``."""
    if len(chunks) != len(batch.rows):
        raise ValueError(f"chunks: expected {len(batch.rows)} (one per live row), got {len(chunks)}")
    chunks = [np.asarray(c, dtype=np.int64).reshape(-1) for c in chunks]
    if any(c.size == 0 for c in chunks):
        raise ValueError("chunks: every row needs at least one token")
    full = [row.index for row, c in zip(batch.rows, chunks) if row.length + c.size > batch.max_length]
    if full:
        raise ValueError(f"rows {full}: the chunk would pass max_length={batch.max_length} tokens")
    return chunks


def check_rewind(row: Row, count: int) -> None:
    if not 0 <= count <= row.length - 1:
        raise ValueError(f"count={count}: expected 0 to {row.length - 1} (the row keeps at least "
                         "one token)")


def check_step(batch: RowBatch, tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.shape != (len(batch.rows),):
        raise ValueError(f"tokens: expected [{len(batch.rows)}] (one per live row), got "
                         f"{tokens.shape}")
    full = [row.index for row in batch.rows if row.length >= batch.max_length]
    if full:
        raise ValueError(f"rows {full} already hold max_length={batch.max_length} tokens")
    return tokens
