"""What the benchmark measures and how: settings, process memory marks, timed decode runs.

A run is a prefill of C tokens and then greedy decode steps, timed on one side: the tfport
runtime through ``Model.stream`` or the PyTorch module as a plain KV-cache loop. ``measure``
alternates the sides so that load from other processes hits each alike, and ``make_row`` turns
one side's runs at one (batch, context) into medians.

Shapes: B batch, C context (prompt length, then cached tokens), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from tfport.dtypes import COMPUTE_DTYPES
from tfport.heap import peak_resident
from tfport.export.validate import RunTiming, time_tfport  # noqa: F401 - the tfport side's run, shared with --max-loss
from tfport.presets import get_preset

log = logging.getLogger(__name__)

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
    ``dtype`` is every export's dtype (``export_model``'s) and the PyTorch side's; the roofline
    counts the weights as stored, which is what the CUDA provider reads: ONNX Runtime's CPU
    provider computes float16 / bfloat16 products from float32 copies (twice the bytes).
    ``settle_ms`` is a pause before each timed run: the engine timed before may still hold a core
    (ONNX Runtime's idle pool threads spin for milliseconds after a run). On the 2-core VM,
    12 interleaved rounds, a prefill right after the other engine's 2-thread run took 1.27x
    (tfport int4) and 1.48x (onnxruntime-genai int4) the median time it took after 300 ms idle.
    """

    preset: str = "llama-55m"
    batches: tuple[int, ...] = (1, 8)
    contexts: tuple[int, ...] = (64, 256, 1024)
    new_tokens: int = 32
    repeats: int = 5
    threads: int = 2
    targets: tuple[str, ...] = ("portable",)
    provider: str = "cpu"
    dtype: str = "float32"  # every export's (and the PyTorch side's) weights
    torch: bool = True
    seed: int = 0
    read_mib: int = 1024
    gemv_mib: int = 256
    bandwidth_repeats: int = 20  # best of many: load from other processes only lowers it
    settle_ms: int = 200

    def __post_init__(self) -> None:
        check_counts(self, lists=("batches", "contexts"), non_negative=("settle_ms",),
                     positive=("new_tokens", "repeats", "threads", "read_mib", "gemv_mib", "bandwidth_repeats"))
        if not self.targets or any(not isinstance(t, str) or not t for t in self.targets):
            raise ValueError(f"targets={self.targets!r}: expected one or more target names "
                             "(e.g. 'portable', 'ort')")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets={self.targets!r}: a target is listed twice")
        if self.provider not in PROVIDERS:
            raise ValueError(f"provider={self.provider!r}: expected one of {list(PROVIDERS)}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {list(COMPUTE_DTYPES)}")
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


def check_counts(settings: object, lists: Sequence[str] = (), positive: Sequence[str] = (),
                 non_negative: Sequence[str] = ()) -> None:
    """``ValueError`` naming the first field of ``settings`` that is not what its group asks:
    ``lists`` one or more positive integers, ``positive`` a positive integer, ``non_negative`` an
    integer >= 0 (a bool is not an integer here)."""
    for name in lists:
        values = getattr(settings, name)
        if not values or any(not _is_int(v) or v < 1 for v in values):
            raise ValueError(f"{name}={values!r}: expected one or more positive integers")
    for name in non_negative:
        value = getattr(settings, name)
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name}={value!r}: expected a non-negative integer")
    for name in positive:
        value = getattr(settings, name)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")


def export_format(model: Any) -> str:
    """A loaded export's quantisation format ("int4", "w8a8", ...), or its dtype when not quantised."""
    scheme = model.manifest.quantization
    return model.manifest.dtype if scheme is None else scheme["format"]


DEFAULT = BenchSettings()
QUICK = BenchSettings(preset="tiny-decoder", batches=(1, 2), contexts=(8, 32), new_tokens=4,
                      repeats=1, threads=1, read_mib=16, gemv_mib=8, bandwidth_repeats=2,
                      settle_ms=0)


# ------------------------------------------------------------------------------------ memory
def peak_rss_mb() -> float:
    """The process's peak resident set size so far, MiB (``tfport.heap.peak_resident``)."""
    return peak_resident() / MIB


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


# ----------------------------------------------------------------------------------- machine
def load_average() -> list[float] | None:
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


# ------------------------------------------------------------------------------------ timing
def best_seconds(run: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Shortest wall time of ``repeats`` calls of ``run`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


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


def measure(runs: Sequence[Callable[[int], RunTiming]], steps: int, repeats: int,
            settle_ms: int = 0) -> list[list[RunTiming]]:
    """Each of ``runs`` once untimed (a few steps, same shapes), then ``repeats`` rounds of one
    timed run each, alternating, so that a burst of load from other processes hits every side;
    round r starts at side r mod n, so that no side always runs first or after the same other
    (on the 2-core VM, in a fixed order, one graph loaded twice measured 3% apart, and which of
    tfport's and onnxruntime-genai's int4 graphs ran faster (by ~5%) followed their order);
    ``settle_ms`` pause before each timed run, so that none starts while the previous side's
    threads still spin. Returns the timed runs per entry of ``runs``."""
    for run in runs:
        run(min(steps, 4))
    timings: list[list[RunTiming]] = [[] for _ in runs]
    for round_ in range(repeats):
        for i in range(len(runs)):
            side = (round_ + i) % len(runs)
            time.sleep(settle_ms / 1e3)
            timings[side].append(runs[side](steps))
    return timings


# ---------------------------------------------------------------------------------------- rows
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
        return side_label(self.side, self.target)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("tokens")
        return data


def side_label(side: str, target: str | None) -> str:
    """How the report names a side: ``"torch"`` or ``"tfport[<target>]"``."""
    return "torch" if side == "torch" else f"tfport[{target}]"


def make_row(side: str, target: str | None, batch: int, context: int, runs: list[RunTiming],
             kv_bytes: int) -> Row:
    """One side's timed ``runs`` at (batch, context) as a row (roofline and comparisons unset)."""
    prefills = [run.prefill_ms for run in runs]
    steps = [statistics.median(run.step_ms) for run in runs]
    step_ms = statistics.median(steps)
    return Row(side, target, batch, context, len(runs[0].step_ms), statistics.median(prefills),
               step_ms, batch * 1e3 / step_ms, prefills, steps, kv_bytes / MIB, peak_rss_mb(),
               tokens=runs[-1].tokens)
