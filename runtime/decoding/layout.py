"""What a cache layout is on the runtime side, and the registry the runtime looks layouts up in.

A cache layout (``tfport.contract.CacheLayout``: the decoder graph's I/O, padding side, last
position) has one module here (``concat.py``, ``inplace.py``) holding everything the runtime does
differently for it, registered as one ``LayoutDecoding``:

- ``strategy``: a fixed batch from prefill to the end (``Model.generate`` / ``stream`` / ``chat``)
      logits, advance = strategy.start(runner, rows, max_new_tokens, pad_token_id, static, prefix)
      logits = advance(tokens, step)        # tokens int64 [B] just picked -> next logits [B, V]
- ``rows``: the ``RowBatch`` class continuous batching runs (``rows.py`` says the interface),
  ``rows(runner, capacity, max_length, pad_token_id, prefix=None)``;
- ``relayout``: how a parity case made in the ``concat`` layout is fed to this layout's graph;
- ``score``: every position's logits of one sequence, piece by piece (prompt log-probabilities).

The token loop (sampling, stops) is not a layout's: ``engine.choose`` serves every layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tfport.contract import CacheLayout

from ..binding import Feed, GraphRunner
from .prefix import PrefixCache
from .rows import RowBatch

# Tokens per prefill run: a longer prompt of one row runs in pieces on top of its own cache, so
# a prefill's activations (attention over the context so far) and logits stay those of this many
# tokens. Whole, a 4,096-token prompt on the Llama-3.2-1B shape peaked at 4.9 GiB resident (0.8 GB
# of weights): a quarter of it its logits for every position. Pieces of 128 against 512, one
# 512-token prompt (Intel Xeon AVX-512 VNNI, 2 threads, docs/scale.md#long-prompts): first token
# 6.3 s against 7.6 and peak 1.46 GiB against 1.80 on the 1B shape; 37.1 s against 39.5 and 6.53
# GiB against 7.02 on the 8B shape; 0.99 s against 1.21 on SmolLM2-135M; pieces of 64 were slower.
PREFILL_PIECE = 128


def prefill_pieces(start: int, stop: int) -> list[tuple[int, int]]:
    """Tokens [start, stop) of a prompt as consecutive runs of at most ``PREFILL_PIECE`` tokens
    (one run when ``stop - start`` is at most that; ``start < stop``)."""
    assert 0 <= start < stop, (start, stop)
    return [(a, min(a + PREFILL_PIECE, stop)) for a in range(start, stop, PREFILL_PIECE)]


def row_groups(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Rows [0, len(lengths)) of prompts of at most ``PREFILL_PIECE`` tokens each as consecutive
    groups [a, b) of at most ``PREFILL_PIECE`` tokens in all, rows counted at the group's longest
    prompt (its padded width): a batch's prefill then holds one piece's activations and logits."""
    assert all(0 < n <= PREFILL_PIECE for n in lengths), lengths
    groups, first, width = [], 0, 0
    for b, n in enumerate(lengths):
        if max(width, n) * (b - first + 1) > PREFILL_PIECE:
            groups.append((first, b))
            first, width = b, 0
        width = max(width, n)
    return groups + [(first, len(lengths))]


# advance(tokens int64 [B], step) -> logits float32 [B, V] after feeding those tokens (the
# array may be the strategy's buffer, overwritten by the next call: read it before).
Advance = Callable[[np.ndarray, int], np.ndarray]
# (feeds of the concat layout, past length, random_buffer(batch, slots) -> [B, Hkv, slots, D]) ->
# (this layout's feeds, buffers bound as past and present or None, to_reference_layout or None).
RelaidInputs = tuple[dict, "dict | None", "Callable[[str, np.ndarray], np.ndarray] | None"]


class DecodeStrategy(Protocol):
    def start(self, runner: GraphRunner, rows: Sequence[np.ndarray], max_new_tokens: int,
              pad_token_id: int, static: Mapping[str, Feed],
              prefix: PrefixCache | None = None) -> tuple[np.ndarray, Advance]:
        """Run the prompts ``rows`` (checked int64 token lists; for seq2seq the decoder start
        token) -> (last-position logits float32 [B, V], advance). ``static``: decoder inputs that
        do not change between steps (seq2seq cross-attention K/V and encoder mask). ``prefix``:
        a cache a single decoder prompt may start from, and keeps its blocks in when the request
        ends (``decoding.prefix``; a strategy may ignore it)."""
        ...


class Relayout(Protocol):
    def batch_for(self, batch: int, past: int, new: int) -> int:
        """The batch a parity case of ``new`` tokens on ``past`` cached ones runs with."""
        ...

    def __call__(self, feeds: dict[str, np.ndarray], past: int,
                 random_buffer: Callable[[int, int], np.ndarray]) -> RelaidInputs:
        ...


@dataclass(frozen=True)
class LayoutDecoding:
    """A cache layout's runtime side (see the module docstring)."""

    layout: CacheLayout
    strategy: DecodeStrategy
    rows: Callable[..., RowBatch]
    relayout: Relayout
    score: Callable[[GraphRunner, np.ndarray], Iterator[np.ndarray]]

    @property
    def name(self) -> str:
        return self.layout.name

    def logits(self, runner: GraphRunner, ids: np.ndarray) -> np.ndarray:
        """Every position's logits [S, V] of one sequence ``ids`` int64 [1, S]: ``score``'s
        pieces joined (S x V floats held at once: reduce the pieces instead for a long text)."""
        return np.concatenate(list(self.score(runner, ids)))


DECODINGS: dict[str, LayoutDecoding] = {}


def register_decoding(decoding: LayoutDecoding) -> LayoutDecoding:
    """Add a layout's runtime side to ``DECODINGS`` (its ``CacheLayout`` must be registered in
    ``tfport.contract.LAYOUTS`` under the same name)."""
    from tfport.contract import LAYOUTS
    if LAYOUTS.get(decoding.name) is not decoding.layout:
        raise ValueError(f"layout {decoding.name!r}: register its CacheLayout in "
                         "tfport.contract.LAYOUTS first (register_layout)")
    if decoding.name in DECODINGS:
        raise ValueError(f"layout {decoding.name!r}: its decoding is already registered")
    DECODINGS[decoding.name] = decoding
    return decoding


def decoding_for(layout: str) -> LayoutDecoding:
    """The runtime side of a cache layout (``Manifest.layout``)."""
    if layout not in DECODINGS:
        raise ValueError(f"layout={layout!r}: this runtime decodes {sorted(DECODINGS)}")
    return DECODINGS[layout]
