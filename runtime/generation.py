"""Autoregressive generation of a batch over an exported decoder graph (decoder-only and
seq2seq): what ``Model.generate`` / ``stream`` / ``chat`` run, on the loop the server runs
(``decoding.loop.DecodeLoop``).

As ``tfport.models.generate.generate`` / ``generate_seq2seq`` in numpy: one forward over the
prompts (prefill; for seq2seq the decoder start token), then per step: the engine picks each
row's token (``decoding.engine.choose``: forced ids, processors, sampling), the step is yielded,
stop ids end rows, and one decode step runs with the cache. Rows that are done continue with the
pad id; the loop ends when every row has ended, skipping the forward after the last token (its
logits would be unused). Without speculation the batch is a ``FixedBatch``: the layout's strategy
(``decoding``) prefills every row in one forward and keeps the cache between steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from .binding import Feed, GraphRunner
from .decoding import DecodeStrategy
from .decoding.engine import SequenceState
from .decoding.loop import DecodeLoop, decode_rows
from .decoding.prefix import PrefixCache
from .decoding.rows import Row


class FixedBatch:
    """A layout strategy's fixed batch (``DecodeStrategy``) as a row batch that admits every row
    at once: ``add_all`` prefills the rows together (padded, in one forward), ``step`` feeds the
    live rows' tokens and the pad id for rows that left, as the strategy's ``advance`` expects
    of every row, and returns the live rows' logits. What ``generate`` decodes on without
    speculation; nothing is freed before the batch goes (a row removed only stops counting)."""

    def __init__(self, strategy: DecodeStrategy, runner: GraphRunner, pad_token_id: int,
                 static: Mapping[str, Feed] | None = None, prefix: PrefixCache | None = None):
        self.strategy, self.runner = strategy, runner
        self.pad_token_id = pad_token_id
        self.static = static or {}
        self.prefix = prefix
        self.rows: list[Row] = []
        self._size = 0
        self._advance = None
        self._steps = 0

    def add_all(self, prompts: Sequence[np.ndarray], max_new_tokens: int) -> tuple[list[Row], np.ndarray]:
        """Prefill ``prompts`` (checked int64 [S_b]; for seq2seq each row's start token) for up to
        ``max_new_tokens`` steps -> (their rows, their last logits [B, V]). Once per batch."""
        if self._advance is not None:
            raise RuntimeError("add_all: a fixed batch admits its rows once")
        logits, self._advance = self.strategy.start(self.runner, prompts, max_new_tokens, self.pad_token_id,
                                                    self.static, self.prefix)
        self._size = len(prompts)
        self.rows = [Row(b, len(prompt)) for b, prompt in enumerate(prompts)]
        return list(self.rows), logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per live row (int64 [n], ordered as ``rows``) -> logits [n, V]."""
        live = [row.index for row in self.rows]
        token = np.full(self._size, self.pad_token_id, np.int64)
        token[live] = tokens
        logits = self._advance(token, self._steps)
        self._steps += 1
        for row in self.rows:
            row.length += 1
        return logits if len(live) == self._size else logits[live]  # no copy while every row lives

    def remove(self, row: Row) -> None:
        self.rows.remove(row)


def generate_steps(strategy: DecodeStrategy, runner: GraphRunner, rows: Sequence[np.ndarray],
                   states: Sequence[SequenceState], pad_token_id: int,
                   static: Mapping[str, Feed] | None = None,
                   prefix: PrefixCache | None = None) -> Iterator[np.ndarray]:
    """Yield one token per row, int64 [B], until every row has ended (``decode_rows`` on a
    ``FixedBatch``).

    ``rows`` are the first decoder input, checked: the prompts, or for seq2seq the decoder start
    token per row; ``strategy`` (from the export's cache layout) pads them and keeps the cache for
    up to ``max(state.max_tokens)`` steps; a single prompt starts from its longest prefix in
    ``prefix``, which keeps its tokens' keys and values when it ends (``decoding.prefix``).
    Nothing runs until the first token is asked for.
    """
    batch = FixedBatch(strategy, runner, pad_token_id, static, prefix)
    added, logits = batch.add_all(rows, max(state.max_tokens for state in states))
    yield from decode_rows(DecodeLoop(batch), added, logits, states, rows, pad_token_id)
