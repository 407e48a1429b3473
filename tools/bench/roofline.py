"""The roofline: memory read bandwidth, bytes read per decode step, the tokens/s they allow.

Decoding is bound by reading the weights once per step, so with ``W`` bytes of weights read per
token (every parameter except gathered embedding tables; a tied LM head counts its table once,
as the head) and a memory read bandwidth ``BW``, batch B makes at most ``B * BW / W`` tokens/s.
``BW`` is the larger of a multi-threaded numpy read kernel and an ONNX Runtime fp32 GEMV, both
measured with the benchmark's thread count.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from .measurement import MIB, BenchSettings, Row, best_seconds

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- bandwidth
@dataclass
class Bandwidth:
    """Measured memory read bandwidths, GB/s (1e9 bytes), and the one the roofline uses."""

    numpy_read_gbps: float
    ort_gemv_gbps: float
    read_mib: int
    gemv_mib: int
    threads: int

    @property
    def source(self) -> str:
        """``"numpy read"`` or ``"ORT GEMV"``: whichever measured more."""
        return "ORT GEMV" if self.ort_gemv_gbps > self.numpy_read_gbps else "numpy read"

    @property
    def gbps(self) -> float:
        """The roofline's bandwidth: the larger measurement."""
        return max(self.numpy_read_gbps, self.ort_gemv_gbps)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "used_gbps": self.gbps, "source": self.source}


def measure_read_bandwidth(mib: int, threads: int, repeats: int) -> float:
    """GB/s of summing a float32 array of ``mib`` MiB in ``threads`` threads, best of ``repeats``.

    Each thread reduces its own contiguous chunk (numpy releases the GIL in the reduction), so
    the threads read disjoint memory at the same time.
    """
    array = np.ones(mib * MIB // 4, dtype=np.float32)  # written once: every page is resident
    chunks = np.array_split(array, threads)
    with ThreadPoolExecutor(threads) as pool:
        seconds = best_seconds(lambda: list(pool.map(np.add.reduce, chunks)), repeats)
    return array.nbytes / seconds / 1e9


def gemv_graph(k: int, n: int) -> onnx.ModelProto:
    """``y [1, N] = x [1, K] @ w [K, N]`` with ``w`` a float32 initializer (constant 0.5)."""
    weight = numpy_helper.from_array(np.full((k, n), 0.5, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def measure_gemv_bandwidth(mib: int, threads: int, provider: str, repeats: int) -> float:
    """GB/s of an ONNX Runtime fp32 GEMV whose weight is ``mib`` MiB, best of ``repeats``.

    The weight is [K, N] with K = 4096 (a wide model's hidden size), so one run reads it once;
    the session has ``threads`` intra-op threads, like the benchmarked model's.
    """
    k = 4096
    n = max(1, mib * MIB // (4 * k))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    providers = ["CUDAExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(gemv_graph(k, n).SerializeToString(), options,
                                   providers=providers)
    x = np.ones((1, k), dtype=np.float32)
    seconds = best_seconds(lambda: session.run(None, {"x": x}), repeats, warmup=2)
    return k * n * 4 / seconds / 1e9


def measure_bandwidth(settings: BenchSettings) -> Bandwidth:
    """Both bandwidth measurements with the benchmark's thread count."""
    numpy_gbps = measure_read_bandwidth(settings.read_mib, settings.threads,
                                        settings.bandwidth_repeats)
    gemv_gbps = measure_gemv_bandwidth(settings.gemv_mib, settings.threads, settings.provider,
                                       settings.bandwidth_repeats)
    result = Bandwidth(numpy_gbps, gemv_gbps, settings.read_mib, settings.gemv_mib,
                       settings.threads)
    log.info("bandwidth: numpy read %.1f GB/s, ORT GEMV %.1f GB/s (%d threads)",
             numpy_gbps, gemv_gbps, settings.threads)
    return result


# ------------------------------------------------------------------------- bytes per step
def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads per batch: every parameter once, except tables
    that are only gathered from (the token embedding, learned positions, token types: one row
    each per token). A tied LM head reads the token table in full, so it counts once, as the
    head; shared parameters count once."""
    gathered = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    read_in_full = {id(head.weight)} if head is not None else set()
    return sum(p.numel() * p.element_size() for p in model.parameters()  # shared ones once
               if id(p) not in gathered or id(p) in read_in_full)


def kv_cache_bytes(model: nn.Module, batch: int, length: int) -> int:
    """Bytes of the K and V caches of every layer at ``length`` cached tokens."""
    config = model.config
    element = next(model.parameters()).element_size()
    return 2 * config.n_decoder_layers * batch * config.kv_heads * length * config.dim_per_head \
        * element


def fill_roofline(rows: Iterable[Row], weight_bytes: int, bandwidth: Bandwidth) -> None:
    """Set each row's roofline tokens/s (batch B reads the weights once per step) and its %."""
    for row in rows:
        row.roofline_tokens_per_s = row.batch * bandwidth.gbps * 1e9 / weight_bytes
        row.roofline_pct = 100.0 * row.tokens_per_s / row.roofline_tokens_per_s
