"""ONNX Runtime sessions: execution providers, session options and loading checks.

A session reports the providers it really got (``session.get_providers()``). Asking for ``cuda``
when CUDA cannot be used raises ``RuntimeError`` instead of quietly running on the CPU;
``auto`` tries CUDA and logs what it chose. Loading errors (truncated graph, missing
external-data file) are re-raised as ``ValueError`` naming the file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort

from tfport.config.checks import is_int
from tfport.contract import (ACTIVATION_KEY, ACTIVATIONS, EXTERNAL_SUFFIX, MATMULNBITS_ACCURACY, QDQ_ACCURACY_CONFIG,
                             GraphSpec)

from .residency import release_weight_pages
from .threads import share_pool, shared_pool, thread_policy

logger = logging.getLogger(__name__)

PROVIDERS = ("cpu", "cuda", "auto")
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
GRAPH_OPTIMIZATIONS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# contract dtype -> the type string ONNX Runtime reports for a graph input or output.
ORT_TYPES = {"int64": "tensor(int64)", "int32": "tensor(int32)", "float32": "tensor(float)",
             "float16": "tensor(float16)", "bool": "tensor(bool)"}


THREADS_PER_CPU = 8  # more threads than this per CPU only slows session creation (minutes at 2048/CPU)
MAX_DEVICE_ID = 2**31 - 1  # ONNX Runtime's int


def max_threads() -> int:
    """The most intra/inter-op threads ``SessionSettings`` accepts on this machine."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


@dataclass(frozen=True)
class SessionSettings:
    """How to open the graphs of an export.

    ``provider`` is ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA if it works, else CPU);
    ``intra_op_threads`` 0 takes tfport's measured default (``threads.thread_policy``: one per
    usable CPU, the pool spinning); ``inter_op_threads`` 0 leaves
    ONNX Runtime's default;
    ``graph_optimization`` is one of ``GRAPH_OPTIMIZATIONS``; ``shared_threads`` runs the
    sessions on one process-wide pool (``threads.share_pool``) instead of a pool each: for
    sessions that take turns, such as a speculative target and its draft.
    """

    provider: str = "cpu"
    device_id: int = 0
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    graph_optimization: str = "all"
    shared_threads: bool = False

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider={self.provider!r}: expected one of {list(PROVIDERS)}")
        if self.graph_optimization not in GRAPH_OPTIMIZATIONS:
            raise ValueError(f"graph_optimization={self.graph_optimization!r}: expected one of "
                             f"{list(GRAPH_OPTIMIZATIONS)}")
        for name in ("device_id", "intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name}={value!r}: expected a non-negative integer")
        if not isinstance(self.shared_threads, bool):
            raise ValueError(f"shared_threads={self.shared_threads!r}: expected True or False")
        if self.device_id > MAX_DEVICE_ID:
            raise ValueError(f"device_id={self.device_id!r}: expected at most {MAX_DEVICE_ID}")
        limit = max_threads()
        for name in ("intra_op_threads", "inter_op_threads"):
            if getattr(self, name) > limit:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected 0 (ONNX Runtime's "
                                 f"choice) to {limit} ({THREADS_PER_CPU} per CPU of this machine); "
                                 "each thread is created when the session opens")

    def session_options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.graph_optimization_level = GRAPH_OPTIMIZATIONS[self.graph_optimization]
        # intra_op_threads 0: one per usable CPU, spinning (threads.py)
        policy = thread_policy(self.intra_op_threads)
        if self.shared_threads or shared_pool() is not None:  # once made, every session uses it
            if shared_pool() is None and not policy.allow_spinning:  # said once, when it is made
                logger.warning("TFPORT_SPIN=0 does not reach the shared pool: ONNX Runtime's "
                               "process-wide pool always spins")
            if shared_pool() is None or self.intra_op_threads:  # unpinned: joins the pool as it is
                share_pool(policy.intra_op_threads)
            options.use_per_session_threads = False
            logger.debug("session on the shared thread pool (%d threads)", shared_pool())
        else:
            options.intra_op_num_threads = policy.intra_op_threads
            for key, value in policy.config_entries().items():
                options.add_session_config_entry(key, value)
        if self.inter_op_threads:
            options.inter_op_num_threads = self.inter_op_threads
        return options

    def provider_list(self) -> list:
        """The ``providers`` argument of ``InferenceSession`` for this setting."""
        if self.provider == "cpu":
            return [CPU]
        return [(CUDA, {"device_id": self.device_id}), CPU]


def device_of(session: ort.InferenceSession) -> str:
    """``"cuda"`` if the session runs on CUDA, else ``"cpu"`` (where IO binding puts outputs)."""
    return "cuda" if session.get_providers()[0] == CUDA else "cpu"


def external_data_files(graph_file: Path) -> list[str]:
    """File names that ``graph_file`` stores tensors in (ONNX external data), read from its bytes.

    A small scan for the ``location`` entries of ``TensorProto.external_data`` (a protobuf
    ``StringStringEntryProto``: tag 0x0a, length 8, ``location``, tag 0x12, length, value), so
    the runtime can name a missing file without the ``onnx`` package.
    """
    data = graph_file.read_bytes()
    names = []
    for match in re.finditer(rb"\x0a\x08location\x12", data):
        start = match.end()
        length, shift, pos = 0, 0, start
        while pos < len(data):  # varint length
            byte = data[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            shift += 7
            if not byte & 0x80:
                break
        name = data[pos:pos + length].decode("utf-8", errors="replace")
        if name and name not in names:
            names.append(name)
    return names


def _load_error(path: Path, argument: str, err: Exception) -> ValueError:
    """A ``ValueError`` saying why ONNX Runtime could not load ``path``."""
    message = str(err)
    if "INVALID_PROTOBUF" in message or "Protobuf parsing failed" in message:
        return ValueError(f"{argument}: graph file {path.name!r} is truncated or not an ONNX "
                          f"model (protobuf parsing failed); re-export it")
    missing = [name for name in external_data_files(path) if not (path.parent / name).is_file()]
    if missing:
        return ValueError(f"{argument}: external-data file(s) {missing} of graph {path.name!r} "
                          f"are missing from {str(path.parent)!r}; copy them beside the graph")
    if "xternal" in message:  # "External data ...", "External initializer ... out of bounds"
        return ValueError(f"{argument}: the external-data file(s) {external_data_files(path)} of "
                          f"graph {path.name!r} could not be read in full (truncated?); re-export "
                          f"or copy them again ({message})")
    return ValueError(f"{argument}: ONNX Runtime could not load graph {path.name!r}: {message}")


def open_session(path: str | Path, spec: GraphSpec, settings: SessionSettings,
                 argument: str = "model_dir", config: Mapping[str, str] | None = None) -> ort.InferenceSession:
    """An ``InferenceSession`` of ``path`` on the providers ``settings`` asks for, with the
    session config entries ``config`` (what the export's manifest asks, ``export_config``).

    Raises ``ValueError`` (naming ``argument``) if the file cannot be loaded or does not match
    ``spec``, and ``RuntimeError`` if ``cuda`` was asked for but the session did not get it.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{argument}: graph file {path.name!r} is missing from "
                         f"{str(path.parent)!r}")
    available = ort.get_available_providers()
    if settings.provider == "cuda" and CUDA not in available:
        raise RuntimeError(f"provider='cuda': this onnxruntime build has no {CUDA} (available: "
                           f"{available}); install onnxruntime-gpu or use provider='cpu'")
    providers = settings.provider_list()
    if settings.provider == "auto" and CUDA not in available:
        providers = [CPU]
    options = settings.session_options()  # outside the try: a bad setting is not the file's fault
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as err:  # onnxruntime raises its own pybind exception types
        raise _load_error(path, argument, err) from None
    got = session.get_providers()
    if settings.provider == "cuda" and CUDA not in got:
        raise RuntimeError(
            f"provider='cuda': {CUDA} is listed as available but the session for {path.name!r} "
            f"could not use it (it got {got}; usually the CUDA or cuDNN libraries that "
            f"onnxruntime-gpu needs are missing, see onnxruntime's log above); refusing to fall "
            f"back to the CPU silently: use provider='cpu' or 'auto'")
    if settings.provider == "auto":
        chosen = "CUDA" if CUDA in got else "CPU"
        reason = "" if CUDA in got or CUDA not in available else " (CUDA listed but not usable)"
        logger.info("provider='auto': %s runs on %s%s; session providers %s",
                    path.name, chosen, reason, got)
    check_session(session, spec, path, argument)
    data = path.with_name(path.name + EXTERNAL_SUFFIX)  # the export's external weights
    if data.is_file():
        release_weight_pages(data)  # what packing read and no kernel reads again
    return session


def export_config(quantization: Mapping[str, Any] | None) -> dict[str, str]:
    """The session config entries an export's manifest ``quantization`` entry asks for: float
    activations (``tfport.contract.ACTIVATIONS``) set the accuracy level ONNX Runtime fuses a
    quantised DequantizeLinear + MatMul into MatMulNBits with (target "portable"; a MatMulNBits
    the export wrote carries its own, as every product of a "mixed" export does)."""
    activations = (quantization or {}).get(ACTIVATION_KEY, ACTIVATIONS[0])
    if activations not in ACTIVATIONS:
        raise ValueError(f"manifest quantization {ACTIVATION_KEY}={activations!r}: expected one of "
                         f"{list(ACTIVATIONS)}; re-export it")
    if activations != "float":
        return {}
    return {QDQ_ACCURACY_CONFIG: str(MATMULNBITS_ACCURACY[activations])}


def _unreadable(path: Path, argument: str, what: str, err: Exception) -> ValueError:
    return ValueError(f"{argument}: graph {path.name!r} has unreadable {what} ({err}); the file "
                      "is damaged, re-export it or copy it again")


def graph_metadata(session: ort.InferenceSession, file: str,
                   argument: str = "model_dir") -> dict[str, str]:
    """The graph's metadata props (``custom_metadata_map``); ``ValueError`` naming ``file`` if
    they cannot be decoded (a damaged file)."""
    try:
        return dict(session.get_modelmeta().custom_metadata_map)
    except UnicodeDecodeError as err:
        raise _unreadable(Path(file), argument, "metadata", err) from None


def _arguments(session: ort.InferenceSession, path: Path, argument: str
               ) -> dict[str, dict[str, tuple[str, list]]]:
    """{"input"|"output": {name: (type, shape)}}; ``ValueError`` naming the file if ONNX Runtime
    cannot decode them (names are UTF-8: a flipped byte in a name fails here)."""
    try:
        return {kind: {arg.name: (arg.type, list(arg.shape)) for arg in args}
                for kind, args in (("input", session.get_inputs()), ("output", session.get_outputs()))}
    except UnicodeDecodeError as err:
        raise _unreadable(path, argument, "input/output names", err) from None


def check_session(session: ort.InferenceSession, spec: GraphSpec, path: Path,
                  argument: str = "model_dir") -> None:
    """``ValueError`` unless the session's inputs and outputs are those of ``spec``."""
    arguments = _arguments(session, path, argument)
    for kind, expected in (("input", spec.inputs), ("output", spec.outputs)):
        got = arguments[kind]
        if set(got) != {t.name for t in expected}:
            raise ValueError(f"{argument}: graph {path.name!r} has {kind}s {sorted(got)}, the "
                             f"manifest expects {sorted(t.name for t in expected)}; re-export it")
        for tensor in expected:
            type_, shape = got[tensor.name]
            if type_ != ORT_TYPES[tensor.dtype]:
                raise ValueError(f"{argument}: graph {path.name!r} {kind} {tensor.name!r} has type "
                                 f"{type_}, the manifest expects {ORT_TYPES[tensor.dtype]}")
            fixed = [(i, d) for i, d in enumerate(tensor.shape) if isinstance(d, int)]
            if len(shape) != len(tensor.shape) or any(shape[i] != d for i, d in fixed):
                raise ValueError(f"{argument}: graph {path.name!r} {kind} {tensor.name!r} has "
                                 f"shape {shape}, the manifest expects {list(tensor.shape)}")
