"""Decode strategies: how the KV cache is fed back between steps, one per contract cache layout.

An export's manifest records the decoder graph's cache layout (``tfport.contract.LAYOUTS``); the
runtime looks its strategy up here once, when a request starts. A strategy prefills the prompts
and returns the last logits with a function that advances one step:

    logits, advance = strategy.start(runner, rows, max_new_tokens, pad_token_id, static)
    logits = advance(tokens, step)        # tokens int64 [B] just picked -> next logits [B, V]

The token loop itself (sampling, stop ids) is shared: ``tfport.runtime.generation.sample_loop``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from ..binding import Feed, GraphRunner
from .concat import ConcatCache
from .inplace import InplaceBuffer

# advance(tokens int64 [B], step) -> logits float32 [B, V] after feeding those tokens (the
# array may be the strategy's buffer, overwritten by the next call: read it before).
Advance = Callable[[np.ndarray, int], np.ndarray]


class DecodeStrategy(Protocol):
    def start(self, runner: GraphRunner, rows: Sequence[np.ndarray], max_new_tokens: int,
              pad_token_id: int, static: Mapping[str, Feed]) -> tuple[np.ndarray, Advance]:
        """Run the prompts ``rows`` (checked int64 token lists; for seq2seq the decoder start
        token) -> (last-position logits float32 [B, V], advance). ``static``: decoder inputs that
        do not change between steps (seq2seq cross-attention K/V and encoder mask)."""
        ...


STRATEGIES: dict[str, DecodeStrategy] = {"concat": ConcatCache(), "inplace": InplaceBuffer()}


def strategy_for(layout: str) -> DecodeStrategy:
    """The decode strategy of a cache layout (``Manifest.layout``)."""
    if layout not in STRATEGIES:
        raise ValueError(f"layout={layout!r}: this runtime decodes {sorted(STRATEGIES)}")
    return STRATEGIES[layout]


__all__ = ["Advance", "DecodeStrategy", "STRATEGIES", "strategy_for", "ConcatCache", "InplaceBuffer"]
