"""The one-node weight products that ``tfport bench --rows`` (``rows``) times: the candidate graphs
for y [M, N] = x [M, K] @ W^T, the sessions that run them, the memory those add, and how their
calls are timed.

Each candidate (``CANDIDATES``) builds its graph from W float32 [N, K], the weights in the
operator's documented layout (as ``targets.ort`` stores them). Quantised codes come from
``rounding.quantize_rows`` (round to nearest, no search): the codes do not matter for speed. A
session (``SESSIONS``, ``open_session``) takes the weights from the graph ("own", as an export
loads them) or as ``OrtValue`` objects the process already holds, given with
``SessionOptions.add_initializer`` (how a second session over one model's weights would open),
with the kernels' repacking ("shared") or without ("shared-unpacked"); ``open_measured`` gives
the resident memory a session adds when it opens and runs once (what its kernels copy).

``time_calls`` takes ``repeats`` samples of each bound call (``bound_call``: one
``run_with_iobinding``, input and output bound once) one after the other after warm-up calls,
fewer where they would take over ``CELL_SECONDS``; a sample is the mean of back-to-back calls
lasting at least ``SAMPLE_SECONDS``. The bound calls take their turns one after the other, each
after a pause of ``settle_ms`` (sessions' thread pools spin after a run). ``overhead_us`` times
one such call on an ``Identity`` graph, to be reported, not subtracted.

Shapes: M rows (batch x new tokens), K inputs, N outputs, Kb = ceil(K / block) blocks per row.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from tfport.runtime.session import SessionSettings

from tfport.export.blocks import pack_nibbles
from tfport.export.rounding import quantize_rows
from .measurement import rss_mb

# What ONNX Runtime raises when it cannot open or run a graph (none derives from RuntimeError).
ORT_ERRORS = (ort_errors.Fail, ort_errors.NotImplemented, ort_errors.InvalidGraph, ort_errors.InvalidArgument,
              ort_errors.RuntimeException)

BLOCK_SIZE = 32  # tfport's default int4 / int8 blocks
SAMPLE_SECONDS = 1e-3  # a product sample lasts at least this long (many calls of a small product)
WARMUP_CALLS = 3  # after the first call and one timed to size the samples
WARMUP_LIMIT_US = 1e4  # calls slower than this get no further warm-up
CELL_SECONDS = 3.0  # a cell's samples take about this long at most ...
MIN_SAMPLES = 3  # ... unless that leaves fewer than these
# int8 weights of the integer GEMM use 7-bit codes (ONNX Runtime's ``reduce_range``): without
# VNNI, x86 multiplies u8 activations by s8 weights with vpmaddubsw, which sums pairs in int16 and
# saturates on full-range codes (576 x 1536 on the AVX2 VM: 10.8% of the largest output off with
# codes to 127, 0.7% with codes to 63). Speed does not depend on the range.
INT8_WEIGHT_LEVELS = 63


# --------------------------------------------------------------------------------- candidates
@dataclass
class Product:
    """One candidate's graph for one shape: input ``x`` [M, K] of ``dtype``, output ``y`` [M, N];
    ``weights`` the initializers by name (what a shared session is given); ``optimization`` the
    graph optimisation level the candidate needs (an unfused pair must stay unfused)."""

    model: onnx.ModelProto
    dtype: np.dtype
    weights: dict[str, np.ndarray]
    optimization: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL

    @property
    def stored_bytes(self) -> int:
        """Bytes of the weight arrays (constants of one value, such as a zero point, aside)."""
        return sum(w.nbytes for w in self.weights.values() if w.size > 1)


@dataclass(frozen=True)
class Candidate:
    """A way to compute y = x @ W^T: ``build`` takes W float32 [N, K] and returns its graph."""

    name: str
    summary: str
    build: Callable[[np.ndarray], Product]


def _model(nodes: list[onnx.NodeProto], k: int, n: int, weights: dict[str, np.ndarray],
           dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "product", [helper.make_tensor_value_info("x", dtype, ["M", k])],
                              [helper.make_tensor_value_info("y", dtype, ["M", n])],
                              [numpy_helper.from_array(w, name) for name, w in weights.items()])
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def float_matmul(dtype: str) -> Callable[[np.ndarray], Product]:
    """``MatMul`` with W^T [K, N] in ``dtype`` (float16: activations and output float16 too)."""
    def build(weight: np.ndarray) -> Product:
        n, k = weight.shape
        weights = {"w": np.ascontiguousarray(weight.T.astype(dtype))}  # [K, N]
        model = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], k, n, weights,
                       helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        return Product(model, np.dtype(dtype), weights)
    return build


def matmul_nbits(bits: int, accuracy_level: int) -> Callable[[np.ndarray], Product]:
    """``com.microsoft.MatMulNBits``, blocks of ``BLOCK_SIZE`` with zero points (tfport's default
    scheme): B uint8 [N, Kb, BLOCK_SIZE * bits / 8] (4 bits: two codes a byte, the first in the
    low nibble), scales float32 [N * Kb], zero points [N * ceil(Kb * bits / 8)] packed like B."""
    pack = pack_nibbles if bits == 4 else np.asarray

    def build(weight: np.ndarray) -> Product:
        n, k = weight.shape
        quantized = quantize_rows(weight, bits, BLOCK_SIZE, symmetric=False, search=False)
        weights = {"B": pack(quantized.padded_codes()), "scales": quantized.scales.reshape(-1),
                   "zero_points": pack(quantized.zero_points).reshape(-1)}
        node = helper.make_node("MatMulNBits", ["x", *weights], ["y"], domain="com.microsoft", K=k, N=n,
                                bits=bits, block_size=BLOCK_SIZE, accuracy_level=accuracy_level)
        return Product(_model([node], k, n, weights), np.dtype("float32"), weights)
    return build


def dynamic_int8(fused: bool) -> Callable[[np.ndarray], Product]:
    """ONNX Runtime's integer GEMM with the input quantised per call (uint8, per tensor): W^T int8
    [K, N] with one float32 scale per output column [N] and zero point 0. ``fused``: one
    ``com.microsoft.DynamicQuantizeMatMul``; else ``DynamicQuantizeLinear`` +
    ``com.microsoft.MatMulIntegerToFloat`` at basic optimisation (the default level fuses the
    pair into ``DynamicQuantizeMatMul``)."""
    def build(weight: np.ndarray) -> Product:
        n, k = weight.shape
        scale = np.abs(weight).max(axis=1) / INT8_WEIGHT_LEVELS  # [N]
        scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        codes = np.clip(np.rint(weight / scale[:, None]), -INT8_WEIGHT_LEVELS, INT8_WEIGHT_LEVELS)
        weights = {"B": np.ascontiguousarray(codes.T.astype(np.int8)), "b_scale": scale}  # [K, N], [N]
        if fused:
            nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "B", "b_scale"], ["y"],
                                      domain="com.microsoft")]
            level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        else:
            nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "x_scale", "x_zero_point"]),
                     helper.make_node("MatMulIntegerToFloat", ["xq", "B", "x_scale", "b_scale", "x_zero_point"],
                                      ["y"], domain="com.microsoft")]
            level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        return Product(_model(nodes, k, n, weights), np.dtype("float32"), weights, level)
    return build


def rows_int8() -> Callable[[np.ndarray], Product]:
    """``--quantize w8a8``'s product, built by the exporter's own lowering (its graph quantiser):
    the input rounded per row to uint8 around 128 (``QuantizeLinear``), int8 weight codes per
    output column (7 bits), standard ``MatMulInteger``, then the column and row scales."""
    def build(weight: np.ndarray) -> Product:
        from tfport.export.graph import GraphBuilder
        from tfport.export.quant import W8A8_FORMAT

        n, k = weight.shape
        g = GraphBuilder("product", "float32")
        quantizer = W8A8_FORMAT.parse().graph_quantizer(target=None)  # standard operators: no target
        y = quantizer.project(g, "x", np.ascontiguousarray(weight.T), "w")  # W^T [K, N]
        weights = {t.name: numpy_helper.to_array(t) for t in g.initializers}
        return Product(_model([*g.nodes, helper.make_node("Identity", [y], ["y"])], k, n, weights),
                       np.dtype("float32"), weights)
    return build


CANDIDATES = (
    Candidate("f32", "float32 MatMul", float_matmul("float32")),
    Candidate("f16", "float16 MatMul (float16 input and output)", float_matmul("float16")),
    *(Candidate(f"nbits4-l{level}", f"MatMulNBits 4 bits, accuracy level {level}", matmul_nbits(4, level))
      for level in (0, 1, 2, 4)),
    Candidate("nbits8-l4", "MatMulNBits 8 bits, accuracy level 4", matmul_nbits(8, 4)),
    Candidate("int8-dql-mitf", "DynamicQuantizeLinear + MatMulIntegerToFloat, int8 per column",
              dynamic_int8(fused=False)),
    Candidate("int8-dqmm", "DynamicQuantizeMatMul, int8 per column", dynamic_int8(fused=True)),
    Candidate("int8-rows", "w8a8: QuantizeLinear per row + MatMulInteger, int8 per column", rows_int8()),
)


def get_candidate(name: str) -> Candidate:
    for candidate in CANDIDATES:
        if candidate.name == name:
            return candidate
    raise ValueError(f"candidate={name!r}: expected one of {[c.name for c in CANDIDATES]}")


# ----------------------------------------------------------------------------------- sessions
# How a candidate's session gets its weights: "own" from its graph, as an export opens; "shared" as
# ``OrtValue`` objects over arrays the process holds (``SessionOptions.add_initializer``), so
# several sessions can take the same ones, though kernels still repack them into their own copies;
# "shared-unpacked" the same with ``session.disable_prepacking``: no copy, the kernels' slow paths.
SESSIONS = ("own", "shared", "shared-unpacked")


def open_session(product: Product, threads: int, session: str = "own") -> ort.InferenceSession:
    """The product's CPU session with ``threads`` intra-op threads (tfport's session options),
    its weights as ``session`` (one of ``SESSIONS``) says; shared weights are ``OrtValue``
    objects over the product's arrays (which must outlive the session)."""
    if session not in SESSIONS:
        raise ValueError(f"session={session!r}: expected one of {list(SESSIONS)}")
    options = SessionSettings(intra_op_threads=threads).session_options()
    options.graph_optimization_level = product.optimization
    values = {}
    if session != "own":
        values = {name: ort.OrtValue.ortvalue_from_numpy(w) for name, w in product.weights.items()}
        for name, value in values.items():
            options.add_initializer(name, value)
    if session == "shared-unpacked":
        options.add_session_config_entry("session.disable_prepacking", "1")
    # From a file, as an export opens: a session opened from bytes keeps them (a second copy).
    with tempfile.TemporaryDirectory(prefix="tfport-rows-") as tmp:
        path = Path(tmp) / "product.onnx"
        onnx.save(product.model, path)
        opened = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    opened.tfport_initializers = values  # keep the OrtValues alive with the session
    return opened


def bound_call(session: ort.InferenceSession, x: np.ndarray, y: np.ndarray) -> Callable[[], None]:
    """One ``run_with_iobinding`` of ``session`` on ``x`` [M, K], writing into ``y`` [M, N] (both
    bound once, over the arrays' memory)."""
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x))
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(y))
    return lambda: session.run_with_iobinding(binding)


def resident_mb() -> float | None:
    """The process's resident MiB after handing freed heap back to the OS (glibc ``malloc_trim``;
    without it, memory freed by one session's opening is reused by the next and hides its cost)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure may undercount
        pass
    return rss_mb()


def open_measured(product: Product, threads: int, session: str) -> tuple[ort.InferenceSession, float | None]:
    """``open_session`` -> (the session, MiB of resident memory it added by opening and running
    once on one row)."""
    before = resident_mb()
    opened = open_session(product, threads, session)
    k = product.model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    opened.run(None, {"x": np.ones((1, k), product.dtype)})
    after = resident_mb()
    return opened, None if before is None or after is None else after - before


# ------------------------------------------------------------------------------------- timing
def _sample_us(call: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def time_calls(calls: dict[str, Callable[[], None]], repeats: int, settle_ms: int = 0) -> dict[str, list[float]]:
    """Per key: ``repeats`` samples of its call, us, each the mean of enough back-to-back calls to
    last ``SAMPLE_SECONDS``, after warm-up calls; fewer samples (at least ``MIN_SAMPLES``) where
    they would take more than ``CELL_SECONDS`` (the kernels' slow paths take a second a call).
    The keys run one after the other, each after a pause of ``settle_ms``: every session has its
    own thread pool, which spins for a while after a run, so alternating sessions call by call
    measures their contention (on the 2-core VM, alternating 18 sessions, medians of 3 samples
    of one 576 x 960 product came out up to 100x the same candidate's in its other session)."""
    samples: dict[str, list[float]] = {}
    for key, call in calls.items():
        time.sleep(settle_ms / 1e3)
        call()  # the first run may set up buffers
        once = _sample_us(call, 1)
        for _ in range(WARMUP_CALLS if once < WARMUP_LIMIT_US else 0):
            call()
        per_sample = max(1, math.ceil(SAMPLE_SECONDS * 1e6 / once))
        count = min(repeats, max(MIN_SAMPLES, int(CELL_SECONDS * 1e6 / (per_sample * once))))
        samples[key] = [_sample_us(call, per_sample) for _ in range(count)]
    return samples


def overhead_us(k: int, rows: Sequence[int], repeats: int, threads: int) -> dict[int, float]:
    """Median us of one bound call of an ``Identity`` graph on [M, K], per row count M."""
    identity = Product(_model([helper.make_node("Identity", ["x"], ["y"])], k, k, {}), np.dtype("float32"), {})
    session = open_session(identity, threads)
    x = np.ones((max(rows), k), np.float32)
    samples = time_calls({str(m): bound_call(session, x[:m], np.empty((m, k), np.float32)) for m in rows}, repeats)
    return {m: statistics.median(samples[str(m)]) for m in rows}
