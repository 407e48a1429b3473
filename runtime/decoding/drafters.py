"""Drafters: cheap proposals of the next K tokens, for the target to verify in one forward.

A drafter makes one ``DraftRows`` per decoding run (``start(count)``); each step it is asked, for
the live rows (keys 0..count-1), what follows each row's context (prompt + tokens so far):

    drafts = drafter.start(count)
    proposals = drafts.propose(keys, contexts, ks)   # -> [Proposal(tokens, probs)] per key

``Proposal.tokens`` may be shorter than asked (even empty: nothing to propose, the step is a
plain one); ``probs`` [len(tokens), V] are the distributions the tokens were drawn from (a draft
model that samples), or None for a deterministic drafter. The verification rule
(``engine.verify``) needs them to keep the target's distribution exact.

- ``PromptLookup``: n-gram lookup in the row's own context (no second model).
- ``DraftModel``: another decoder export with the same vocabulary (a smaller family member, or
  the same model quantised), run on a ``RowBatch`` of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..sampling import SamplingParams, distribution, sample

if TYPE_CHECKING:  # the model module imports the decoding package
    from ..model import Model


@dataclass
class Proposal:
    tokens: list[int]
    probs: np.ndarray | None = None  # [len(tokens), V]: what each token was drawn from


class DraftRows(Protocol):
    def propose(self, keys: Sequence[int], contexts: Sequence[Sequence[int]],
                ks: Sequence[int]) -> list[Proposal]:
        """At most ``ks[i]`` tokens to follow ``contexts[i]`` (row ``keys[i]``'s prompt and
        tokens so far) for each live row."""
        ...


class Drafter(Protocol):
    name: str

    def start(self, count: int, params: SamplingParams, rng: np.random.Generator | None) -> DraftRows:
        """Drafts for a run of ``count`` rows sampled with ``params`` (a draft model samples
        from its own distribution with them; ``rng`` seeds its draws)."""
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

    def start(self, count: int, params: SamplingParams, rng: np.random.Generator | None) -> "LookupRows":
        return LookupRows(self, count)


class LookupRows:
    """Per row, an index n-gram -> the end of its most recent occurrence, grown as the context
    grows (each step indexes the new tokens only)."""

    def __init__(self, lookup: PromptLookup, count: int):
        self.lookup = lookup
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(count)]
        self.indexed = [0] * count  # n-grams ending before this position are indexed

    def propose(self, keys: Sequence[int], contexts: Sequence[Sequence[int]],
                ks: Sequence[int]) -> list[Proposal]:
        return [Proposal(self._follow(key, context, k) if k else []) for key, context, k in zip(keys, contexts, ks)]

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

    def __init__(self, model: "Model", target_vocab: int | None = None):
        if model.config.family != "decoder":
            raise ValueError(f"speculative: the draft export {str(model.directory)!r} is a "
                             f"{model.config.family} model; a draft must be a decoder-only export")
        if target_vocab is not None and model.config.vocab_size != target_vocab:
            raise ValueError(f"speculative: the draft's vocab_size={model.config.vocab_size} differs "
                             f"from the target's {target_vocab}; a draft must share the vocabulary")
        self.model = model

    def start(self, count: int, params: SamplingParams, rng: np.random.Generator | None) -> "DraftModelRows":
        return DraftModelRows(self.model, count, params, rng)


class DraftModelRows:
    """The draft's rows follow the target's: before proposing, each row's draft cache is cut to
    the longest prefix it shares with the row's context and fed the rest."""

    def __init__(self, model: "Model", count: int, params: SamplingParams, rng: np.random.Generator | None):
        config = model.config
        self.batch = model.decoding.rows(model.runner("decoder", "speculative"), count,
                                         config.max_positions, config.fill_token_id)
        self.params = params
        self.rng = None if rng is None else np.random.default_rng(rng.integers(2**63))
        self.rows: dict[int, object] = {}
        self.fed: dict[int, list[int]] = {}  # key -> the tokens in its draft cache

    def _pick(self, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        if self.params.greedy:
            return int(np.argmax(logits)), None
        q = distribution(logits[None], self.params)[0]
        return int(sample(q[None], self.rng)[0]), q

    def propose(self, keys: Sequence[int], contexts: Sequence[Sequence[int]],
                ks: Sequence[int]) -> list[Proposal]:
        for key in [k for k in self.rows if k not in set(keys)]:  # rows that ended
            self.batch.remove(self.rows.pop(key))
        live = [(key, list(context), k) for key, context, k in zip(keys, contexts, ks)]
        chunks = {}
        for key, context, _ in live:
            if key not in self.rows:
                self.rows[key], _ = self.batch.add(np.asarray(context[:-1] or context[:1], np.int64))
                self.fed[key] = list(context[:-1] or context[:1])
            fed = self.fed[key]
            common = next((i for i, (a, b) in enumerate(zip(fed, context)) if a != b), min(len(fed), len(context)))
            common = min(common, len(context) - 1)  # the last token is fed again: its logits are needed
            self.batch.rewind(self.rows[key], len(fed) - max(common, 1))
            del fed[max(common, 1):]
            chunks[key] = context[len(fed):]
        order = sorted(self.rows, key=lambda key: self.rows[key].index)  # the batch's row order
        logits = self.batch.extend([np.asarray(chunks[key], np.int64) for key in order])
        drafts = {key: Proposal([], []) for key in order}
        last = {}
        for key, chunk, rows_logits in zip(order, (chunks[k] for k in order), logits):
            self.fed[key].extend(int(t) for t in chunk)
            last[key] = rows_logits[-1]
        want = dict((key, k) for key, _, k in live)
        for step in range(max(want.values(), default=0)):
            for key in order:
                if step < want[key]:
                    token, q = self._pick(last[key])
                    drafts[key].tokens.append(token)
                    drafts[key].probs.append(q)
            if step + 1 >= max(want.values()):
                break
            feed = np.array([drafts[key].tokens[-1] if drafts[key].tokens else self.fed[key][-1] for key in order])
            stepped = self.batch.step(feed)
            for key, token, row_logits in zip(order, feed, stepped):
                self.fed[key].append(int(token))
                last[key] = row_logits
        out = []
        for key, _, _ in live:
            draft = drafts[key]
            probs = None if self.params.greedy or not draft.tokens else np.stack(draft.probs)
            out.append(Proposal(draft.tokens, probs))
        return out
