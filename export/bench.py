"""``tfport bench``: decode speed of an export, against the PyTorch reference and the roofline.

One reference module is built from a preset (random weights from ``seed``) and exported once per
target; the same module is the PyTorch side. For each batch B and context C, both sides run a
prompt of C tokens (the prefill, timed) and then ``new_tokens`` greedy decode steps, each timed
while the cache already holds at least C tokens:

* tfport: ``Model.stream`` of ``tfport.runtime`` (what a user calls), so the figures include the
  runtime's own per-step work (mask, positions, IO binding, argmax over the logits);
* PyTorch: a plain loop ``logits, cache = module(token, mask, past_key_values=cache)`` under
  ``torch.no_grad`` with ``torch.set_num_threads`` equal to ONNX Runtime's intra-op threads.

Per cell: one untimed warm-up run per side, then ``repeats`` rounds of one timed run per side,
alternating so that load from other processes hits every side alike; a run's step time is the
median over its steps, a cell's the median over its runs (the machine may be shared and noisy).

The roofline: decoding is bound by reading the weights once per step, so with ``W`` bytes of
weights read per token (every parameter except gathered embedding tables; a tied LM head counts
its table once, as the head) and a memory read bandwidth ``BW``, batch B makes at most
``B * BW / W`` tokens/s. ``BW`` is the larger of a multi-threaded numpy read kernel and an ONNX
Runtime fp32 GEMV, both measured here with the same thread count (after the decode runs, so their
buffers do not count in the decode rows' peak RSS).

Shapes: B batch, C context (prompt length, then cached tokens), V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from tfport.files import atomic_file, write_text_atomic
from tfport.presets import get_preset

log = logging.getLogger(__name__)

JSON_FORMAT = "tfport-bench/1"
PROVIDERS = ("cpu", "cuda")
MIB = 2**20


# ---------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class BenchSettings:
    """What to measure; ``QUICK`` is the seconds-long CI variant (its speeds mean nothing).

    ``contexts`` are prompt lengths C: the prefill runs C tokens, and the ``new_tokens`` timed
    decode steps run with C, C+1, ... tokens already cached. ``targets`` are export targets
    (``"portable"`` is the exporter's default). ``read_mib`` sizes the numpy read kernel's array
    (use >= 512 MiB so no cache holds it) and ``gemv_mib`` the ONNX Runtime GEMV's weight.
    """

    preset: str = "llama-55m"
    batches: tuple[int, ...] = (1, 8)
    contexts: tuple[int, ...] = (64, 256, 1024)
    new_tokens: int = 32
    repeats: int = 5
    threads: int = 2
    targets: tuple[str, ...] = ("portable",)
    provider: str = "cpu"
    torch: bool = True
    seed: int = 0
    read_mib: int = 1024
    gemv_mib: int = 256
    bandwidth_repeats: int = 20  # best of many: load from other processes only lowers it

    def __post_init__(self) -> None:
        for name in ("batches", "contexts"):
            values = getattr(self, name)
            if not values or any(not _is_int(v) or v < 1 for v in values):
                raise ValueError(f"{name}={values!r}: expected one or more positive integers")
        for name in ("new_tokens", "repeats", "threads", "read_mib", "gemv_mib",
                     "bandwidth_repeats"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if not self.targets or any(not isinstance(t, str) or not t for t in self.targets):
            raise ValueError(f"targets={self.targets!r}: expected one or more target names "
                             "(e.g. 'portable', 'ort')")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets={self.targets!r}: a target is listed twice")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider={self.provider!r}: expected one of {list(PROVIDERS)}")
        config = get_preset(self.preset)
        if config.family != "decoder":
            raise ValueError(f"preset={self.preset!r} is a {config.family} model; the decode "
                             "benchmark needs a decoder-only preset")
        needed = max(self.contexts) + self.new_tokens + 1  # prompt, first token, timed steps
        if needed > config.max_positions:
            raise ValueError(f"contexts={self.contexts!r} with new_tokens={self.new_tokens}: the "
                             f"longest run needs {needed} positions, preset {self.preset!r} has "
                             f"max_positions={config.max_positions}")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


DEFAULT = BenchSettings()
QUICK = BenchSettings(preset="tiny-decoder", batches=(1, 2), contexts=(8, 32), new_tokens=4,
                      repeats=1, threads=1, read_mib=16, gemv_mib=8, bandwidth_repeats=2)


# ------------------------------------------------------------------------------------ memory
def peak_rss_mb() -> float:
    """The process's peak resident set size so far, MiB (``getrusage`` ``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere


def rss_mb() -> float | None:
    """The process's current resident set size, MiB (Linux ``/proc``; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


@dataclass
class MemoryMark:
    """Process memory after a phase: current RSS (None off Linux) and the peak so far, MiB."""

    phase: str
    rss_mb: float | None
    peak_rss_mb: float


def mark_memory(phase: str) -> MemoryMark:
    mark = MemoryMark(phase, rss_mb(), peak_rss_mb())
    log.debug("memory after %s: rss %s MiB, peak %.0f MiB", phase, mark.rss_mb, mark.peak_rss_mb)
    return mark


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


def _best_seconds(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Shortest wall time of ``repeats`` calls of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_read_bandwidth(mib: int, threads: int, repeats: int) -> float:
    """GB/s of summing a float32 array of ``mib`` MiB in ``threads`` threads, best of ``repeats``.

    Each thread reduces its own contiguous chunk (numpy releases the GIL in the reduction), so
    the threads read disjoint memory at the same time.
    """
    array = np.ones(mib * MIB // 4, dtype=np.float32)  # written once: every page is resident
    chunks = np.array_split(array, threads)
    with ThreadPoolExecutor(threads) as pool:
        seconds = _best_seconds(lambda: list(pool.map(np.add.reduce, chunks)), repeats)
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
    seconds = _best_seconds(lambda: session.run(None, {"x": x}), repeats, warmup=2)
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


# ---------------------------------------------------------------------------------- roofline
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


# ------------------------------------------------------------------------------------ timing
@dataclass
class RunTiming:
    """One run: prefill ms, each decode step's ms, and the greedy tokens int64 [B, 1 + steps]."""

    prefill_ms: float
    step_ms: list[float]
    tokens: np.ndarray


def time_tfport(model: Any, prompts: np.ndarray, steps: int) -> RunTiming:
    """Prefill ``prompts`` int64 [B, C] and decode ``steps`` greedy steps with ``Model.stream``.

    The prefill time runs from the ``stream`` call to the first token (input checks included);
    each step's from asking for the next token to getting it.
    """
    tokens, times = [], []
    start = time.perf_counter()
    stream = model.stream(prompts, max_new_tokens=steps + 1, stop_token_ids=())
    tokens.append(next(stream))
    prefill = time.perf_counter() - start
    while True:
        start = time.perf_counter()
        token = next(stream, None)
        if token is None:
            break
        times.append(time.perf_counter() - start)
        tokens.append(token)
    return RunTiming(prefill * 1e3, [t * 1e3 for t in times], np.stack(tokens, axis=1))


@torch.no_grad()
def time_torch(module: nn.Module, prompts: np.ndarray, steps: int) -> RunTiming:
    """The same run on the PyTorch module: a plain loop over its KV cache, greedy argmax."""
    device = next(module.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = torch.from_numpy(prompts).to(device)  # [B, C]
    mask = torch.ones_like(ids)
    one = mask[:, :1]
    tokens, times = [], []
    start = time.perf_counter()
    logits, cache = module(ids, mask)  # [B, C, V]
    token = logits[:, -1].argmax(-1)  # [B]
    sync()
    prefill = time.perf_counter() - start
    tokens.append(token)
    for _ in range(steps):
        start = time.perf_counter()
        mask = torch.cat([mask, one], dim=1)  # [B, T + 1]
        logits, cache = module(token[:, None], mask, past_key_values=cache)
        token = logits[:, -1].argmax(-1)
        sync()
        times.append(time.perf_counter() - start)
        tokens.append(token)
    return RunTiming(prefill * 1e3, [t * 1e3 for t in times],
                     torch.stack(tokens, dim=1).cpu().numpy())


def measure(runs: Sequence[Callable[[int], RunTiming]], steps: int, repeats: int
            ) -> list[list[RunTiming]]:
    """Each of ``runs`` once untimed (a few steps, same shapes), then ``repeats`` rounds of one
    timed run each, alternating, so that a burst of load from other processes hits every side.
    Returns the timed runs per entry of ``runs``."""
    for run in runs:
        run(min(steps, 4))
    timings: list[list[RunTiming]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, timed in zip(runs, timings):
            timed.append(run(steps))
    return timings


# ----------------------------------------------------------------------------------- results
@dataclass
class Row:
    """One side at one (batch, context): medians over repeats, and what they mean.

    ``side`` is ``"tfport"`` (with its export ``target``) or ``"torch"`` (target None).
    ``step_ms``: median over repeats of each run's median step time; ``tokens_per_s`` is
    ``batch / step_ms``; ``roofline_pct`` is it as a percentage of ``roofline_tokens_per_s``;
    ``ratio_vs_torch`` (tfport rows, when PyTorch ran) is tfport tokens/s over PyTorch's at the
    same cell; ``greedy_agreement`` the fraction of greedy tokens equal to PyTorch's (a sanity
    check; near-ties in random weights may lower it). ``peak_rss_mb`` is the process peak so far.
    """

    side: str
    target: str | None
    batch: int
    context: int
    new_tokens: int
    prefill_ms: float
    step_ms: float
    tokens_per_s: float
    prefill_ms_repeats: list[float]
    step_ms_repeats: list[float]
    kv_cache_mb: float
    peak_rss_mb: float
    roofline_tokens_per_s: float = math.nan
    roofline_pct: float = math.nan
    ratio_vs_torch: float | None = None
    greedy_agreement: float | None = None
    tokens: np.ndarray | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return "torch" if self.side == "torch" else f"tfport[{self.target}]"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("tokens")
        return data


def make_row(side: str, target: str | None, batch: int, context: int, runs: list[RunTiming],
             kv_bytes: int) -> Row:
    prefills = [run.prefill_ms for run in runs]
    steps = [statistics.median(run.step_ms) for run in runs]
    step_ms = statistics.median(steps)
    return Row(side, target, batch, context, len(runs[0].step_ms), statistics.median(prefills),
               step_ms, batch * 1e3 / step_ms, prefills, steps, kv_bytes / MIB, peak_rss_mb(),
               tokens=runs[-1].tokens)


@dataclass
class Growth:
    """Step time at the longest context over the shortest, per side, target and batch."""

    side: str
    target: str | None
    batch: int
    from_context: int
    to_context: int
    ratio: float


@dataclass
class Skipped:
    """A target that could not be exported or loaded, and why."""

    target: str
    reason: str


@dataclass
class BenchResult:
    """Everything one benchmark run measured (``to_dict`` is the JSON)."""

    settings: BenchSettings
    machine: dict[str, Any]
    model: dict[str, Any]
    bandwidth: Bandwidth
    rows: list[Row]
    growth: list[Growth]
    memory: list[MemoryMark]
    skipped: list[Skipped]
    plot: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": JSON_FORMAT,
            "settings": dataclasses.asdict(self.settings),
            "machine": self.machine,
            "model": self.model,
            "bandwidth": self.bandwidth.to_dict(),
            "rows": [row.to_dict() for row in self.rows],
            "growth": [dataclasses.asdict(g) for g in self.growth],
            "memory": [dataclasses.asdict(m) for m in self.memory],
            "skipped": [dataclasses.asdict(s) for s in self.skipped],
            "plot": self.plot,
        }


def fill_roofline(rows: Iterable[Row], weight_bytes: int, bandwidth: Bandwidth) -> None:
    """Set each row's roofline tokens/s (batch B reads the weights once per step) and its %."""
    for row in rows:
        row.roofline_tokens_per_s = row.batch * bandwidth.gbps * 1e9 / weight_bytes
        row.roofline_pct = 100.0 * row.tokens_per_s / row.roofline_tokens_per_s


def fill_comparisons(rows: list[Row]) -> None:
    """Set tfport rows' ratio to PyTorch's tokens/s and greedy agreement at the same cell."""
    reference = {(r.batch, r.context): r for r in rows if r.side == "torch"}
    for row in rows:
        torch_row = reference.get((row.batch, row.context))
        if row.side == "torch" or torch_row is None:
            continue
        row.ratio_vs_torch = row.tokens_per_s / torch_row.tokens_per_s
        row.greedy_agreement = float(np.mean(row.tokens == torch_row.tokens))
        if row.greedy_agreement < 1.0:
            log.warning("%s batch %d context %d: greedy tokens agree with PyTorch's on %.0f%% "
                        "(near-ties in random weights, or a broken export)", row.label,
                        row.batch, row.context, 100 * row.greedy_agreement)


def step_growth(rows: list[Row]) -> list[Growth]:
    """Step time at the longest context / at the shortest, for each side, target and batch."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        groups.setdefault((row.side, row.target, row.batch), []).append(row)
    growth = []
    for (side, target, batch), group in groups.items():
        short = min(group, key=lambda r: r.context)
        long = max(group, key=lambda r: r.context)
        if long.context > short.context:
            growth.append(Growth(side, target, batch, short.context, long.context,
                                 long.step_ms / short.step_ms))
    return growth


def _load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def machine_info(settings: BenchSettings) -> dict[str, Any]:
    """Where the figures come from."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": affinity,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "onnxruntime": ort.__version__,
        "provider": settings.provider,
    }


# ------------------------------------------------------------------------------------- runner
def export_targets(module: nn.Module, targets: Sequence[str], root: Path
                   ) -> tuple[dict[str, Path], list[Skipped]]:
    """Export ``module`` once per target into ``root/<target>``.

    ``export_model`` is called with ``target=`` only for targets other than ``"portable"`` (its
    default), and a ``TypeError``/``ValueError`` for such a target (an exporter that does not
    know the option, or refuses it for this model) makes it a skipped target with the reason.
    """
    from .exporter import export_model

    exports, skipped = {}, []
    for target in targets:
        options = {} if target == "portable" else {"target": target}
        try:
            export_model(module, root / target, dtype="float32", validate=True, **options)
        except (TypeError, ValueError) as err:
            if target == "portable":
                raise
            log.warning("target %r skipped: %s", target, err)
            skipped.append(Skipped(target, f"export: {err}"))
            continue
        exports[target] = root / target
    return exports, skipped


def load_exports(exports: dict[str, Path], settings: BenchSettings
                 ) -> tuple[dict[str, Any], list[Skipped]]:
    """Open each export with ``tfport.runtime.load_model``; a load failure skips the target."""
    from tfport.runtime import load_model

    models, skipped = {}, []
    for target, directory in exports.items():
        try:
            models[target] = load_model(directory, settings.provider,
                                        intra_op_threads=settings.threads)
        except (TypeError, ValueError, RuntimeError) as err:
            if target == "portable":
                raise
            log.warning("target %r skipped: %s", target, err)
            skipped.append(Skipped(target, f"load: {err}"))
    return models, skipped


def _torch_device(settings: BenchSettings) -> str:
    if settings.provider == "cuda" and settings.torch and not torch.cuda.is_available():
        raise ValueError("provider='cuda': this torch build has no CUDA for the PyTorch side; "
                         "pass --no-torch, or use provider='cpu'")
    return "cuda" if settings.provider == "cuda" else "cpu"


def run_benchmark(settings: BenchSettings) -> BenchResult:
    """Export, time both sides at every (batch, context), measure bandwidth, assemble results."""
    from tfport.models import build_model

    config = get_preset(settings.preset)
    device = _torch_device(settings)
    load_before = _load_average()
    memory = [mark_memory("start")]
    module = build_model(config, seed=settings.seed)
    weight_bytes = weight_bytes_per_token(module)
    memory.append(mark_memory("model built"))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="tfport-bench-") as tmp:
            exports, skipped = export_targets(module, settings.targets, Path(tmp))
            memory.append(mark_memory("exported"))
            models, load_skipped = load_exports(exports, settings)
            skipped += load_skipped
            memory.append(mark_memory("sessions loaded"))
            module = module.to(device)
            rows = time_cells(models, module, settings)
            memory.append(mark_memory("decode runs"))
            del models
    finally:
        torch.set_num_threads(previous_threads)
    bandwidth = measure_bandwidth(settings)
    memory.append(mark_memory("bandwidth"))
    fill_roofline(rows, weight_bytes, bandwidth)
    fill_comparisons(rows)
    params = sum(p.numel() for p in module.parameters())
    model_info = {"preset": settings.preset, "dtype": "float32", "parameters": params,
                  "weight_bytes_per_token": weight_bytes, "config": config.to_dict()}
    machine = {**machine_info(settings), "load_average_before": load_before,
               "load_average_after": _load_average()}
    return BenchResult(settings, machine, model_info, bandwidth, rows, step_growth(rows), memory,
                       skipped)


def time_cells(models: dict[str, Any], module: nn.Module, settings: BenchSettings) -> list[Row]:
    """Time every (batch, context) on each tfport target and PyTorch, runs alternating."""
    rng = np.random.default_rng(settings.seed)
    vocab = module.config.vocab_size
    steps, repeats = settings.new_tokens, settings.repeats
    rows = []
    for batch in settings.batches:
        for context in settings.contexts:
            prompts = rng.integers(0, vocab, size=(batch, context), dtype=np.int64)  # [B, C]
            kv_bytes = kv_cache_bytes(module, batch, context)
            sides: list[tuple[str, str | None, Callable[[int], RunTiming]]] = [
                ("tfport", target, lambda n, m=model: time_tfport(m, prompts, n))
                for target, model in models.items()]
            if settings.torch:
                sides.append(("torch", None, lambda n: time_torch(module, prompts, n)))
            timings = measure([run for _, _, run in sides], steps, repeats)
            for (side, target, _), runs in zip(sides, timings):
                row = make_row(side, target, batch, context, runs, kv_bytes)
                log.info("%s batch %d context %d: prefill %.1f ms, step %.2f ms (%.1f tokens/s)",
                         row.label, batch, context, row.prefill_ms, row.step_ms,
                         row.tokens_per_s)
                rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ output
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def format_table(result: BenchResult) -> str:
    """The human-readable report: settings, bandwidth and roofline, rows, growth, memory."""
    s, bw, model = result.settings, result.bandwidth, result.model
    weight_mb = model["weight_bytes_per_token"] / 1e6
    batch1 = bw.gbps * 1e9 / model["weight_bytes_per_token"]
    lines = [
        f"tfport bench: {s.preset} (float32, {model['parameters']:,} parameters, "
        f"{weight_mb:.1f} MB of weights read per step), provider {s.provider}, {s.threads} "
        f"thread(s), {s.new_tokens} timed steps, median of {s.repeats} repeat(s)",
        f"memory read bandwidth: numpy read {bw.numpy_read_gbps:.1f} GB/s ({bw.read_mib} MiB), "
        f"ORT GEMV {bw.ort_gemv_gbps:.1f} GB/s ({bw.gemv_mib} MiB weight); "
        f"the roofline uses {bw.source} ({bw.gbps:.1f} GB/s)",
        f"roofline: {batch1:.0f} tokens/s at batch 1, B times that at batch B",
        f"load average (1/5/15 min) before {result.machine.get('load_average_before')}, after "
        f"{result.machine.get('load_average_after')} on {result.machine.get('usable_cpus')} "
        "usable CPUs (other processes' load slows both sides, PyTorch's OpenMP threads most)",
        "",
    ]
    header = ("side", "batch", "context", "prefill ms", "step ms", "tokens/s", "% roofline",
              "vs torch", "peak RSS MiB")
    table = [header]
    for row in result.rows:
        table.append((row.label, str(row.batch), str(row.context), _fmt(row.prefill_ms, ".1f"),
                      _fmt(row.step_ms, ".2f"), _fmt(row.tokens_per_s, ".1f"),
                      _fmt(row.roofline_pct, ".1f") + "%",
                      "-" if row.ratio_vs_torch is None else f"{row.ratio_vs_torch:.2f}x",
                      _fmt(row.peak_rss_mb, ".0f")))
    for skip in result.skipped:
        table.append((f"tfport[{skip.target}]", "skipped: " + skip.reason.splitlines()[0]))
    widths = [max(len(r[i]) for r in table if len(r) == len(header)) for i in range(len(header))]
    for cells in table:
        if len(cells) != len(header):  # a skipped target: one free-text line
            lines.append(f"{cells[0]:<{widths[0]}}  {cells[1]}")
            continue
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))))
    over = [row for row in result.rows if row.roofline_pct is not None and row.roofline_pct > 100]
    if over:
        lines += ["", f"note: {len(over)} row(s) exceed 100% of the roofline, so the bandwidth "
                      "measurement was depressed (load from other processes); the decode itself "
                      f"read weights at up to {max(r.roofline_pct for r in over) * bw.gbps / 100:.1f} "
                      "GB/s. Rerun on a quiet machine for a meaningful percentage."]
    if result.growth:
        first = result.growth[0]
        lines += ["", f"step time at context {first.to_context} / context {first.from_context} "
                      "(the issue's target: <= 1.3):"]
        for g in result.growth:
            label = "torch" if g.side == "torch" else f"tfport[{g.target}]"
            lines.append(f"  {label} batch {g.batch}: {g.ratio:.2f}")
    lines += ["", "process memory, MiB (current RSS / peak so far): " + ", ".join(
        f"{m.phase} {_fmt(m.rss_mb, '.0f')}/{m.peak_rss_mb:.0f}" for m in result.memory)]
    if result.plot:
        lines.append(f"plot: {result.plot}")
    return "\n".join(lines)


def write_json(result: BenchResult, path: str | os.PathLike) -> Path:
    """Write ``result.to_dict()`` to ``path`` atomically (a temporary file, then a rename)."""
    return write_text_atomic(path, json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")


def write_plot(result: BenchResult, path: str | os.PathLike) -> str:
    """Plot step time against context, one line per side, target and batch (needs matplotlib);
    returns what happened, for the report."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return "skipped (matplotlib is not installed)"
    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups: dict[tuple, list[Row]] = {}
    for row in result.rows:
        groups.setdefault((row.label, row.batch), []).append(row)
    for (label, batch), rows in groups.items():
        rows = sorted(rows, key=lambda r: r.context)
        ax.plot([r.context for r in rows], [r.step_ms for r in rows], marker="o",
                linestyle="--" if label == "torch" else "-", label=f"{label}, batch {batch}")
    ax.set_xscale("log", base=2)
    contexts = sorted({row.context for row in result.rows})
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens in the cache)")
    ax.set_ylabel("decode step, ms (median)")
    ax.set_title(f"{result.settings.preset}: decode step time, {result.settings.threads} thread(s)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return f"wrote {path}"


# --------------------------------------------------------------------------------------- CLI
def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 1,8")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


# CLI option -> BenchSettings field; unset options take the defaults (or QUICK's with --quick).
_OPTIONS = {"preset": "preset", "batch": "batches", "contexts": "contexts",
            "new_tokens": "new_tokens", "repeats": "repeats", "threads": "threads",
            "targets": "targets", "provider": "provider", "seed": "seed",
            "read_mib": "read_mib", "gemv_mib": "gemv_mib"}


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    base = QUICK if args.quick else DEFAULT
    changes = {fld: getattr(args, opt) for opt, fld in _OPTIONS.items()
               if getattr(args, opt) is not None}
    if args.no_torch:
        changes["torch"] = False
    return dataclasses.replace(base, **changes)


def run_bench(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    result = run_benchmark(settings)
    if args.plot:
        result.plot = write_plot(result, args.plot)
    print(format_table(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    return 0


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``tfport bench``."""
    p = subparsers.add_parser(
        "bench", help="decode speed vs PyTorch and the memory-bandwidth roofline",
        description=__doc__.split("\n\n")[0],
        epilog=f"defaults: preset {DEFAULT.preset}, batch {DEFAULT.batches}, contexts "
               f"{DEFAULT.contexts}, {DEFAULT.new_tokens} new tokens, {DEFAULT.repeats} repeats, "
               f"{DEFAULT.threads} threads; --quick: preset {QUICK.preset}, batch "
               f"{QUICK.batches}, contexts {QUICK.contexts}, {QUICK.new_tokens} new tokens, "
               f"{QUICK.repeats} repeat, small bandwidth buffers (seconds; speeds mean nothing)")
    p.add_argument("--quick", action="store_true",
                   help="a seconds-long run on a tiny preset (CI; options given still apply)")
    p.add_argument("--preset", help="decoder preset to build (random weights from --seed)")
    p.add_argument("--batch", type=_int_list, help="batch sizes, comma-separated (e.g. 1,8)")
    p.add_argument("--contexts", type=_int_list,
                   help="prompt lengths = tokens cached when the timed steps run (e.g. 64,256,1024)")
    p.add_argument("--new-tokens", type=int, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, help="timed runs per cell (medians are reported)")
    p.add_argument("--threads", type=int,
                   help="ONNX Runtime intra-op threads = torch threads = bandwidth threads")
    p.add_argument("--targets", type=_name_list,
                   help="export targets, comma-separated (portable, ort); one export each")
    p.add_argument("--provider", choices=PROVIDERS, help="ONNX Runtime execution provider")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference side")
    p.add_argument("--seed", type=int, help="seed of the weights and the prompts")
    p.add_argument("--read-mib", type=int, help="numpy read kernel's array, MiB (>= 512)")
    p.add_argument("--gemv-mib", type=int, help="ORT GEMV's weight, MiB")
    p.add_argument("--json", help="write the results as JSON here (atomically)")
    p.add_argument("--plot", help="plot step time vs context here (needs matplotlib)")
    p.set_defaults(func=run_bench)


def main(argv: list[str] | None = None) -> int:
    """``python -m tfport.export.bench [options]``: the same as ``tfport bench [options]``."""
    from tfport.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
