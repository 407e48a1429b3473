"""Speculative decoding: a drafter proposes up to K tokens per row, the target verifies them all
in one forward on top of the row's cache, and the rows keep the accepted run (``engine.verify``)
and forget the rest (``RowBatch.rewind``).

    stats = SpeculationStats()
    for tokens in speculative_steps(batch, prompts, states, PromptLookup(), KPolicy(8, cost), pad, stats):
        ...                                   # int64 [B] per step, as plain decoding yields them

Greedy output is token for token plain greedy decoding's; sampled output follows the target's
distribution exactly (the rejection rule). K is chosen per row and step by ``KPolicy`` from the
row's running acceptance rate and the measured cost of verifying (``measure_costs``): the K that
maximises the expected tokens per unit of target time, 0 (a plain step) when speculating does not
pay.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .drafters import Drafter, DraftModel, PromptLookup, Proposal
from .engine import SequenceState, choose, verify
from .rows import RowBatch


@dataclass
class SpeculationStats:
    """What speculation did: ``proposed`` / ``accepted`` draft tokens; ``forwards``, the rows the
    target ran after the prefill, each verifying one row's run (or stepping it plainly: nothing
    proposed), and the ``tokens`` they gave; ``tokens_per_forward`` is 1 without speculation."""

    proposed: int = 0
    accepted: int = 0
    forwards: int = 0
    tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"proposed": self.proposed, "accepted": self.accepted, "forwards": self.forwards,
                "tokens": self.tokens, "acceptance_rate": round(self.acceptance_rate, 4),
                "tokens_per_forward": round(self.tokens_per_forward, 4)}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification of k proposals yields when each is accepted with probability
    ``alpha`` independently: 1 + alpha + ... + alpha^k (Leviathan et al. 2023, eq. 1)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


class KPolicy:
    """K per row: argmax over k in 0..``k_max`` of expected_tokens(alpha, k) / cost(k + 1), where
    alpha is the row's running acceptance rate (exponential average, starting at ``prior``) and
    ``cost(s)`` the measured time of feeding s tokens per row relative to one; without a cost
    function, always ``k_max``."""

    def __init__(self, k_max: int, cost: Callable[[int], float] | None, prior: float = 0.6,
                 decay: float = 0.7):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"draft_tokens={k_max!r}: expected a positive integer")
        self.k_max, self.cost, self.prior, self.decay = k_max, cost, prior, decay
        self.alpha: dict[int, float] = {}

    def k(self, key: int) -> int:
        if self.cost is None:
            return self.k_max
        alpha = self.alpha.get(key, self.prior)
        gains = [expected_tokens(alpha, k) / self.cost(k + 1) for k in range(self.k_max + 1)]
        return int(np.argmax(gains))

    def record(self, key: int, proposed: int, accepted: int) -> None:
        if proposed:
            alpha = self.alpha.get(key, self.prior)
            self.alpha[key] = self.decay * alpha + (1 - self.decay) * accepted / proposed


def measure_costs(batch: RowBatch, k_max: int, repeats: int = 3) -> Callable[[int], float]:
    """cost(s): the time of ``batch.extend`` with s tokens per live row over that with one, from
    the medians of ``repeats`` timed calls each at s = 1 and s = k_max + 1 (after one untimed
    call each), interpolated linearly between. Each call is rewound: the rows are unchanged."""
    last = [np.array([0], np.int64) for _ in batch.rows]  # token 0: the values do not matter

    def timed(size: int) -> float:
        times = []
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            batch.extend([np.repeat(t, size) for t in last])
            if attempt:
                times.append(time.perf_counter() - start)
            for row in batch.rows:
                batch.rewind(row, size)
        return float(np.median(times))

    one, many = timed(1), timed(k_max + 1)
    slope = max(many / one - 1.0, 0.0) / k_max
    return lambda size: 1.0 + slope * (size - 1)


def speculative_steps(batch: RowBatch, prompts: Sequence[np.ndarray], states: Sequence[SequenceState],
                      drafter: Drafter, policy: KPolicy, pad_token_id: int,
                      stats: SpeculationStats | None = None) -> Iterator[np.ndarray]:
    """Decode ``prompts`` (checked int64 [S_b]) on an empty ``batch`` with speculation; yields
    int64 [B] per step like plain decoding (rows that ended carry ``pad_token_id``). Rows advance
    by different counts per forward; a step is yielded once every live row has its token.
    ``RuntimeError`` for NaN logits."""
    stats = stats if stats is not None else SpeculationStats()
    count = len(prompts)
    added = [batch.add(prompt) for prompt in prompts]
    rows = [row for row, _ in added]
    picked, errors = choose(np.stack([logits for _, logits in added]), states)
    _raise(errors)
    contexts = [[int(t) for t in prompt] for prompt in prompts]
    ready: list[collections.deque[int]] = [collections.deque() for _ in range(count)]
    for b, token in enumerate(picked.tolist()):
        states[b].push(token)
        _take(batch, rows[b], states[b], [token], contexts[b], ready[b])
    drafts = drafter.start(count, states[0].params, states[0].rng)
    while True:
        while all(ready[b] or states[b].finish for b in range(count)) and any(ready):
            yield np.array([ready[b].popleft() if ready[b] else pad_token_id for b in range(count)])
        live = [b for b in range(count) if not states[b].finish]
        if not live:
            return
        room = [min(states[b].max_tokens - len(states[b].tokens) - 1, batch.max_length - rows[b].length - 1)
                for b in live]
        ks = [max(0, min(policy.k(b), r)) for b, r in zip(live, room)]
        proposals: list[Proposal] = drafts.propose(live, [contexts[b] for b in live], ks)
        order = sorted(range(len(live)), key=lambda i: rows[live[i]].index)  # the batch's row order
        chunks = [np.array([contexts[live[i]][-1], *proposals[i].tokens], np.int64) for i in order]
        logits = dict(zip(order, batch.extend(chunks)))
        stats.forwards += len(live)
        for i, b in enumerate(live):
            offered = proposals[i].tokens
            pushed, error = verify(states[b], logits[i], offered, proposals[i].probs)
            if error is not None:
                raise error
            accepted = next((n for n, (a, t) in enumerate(zip(pushed, offered)) if a != t), min(len(pushed), len(offered)))
            stats.proposed += len(offered)
            stats.accepted += accepted
            stats.tokens += len(pushed)
            policy.record(b, len(offered), accepted)
            if not states[b].finish:
                batch.rewind(rows[b], len(offered) - accepted)
            _take(batch, rows[b], states[b], pushed, contexts[b], ready[b])


def _take(batch: RowBatch, row, state: SequenceState, tokens: list[int], context: list[int],
          ready: collections.deque) -> None:
    """Tokens the engine pushed for a row: ready to yield and part of its context; the row
    leaves the batch once it ended."""
    context.extend(tokens)
    ready.extend(tokens)
    if state.finish:
        batch.remove(row)


def _raise(errors: dict[int, RuntimeError]) -> None:
    if errors:
        raise RuntimeError(f"rows {sorted(errors)}: {next(iter(errors.values()))}")


# Verification costs measured once per (decoder session, rows, K): cost(s) functions.
_COSTS = "verify-costs"


@dataclass(frozen=True)
class Speculation:
    """How to speculate: ``drafter`` ("lookup", a draft export's directory, a draft ``Model`` or
    a ``Drafter``), at most ``draft_tokens`` proposals per step; ``adaptive`` chooses K per row
    and step (``KPolicy``: acceptance and measured cost, 0 where it does not pay), else always
    ``draft_tokens`` (within the token budget)."""

    drafter: object
    draft_tokens: int = 8
    adaptive: bool = True


def speculate(model, rows: Sequence[np.ndarray], states: Sequence[SequenceState], speculative,
              draft_tokens: int | None, stats: SpeculationStats | None) -> Iterator[np.ndarray]:
    """``Model.stream``'s decoding with ``speculative`` (a ``Speculation``, or its ``drafter``
    alone); ``draft_tokens`` overrides its K."""
    if not isinstance(speculative, Speculation):
        speculative = Speculation(speculative)
    drafter = drafter_for(speculative.drafter, model)
    k_max = speculative.draft_tokens if draft_tokens is None else draft_tokens
    policy = KPolicy(k_max, None)  # checks draft_tokens now; costs measured below when adaptive
    config = model.config
    if config.family != "decoder":
        raise ValueError(f"speculative: family {config.family!r} is not supported; speculative "
                         "decoding runs decoder-only exports")
    runner = model.runner("decoder", "generate")
    length = max(len(row) for row in rows) + max(state.max_tokens for state in states) + k_max + 1
    batch = model.decoding.rows(runner, len(rows), min(length, config.max_positions), config.fill_token_id)
    if not batch.all_logits:
        raise ValueError("speculative: this export returns the last position's logits only "
                         "(logits='last'); verifying proposals needs every position's (re-export "
                         "with logits='all')")

    def steps() -> Iterator[np.ndarray]:
        costs = runner.kept.setdefault(_COSTS, {})
        inner = speculative_steps(batch, rows, states, drafter, policy, config.fill_token_id, stats)
        first = next(inner)  # prefilled: the rows are there to time verification on
        key = (len(batch.rows), k_max)
        if speculative.adaptive:
            if key not in costs and batch.rows:
                costs[key] = measure_costs(batch, k_max)
            policy.cost = costs.get(key, policy.cost)
        yield first
        yield from inner

    return steps()


def drafter_for(speculative, model) -> Drafter:
    """The drafter ``speculative`` names: "lookup", a ``Drafter``, a draft ``Model`` or the
    directory of a draft export (opened with the target's session settings)."""
    from ..model import Model  # the model module imports this package

    if isinstance(speculative, str) and speculative == "lookup":
        return PromptLookup()
    if isinstance(speculative, Model):
        return DraftModel(speculative, model.config.vocab_size)
    if isinstance(speculative, (str, os.PathLike)):
        if not Path(speculative).is_dir():
            raise ValueError(f"speculative={str(speculative)!r}: expected 'lookup' or the directory "
                             "of a draft decoder export")
        return DraftModel(Model.load(speculative, settings=model.settings), model.config.vocab_size)
    if hasattr(speculative, "start") and hasattr(speculative, "name"):
        return speculative
    raise TypeError(f"speculative={speculative!r}: expected 'lookup', a draft export's directory, "
                    "a Model or a Drafter")
