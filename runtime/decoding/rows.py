"""Decoding with rows that come and go: the per-row interface continuous batching needs.

``decoding.STRATEGIES`` run one fixed batch from prefill to the end. A server instead keeps a
running batch whose rows are independent requests at different positions: a new request is
prefilled into a free row at a step boundary, every step advances all live rows by one token,
and a finished row is released at once. One ``RowBatch`` per cache layout:

    batch = row_batch_for(layout)(runner, capacity=16, max_length=512, pad_token_id=0)
    row, logits = batch.add(prompt)        # prompt int64 [S] -> its last logits [V]
    logits = batch.step(tokens)            # tokens int64 [n] for batch.rows, in order -> [n, V]
    batch.remove(row)                      # frees the row; the others keep their state

A row's tokens do not depend on its neighbours: each prompt is prefilled alone (batch 1), and a
decode step sees only the row's own cache (masked padding or its own ``seqlens_k``).
Decoder-only exports; seq2seq (cross-attention inputs per row) is not batched here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import onnxruntime as ort

from tfport.dtypes import NUMPY_DTYPES

from ..binding import PAST, PRESENT, GraphRunner, empty_cache, self_cache_inputs
from .concat import decoder_forward
from .inplace import logits_layout, require_finite


@dataclass(eq=False)
class Row:
    """One live sequence of a ``RowBatch``: ``index`` is its position in ``batch.rows`` (it moves
    down when an earlier row leaves), ``length`` the tokens in its cache."""

    index: int
    length: int
    # concat layout: the prompt's cache until it is merged into the batch, name -> [1, Hkv, S, D]
    pending: dict[str, np.ndarray] | None = field(default=None, repr=False)


class RowBatch(Protocol):
    rows: list[Row]
    capacity: int
    max_length: int

    def add(self, prompt: np.ndarray) -> tuple[Row, np.ndarray]:
        """Prefill ``prompt`` int64 [S] into a free row -> (the row, last logits float32 [V])."""
        ...

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per live row (int64 [n], ordered as ``rows``) -> logits [n, V]."""
        ...

    def remove(self, row: Row) -> None:
        """Release ``row``; the other rows keep their caches."""
        ...


def _check_prompt(batch: RowBatch, prompt: np.ndarray) -> np.ndarray:
    prompt = np.asarray(prompt, dtype=np.int64)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt: expected a non-empty int64 [S], got shape {prompt.shape}")
    if prompt.size > batch.max_length:
        raise ValueError(f"prompt: {prompt.size} tokens, more than max_length={batch.max_length}")
    if len(batch.rows) >= batch.capacity:
        raise RuntimeError(f"no free row: all {batch.capacity} are live")
    return prompt


def _check_step(batch: RowBatch, tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.shape != (len(batch.rows),):
        raise ValueError(f"tokens: expected [{len(batch.rows)}] (one per live row), got "
                         f"{tokens.shape}")
    full = [row.index for row in batch.rows if row.length >= batch.max_length]
    if full:
        raise ValueError(f"rows {full} already hold max_length={batch.max_length} tokens")
    return tokens


class InplaceRows:
    """Layout "inplace": one KV buffer per layer [capacity, Hkv, max_length, D], rows = its first
    axis, live rows packed at the front so a step runs on the slice [:n] of every buffer.

    On the CPU, OrtValues over numpy slices share their memory, so the kernel writes each row's
    new keys/values in place and a slice's binding is made once per batch size. A prompt is
    prefilled alone on its row's slice (the CPU GroupQueryAttention kernel takes several new
    tokens on top of a cache only at batch 1). Removing a row moves the last row into its place.
    """

    def __init__(self, runner: GraphRunner, capacity: int, max_length: int, pad_token_id: int = 0):
        if runner.device != "cpu":
            raise ValueError(f"InplaceRows: device {runner.device!r} is not supported; row "
                             "slices share host memory, which needs the CPU provider")
        self.runner = runner
        self.capacity = int(capacity)
        self.max_length = int(max_length)
        self.rows: list[Row] = []
        self.buffers: dict[str, np.ndarray] = {}
        for spec in runner.spec.inputs:
            if spec.name.startswith(PAST):
                _, heads, _, dim = spec.shape
                self.buffers[spec.name] = np.zeros((self.capacity, heads, self.max_length, dim),
                                                   dtype=NUMPY_DTYPES[spec.dtype])
        self._bindings: dict[tuple[int, int], tuple[ort.IOBinding, list[ort.OrtValue]]] = {}
        self.rows_out, self.vocab, self.logits_dtype = logits_layout(runner)

    def _binding(self, start: int, stop: int) -> ort.IOBinding:
        """An IO binding with every buffer's rows [start:stop] bound as past and present."""
        key = (start, stop)
        if key not in self._bindings:
            binding = self.runner.session.io_binding()
            values = []
            for name, buffer in self.buffers.items():
                value = ort.OrtValue.ortvalue_from_numpy(buffer[start:stop])  # a view, no copy
                values.append(value)
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(PRESENT + name[len(PAST):], value)
            self._bindings[key] = (binding, values)  # values: keep the views alive
        return self._bindings[key][0]

    def _run(self, start: int, stop: int, input_ids: np.ndarray, seqlens_k: np.ndarray) -> np.ndarray:
        """input_ids [n, S] on rows [start:stop], seqlens_k [n] -> logits [n, S, V] (or [n, 1, V]
        from an export with ``logits="last"``), written by the run into a fresh host array bound
        as the output: the other outputs (the rows' caches, bound in place) are never read back."""
        binding = self._binding(start, stop)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", seqlens_k.astype(np.int32))
        binding.bind_cpu_input("total_sequence_length",
                               np.array(seqlens_k.max() + 1, dtype=np.int32))
        logits = np.empty((stop - start, self.rows_out or input_ids.shape[1], self.vocab), self.logits_dtype)
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        self.runner.session.run_with_iobinding(binding)
        return logits

    def add(self, prompt: np.ndarray) -> tuple[Row, np.ndarray]:
        prompt = _check_prompt(self, prompt)
        index = len(self.rows)
        length = prompt.size
        logits = require_finite(self._run(index, index + 1, prompt[None], np.array([length - 1]))[0, -1])
        row = Row(index, length)
        self.rows.append(row)
        return row, logits

    def step(self, tokens: np.ndarray) -> np.ndarray:
        tokens = _check_step(self, tokens)
        n = len(self.rows)
        lengths = np.array([row.length for row in self.rows])
        logits = self._run(0, n, tokens[:, None], lengths)[:, -1]  # new token's index = length
        for row in self.rows:
            row.length += 1
        return logits

    def remove(self, row: Row) -> None:
        assert self.rows[row.index] is row, (row, self.rows)
        last = self.rows.pop()
        if last is not row:  # move the last row's cache into the freed place
            for buffer in self.buffers.values():
                buffer[row.index, :, :last.length] = buffer[last.index, :, :last.length]
            last.index = row.index
            self.rows[row.index] = last
        row.index = -1


class ConcatRows:
    """Layout "concat": the live rows as one left-padded batch (cache [n, Hkv, P, D] with an
    attention mask [n, P]) that steps like ``ConcatCache``; when rows join or leave, the batch is
    rebuilt on the host with the common padding stripped.

    A prompt is prefilled alone (batch 1) and joins the batch at the next step.
    """

    def __init__(self, runner: GraphRunner, capacity: int, max_length: int, pad_token_id: int = 0):
        self.runner = runner
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
        prompt = _check_prompt(self, prompt)
        ids = prompt[None]
        mask = np.ones_like(ids)
        logits, cache = decoder_forward(self.runner, ids, mask, empty_cache(self.runner.spec, 1), {})
        row = Row(len(self.rows), prompt.size, {n: v.numpy() for n, v in cache.items()})
        self.rows.append(row)
        return row, logits[0]

    def remove(self, row: Row) -> None:
        assert self.rows[row.index] is row, (row, self.rows)
        del self.rows[row.index]
        for index, other in enumerate(self.rows):
            other.index = index
        row.index = -1

    def _rebuild(self) -> None:
        """Lay the live rows out as one left-padded batch (only when membership changed)."""
        old = {id(row): b for b, row in enumerate(self._members)}
        host = {name: np.asarray(value.numpy() if isinstance(value, ort.OrtValue) else value)
                for name, value in self.cache.items()}
        width = max(row.length for row in self.rows)
        n = len(self.rows)
        mask = np.zeros((n, width), dtype=np.int64)
        cache = {}
        for name in self.names:
            spec = self.runner.spec.input(name)
            _, heads, _, dim = spec.shape
            cache[name] = np.zeros((n, heads, width, dim), dtype=NUMPY_DTYPES[spec.dtype])
        for b, row in enumerate(self.rows):
            mask[b, width - row.length:] = 1
            for name in self.names:
                if row.pending is not None:
                    source = row.pending[name][0]  # [Hkv, S, D]
                else:  # the row's real tokens are the last `length` columns of its old slot
                    source = host[name][old[id(row)], :, host[name].shape[2] - row.length:]
                cache[name][b, :, width - row.length:] = source
            row.pending = None
        self.cache, self.mask, self._members = cache, mask, list(self.rows)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        tokens = _check_step(self, tokens)
        if self._members != self.rows:
            self._rebuild()
        ones = np.ones((len(self.rows), 1), dtype=np.int64)
        self.mask = np.concatenate([self.mask, ones], axis=1)  # [n, P+1]
        logits, self.cache = decoder_forward(self.runner, tokens[:, None], self.mask, self.cache, {})
        for row in self.rows:
            row.length += 1
        return logits


ROW_BATCHES: dict[str, Callable[..., RowBatch]] = {"concat": ConcatRows, "inplace": InplaceRows}


def row_batch_for(layout: str) -> Callable[..., RowBatch]:
    """The ``RowBatch`` class of a cache layout (``Manifest.layout``)."""
    if layout not in ROW_BATCHES:
        raise ValueError(f"layout={layout!r}: rows are batched for {sorted(ROW_BATCHES)}")
    return ROW_BATCHES[layout]
