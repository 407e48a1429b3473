"""Speculative decoding: a drafter proposes up to K tokens per row, the target verifies them all
in one forward on top of the row's cache, and the rows keep the accepted run (``engine.verify``)
and forget the rest (``RowBatch.rewind``).

    speculator = Speculator(batch, runner, Speculation("lookup"), PromptLookup(), stats)
    for tokens in speculative_steps(batch, prompts, states, speculator, pad_token_id):
        ...                                   # int64 [B] per step, as plain decoding yields them

(``speculate`` builds them for ``Model.stream``; the server's scheduler uses a ``Speculator`` of
its own over its running batch.)

Greedy output is token for token plain greedy decoding's; sampled output follows the target's
distribution exactly (the rejection rule). K is chosen per row and step by ``KPolicy`` from the
row's running acceptance rate and the measured cost of verifying (``measure_costs``): the K that
maximises the expected tokens per unit of target time, 0 (a plain step) when speculating does not
pay.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .drafters import Drafter, DraftModel, PromptLookup, Proposal
from .engine import SequenceState, choose, verify
from .rows import Row, RowBatch


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
    """K per row: argmax over k in 0..``k_max`` of expected_tokens(alpha, k) / (cost(k + 1) +
    k * draft_cost), where alpha is the row's running acceptance rate (exponential average,
    starting at ``prior``), ``cost(s)`` the measured time of feeding s tokens per row relative to
    one, and ``draft_cost`` the measured time of a draft model's forward relative to the same (0
    for prompt lookup; drafting k tokens takes k forwards: the first also feeds the row's new
    tokens). Without a cost function, always ``k_max``.

    A row whose best k is 0 would never update its alpha again, so with a drafter that costs
    nothing (prompt lookup) it probes: after ``PROBE_AFTER`` plain steps it proposes
    ``PROBE_TOKENS``, and each probe that does not make speculation pay doubles the wait (up to
    ``PROBE_MAX``). A draft model does not probe: before drafting it must be fed every token since
    it last drafted, at several-row cost (SmolLM2's int4 draft on open chat, where it agrees on
    37% of its tokens: 0.75x plain decoding with probes, as a probe after a row's acceptance
    dipped kept it switching on and off). Its k falls to 0 only on measured costs: its forwards'
    median time and the verification cost.
    """

    PROBE_AFTER, PROBE_MAX, PROBE_TOKENS = 8, 128, 2

    def __init__(self, k_max: int, cost: Callable[[int], float] | None, prior: float = 0.6,
                 decay: float = 0.7):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"draft_tokens={k_max!r}: expected a positive integer")
        self.k_max, self.cost, self.prior, self.decay = k_max, cost, prior, decay
        self.draft_cost = 0.0
        self.alpha: dict[Hashable, float] = {}
        self.waits: dict[Hashable, tuple[int, int]] = {}  # key -> (plain steps since a proposal, wait)

    def k(self, key: Hashable) -> int:
        if self.cost is None:
            return self.k_max
        alpha = self.alpha.get(key, self.prior)
        gains = [expected_tokens(alpha, k) / (self.cost(k + 1) + k * self.draft_cost)
                 for k in range(self.k_max + 1)]
        best = int(np.argmax(gains))
        if best:
            self.waits.pop(key, None)
            return best
        if self.draft_cost:  # a draft model's probe first feeds it every token since its last one
            return 0
        plain, wait = self.waits.get(key, (0, self.PROBE_AFTER))
        if plain + 1 < wait:
            self.waits[key] = (plain + 1, wait)
            return 0
        self.waits[key] = (0, min(2 * wait, self.PROBE_MAX))
        return min(self.k_max, self.PROBE_TOKENS)

    def record(self, key: Hashable, proposed: int, accepted: int) -> None:
        if proposed:
            alpha = self.alpha.get(key, self.prior)
            self.alpha[key] = self.decay * alpha + (1 - self.decay) * accepted / proposed

    def forget(self, key: Hashable) -> None:
        self.alpha.pop(key, None)
        self.waits.pop(key, None)


def measure_costs(batch: RowBatch, k_max: int, repeats: int = 3) -> tuple[Callable[[int], float], float]:
    """(cost(s): the time of ``batch.extend`` with s tokens per live row over that with one, the
    seconds of one such call with one token), from the medians of ``repeats`` timed calls each at
    s = 1 and s = k_max + 1 (after one untimed call each), interpolated linearly between. Each
    call is rewound: the rows are unchanged."""
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
    return (lambda size: 1.0 + slope * (size - 1)), one


class Speculator:
    """One decoding run's or scheduler's speculation over ``batch``: drafts, K per row, the
    verification of each row's run, and the statistics. Rows are named by any hashable key.

        proposals = speculator.propose(keys, contexts, states, rows)      # before a forward
        logits = batch.extend([[last, *p.tokens] for each row])           # one target forward
        pushed, accepted, error = speculator.verify(key, row, state, logits, proposal)
    """

    def __init__(self, batch: RowBatch, runner, speculation: "Speculation", drafter: Drafter,
                 stats: SpeculationStats | None = None):
        self.batch, self.speculation = batch, speculation
        self.policy = KPolicy(speculation.draft_tokens, None)
        self.drafts = drafter.start(batch.capacity, batch.max_length)
        self.stats = stats if stats is not None else SpeculationStats()
        self.costs = runner.kept.setdefault(_COSTS, {})  # (rows, K) -> (cost(s), seconds), per session
        self.step_seconds = 0.0  # one plain step of the live rows (measured)

    def propose(self, keys: Sequence[Hashable], contexts: Sequence[Sequence[int]],
                states: Sequence[SequenceState], rows: Sequence[Row]) -> list[Proposal]:
        """Each live row's proposal (``rows`` are theirs in ``batch``): K from the policy, within
        the row's token budget and cache room."""
        k_max = self.policy.k_max
        if self.speculation.adaptive:
            key = (len(self.batch.rows), k_max)
            if key not in self.costs:
                self.costs[key] = measure_costs(self.batch, k_max)
            self.policy.cost, self.step_seconds = self.costs[key]
        ks = [max(0, min(self.policy.k(key), state.max_tokens - len(state.tokens) - 1,
                         self.batch.max_length - row.length - 1))
              for key, state, row in zip(keys, states, rows)]
        proposals = self.drafts.propose(keys, contexts, ks, states)
        if self.step_seconds:  # a draft model's forward per drafted token (0 for prompt lookup)
            self.policy.draft_cost = getattr(self.drafts, "step_seconds", 0.0) / self.step_seconds
        return proposals

    def verify(self, key: Hashable, row: Row, state: SequenceState, logits: np.ndarray,
               proposal: Proposal) -> tuple[list[int], int, RuntimeError | None]:
        """Push the run ``state`` takes (``engine.verify``) and forget the rejected proposals in
        the row's cache -> (the tokens pushed, how many were accepted proposals, the error that
        ends the row or None); a row that ended is forgotten by the drafter."""
        offered = proposal.tokens
        pushed, error = verify(state, logits, offered, proposal.probs)
        accepted = next((n for n, (a, t) in enumerate(zip(pushed, offered)) if a != t),
                        min(len(pushed), len(offered)))
        self.stats.forwards += 1
        self.stats.proposed += len(offered)
        self.stats.accepted += accepted
        self.stats.tokens += len(pushed)
        self.policy.record(key, len(offered), accepted)
        if state.finish or error is not None:
            self.forget(key)
        else:
            self.batch.rewind(row, len(offered) - accepted)
        return pushed, accepted, error

    def forget(self, key: Hashable) -> None:
        self.drafts.forget(key)
        self.policy.forget(key)


def speculative_steps(batch: RowBatch, prompts: Sequence[np.ndarray], states: Sequence[SequenceState],
                      speculator: Speculator, pad_token_id: int) -> Iterator[np.ndarray]:
    """Decode ``prompts`` (checked int64 [S_b]) on an empty ``batch`` with speculation; yields
    int64 [B] per step like plain decoding (rows that ended carry ``pad_token_id``). Rows advance
    by different counts per forward; a step is yielded once every live row has its token.
    ``RuntimeError`` for NaN logits."""
    count = len(prompts)
    added = [batch.add(prompt) for prompt in prompts]
    rows = [row for row, _ in added]
    first = np.stack([logits for _, logits in added])  # [B, V]
    picked, errors = choose(first, states)
    if errors:
        raise RuntimeError(f"rows {sorted(errors)}: {next(iter(errors.values()))}")
    contexts = [[int(t) for t in prompt] for prompt in prompts]
    ready: list[collections.deque[int]] = [collections.deque() for _ in range(count)]
    for b, token in enumerate(picked.tolist()):
        states[b].push(token, first[b])
        _take(batch, rows[b], states[b], [token], contexts[b], ready[b])
    while True:
        while all(ready[b] or states[b].finish for b in range(count)) and any(ready):
            yield np.array([ready[b].popleft() if ready[b] else pad_token_id for b in range(count)])
        live = sorted((b for b in range(count) if not states[b].finish), key=lambda b: rows[b].index)
        if not live:
            return
        proposals = speculator.propose(live, [contexts[b] for b in live], [states[b] for b in live],
                                       [rows[b] for b in live])
        chunks = [np.array([contexts[b][-1], *p.tokens], np.int64) for b, p in zip(live, proposals)]
        for b, proposal, logits in zip(live, proposals, batch.extend(chunks)):
            pushed, _, error = speculator.verify(b, rows[b], states[b], logits, proposal)
            if error is not None:
                raise error
            _take(batch, rows[b], states[b], pushed, contexts[b], ready[b])


def _take(batch: RowBatch, row: Row, state: SequenceState, tokens: list[int], context: list[int],
          ready: collections.deque) -> None:
    """Tokens the engine pushed for a row: ready to yield and part of its context; the row
    leaves the batch once it ended."""
    context.extend(tokens)
    ready.extend(tokens)
    if state.finish:
        batch.remove(row)


# Verification costs measured once per (decoder session, rows, K): cost(s) functions.
_COSTS = "verify-costs"


@dataclass(frozen=True)
class Speculation:
    """How to speculate: ``drafter`` ("lookup", a draft export's directory, a draft ``Model`` or
    a ``Drafter``), at most ``draft_tokens`` proposals per step; ``adaptive`` chooses K per row
    and step (``KPolicy``: acceptance and measured cost, 0 where it does not pay), else always
    ``draft_tokens`` (within the token budget). ``exact`` refuses a quantised target, whose
    verified tokens can differ from plain decoding's (``check_speculative``); False accepts that.
    """

    drafter: object
    draft_tokens: int = 8
    adaptive: bool = True
    exact: bool = True  # refuse targets whose verified tokens can differ from plain decoding's


def speculate(model, rows: Sequence[np.ndarray], states: Sequence[SequenceState], speculative,
              draft_tokens: int | None, stats: SpeculationStats | None) -> Iterator[np.ndarray]:
    """``Model.stream``'s decoding with ``speculative`` (a ``Speculation``, or its ``drafter``
    alone); ``draft_tokens`` overrides its K. Checks everything before returning."""
    if not isinstance(speculative, Speculation):
        speculative = Speculation(speculative)
    if draft_tokens is not None:
        speculative = dataclasses.replace(speculative, draft_tokens=draft_tokens)
    KPolicy(speculative.draft_tokens, None)  # checks draft_tokens
    drafter = drafter_for(speculative.drafter, model)
    config = model.config
    if config.family != "decoder":
        raise ValueError(f"speculative: family {config.family!r} is not supported; speculative "
                         "decoding runs decoder-only exports")
    runner = model.runner("decoder", "generate")
    length = max(len(row) for row in rows) + max(state.max_tokens for state in states) + speculative.draft_tokens + 1
    # A single prompt starts from its longest cached prefix and leaves its keys and values, as in
    # plain decoding (generation.generate_steps); so a chat's next turn is not prefilled again.
    prefix = model.prefix_cache if len(rows) == 1 else None
    batch = model.decoding.rows(runner, len(rows), min(length, config.max_positions), config.fill_token_id,
                                prefix=prefix)
    check_speculative(model, batch, speculative)
    speculator = Speculator(batch, runner, speculative, drafter, stats)
    return speculative_steps(batch, rows, states, speculator, config.fill_token_id)


def check_speculative(model, batch: RowBatch, speculation: Speculation) -> None:
    """``ValueError`` for a target that cannot verify proposals (``batch`` is its row batch), or
    whose verified tokens can differ from plain decoding's while ``speculation.exact``."""
    quantization = model.manifest.quantization
    if speculation.exact and getattr(model, "batch_manifest", None) is not None:
        raise ValueError(
            "speculative: this model runs steps of many rows on its batch export (batch_export), "
            "so a verification step and a plain step can run on different weights and verified "
            "tokens can differ from plain decoding's. Speculate without a batch export, or accept "
            "inexact tokens: Speculation(..., exact=False), --speculative-inexact")
    if speculation.exact and quantization is not None:
        raise ValueError(
            f"speculative: this export's weights are quantised ({quantization.get('format', 'int')}); "
            "ONNX Runtime's CPU kernel for them (MatMulNBits at accuracy level 4) rounds a step of "
            "one row differently from a step of several (SmolLM2-135M int4 logits 3e-5 apart on an "
            "AVX2 CPU, 1.25 on another; greedy tokens diverged on both), and w8a8's per-row "
            "activation codes turn the float kernels' few-ulp differences between a step of one "
            "token and a verified chunk into logits units apart (SmolLM2), so verified tokens can "
            "differ from plain greedy decoding. Speculate on a float export (a quantised "
            "export can be its draft), or accept inexact tokens: Speculation(..., exact=False), "
            "--speculative-inexact")
    if not batch.all_logits:
        raise ValueError("speculative: this export returns the last position's logits only "
                         "(logits='last'); verifying proposals needs every position's (re-export "
                         "with logits='all')")


LOOKUP = "lookup"  # --speculative's name for prompt lookup; any other value is a draft export's directory


def names_draft_model(speculative: str | None) -> bool:
    """Whether ``--speculative``'s value (None: off) names a draft export, whose sessions take
    turns with the target's (so both should share one thread pool, ``SessionSettings.shared_threads``)."""
    return speculative is not None and speculative != LOOKUP


def open_drafter(speculative: str, settings, argument: str, verify: str = "full"):
    """``--speculative``'s value -> ``LOOKUP``, or the draft export it names opened once with
    ``settings`` (a ``SessionSettings``); ``ValueError`` naming ``argument`` for anything else."""
    from ..model import Model  # the model module imports this package

    if speculative == LOOKUP:
        return LOOKUP
    if not Path(speculative).is_dir():
        raise ValueError(f"{argument}={speculative!r}: expected {LOOKUP!r} or the directory of a draft "
                         "decoder export")
    return Model.load(speculative, settings=settings, verify=verify)


def drafter_for(speculative, model) -> Drafter:
    """The drafter ``speculative`` names: "lookup", a ``Drafter``, a draft ``Model`` or the
    directory of a draft export (opened with the target's session settings)."""
    from ..model import Model  # the model module imports this package

    if isinstance(speculative, str) and speculative == LOOKUP:
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
