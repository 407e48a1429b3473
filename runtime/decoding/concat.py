"""Layout "concat": the decoder takes ``past_key_values.*`` and returns ``present.*`` = past
followed by the new tokens; prompts are left-padded and described by the attention mask.

State is explicit: the attention mask [B, T] grows by one column per step and the KV cache is a
dict of OrtValues kept on the session's device (see ``binding``). This module is the layout's
whole runtime side: the fixed-batch strategy (``ConcatCache``), the row batch for serving
(``ConcatRows``), the parity relayout (``ConcatRelayout``: none) and ``score``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import weakref

import numpy as np
import onnxruntime as ort

from tfport.contract import CONCAT, LAST_LOGITS

from ..binding import PRESENT, Feed, GraphRunner, KVCache, empty_cache, past_name, self_cache_inputs
from ..inputs import pad_batch, positions_from_mask
from .layout import LayoutDecoding, prefill_pieces, register_decoding
from .prefix import NO_PREFIX, Prefix, PrefixCache, cache_chunk, cached_start
from .rows import Row, check_chunks, check_prompt, check_rewind, check_step


@dataclass
class DecodeState:
    """What changes from step to step: ``attention_mask`` int64 [B, T] covers the cache and the
    tokens fed next; ``cache`` maps ``past_key_values.*`` to OrtValues [B, Hkv, P, D]."""

    attention_mask: np.ndarray
    cache: Mapping[str, Feed]


def decoder_forward(runner: GraphRunner, input_ids: np.ndarray, attention_mask: np.ndarray,
                    cache: Mapping[str, Feed], static: Mapping[str, Feed],
                    every_position: bool = False) -> tuple[np.ndarray, KVCache]:
    """One decoder call: input_ids [B, S], attention_mask [B, P+S], cache [B, Hkv, P, D]
    -> (last-position logits float32 [B, V], or [B, S, V] with ``every_position``; present cache
    [B, Hkv, P+S, D] as OrtValues). Without ``every_position`` the graph runs its head on the
    last position alone (its ``last_logits`` input).

    ``static`` holds the inputs that do not change between steps (seq2seq
    ``encoder_attention_mask`` and cross-attention K/V). ``position_ids`` [B, S] are counted
    from the mask when the graph takes them.
    """
    feeds: dict[str, Feed] = {"input_ids": input_ids, "attention_mask": attention_mask,
                              LAST_LOGITS: np.array(not every_position)}
    if "position_ids" in runner.input_names:
        feeds["position_ids"] = positions_from_mask(attention_mask, input_ids.shape[1])
    feeds.update(cache)
    feeds.update(static)
    presents = [t.name for t in runner.spec.outputs if t.name.startswith(PRESENT)]
    outputs = runner.run(feeds, device_outputs=presents, host_outputs=["logits"])
    logits = outputs["logits"].numpy()
    logits = logits if every_position else logits[:, -1]  # [B, S, V] or [B, V]
    if not np.isfinite(logits).all():
        raise RuntimeError(f"the decoder produced non-finite logits (cache length "
                           f"{attention_mask.shape[1] - input_ids.shape[1]}); the export or its "
                           f"dtype may be broken")
    return logits, {past_name(name): outputs[name] for name in presents}


def past_from(runner: GraphRunner, prefix: Prefix) -> dict[str, np.ndarray]:
    """The cache of one row starting from ``prefix``: name -> [1, Hkv, prefix.length, D]."""
    if not prefix.length:
        return empty_cache(runner.spec, 1)
    return {name: value[None] for name, value in prefix.kv.items()}


def prefill_row(runner: GraphRunner, prompt: np.ndarray, start: Prefix, stop: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``prompt[start.length:stop]`` (int64 [S]) on top of ``start``, batch 1, in pieces ->
    (logits [1, V], the cache name -> [1, Hkv, stop, D] on the host)."""
    cache = past_from(runner, start)
    for first, last in prefill_pieces(start.length, stop):
        logits, cache = decoder_forward(runner, prompt[None, first:last], np.ones((1, last), dtype=np.int64), cache, {})
    return logits, host_cache(cache)


def host_cache(cache: Mapping[str, Feed]) -> dict[str, np.ndarray]:
    """``cache`` with every OrtValue copied to a host array."""
    return {name: np.asarray(value.numpy() if isinstance(value, ort.OrtValue) else value)
            for name, value in cache.items()}


class ConcatCache:
    """Left-padded prompts, a growing mask, the cache returned by each call fed to the next.

    With a ``prefix`` cache, a single decoder prompt starts from its longest cached prefix
    (``decoding.prefix``), and its prompt and fed tokens are kept when the request ends."""

    def start(self, runner: GraphRunner, rows: Sequence[np.ndarray], max_new_tokens: int,
              pad_token_id: int, static: Mapping[str, Feed], prefix: PrefixCache | None = None):
        ids, mask = pad_batch(rows, pad_token_id, "left")  # [B, S]
        static = dict(static)
        cached = prefix is not None and len(rows) == 1 and not static
        start = cached_start(prefix, rows[0]) if cached else NO_PREFIX
        past = past_from(runner, start) if cached else empty_cache(runner.spec, ids.shape[0])
        state = DecodeState(mask, past)
        if len(rows) == 1:  # in pieces on top of its cache
            for first, stop in prefill_pieces(start.length, ids.shape[1]):
                logits, state.cache = decoder_forward(runner, ids[:, first:stop], mask[:, :stop], state.cache, static)
        elif not static and len(prefill_pieces(0, ids.shape[1])) > 1:
            # each row alone in pieces (a piece of a left-padded batch could be all padding), its
            # keys and values then laid out as the batch's, left-padded as its mask says
            last = []
            state.cache = empty_cache(runner.spec, len(rows), ids.shape[1])
            for b, prompt in enumerate(rows):
                row_logits, row_cache = prefill_row(runner, np.asarray(prompt, dtype=np.int64), NO_PREFIX, len(prompt))
                last.append(row_logits[0])
                for name, value in row_cache.items():  # [1, Hkv, L, D]
                    state.cache[name][b, :, ids.shape[1] - len(prompt):] = value[0]
            logits = np.stack(last)  # [B, V]
        else:
            logits, state.cache = decoder_forward(runner, ids, mask, state.cache, static)
        fed = [int(t) for t in rows[0]] if cached else None  # the tokens in the cache

        def advance(token: np.ndarray, step: int) -> np.ndarray:
            if fed is not None:
                fed.append(int(token[0]))
            ones = np.ones((token.shape[0], 1), dtype=np.int64)
            state.attention_mask = np.concatenate([state.attention_mask, ones], axis=1)  # [B, T+1]
            next_logits, state.cache = decoder_forward(runner, token[:, None], state.attention_mask,
                                                       state.cache, static)
            return next_logits

        if cached:  # the request is over when advance goes
            weakref.finalize(advance, _keep_blocks, prefix, fed, state)
        return logits, advance


def _keep_blocks(prefix: PrefixCache, fed: list[int], state: DecodeState) -> None:
    prefix.insert(fed, {name: value[0] for name, value in host_cache(state.cache).items()})


class ConcatRows:
    """Layout "concat": the live rows as one left-padded batch (cache [n, Hkv, P, D] with an
    attention mask [n, P]) that steps like ``ConcatCache``; when rows join or leave, the batch is
    rebuilt on the host with the common padding stripped. Rewound tokens stay in the cache as
    masked columns (positions are counted from the mask, so the holes are invisible) until a
    rebuild drops them.

    A prompt is prefilled alone (batch 1), from its longest cached prefix with a ``prefix``
    cache, and joins the batch at the next step.
    """

    def __init__(self, runner: GraphRunner, capacity: int, max_length: int, pad_token_id: int = 0,
                 prefix: PrefixCache | None = None):
        self.runner = runner
        self.prefix = prefix
        self.capacity = int(capacity)
        self.max_length = int(max_length)
        self.pad_token_id = pad_token_id
        self.rows: list[Row] = []
        self.names = self_cache_inputs(runner.spec)
        self.cache: dict = {}  # name -> OrtValue or array [n, Hkv, P, D]
        self.mask = np.zeros((0, 0), dtype=np.int64)  # [n, P]
        self._members: list[Row] = []  # the rows the current cache holds, in order
        if any(".encoder." in t.name for t in runner.spec.inputs):
            raise ValueError("ConcatRows: seq2seq decoders (cross-attention inputs) are not "
                             "batched per row; serve decoder-only exports")

    def add(self, prompt: np.ndarray) -> tuple[Row, np.ndarray]:
        prompt = check_prompt(self, prompt)
        logits, cache = prefill_row(self.runner, prompt, cached_start(self.prefix, prompt), prompt.size)
        row = Row(len(self.rows), prompt.size, prompt.tolist(), cache)
        if self.prefix is not None:
            self.prefix.insert(row.tokens, {name: value[0] for name, value in row.pending.items()})
        self.rows.append(row)
        return row, logits[0]

    def prefill_chunk(self, prompt: np.ndarray, budget: int) -> int:
        if self.prefix is None:
            return 0
        prompt = check_prompt(self, prompt)
        return cache_chunk(self.prefix, prompt, budget, lambda start, stop: {
            name: value[0] for name, value in prefill_row(self.runner, prompt, start, stop)[1].items()})

    def remove(self, row: Row) -> None:
        assert self.rows[row.index] is row, (row, self.rows)
        if self.prefix is not None:
            self.prefix.insert(row.tokens, self._row_cache(row))
        del self.rows[row.index]
        for index, other in enumerate(self.rows):
            other.index = index
        row.index = -1

    def _row_cache(self, row: Row) -> dict[str, np.ndarray]:
        """``row``'s keys and values: name -> [Hkv, length, D] (the batch's cache comes to the
        host, where the next rebuild reads it)."""
        if row.pending is not None:
            return {name: value[0, :, :row.length] for name, value in row.pending.items()}
        self.cache = host_cache(self.cache)
        b = self._members.index(row)
        real = self.mask[b].astype(bool)  # its real tokens: the unmasked columns
        return {name: value[b][:, real] for name, value in self.cache.items()}

    def _rebuild(self) -> None:
        """Lay the live rows out as one left-padded batch without holes (when membership changed,
        or rewound tokens left too many masked columns)."""
        old = {id(row): b for b, row in enumerate(self._members)}
        host = self.cache = host_cache(self.cache)
        width = max(row.length for row in self.rows)
        n = len(self.rows)
        mask = np.zeros((n, width), dtype=np.int64)
        cache = empty_cache(self.runner.spec, n, width)
        for b, row in enumerate(self.rows):
            mask[b, width - row.length:] = 1
            real = None if row.pending is not None else self.mask[old[id(row)]].astype(bool)
            for name in self.names:
                if row.pending is not None:
                    source = row.pending[name][0, :, :row.length]  # [Hkv, S, D]
                else:  # the row's real tokens: the unmasked columns of its old slot
                    source = host[name][old[id(row)]][:, real]
                cache[name][b, :, width - row.length:] = source
            row.pending = None
        self.cache, self.mask, self._members = cache, mask, list(self.rows)

    def _feed(self, ids: np.ndarray, new_mask: np.ndarray) -> np.ndarray:
        """ids [n, S] with new_mask [n, S] (1: a real token) on top of the live rows -> logits
        [n, S, V]; the mask and every row's length grow."""
        if self._members != self.rows or self.mask.shape[1] > 2 * max(r.length for r in self.rows) + 16:
            self._rebuild()
        self.mask = np.concatenate([self.mask, new_mask], axis=1)  # [n, P+S]
        logits, self.cache = decoder_forward(self.runner, ids, self.mask, self.cache, {}, every_position=True)
        for row, count in zip(self.rows, new_mask.sum(axis=1).tolist()):
            row.length += count
        return logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        tokens = check_step(self, tokens)
        for row, token in zip(self.rows, tokens.tolist()):
            row.tokens.append(token)
        return self._feed(tokens[:, None], np.ones((len(self.rows), 1), dtype=np.int64))[:, -1]

    def extend(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        chunks = check_chunks(self, chunks)
        width = max(c.size for c in chunks)
        ids = np.full((len(chunks), width), self.pad_token_id, dtype=np.int64)
        new_mask = np.zeros((len(chunks), width), dtype=np.int64)  # a short chunk: masked tail
        for b, (row, chunk) in enumerate(zip(self.rows, chunks)):
            ids[b, :chunk.size], new_mask[b, :chunk.size] = chunk, 1
            row.tokens.extend(chunk.tolist())
        logits = self._feed(ids, new_mask)
        return [logits[b, :chunk.size] for b, chunk in enumerate(chunks)]

    def rewind(self, row: Row, count: int) -> None:
        check_rewind(row, count)
        if count and row.pending is None:  # mask the last `count` real columns of its slot
            b = self._members.index(row)
            real = np.nonzero(self.mask[b])[0]
            self.mask[b, real[len(real) - count:]] = 0
        row.length -= count  # a pending prompt's cache is cut at its length when merged
        del row.tokens[row.length:]


class ConcatRelayout:
    """Parity inputs are made in this layout: nothing to re-lay out."""

    def batch_for(self, batch: int, past: int, new: int) -> int:
        return batch

    def __call__(self, feeds: dict[str, np.ndarray], past: int,
                 random_buffer: Callable[[int, int], np.ndarray]):
        return feeds, None, None


def score(runner: GraphRunner, ids: np.ndarray) -> Iterator[np.ndarray]:
    """Every position's logits of one sequence ``ids`` int64 [1, S], as the logits [s, V] of its
    consecutive pieces of at most ``PREFILL_PIECE`` tokens, each run on the cache of those before
    (from an empty one)."""
    cache = empty_cache(runner.spec, 1)
    for first, stop in prefill_pieces(0, ids.shape[1]):
        logits, cache = decoder_forward(runner, ids[:, first:stop], np.ones((1, stop), dtype=np.int64), cache, {},
                                        every_position=True)
        yield logits[0]


DECODING = register_decoding(LayoutDecoding(CONCAT, ConcatCache(), ConcatRows, ConcatRelayout(), score))
