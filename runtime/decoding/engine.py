"""The one step function: how the next token of every sequence is chosen, and when it ends.

Every entry point that decodes runs it: ``Model.generate`` / ``stream`` / ``chat`` (a fixed batch,
``tfport.runtime.generation``) and the server's scheduler (rows that come and go,
``tfport.runtime.serve.scheduler``). Each sequence carries its own ``SequenceState``: sampling
parameters and random generator, stop ids, token budget, the tokens the export forces at given
steps, and logits processors. Per step:

    tokens, errors = choose(logits, states)   # logits [n, V] -> int64 [n], {row: RuntimeError}
    for b, (state, token) in enumerate(zip(states, tokens)):
        state.push(int(token), logits[b])     # records it; state.finish: "stop" | "length" | None

``choose`` applies, per row, the forced ids of its step (``force_tokens``), then its processors
in order (a request's bias and penalties are one, ``sampling.Penalties``, so greedy rows with
penalties are not plain), then picks greedily or samples (temperature, top-k, top-p, min-p).
``push`` records the token's log-probability under the model (the raw logits' log-softmax, before
any processor) and its ``logprobs`` most likely alternatives when the state asks for them.
Greedy rows with nothing to apply are one vectorised argmax; sampled rows that share one
parameter set and one generator (the rows of one ``generate`` call) are drawn together, so a
batch draws the same numbers as before the engine existed. NaN logits fail their row only
(``errors``); +-inf are clipped (``check_logits``).

A step may also verify K proposed tokens (speculative decoding, ``speculative``): the target's
logits after the row's last token and after each proposal, [K + 1, V], go to ``verify``, which
pushes the accepted run and one token of the target's own (greedy: the proposals that equal the
target's pick; sampling: the rejection rule of Leviathan et al. 2023 / Chen et al. 2023, so the
tokens follow the target's distribution exactly).

Seams for what plugs in next: a processor (``LogitsProcessor``) sees the row's tokens so far and
may mask logits (a grammar); a row may start from a cached prefix (the layout's ``RowBatch.add``
owns how the cache is filled; the state only counts generated tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..sampling import (SamplingParams, TokenLogprob, distribution, force_tokens, nan_logits, next_token,
                        sample, token_logprobs)


class LogitsProcessor(Protocol):
    def __call__(self, tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        """(tokens generated so far, logits float32 [V]) -> logits [V] to pick from (a new array
        or ``logits`` changed in place; -inf removes a token)."""
        ...


@dataclass(eq=False)
class SequenceState:
    """One sequence being decoded: ``params`` and ``rng`` (None when greedy), at most
    ``max_tokens`` new tokens, ends at any of ``stop_ids`` (reported, then the row ends),
    ``forced`` step -> the only ids allowed there (``Model.forced_tokens``), ``processors``
    applied before picking. ``tokens`` are those pushed; ``finish`` is "stop" or "length" once
    the sequence has ended. ``logprobs``: record each token's ``TokenLogprob`` with that many
    alternatives in ``token_logprobs`` (None: not recorded)."""

    params: SamplingParams
    rng: np.random.Generator | None
    max_tokens: int
    stop_ids: tuple[int, ...] = ()
    forced: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    processors: tuple[LogitsProcessor, ...] = ()
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply at this step: picked by the batch's vectorised argmax."""
        return self.params.greedy and not self.processors and len(self.tokens) not in self.forced

    def push(self, token: int, logits: np.ndarray | None = None) -> str | None:
        """Record ``token``, chosen from the raw ``logits`` [V] (needed when ``logprobs`` is
        set) -> why the sequence ended with it ("stop", "length") or None."""
        if self.logprobs is not None:
            assert logits is not None, "a state that records logprobs needs the logits of each token"
            self.token_logprobs.extend(token_logprobs(logits[None], [token], self.logprobs))
        self.tokens.append(token)
        if token in self.stop_ids:
            self.finish = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish = "length"
        return self.finish

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] -> what this step picks from: the forced ids, then the processors."""
        step = len(self.tokens)
        if step in self.forced:
            logits = force_tokens(logits[None], self.forced[step])[0]
        elif self.processors:  # processors may change it in place; the raw logits stay for push
            logits = logits.copy()
        for processor in self.processors:
            logits = processor(self.tokens, logits)
        return logits


def choose(logits: np.ndarray, states: Sequence[SequenceState]) -> tuple[np.ndarray, dict[int, RuntimeError]]:
    """One token per row of ``logits`` [n, V] (row b is ``states[b]``'s) -> (int64 [n], the rows
    that failed, with their error: NaN logits). Tokens of failed rows are meaningless."""
    tokens = np.argmax(logits, axis=-1).astype(np.int64)  # the plain greedy rows, vectorised
    errors: dict[int, RuntimeError] = {}
    finite = np.isfinite(logits).all(axis=-1)
    groups: dict[tuple[int, int], list[int]] = {}
    for b, state in enumerate(states):
        if not (state.plain and finite[b]):
            groups.setdefault((id(state.params), id(state.rng)), []).append(b)
    for rows in groups.values():
        for b in rows:
            if np.isnan(logits[b]).any():
                errors[b] = nan_logits([b])
        rows = [b for b in rows if b not in errors]
        if not rows:
            continue
        block = np.stack([states[b].adjust(logits[b]) for b in rows])  # [m, V]
        first = states[rows[0]]
        tokens[rows] = next_token(block, first.params, first.rng)
    return tokens, errors


def verify(state: SequenceState, logits: np.ndarray, proposal: Sequence[int],
           draft: np.ndarray | None = None) -> tuple[list[int], RuntimeError | None]:
    """Push the run ``state`` takes from ``proposal`` (K token ids) -> (the tokens pushed, at
    least one unless it failed; the error that ends the row: NaN logits, or None).

    ``logits`` [K + 1, V]: the target's after the row's last token and after each proposal.
    Greedy: proposals are accepted while they equal the target's pick, then the target's pick
    follows (the tokens of plain greedy decoding). Sampling: proposal d_i is accepted with
    probability min(1, p_i(d_i) / q_i(d_i)); on rejection a token is drawn from
    max(p_i - q_i, 0) normalised; after K acceptances one more from p_K. ``draft`` [K, V] is q
    (the draft model's distributions), None for a deterministic drafter (q_i one-hot on d_i).
    The run stops where the sequence ends (a stop id, ``max_tokens``).
    """
    pushed: list[int] = []
    try:
        for i in range(len(proposal) + 1):
            offered = int(proposal[i]) if i < len(proposal) else None
            if state.params.greedy:
                tokens, errors = choose(logits[i:i + 1], [state])
                if errors:
                    return pushed, errors[0]
                token = int(tokens[0])
            else:
                token = _sample_against(state, logits[i], offered, None if draft is None or offered is None
                                        else draft[i])
            pushed.append(token)
            if state.push(token, logits[i]) or token != offered:
                return pushed, None
    except RuntimeError as err:  # NaN logits (sampling.check_logits)
        return pushed, err
    return pushed, None


def _sample_against(state: SequenceState, logits: np.ndarray, offered: int | None,
                    q: np.ndarray | None) -> int:
    """One sampled token of the rejection rule: ``offered`` (accepted with probability
    min(1, p / q)) or a draw from the residual; a plain draw from p when nothing is offered."""
    p = distribution(state.adjust(logits)[None], state.params)[0]  # [V] float64
    if offered is None:
        return int(sample(p[None], state.rng)[0])
    q_offered = 1.0 if q is None else float(q[offered])
    if state.rng.random() * q_offered < p[offered]:  # u < p / q without dividing by 0
        return offered
    residual = p.copy()
    if q is None:
        residual[offered] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q where it matters: every draw is accepted, rejection cannot happen
        residual, total = p, 1.0
    return int(sample(residual[None] / total, state.rng)[0])
