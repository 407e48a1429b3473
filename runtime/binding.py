"""Running a graph through IO binding, and the KV cache it keeps on the session's device.

Outputs the next step feeds back (``present.*``, cross-attention K/V) are bound to the session's
device and returned as ``OrtValue``s, which are bound again as the next step's
``past_key_values.*`` inputs: on CUDA the cache never leaves the GPU. Outputs the host reads
(``logits``, hidden states) are bound to the CPU. The same code runs on the CPU provider.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Union

import numpy as np
import onnxruntime as ort

from tfport.contract import GraphSpec
from tfport.dtypes import NUMPY_DTYPES

from .session import device_of

PAST = "past_key_values."
PRESENT = "present."

# A graph input: a host array (copied to the device by ONNX Runtime) or an OrtValue already there.
Feed = Union[np.ndarray, ort.OrtValue]
# Cache: input name ``past_key_values.*`` -> OrtValue [B, Hkv, P, D] on the session's device.
KVCache = dict[str, ort.OrtValue]


def past_name(present: str) -> str:
    """``present.0.key`` -> ``past_key_values.0.key`` (the input that takes it next step)."""
    assert present.startswith(PRESENT), present
    return PAST + present[len(PRESENT):]


def self_cache_inputs(spec: GraphSpec) -> list[str]:
    """The decoder's self-attention cache inputs (not the seq2seq cross-attention ones)."""
    return [t.name for t in spec.inputs if t.name.startswith(PAST) and ".encoder." not in t.name]


def empty_cache(spec: GraphSpec, batch: int, length: int = 0) -> dict[str, np.ndarray]:
    """Zeros for each self-attention cache input [B, Hkv, length, D]: with ``length`` 0 the past
    of a prefill, else a cache to fill."""
    cache = {}
    for name in self_cache_inputs(spec):
        tensor = spec.input(name)
        _, heads, _, dim = tensor.shape
        cache[name] = np.zeros((batch, heads, length, dim), dtype=NUMPY_DTYPES[tensor.dtype])
    return cache


class GraphRunner:
    """One session, its contract and its device; ``run`` binds inputs and outputs and runs."""

    def __init__(self, session: ort.InferenceSession, spec: GraphSpec, device_id: int = 0):
        self.session = session
        self.spec = spec
        self.device = device_of(session)
        self.device_id = device_id if self.device != "cpu" else 0
        # What a decode strategy keeps between requests on this session, by the strategy's key
        # (decoding.inplace: the idle KV buffers and their binding).
        self.kept: dict[str, object] = {}
        # Another export's session of this graph (same inputs and outputs) for runs of at least
        # ``batch_rows`` rows: ``Model.load(batch_export=...)``, batch_export.attach_batch_export.
        self.batch_session: ort.InferenceSession | None = None
        self.batch_rows = 0
        self.runs = {"own": 0, "batch": 0}  # runs ``session_for`` sent to each (tfport serve's /metrics)

    def session_for(self, rows: int) -> ort.InferenceSession:
        """The session a run of ``rows`` rows (batch x new tokens) goes to (``choose_session``),
        counted in ``runs``."""
        return choose_session(self.session, self.batch_session, self.batch_rows, rows, self.runs)

    @property
    def input_names(self) -> set[str]:
        return {t.name for t in self.spec.inputs}

    def run(self, feeds: Mapping[str, Feed], device_outputs: Iterable[str] = (),
            host_outputs: Iterable[str] = ()) -> dict[str, ort.OrtValue]:
        """Run once: ``device_outputs`` stay on the session's device, ``host_outputs`` come to
        the CPU (read them with ``.numpy()``). Returns output name -> OrtValue."""
        session = self.session_for(_rows(feeds.get("input_ids")))
        binding = session.io_binding()
        arrays = []  # keep host arrays alive until the run has copied them
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                array = np.ascontiguousarray(value)
                arrays.append(array)
                binding.bind_cpu_input(name, array)
        names = []
        for name in device_outputs:
            binding.bind_output(name, self.device, self.device_id)
            names.append(name)
        for name in host_outputs:
            binding.bind_output(name, "cpu")
            names.append(name)
        binding.synchronize_inputs()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return dict(zip(names, binding.get_outputs()))


def choose_session(session: ort.InferenceSession, batch_session: ort.InferenceSession | None, batch_rows: int,
                   rows: int, runs: dict[str, int]) -> ort.InferenceSession:
    """The batch export's session for a run of ``batch_rows`` rows or more, else the export's own;
    the run counted in ``runs`` ("own" or "batch")."""
    batch = batch_session is not None and rows >= batch_rows
    runs["batch" if batch else "own"] += 1
    return batch_session if batch else session


def _rows(ids: Feed | None) -> int:
    """Rows of a run: the number of ``input_ids`` (0 without them)."""
    if ids is None:
        return 0
    return int(np.prod(ids.shape() if isinstance(ids, ort.OrtValue) else np.shape(ids)))
