"""Layout "inplace": one preallocated KV buffer per layer, updated in place (target "ort").

Each layer's key and value buffer [B, Hkv, M, D] (M >= longest prompt + max_new_tokens) lives on
the session's device and is bound as both ``past_key_values.*`` and ``present.*``: the kernel
writes the new tokens' keys and values into their slots, so a step costs the same at any context
length and nothing is copied between steps. Prompts are right-padded; ``seqlens_k`` [B] holds the
index of each row's last token and ``total_sequence_length`` the longest row's length.

The buffers and their binding outlive a request: when it ends, its ``InplaceDecoder`` is kept on
the runner and the next request of the same batch size that fits in its M slots reuses it,
instead of allocating and zeroing B * layers * 2 * Hkv * M * D values again (on the 2-core VM,
0.7 ms for SmolLM2-135M at M = 81, 19 ms at M = 2048). The slots a request has not written hold
an earlier request's keys and values; the kernel never reads them (row b attends to its first
``seqlens_k[b] + 1`` slots only, all written by this request).

This module is the layout's runtime side as the registry sees it: the fixed-batch strategy
(``InplaceBuffer``), the row batch for serving (``InplaceRows``), the parity relayout
(``InplaceRelayout``) and ``score``; the graph bound to its buffers, which they all run, is
``inplace_binding``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import onnxruntime as ort

from tfport.contract import INPLACE, LAST_LOGITS
from tfport.dtypes import NUMPY_DTYPES

from ..binding import PAST, PRESENT, Feed, GraphRunner
from ..inputs import pad_batch
from .inplace_binding import (InplaceDecoder, StepFeeds, bind_cache, keep, lease, logits_layout, require_finite,
                              row_views, run_tokens)
from .layout import LayoutDecoding, prefill_pieces, register_decoding, row_groups
from .prefix import NO_PREFIX, Prefix, PrefixCache, cache_chunk, cached_start
from .rows import Row, check_chunks, check_prompt, check_rewind, check_step

INITIAL_SLOTS = 256  # KV slots per row before InplaceRows grows them (doubling)


class InplaceBuffer:
    """Right-padded prompts; ``seqlens_k`` says where each row's tokens go in its buffer.

    With a ``prefix`` cache, a single prompt on the CPU starts from its longest cached prefix
    (``decoding.prefix``), and its prompt and fed tokens are kept when the request ends."""

    def start(self, runner: GraphRunner, rows: Sequence[np.ndarray], max_new_tokens: int,
              pad_token_id: int, static: Mapping[str, Feed], prefix: PrefixCache | None = None):
        assert not static, "the inplace layout is decoder-only: no cross-attention inputs"
        ids, mask = pad_batch(rows, pad_token_id, "right")  # [B, S]
        lengths = mask.sum(axis=1)  # real prompt tokens per row
        batch = len(rows)
        decoder = lease(runner, batch, ids.shape[1] + max_new_tokens)
        cached = prefix is not None and batch == 1 and decoder.host is not None
        start = cached_start(prefix, rows[0]) if cached else NO_PREFIX
        if start.length:
            start.copy_into({name: value[0] for name, value in decoder.host.items()})
        if batch == 1 or (decoder.host is not None and len(prefill_pieces(0, int(lengths.max()))) > 1):
            # each row alone, in pieces on top of its cache (the CPU kernel takes several new
            # tokens over a cache at batch 1 only): each piece's last token is a real one
            last_logits = []
            for b in range(batch):
                for first, stop in prefill_pieces(start.length, int(lengths[b])):
                    piece = decoder(ids[b:b + 1, first:stop], np.array([stop - 1]), None if batch == 1 else b)
                last_logits.append(piece[0, -1])
            logits = np.stack(last_logits)  # [B, V]
        elif decoder.host is not None:
            # groups of rows of at most a piece's tokens on their slice of the buffers
            logits = np.concatenate([decoder(ids[a:b, :lengths[a:b].max()], lengths[a:b] - 1, a)[:, 0]
                                     for a, b in row_groups(lengths.tolist())])
        else:
            logits = decoder(ids, lengths - 1)[:, 0]

        top = int(lengths.max())
        fed = [int(t) for t in rows[0]] if cached else None  # the tokens in the cache

        def advance(token: np.ndarray, step: int) -> np.ndarray:
            # Step k's token is row b's token number lengths[b] + k: seqlens_k = its index.
            if fed is not None:
                fed.append(int(token[0]))
            return decoder.step(token, lengths + step, top + step + 1)

        # The request is over when advance goes: its blocks are kept, then its buffers.
        weakref.finalize(advance, _hand_back, runner, decoder, prefix if cached else None, fed)
        return logits, advance


def _hand_back(runner: GraphRunner, decoder: InplaceDecoder, prefix: PrefixCache | None,
               fed: list[int] | None) -> None:
    if prefix is not None:
        prefix.insert(fed, {name: value[0] for name, value in decoder.host.items()})
    keep(runner, decoder)


class InplaceRows:
    """Layout "inplace": one KV buffer per layer [capacity, Hkv, max_length, D], rows = its first
    axis, live rows packed at the front so a step runs on the slice [:n] of every buffer.

    On the CPU, OrtValues over numpy slices share their memory, so the kernel writes each row's
    new keys/values in place and a slice's binding is made once per batch size. A prompt is
    prefilled alone on its row's slice (the CPU GroupQueryAttention kernel takes several new
    tokens on top of a cache only at batch 1), from its longest cached prefix with a ``prefix``
    cache. Removing a row moves the last row into its place.
    """

    def __init__(self, runner: GraphRunner, capacity: int, max_length: int, pad_token_id: int = 0,
                 prefix: PrefixCache | None = None):
        if runner.device != "cpu":
            raise ValueError(f"InplaceRows: device {runner.device!r} is not supported; row "
                             "slices share host memory, which needs the CPU provider")
        self.runner = runner
        self.prefix = prefix
        self.capacity = int(capacity)
        self.max_length = int(max_length)
        self.rows: list[Row] = []
        # Slots per row grow with the longest row (``_reserve``) up to max_length: ONNX Runtime's
        # CPU GroupQueryAttention works over the whole buffer it is given, so a server sized to
        # an 8k context paid for 8k slots per row at every step (SmolLM2 int4, 16 clients: 68
        # tokens/s with 8,192 slots, 207 with 128).
        self.slots = min(self.max_length, INITIAL_SLOTS)
        self.buffers: dict[str, np.ndarray] = {}
        for spec in runner.spec.inputs:
            if spec.name.startswith(PAST):
                _, heads, _, dim = spec.shape
                self.buffers[spec.name] = np.zeros((self.capacity, heads, self.slots, dim),
                                                   dtype=NUMPY_DTYPES[spec.dtype])
        self._bindings: dict[tuple[int, int, bool], tuple[ort.IOBinding, dict[str, ort.OrtValue]]] = {}
        self.vocab, self.logits_dtype = logits_layout(runner)
        # A step's host feeds per row count, bound once (InplaceDecoder.step's fast path); the
        # binding of the rows [0:n] (per session) holds them until a ``_run`` on it rebinds it.
        self._steps: dict[int, StepFeeds] = {}
        self._step_bound: set[tuple] = set()  # keys of ``_bindings``

    def _reserve(self, length: int) -> None:
        """At least ``length`` (<= max_length) slots per row: the buffers are reallocated with
        twice the slots (or ``length``), the live rows' caches copied, the bindings dropped."""
        if length <= self.slots:
            return
        slots = min(self.max_length, max(length, 2 * self.slots))
        for name, buffer in self.buffers.items():
            grown = np.zeros(buffer.shape[:2] + (slots,) + buffer.shape[3:], dtype=buffer.dtype)
            grown[:, :, :self.slots] = buffer
            self.buffers[name] = grown
        self.slots = slots
        self._bindings.clear()
        self._step_bound.clear()

    def _binding(self, start: int, stop: int, rows: int) -> tuple[ort.InferenceSession, ort.IOBinding, tuple]:
        """(the session a run of ``rows`` rows goes to, an IO binding of it with every buffer's
        rows [start:stop] bound as past and present, the binding's key)."""
        session = self.runner.session_for(rows)
        key = (start, stop, session is self.runner.session)
        if key not in self._bindings:
            binding = session.io_binding()
            values = row_views(self.buffers, start, stop)
            bind_cache(binding, values)
            self._bindings[key] = (binding, values)  # values: keep the views alive
        return session, self._bindings[key][0], key

    def _run(self, start: int, stop: int, input_ids: np.ndarray, seqlens_k: np.ndarray,
             every_position: bool = False) -> np.ndarray:
        """input_ids [n, S] on rows [start:stop], seqlens_k [n] -> logits [n, 1, V] of each row's
        last new token (or [n, S, V] ``every_position``), written by the run into a fresh host
        array bound as the output: the other outputs (the rows' caches, bound in place) are
        never read back."""
        session, binding, key = self._binding(start, stop, input_ids.size)
        self._step_bound.discard(key)
        return run_tokens(session, binding, input_ids, seqlens_k, every_position, self.vocab, self.logits_dtype)

    def add(self, prompt: np.ndarray) -> tuple[Row, np.ndarray]:
        prompt = check_prompt(self, prompt)
        index = len(self.rows)
        length = prompt.size
        self._reserve(length)
        logits = self._prefill(index, prompt, cached_start(self.prefix, prompt), length)
        row = Row(index, length, prompt.tolist())
        if self.prefix is not None:
            self.prefix.insert(row.tokens, self._row_cache(index))
        self.rows.append(row)
        return row, require_finite(logits[0, -1])

    def _prefill(self, index: int, prompt: np.ndarray, start: Prefix, stop: int) -> np.ndarray:
        """``prompt[start.length:stop]`` on top of ``start`` in row ``index``'s buffers -> its last
        token's logits [1, 1, V]."""
        start.copy_into(self._row_cache(index))
        for first, last in prefill_pieces(start.length, stop):
            logits = self._run(index, index + 1, prompt[None, first:last], np.array([last - 1]))
        return logits  # the last piece's

    def prefill_chunk(self, prompt: np.ndarray, budget: int) -> int:
        """On the first free row (``check_prompt``: there is one), left free."""
        if self.prefix is None:
            return 0
        prompt = check_prompt(self, prompt)
        index = len(self.rows)
        self._reserve(prompt.size)

        def prefill(start: Prefix, stop: int) -> dict[str, np.ndarray]:
            self._prefill(index, prompt, start, stop)
            return self._row_cache(index)

        return cache_chunk(self.prefix, prompt, budget, prefill)

    def _row_cache(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index``'s buffers: name -> [Hkv, slots, D] (views, valid until they grow)."""
        return {name: buffer[index] for name, buffer in self.buffers.items()}

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """One token per live row -> logits [n, V], a view of this batch's step buffer for n
        rows, valid until the next step with n rows (NaN is refused where tokens are picked)."""
        tokens = check_step(self, tokens)
        n = len(self.rows)
        lengths = [row.length for row in self.rows]  # each new token's index
        total = max(lengths, default=0) + 1
        self._reserve(total)
        feeds = self._steps.get(n)
        if feeds is None:
            feeds = self._steps[n] = StepFeeds(n, self.vocab, self.logits_dtype)
        session, binding, key = self._binding(0, n, n)
        if key not in self._step_bound:
            feeds.bind(binding)
            self._step_bound.add(key)
        feeds.input_ids[:, 0] = tokens
        feeds.seqlens_k[:] = lengths
        feeds.total_sequence_length[()] = total
        session.run_with_iobinding(binding)
        for row, token in zip(self.rows, tokens.tolist()):
            row.length += 1
            row.tokens.append(token)
        return feeds.logits[:, -1]

    def extend(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        """Each row's chunk on its own slice (the CPU kernel takes several new tokens on top of a
        cache only at batch 1); rows of one token each step together."""
        chunks = check_chunks(self, chunks)
        if all(c.size == 1 for c in chunks):
            return list(self.step(np.concatenate(chunks))[:, None])
        self._reserve(max(row.length + chunk.size for row, chunk in zip(self.rows, chunks)))
        out = []
        for row, chunk in zip(self.rows, chunks):
            index = row.index
            out.append(self._run(index, index + 1, chunk[None], np.array([row.length + chunk.size - 1]),
                                 every_position=True)[0])
            row.length += chunk.size
            row.tokens.extend(chunk.tolist())
        return out

    def rewind(self, row: Row, count: int) -> None:
        """The rewound slots are overwritten by the next tokens; the kernel never reads them."""
        check_rewind(row, count)
        row.length -= count
        del row.tokens[row.length:]

    def remove(self, row: Row) -> None:
        assert self.rows[row.index] is row, (row, self.rows)
        if self.prefix is not None:
            self.prefix.insert(row.tokens, self._row_cache(row.index))
        last = self.rows.pop()
        if last is not row:  # move the last row's cache into the freed place
            for buffer in self.buffers.values():
                buffer[row.index, :, :last.length] = buffer[last.index, :, :last.length]
            last.index = row.index
            self.rows[row.index] = last
        row.index = -1


class InplaceRelayout:
    """A parity case made in the ``concat`` layout, re-laid out as ONNX Runtime's
    GroupQueryAttention wants it. Each row's real tokens move to the front (right padding), its
    past to the front of a buffer of P + S + 3 slots whose spare slots hold large random values
    (they must be ignored), ``seqlens_k`` = each row's real P + S - 1. The CPU kernel takes
    several new tokens on top of a past only at batch 1, so such cases run with batch 1."""

    def batch_for(self, batch: int, past: int, new: int) -> int:
        return 1 if past and new > 1 else batch

    def __call__(self, feeds: dict[str, np.ndarray], past: int,
                 random_buffer: Callable[[int, int], np.ndarray]):
        """concat ``feeds`` (attention_mask [B, P+S], left- or right-padded) with ``past`` cached
        slots -> (feeds, buffers bound as past and present, to_reference_layout(name, value))."""
        mask = feeds["attention_mask"]
        batch, total = mask.shape
        real = mask.astype(bool)
        new_real = real[:, past:]
        new = new_real.shape[1]
        ids = np.zeros_like(feeds["input_ids"])
        for b in range(batch):
            ids[b, :new_real[b].sum()] = feeds["input_ids"][b][new_real[b]]
        laid = {"input_ids": ids, "seqlens_k": (real.sum(1) - 1).astype(np.int32),
                "total_sequence_length": np.array(real.sum(1).max(), dtype=np.int32),
                LAST_LOGITS: feeds[LAST_LOGITS]}
        buffers = {}
        for name, cached in feeds.items():
            if name.startswith(PAST):
                buffer = random_buffer(batch, total + 3)  # [B, Hkv, P+S+3, D]
                for b in range(batch):
                    n_past = real[b, :past].sum()
                    buffer[b][:, :n_past] = cached[b][:, real[b, :past]]
                buffers[name] = buffer

        def to_reference_layout(name: str, value: np.ndarray) -> np.ndarray:
            if not name.startswith(PRESENT) and value.shape[:2] == (batch, new):
                # logits and taps [B, S, ...]: row b's queries are at its real new slots
                out = np.zeros((batch, new) + value.shape[2:], dtype=value.dtype)
                for b in range(batch):
                    out[b, new_real[b]] = value[b, :new_real[b].sum()]
                return out
            if name.startswith(PRESENT):  # [B, Hkv, M, D] -> [B, Hkv, P+S, D]
                out = np.zeros(value.shape[:2] + (total,) + value.shape[3:], dtype=value.dtype)
                for b in range(batch):
                    out[b][:, real[b]] = value[b][:, :real[b].sum()]
                return out
            return value

        return laid, buffers, to_reference_layout


def score(runner: GraphRunner, ids: np.ndarray) -> Iterator[np.ndarray]:
    """Every position's logits of one sequence ``ids`` int64 [1, S], as the logits [s, V] of its
    consecutive pieces of at most ``PREFILL_PIECE`` tokens, each run on top of the cache of those
    before: a long text holds one piece's activations and logits."""
    decoder = InplaceDecoder(runner, 1, ids.shape[1])
    for first, stop in prefill_pieces(0, ids.shape[1]):
        yield decoder(ids[:, first:stop], np.array([stop - 1]), every_position=True)[0]


DECODING = register_decoding(LayoutDecoding(INPLACE, InplaceBuffer(), InplaceRows, InplaceRelayout(), score))
