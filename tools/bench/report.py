"""The benchmark's result and its report: comparisons between rows, the table, JSON, a plot."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tfport.files import atomic_file, write_text_atomic

from .measurement import BenchSettings, MemoryMark, Row, side_label
from .roofline import Bandwidth

log = logging.getLogger(__name__)

JSON_FORMAT = "tfport-bench/1"


# ----------------------------------------------------------------------------------- results
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


# ------------------------------------------------------------------------------------ output
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def format_table(result: BenchResult) -> str:
    """The human-readable report: settings, bandwidth and roofline, rows, growth, memory."""
    s, bw, model = result.settings, result.bandwidth, result.model
    weight_mb = model["weight_bytes_per_token"] / 1e6
    batch1 = bw.gbps * 1e9 / model["weight_bytes_per_token"]
    lines = [
        f"tfport bench: {s.preset} ({s.dtype}, {model['parameters']:,} parameters, "
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
        table.append((side_label("tfport", skip.target),
                      "skipped: " + skip.reason.splitlines()[0]))
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
            lines.append(f"  {side_label(g.side, g.target)} batch {g.batch}: {g.ratio:.2f}")
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
