"""Drafters: cheap proposals of the next K tokens, for the target to verify in one forward.

A drafter makes one ``DraftRows`` per decoding run or scheduler (``start(capacity, max_length)``:
rows at once, tokens per row); each step it is asked, for the live rows (any hashable keys), what follows
each row's context (prompt + tokens so far), and told when a row ends:

    drafts = drafter.start(capacity, max_length)
    proposals = drafts.propose(keys, contexts, ks, states)  # -> [Proposal(tokens, probs)] per key
    drafts.forget(key)                                      # the row ended

``Proposal.tokens`` may be shorter than asked (even empty: nothing to propose, the step is a
plain one); ``probs`` [len(tokens), V] are the distributions the tokens were drawn from (a draft
model that samples), or None for a deterministic drafter. The verification rule
(``engine.verify``) needs them to keep the target's distribution exact. ``confidences`` (a draft
model's probability of each token it proposed, or None) let the speculator learn how acceptance
depends on them, and a draft model asks it (``keep``) whether to draft one more token; stopping
on what the draft itself computed keeps the target's distribution exact.

- ``PromptLookup``: n-gram lookup in the row's own context (no second model).
- ``DraftModel``: another decoder export with the same vocabulary (a smaller family member, or
  the same model quantised), run on a ``RowBatch`` of its own.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..sampling import distribution, sample
from .engine import SequenceState

DRAFT_TIMES = 15  # draft forwards of each kind (feeding, drafting) whose median is their cost

# A loaded decoder ``tfport.runtime.Model`` (not imported: the model module imports this package).
DecoderModel = Any


@dataclass
class Proposal:
    tokens: list[int]
    probs: np.ndarray | None = None  # [len(tokens), V]: what each token was drawn from
    confidences: list[float] | None = None  # the drafter's probability of each token


class DraftRows(Protocol):
    def propose(self, keys: Sequence[Hashable], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                states: Sequence[SequenceState]) -> list[Proposal]:
        """At most ``ks[i]`` tokens to follow ``contexts[i]`` (row ``keys[i]``'s prompt and
        tokens so far) for each live row; ``states[i]`` says how the row samples (a draft model
        draws with its parameters and generator)."""
        ...

    def forget(self, key: Hashable) -> None:
        """Row ``key`` ended."""
        ...


class Drafter(Protocol):
    name: str

    def start(self, capacity: int, max_length: int) -> DraftRows:
        """Drafts for up to ``capacity`` rows at once of up to ``max_length`` tokens each."""
        ...


class PromptLookup:
    """Propose what followed the most recent earlier occurrence of the context's last n tokens
    (n from ``max_ngram`` down to ``min_ngram``), in the prompt or the text generated so far:
    strong where the output quotes its input (rewriting, summarising, code editing, RAG)."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram={min_ngram!r}, max_ngram={max_ngram!r}: expected "
                             "1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, capacity: int, max_length: int) -> "LookupRows":
        return LookupRows(self)


class LookupRows:
    """Per row, an index n-gram -> the end of its most recent occurrence, grown as the context
    grows (each step indexes the new tokens only)."""

    def __init__(self, lookup: PromptLookup):
        self.lookup = lookup
        self.index: dict[Hashable, dict[tuple[int, ...], int]] = defaultdict(dict)
        self.indexed: dict[Hashable, int] = defaultdict(int)  # n-grams ending before it are indexed

    def propose(self, keys: Sequence[Hashable], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                states: Sequence[SequenceState]) -> list[Proposal]:
        return [Proposal(self._follow(key, context, k) if k else []) for key, context, k in zip(keys, contexts, ks)]

    def forget(self, key: Hashable) -> None:
        self.index.pop(key, None)
        self.indexed.pop(key, None)

    def _follow(self, key: int, context: Sequence[int], k: int) -> list[int]:
        index, end = self.index[key], len(context)
        for stop in range(max(self.indexed[key], 1), end):  # every end but the query's own
            for n in range(self.lookup.min_ngram, min(self.lookup.max_ngram, stop) + 1):
                index[tuple(context[stop - n:stop])] = stop
        self.indexed[key] = max(self.indexed[key], end)
        for n in range(min(self.lookup.max_ngram, end - 1), self.lookup.min_ngram - 1, -1):
            found = index.get(tuple(context[end - n:]))
            if found is not None:
                return [int(t) for t in context[found:found + k]]
        return []


class DraftModel:
    """Another decoder export drafts: the same vocabulary, its own cache layout and row batch.
    Greedy targets get its greedy tokens; sampling targets its samples with their
    probabilities, drawn with the target's parameters."""

    name = "draft"

    def __init__(self, model: DecoderModel, target_vocab: int | None = None):
        if model.config.family != "decoder":
            raise ValueError(f"speculative: the draft export {str(model.directory)!r} is a "
                             f"{model.config.family} model; a draft must be a decoder-only export")
        if target_vocab is not None and model.config.vocab_size != target_vocab:
            raise ValueError(f"speculative: the draft's vocab_size={model.config.vocab_size} differs "
                             f"from the target's {target_vocab}; a draft must share the vocabulary")
        self.model = model

    def start(self, capacity: int, max_length: int) -> "DraftModelRows":
        return DraftModelRows(self.model, capacity, max_length)


class DraftModelRows:
    """The draft's rows follow the target's: before proposing, each row's draft cache is cut to
    the longest prefix it shares with the row's context and fed the rest; then all rows draft
    together, one batched step per proposed token. A new row starts from the longest prefix of
    its context in the draft model's ``prefix_cache`` (``Model.prefix_cache``; None: off).

    ``keep`` (None: draft every row's k): ``keep(key, confidences)`` says whether row ``key``,
    having drafted tokens with these probabilities (the draft's own), should draft one more; a
    row told no stops proposing (the speculator sets it: ``KPolicy.keep_drafting``)."""

    def __init__(self, model: DecoderModel, capacity: int, max_length: int):
        config = model.config
        # The draft model's own prefix cache (None: off): a conversation resent every turn (a
        # served chat, whose target reuses its cache too) is not prefilled again by the draft.
        self.batch = model.decoding.rows(model.runner("decoder", "speculative"), capacity,
                                         min(max_length, config.max_positions), config.fill_token_id,
                                         prefix=getattr(model, "prefix_cache", None))
        self.rows: dict[Hashable, object] = {}
        self.fed: dict[Hashable, list[int]] = {}  # key -> the tokens in its draft cache
        self.feeds: deque[float] = deque(maxlen=DRAFT_TIMES)  # seconds of feeding forwards
        self.seconds: deque[float] = deque(maxlen=DRAFT_TIMES)  # seconds of drafting steps
        self.keep: Callable[[Hashable, list[float]], bool] | None = None

    def forget(self, key: Hashable) -> None:
        if key in self.rows:
            self.batch.remove(self.rows.pop(key))
            del self.fed[key]

    def _sync(self, key: Hashable, context: list[int]) -> list[int]:
        """Cut row ``key``'s draft cache to what it shares with ``context`` (all but its last
        token at most) -> the tokens to feed next (at least the last)."""
        if key not in self.rows:
            self.rows[key], _ = self.batch.add(np.asarray(context[:-1], np.int64))
            self.fed[key] = list(context[:-1])
        fed = self.fed[key]
        common = 0
        limit = min(len(fed), len(context) - 1)
        while common < limit and fed[common] == context[common]:
            common += 1
        common = max(common, 1)  # a row keeps one token: its first is its prompt's
        self.batch.rewind(self.rows[key], len(fed) - common)
        del fed[common:]
        return context[common:]

    @property
    def feed_seconds(self) -> float:
        """A proposal's first forward, which feeds the rows' new tokens (the accepted run and
        the target's token: a chunk, which on an int4 draft on AVX2 costs 1.4 steps for 2 tokens,
        5 for 9): the median of the last ``DRAFT_TIMES``."""
        return float(np.median(self.feeds)) if self.feeds else 0.0

    @property
    def step_seconds(self) -> float:
        """One drafting step of all rows: the median of the last ``DRAFT_TIMES`` (a first
        forward after the rows grow or change count binds anew and measured 1.7x a later one:
        SmolLM2 int4, 17.5 against 10.3 ms). Drafting k tokens costs ``feed_seconds`` + (k - 1)
        ``step_seconds``."""
        return float(np.median(self.seconds)) if self.seconds else 0.0

    @staticmethod
    def _timed(forward, feed, times: deque):
        """``forward(feed)``, its time appended to ``times``."""
        start = time.perf_counter()
        out = forward(feed)
        times.append(time.perf_counter() - start)
        return out

    def propose(self, keys: Sequence[Hashable], contexts: Sequence[Sequence[int]], ks: Sequence[int],
                states: Sequence[SequenceState]) -> list[Proposal]:
        wanted = {key: (k, state) for key, k, state in zip(keys, ks, states) if k}
        chunks = {key: self._sync(key, list(context)) for key, context in zip(keys, contexts) if key in wanted}
        drafts: dict[Hashable, Proposal] = {key: Proposal([], [], []) for key in wanted}
        if wanted:
            order = sorted(self.rows, key=lambda key: self.rows[key].index)
            steps = max(k for k, _ in wanted.values())
            going = set(wanted)  # rows still drafting
            feed = {key: chunks.get(key, [self.fed[key][-1]]) for key in order}  # idle rows: rewound later
            logits = dict(zip(order, self._timed(self.batch.extend, [np.asarray(feed[key], np.int64)
                                                                     for key in order], self.feeds)))
            for step in range(steps):
                for key in order:
                    self.fed[key].extend(int(t) for t in feed[key])
                    if key in going:
                        draft = drafts[key]
                        token, q, confidence = _draw(logits[key][-1], wanted[key][1])
                        draft.tokens.append(token)
                        draft.probs.append(q)
                        draft.confidences.append(confidence)
                        if len(draft.tokens) == wanted[key][0] or (
                                self.keep is not None and not self.keep(key, draft.confidences)):
                            going.discard(key)
                if not going:
                    break
                feed = {key: [drafts[key].tokens[-1]] if key in drafts and len(drafts[key].tokens) > step
                        else [self.fed[key][-1]] for key in order}
                stepped = self._timed(self.batch.step, np.array([feed[key][0] for key in order], np.int64),
                                      self.seconds)
                logits = {key: stepped[b][None] for b, key in enumerate(order)}
        out = []
        for key in keys:
            draft = drafts.get(key, Proposal([]))
            sampled = draft.tokens and draft.probs and draft.probs[0] is not None
            out.append(Proposal(draft.tokens, np.stack(draft.probs) if sampled else None, draft.confidences))
        return out


def _draw(logits: np.ndarray, state: SequenceState) -> tuple[int, np.ndarray | None, float]:
    """The draft's token from its logits [V] with the row's sampling: greedy, or drawn with the
    row's generator (returning the distribution it was drawn from); and the draft's probability
    of the token (greedy: its softmax at temperature 1)."""
    if state.params.greedy:
        token = int(np.argmax(logits))
        return token, None, float(1.0 / np.exp(logits - logits[token]).sum())
    q = distribution(logits[None], state.params)[0]
    token = int(sample(q[None], state.rng)[0])
    return token, q, float(q[token])
