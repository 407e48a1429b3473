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

A row's tokens do not depend on its neighbours: each prompt is prefilled alone (batch 1), and a
decode step sees only the row's own cache (masked padding or its own ``seqlens_k``).
Decoder-only exports; seq2seq (cross-attention inputs per row) is not batched here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


@dataclass(eq=False)
class Row:
    """One live sequence of a ``RowBatch``: ``index`` is its position in ``batch.rows`` (it moves
    down when an earlier row leaves), ``length`` the tokens in its cache."""

    index: int
    length: int
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


def check_prompt(batch: RowBatch, prompt: np.ndarray) -> np.ndarray:
    prompt = np.asarray(prompt, dtype=np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt: expected a non-empty int64 [S], got shape {prompt.shape}")
    if prompt.size > batch.max_length:
        raise ValueError(f"prompt: {prompt.size} tokens, more than max_length={batch.max_length}")
    if len(batch.rows) >= batch.capacity:
        raise RuntimeError(f"no free row: all {batch.capacity} are live")
    return prompt


def check_step(batch: RowBatch, tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.shape != (len(batch.rows),):
        raise ValueError(f"tokens: expected [{len(batch.rows)}] (one per live row), got "
                         f"{tokens.shape}")
    full = [row.index for row in batch.rows if row.length >= batch.max_length]
    if full:
        raise ValueError(f"rows {full} already hold max_length={batch.max_length} tokens")
    return tokens
