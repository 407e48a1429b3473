"""Autoregressive generation of a fixed batch over an exported decoder graph (decoder-only and
seq2seq): what ``Model.generate`` / ``stream`` / ``chat`` run.

The loop is ``tfport.models.generate.generate`` / ``generate_seq2seq`` in numpy: one forward over
the prompt (prefill; for seq2seq the decoder start token), then per step: the engine picks each
row's token (``decoding.engine.choose``: forced ids, processors, sampling), the step is yielded,
stop ids end rows, and one decode step runs with the cache. Rows that are done continue with the
pad id; the loop ends when every row has ended, skipping the forward after the last token (its
logits would be unused). How the cache is kept between steps is the layout's strategy
(``decoding``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from .binding import Feed, GraphRunner
from .decoding import DecodeStrategy
from .decoding.engine import SequenceState, choose
from .decoding.prefix import PrefixCache

# step -> the token ids allowed at that step (forced bos at 0, forced eos at the last).
Forced = Mapping[int, tuple[int, ...]]


def sample_loop(logits: np.ndarray, advance: Callable[[np.ndarray, int], np.ndarray],
                states: Sequence[SequenceState], pad_token_id: int) -> Iterator[np.ndarray]:
    """The token loop of a fixed batch; yields int64 [B] per step.

    ``logits`` [B, V] are the prompts' last; ``advance(token [B], step)`` feeds the tokens just
    picked and returns the next logits; ``states[b]`` says how row b's tokens are chosen and when
    it ends. Rows that ended continue with ``pad_token_id``. ``RuntimeError`` for NaN logits.
    """
    for step in range(max(state.max_tokens for state in states)):
        picked, errors = choose(logits, states)
        if errors:
            raise RuntimeError(f"rows {sorted(errors)}: {next(iter(errors.values()))}")
        done = np.array([state.finish is not None for state in states])
        token = np.where(done, pad_token_id, picked)
        for state, t, ended, row in zip(states, token.tolist(), done, logits):
            if not ended:  # pushed before the yield: the step's logprobs come with its tokens
                state.push(t, row)
        yield token
        if all(state.finish is not None for state in states):
            return
        logits = advance(token, step)


def generate_steps(strategy: DecodeStrategy, runner: GraphRunner, rows: Sequence[np.ndarray],
                   states: Sequence[SequenceState], pad_token_id: int,
                   static: Mapping[str, Feed] | None = None,
                   prefix: PrefixCache | None = None) -> Iterator[np.ndarray]:
    """Yield one token per row, int64 [B], until every row has ended (``sample_loop``).

    ``rows`` are the first decoder input, checked: the prompts, or for seq2seq the decoder start
    token per row; ``strategy`` (from the export's cache layout) pads them and keeps the cache for
    up to ``max(state.max_tokens)`` steps; a single prompt starts from its longest prefix in
    ``prefix``, which keeps its tokens' keys and values when it ends (``decoding.prefix``).
    Nothing runs until the first token is asked for.
    """
    steps = max(state.max_tokens for state in states)
    logits, advance = strategy.start(runner, rows, steps, pad_token_id, static or {}, prefix)
    yield from sample_loop(logits, advance, states, pad_token_id)
