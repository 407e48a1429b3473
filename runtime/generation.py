"""Autoregressive generation over an exported decoder graph (decoder-only and seq2seq).

The loop is ``tfport.models.generate.generate`` / ``generate_seq2seq`` in numpy: one forward over
the prompt (prefill; for seq2seq the decoder start token), then per step: pick a token from the
last logits (only a forced token at the steps that force one), yield it, stop at a stop id once
every row has produced one, append it and run one decode step with the cache. Rows that are done
continue with the pad id. The forward after the
last token is skipped (its logits would be unused). How the cache is kept between steps is the
decode strategy's (``decoding``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from .binding import Feed, GraphRunner
from .decoding import DecodeStrategy
from .sampling import SamplingParams, force_tokens, next_token

# step -> the token ids allowed at that step (forced bos at 0, forced eos at the last).
Forced = Mapping[int, tuple[int, ...]]


def sample_loop(logits: np.ndarray, advance: Callable[[np.ndarray, int], np.ndarray],
                max_new_tokens: int, params: SamplingParams, rng: np.random.Generator | None,
                stop_token_ids: tuple[int, ...], pad_token_id: int,
                forced: Forced | None = None) -> Iterator[np.ndarray]:
    """The token loop every decoder layout shares; yields int64 [B] per step.

    ``logits`` [B, V] are the prompt's last; ``advance(token [B], step)`` feeds the tokens just
    picked and returns the next logits. At a step in ``forced`` only its ids can be picked
    (``force_tokens``). Rows that produced a stop id continue with ``pad_token_id``; the loop
    ends when every row has stopped, and skips the forward after the last token (its logits would
    be unused).
    """
    done = np.zeros(logits.shape[0], dtype=bool)
    stops = np.asarray(stop_token_ids, dtype=np.int64)
    forced = forced or {}
    for step in range(max_new_tokens):
        if step in forced:
            logits = force_tokens(logits, forced[step])
        token = np.where(done, pad_token_id, next_token(logits, params, rng))
        yield token
        if stops.size:
            done |= np.isin(token, stops)
            if done.all():
                return
        if step + 1 == max_new_tokens:
            return
        logits = advance(token, step)


def generate_steps(strategy: DecodeStrategy, runner: GraphRunner, rows: Sequence[np.ndarray],
                   max_new_tokens: int, params: SamplingParams, rng: np.random.Generator | None,
                   stop_token_ids: tuple[int, ...], pad_token_id: int,
                   static: Mapping[str, Feed] | None = None, forced: Forced | None = None
                   ) -> Iterator[np.ndarray]:
    """Yield one token per row, int64 [B], for up to ``max_new_tokens`` steps.

    ``rows`` are the first decoder input, checked: the prompts, or for seq2seq the decoder start
    token per row; ``strategy`` (from the export's cache layout) pads them and keeps the cache;
    ``forced`` as in ``sample_loop``. Nothing runs until the first token is asked for.
    """
    logits, advance = strategy.start(runner, rows, max_new_tokens, pad_token_id, static or {})
    yield from sample_loop(logits, advance, max_new_tokens, params, rng, stop_token_ids, pad_token_id,
                           forced)
