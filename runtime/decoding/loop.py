"""The decoding loop ``Model.generate`` and the server's ``Scheduler`` both run.

A ``DecodeLoop`` holds the live rows of one row batch (``rows.RowBatch``), each with the
``SequenceState`` that chooses its tokens (``engine``). ``start`` takes rows just prefilled and
picks each one's first token from its prefill logits; ``step`` runs one forward for every live
row and pushes what it takes: one token each, or with a ``Speculator`` each row's verified run
(``speculative``); the caller ``remove``s a row once it ended. Who admits rows and when is the
caller's: the server admits requests as rows free up (continuous batching), ``generate`` admits
its whole batch at once, on a fixed batch (``FixedBatch``) or, to speculate, on a row batch.

    loop = DecodeLoop(batch)
    results = loop.start([row], logits[None], [state], [prompt], [key])   # first tokens
    while loop.live:
        for result in loop.step():       # Advanced(live, tokens, error, proposed, accepted)
            if result.live.state.finish or result.error:
                loop.remove(result.live)
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .engine import SequenceState, choose
from .rows import Row, RowBatch


@dataclass(eq=False)
class LiveRow:
    """A row of the loop: its place in the batch, its ``state``, its ``context`` (prompt and the
    tokens pushed so far: what speculation drafts from) and the caller's ``key`` (unique among
    the live rows: the drafter and the speculation policy know the row by it)."""

    row: Row
    state: SequenceState
    context: list[int] = field(repr=False)
    key: Hashable = None


@dataclass
class Advanced:
    """What one ``start`` / ``step`` did to a row: the ``tokens`` pushed (its logprobs are the
    last ``len(tokens)`` of its state's), the ``error`` that ends it (NaN logits) or None, and
    with speculation the tokens ``proposed`` and ``accepted``."""

    live: LiveRow
    tokens: list[int]
    error: BaseException | None = None
    proposed: int = 0
    accepted: int = 0


class DecodeLoop:
    """The live rows of ``batch``, stepped together (see the module docstring). ``speculator``:
    a ``speculative.Speculator`` over the same batch, or None for one token per step."""

    def __init__(self, batch: RowBatch, speculator=None):
        self.batch = batch
        self.speculator = speculator
        self.live: list[LiveRow] = []

    def start(self, rows: Sequence[Row], logits: np.ndarray, states: Sequence[SequenceState],
              prompts: Sequence[Sequence[int]], keys: Sequence[Hashable]) -> list[Advanced]:
        """Rows just added to the batch, with their prefills' last logits [n, V] -> each one's
        first token pushed (or its error)."""
        picked, errors = choose(logits, states)
        results = []
        for b, (row, state, prompt, key) in enumerate(zip(rows, states, prompts, keys)):
            live = LiveRow(row, state, [int(t) for t in prompt], key)
            self.live.append(live)
            results.append(Advanced(live, [], errors[b]) if b in errors else self._push(live, int(picked[b]), logits[b]))
        return results

    def step(self) -> list[Advanced]:
        """One forward for every live row -> what it pushed to each, rows in the batch's order.
        An exception from the forward itself propagates (every live row's state is then unknown)."""
        self.live.sort(key=lambda live: live.row.index)  # the batch's row order (rows move)
        live = list(self.live)
        if self.speculator is not None:
            return self._speculate(live)
        logits = self.batch.step(np.array([row.context[-1] for row in live], dtype=np.int64))
        picked, errors = choose(logits, [row.state for row in live])
        return [Advanced(row, [], errors[b]) if b in errors else self._push(row, int(picked[b]), logits[b])
                for b, row in enumerate(live)]

    def remove(self, live: LiveRow) -> None:
        """Take ``live`` out of the loop and its row out of the batch."""
        self.live.remove(live)
        self.batch.remove(live.row)
        if self.speculator is not None:
            self.speculator.forget(live.key)

    def _push(self, live: LiveRow, token: int, logits: np.ndarray) -> Advanced:
        live.state.push(token, logits)
        live.context.append(token)
        return Advanced(live, [token])

    def _speculate(self, live: list[LiveRow]) -> list[Advanced]:
        """Each live row's proposal verified in one forward; the run it takes pushed."""
        speculator = self.speculator
        keys = [row.key for row in live]
        proposals = speculator.propose(keys, [row.context for row in live], [row.state for row in live],
                                       [row.row for row in live])
        chunks = [np.array([row.context[-1], *p.tokens], np.int64) for row, p in zip(live, proposals)]
        results = []
        for row, key, proposal, logits in zip(live, keys, proposals, speculator.forward(chunks)):
            pushed, accepted, error = speculator.verify(key, row.row, row.state, logits, proposal)
            row.context.extend(pushed)
            results.append(Advanced(row, pushed, error, len(proposal.tokens), accepted))
        return results


def decode_rows(loop: DecodeLoop, rows: Sequence[Row], logits: np.ndarray,
                states: Sequence[SequenceState], prompts: Sequence[np.ndarray],
                pad_token_id: int) -> Iterator[np.ndarray]:
    """``generate``'s side of the ``DecodeLoop``: rows just added to ``loop.batch`` with their
    prefill logits [B, V] -> int64 [B] per step until every row has ended, rows that ended
    carrying ``pad_token_id``. With speculation rows advance by different counts per forward;
    a step is yielded once every live row has its token. ``RuntimeError`` for NaN logits."""
    count = len(rows)
    ready: list[collections.deque[int]] = [collections.deque() for _ in range(count)]

    def take(results: list[Advanced]) -> None:
        errors = {}
        for result in results:
            live = result.live
            ready[live.key].extend(result.tokens)
            if result.error is not None:
                errors[live.key] = result.error
            if live.state.finish or result.error is not None:
                loop.remove(live)
        if errors:
            raise RuntimeError(f"rows {sorted(errors)}: {next(iter(errors.values()))}")

    take(loop.start(rows, logits, states, prompts, range(count)))
    while True:
        while all(ready[b] or states[b].finish for b in range(count)) and any(ready):
            yield np.array([ready[b].popleft() if ready[b] else pad_token_id for b in range(count)])
        if not loop.live:
            return
        take(loop.step())
