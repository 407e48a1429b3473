"""Layout "inplace": the decoder graph bound to its preallocated KV buffers (``InplaceDecoder``),
which the layout's strategies (``inplace``) run.

Each layer's key and value buffer [B, Hkv, M, D] is bound as both ``past_key_values.*`` and
``present.*``, so the kernel writes the new tokens' keys and values into their slots. A runner
keeps the last decoder handed back (``keep``) for the next request of its batch size that fits
(``lease``), with the earlier request's keys and values still in slots it never reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnxruntime as ort

from tfport.contract import LAST_LOGITS
from tfport.dtypes import NUMPY_DTYPES

from ..binding import PAST, PRESENT, GraphRunner, choose_session

KEPT = "inplace"  # GraphRunner.kept key of the idle decoder


def logits_layout(runner: GraphRunner) -> tuple[int, type]:
    """(vocabulary size V, numpy dtype) of the decoder's logits output."""
    logits = next(t for t in runner.spec.outputs if t.name == "logits")
    return logits.shape[-1], NUMPY_DTYPES[logits.dtype]


def require_finite(logits: np.ndarray) -> np.ndarray:
    """``logits`` if all finite; ``RuntimeError`` otherwise (a prefill's check: a decode step's
    logits are checked where its tokens are picked, ``sampling.next_token``)."""
    if not np.isfinite(logits).all():
        raise RuntimeError("the decoder produced non-finite logits; the export or its dtype may be broken")
    return logits


class InplaceDecoder:
    """The decoder graph with its KV buffers [B, Hkv, slots, D] bound once, as past and present.

    A call binds ``input_ids``, ``seqlens_k``, ``total_sequence_length``, ``last_logits`` and a
    fresh host array for the logits, runs, and returns that array: the per-call host work does
    not depend on the number of layers (the binding's other outputs are never read back).
    ``step`` is the decode step's faster path: its inputs and logits live in host arrays bound
    once.
    """

    def __init__(self, runner: GraphRunner, batch: int, slots: int):
        # The sessions, not the runner, which keeps this decoder (no cycle); a run of at least
        # ``batch_rows`` rows goes to the batch export's session (GraphRunner.session_for).
        self.session, self.batch_session, self.batch_rows = runner.session, runner.batch_session, runner.batch_rows
        self.runs = runner.runs  # the runner's counts, by export (a dict: no reference to the runner)
        self.batch, self.slots = batch, slots
        self.vocab, self.logits_dtype = logits_layout(runner)
        self.cache: dict[str, ort.OrtValue] = {}
        # On the CPU the buffers are these host arrays (an OrtValue over a numpy array shares
        # its memory there): a cached prefix is copied in, a finished request's blocks read out.
        self.host: dict[str, np.ndarray] | None = {} if runner.device == "cpu" else None
        self._step: StepFeeds | None = None  # made by the first ``step``
        # Per session: its binding of the buffers, and whether it holds the step feeds (a call rebinds).
        self._bindings: dict[int, tuple[ort.IOBinding, bool]] = {}
        for spec in runner.spec.inputs:
            if spec.name.startswith(PAST):
                _, heads, _, dim = spec.shape
                zeros = np.zeros((batch, heads, slots, dim), dtype=NUMPY_DTYPES[spec.dtype])
                buffer = ort.OrtValue.ortvalue_from_numpy(zeros, runner.device, runner.device_id)
                self.cache[spec.name] = buffer
                if self.host is not None:
                    self.host[spec.name] = zeros

    def _binding(self, rows: int) -> tuple[ort.InferenceSession, ort.IOBinding]:
        """(the session a run of ``rows`` rows goes to, counted in the runner's ``runs``, its
        binding with the buffers bound as past and present)."""
        session = choose_session(self.session, self.batch_session, self.batch_rows, rows, self.runs)
        if id(session) not in self._bindings:
            binding = session.io_binding()
            bind_cache(binding, self.cache)
            self._bindings[id(session)] = (binding, False)
        return session, self._bindings[id(session)][0]

    def __call__(self, input_ids: np.ndarray, seqlens_k: np.ndarray, row: int | None = None,
                 every_position: bool = False) -> np.ndarray:
        """input_ids [B, S] (right-padded), seqlens_k [B] -> logits float32 [B, 1, V] of each
        row's last new token (the head runs on it alone), or [B, S, V] with ``every_position``;
        the array is the caller's (a new one each call). ``row``: run the B rows from that one
        alone on their slice of the buffers (the CPU's host arrays), the others untouched.

        ``seqlens_k[b]`` is the index of row b's last real token counting its cache: a prefill passes
        each prompt's length - 1 (its padded slots are ignored), a decode step the cached length.
        The new keys/values are written in place into the row's slots after its cache.
        """
        batch = input_ids.shape[0]
        assert seqlens_k.max() < self.slots, (seqlens_k, self.slots)
        if row is None:
            assert batch == self.batch, (input_ids.shape, self.batch)
            session, binding = self._binding(input_ids.size)
            self._bindings[id(session)] = (binding, False)
        else:
            assert self.host is not None and 0 <= row and row + batch <= self.batch, (input_ids.shape, row)
            session = choose_session(self.session, self.batch_session, self.batch_rows, input_ids.size, self.runs)
            binding = session.io_binding()
            views = row_views(self.host, row, row + batch)  # alive until the run is over
            bind_cache(binding, views)
        return require_finite(run_tokens(session, binding, input_ids, seqlens_k, every_position,
                                         self.vocab, self.logits_dtype))

    def step(self, tokens: np.ndarray, seqlens_k: np.ndarray, total_sequence_length: int) -> np.ndarray:
        """One new token per row: tokens int64 [B], seqlens_k [B] (each row's cached length),
        ``total_sequence_length`` = max(seqlens_k) + 1 -> logits [B, V], a view of this decoder's
        step buffer, valid until the next ``step``.

        A step writes its B + 1 numbers into host arrays bound once and runs. After each run the
        CPU caches are cold (the weights streamed through them): each numpy or binding call
        between two runs measured ~50 us of CPU on the 2-core VM, so the fewer the better: the
        logits are not checked here but by ``sampling.next_token``, which every caller picks
        the step's tokens with (NaN raises there).
        """
        feeds = self._step
        if feeds is None:
            feeds = self._step = StepFeeds(self.batch, self.vocab, self.logits_dtype)
        session, binding = self._binding(self.batch)
        if not self._bindings[id(session)][1]:
            feeds.bind(binding)
            self._bindings[id(session)] = (binding, True)
        feeds.input_ids[:, 0] = tokens
        feeds.seqlens_k[:] = seqlens_k
        feeds.total_sequence_length[()] = total_sequence_length
        session.run_with_iobinding(binding)
        return feeds.logits[:, 0]  # [B, V]; NaN is refused where a token is picked (sampling.check_logits)


def run_tokens(session: ort.InferenceSession, binding: ort.IOBinding, input_ids: np.ndarray,
               seqlens_k: np.ndarray, every_position: bool, vocab: int, logits_dtype: type) -> np.ndarray:
    """Bind one run's new tokens (input_ids [B, S], seqlens_k [B], ``total_sequence_length``,
    ``last_logits``) and a fresh logits array on ``binding`` (its KV buffers bound already), run
    -> that array, [B, 1, V] of each row's last new token or [B, S, V] ``every_position``."""
    binding.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
    binding.bind_cpu_input("seqlens_k", seqlens_k.astype(np.int32))
    binding.bind_cpu_input("total_sequence_length", np.array(seqlens_k.max() + 1, dtype=np.int32))
    binding.bind_cpu_input(LAST_LOGITS, np.array(not every_position))
    logits = np.empty((input_ids.shape[0], input_ids.shape[1] if every_position else 1, vocab), dtype=logits_dtype)
    binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
    session.run_with_iobinding(binding)
    return logits


class StepFeeds:
    """A decode step's host arrays (input_ids [B, 1], seqlens_k [B], total_sequence_length,
    last_logits, logits [B, 1, V]) and the OrtValues over them (shared memory: writing an array
    feeds the next run)."""

    def __init__(self, batch: int, vocab: int, logits_dtype: np.dtype):
        self.input_ids = np.zeros((batch, 1), dtype=np.int64)
        self.seqlens_k = np.zeros(batch, dtype=np.int32)
        self.total_sequence_length = np.zeros((), dtype=np.int32)
        self.last_logits = np.ones((), dtype=bool)
        self.logits = np.zeros((batch, 1, vocab), dtype=logits_dtype)
        self.values = {name: ort.OrtValue.ortvalue_from_numpy(getattr(self, name))
                       for name in ("input_ids", "seqlens_k", "total_sequence_length", LAST_LOGITS, "logits")}

    def bind(self, binding: ort.IOBinding) -> None:
        for name, value in self.values.items():
            if name == "logits":
                binding.bind_ortvalue_output(name, value)
            else:
                binding.bind_ortvalue_input(name, value)


def row_views(buffers: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, ort.OrtValue]:
    """OrtValues over rows [start:stop] of each host KV buffer [B, Hkv, slots, D] (views: on the
    CPU a run writes the buffers themselves)."""
    return {name: ort.OrtValue.ortvalue_from_numpy(buffer[start:stop]) for name, buffer in buffers.items()}


def bind_cache(binding: ort.IOBinding, buffers: Mapping[str, ort.OrtValue]) -> None:
    """Bind each KV buffer (name: its ``past_key_values.*`` input) as its layer's past and as
    its present, so the run writes the new keys and values in place."""
    for name, value in buffers.items():
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(PRESENT + name[len(PAST):], value)


def lease(runner: GraphRunner, batch: int, slots: int) -> InplaceDecoder:
    """The runner's idle decoder if it has ``batch`` rows and at least ``slots`` slots, else a new
    one (the idle one, too small, is dropped). Hand it back with ``keep``."""
    idle = runner.kept.pop(KEPT, None)
    if idle is not None and idle.batch == batch and idle.slots >= slots:
        return idle
    return InplaceDecoder(runner, batch, slots)


def keep(runner: GraphRunner, decoder: InplaceDecoder) -> None:
    """Keep ``decoder`` as the runner's idle one (one at most: the last handed back)."""
    runner.kept[KEPT] = decoder

