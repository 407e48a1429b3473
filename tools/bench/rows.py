"""``tfport bench --rows``: which weight product a decode step with many rows should run, and
what each costs in memory (issue 24, "quantised models that batch").

``MatMulNBits`` at accuracy level 4 (tfport's int4 products) grows about linearly with the rows
of its input, where a float32 ``MatMul`` hardly grows up to 8 rows, so int4 exports gain little
from batching. Two measurements, each optional:

* products (``--rows``): for each product shape of a decode step of SmolLM2-135M (``SHAPES``:
  the fused q/k/v, the attention output, the fused gate/up, down and the LM head, as tfport's
  export has them), each candidate (``products.CANDIDATES``) as a one-node graph, timed at each
  row count M: y [M, N] = x [M, K] @ W^T, W [N, K] random. Each candidate is timed in three
  sessions (``products.SESSIONS``: weights in the graph, as an export loads them, or shared
  ``OrtValue`` objects with or without the kernels' repacking). Per candidate the report gives
  the stored weight bytes and the resident memory each session adds when it opens and runs once
  (what its kernels copy);
* exports (``--rows-exports A,B,...``): the decode step time of whole exports at each row count
  through ``tfport.runtime`` (``Model.stream``, timed by ``measurement.time_tfport`` and
  alternated by ``measurement.measure``), with each export's file size and the memory its loading
  adds.

    tfport bench --rows [--threads 2] [--repeats 30] [--batch 1,2,4,8,16,32] [--json rows.json]
    tfport bench --rows-exports out/int4,out/int8,out/f32 [--contexts 64] [--new-tokens 32]

``products`` builds the candidates' graphs, opens their sessions and times their calls: a cell
here is the median of ``--repeats`` samples from ``products.time_calls``, each candidate and
session after a pause of ``--settle-ms``, and the cost of one bound call of an ``Identity`` graph
(``products.overhead_us``) is reported, not subtracted. This module runs them over the shapes and
row counts, times the exports and reports.

Shapes: M rows (batch x new tokens), K inputs, N outputs, B batch, C context.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tfport.files import write_text_atomic

from .measurement import (DEFAULT, MIB, check_counts, export_format, load_average, machine_info, make_row,
                          measure, time_tfport)
from .products import (BLOCK_SIZE, CANDIDATES, ORT_ERRORS, SAMPLE_SECONDS, SESSIONS, bound_call, get_candidate,
                       open_measured, overhead_us, resident_mb, time_calls)

log = logging.getLogger(__name__)

JSON_FORMAT = "tfport-bench-rows/1"


@dataclass(frozen=True)
class Shape:
    """One weight product of a decode step: x [M, K] @ W^T with W [N, K], ``count`` per step."""

    name: str
    k: int
    n: int
    count: int


# SmolLM2-135M (E 576, 9 + 2 x 3 heads of 64, FFN 1536, V 49152, 30 layers) as tfport exports it.
SHAPES = (Shape("qkv", 576, 960, 30), Shape("o", 576, 576, 30), Shape("gate_up", 576, 3072, 30),
          Shape("down", 1536, 576, 30), Shape("head", 576, 49152, 1))
QUICK_SHAPES = (Shape("in", 80, 96, 2), Shape("out", 96, 80, 2))  # K = 80: a short last block


# ----------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class RowsSettings:
    """What ``--rows`` and ``--rows-exports`` measure. ``rows``: product row counts;
    ``export_rows``: batch sizes of the exports' decode steps (one new token each); ``context``:
    prompt length before the timed steps; ``candidates``: names of ``products.CANDIDATES``."""

    shapes: tuple[Shape, ...] = SHAPES
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    export_rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 30
    threads: int = 2
    context: int = 64
    new_tokens: int = 32
    settle_ms: int = 200
    seed: int = 0
    candidates: tuple[str, ...] = tuple(c.name for c in CANDIDATES)

    def __post_init__(self) -> None:
        check_counts(self, lists=("rows", "export_rows"), positive=("repeats", "threads", "context", "new_tokens"),
                     non_negative=("settle_ms",))
        for name in self.candidates:
            get_candidate(name)


QUICK_ROWS = RowsSettings(shapes=QUICK_SHAPES, rows=(1, 3), export_rows=(1, 2), repeats=2, threads=1,
                          context=8, new_tokens=4, settle_ms=0)


def rows_settings(args: argparse.Namespace) -> RowsSettings:
    """``tfport bench --rows`` options -> settings: ``QUICK_ROWS`` with ``--quick``, else the
    defaults; ``--batch`` sets both row lists, ``--contexts`` (its first) the context."""
    changes: dict[str, Any] = {}
    if args.batch:
        changes["rows"] = changes["export_rows"] = tuple(args.batch)
    if args.contexts:
        changes["context"] = args.contexts[0]
    for option, name in (("repeats", "repeats"), ("threads", "threads"), ("new_tokens", "new_tokens"),
                         ("settle_ms", "settle_ms"), ("seed", "seed")):
        if getattr(args, option) is not None:
            changes[name] = getattr(args, option)
    return replace(QUICK_ROWS if args.quick else RowsSettings(), **changes)


# ----------------------------------------------------------------------------------- products
def measure_shape(shape: Shape, settings: RowsSettings, rng: np.random.Generator
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every candidate on one shape -> (memory entries, one per candidate; cells, one per
    candidate, session and row count). A candidate whose graph ONNX Runtime cannot open or run
    gets ``skipped`` with the reason and no cells."""
    weight = (rng.standard_normal((shape.n, shape.k)) * 0.05).astype(np.float32)  # [N, K]
    memory, sessions = [], {}
    for name in settings.candidates:
        product = get_candidate(name).build(weight)
        entry: dict[str, Any] = {"shape": shape.name, "candidate": name, "stored_bytes": product.stored_bytes}
        try:
            for kind in SESSIONS:
                session, added = open_measured(product, settings.threads, kind)
                sessions[name, kind] = (session, product)
                entry[f"{kind}_session_mib"] = added
        except ORT_ERRORS as err:  # e.g. a kernel this CPU provider lacks
            log.warning("%s on %s skipped: %s", name, shape.name, err)
            entry["skipped"] = f"{type(err).__name__}: {err}"
            sessions = {key: value for key, value in sessions.items() if key[0] != name}
        memory.append(entry)
    cells = []
    for m in settings.rows:
        x = rng.standard_normal((m, shape.k)).astype(np.float32)  # [M, K]
        calls = {f"{name}/{kind}": bound_call(session, x.astype(product.dtype), np.empty((m, shape.n), product.dtype))
                 for (name, kind), (session, product) in sessions.items()}
        samples = time_calls(calls, settings.repeats, settings.settle_ms)
        for (name, kind) in sessions:
            us = samples[f"{name}/{kind}"]
            cells.append({"shape": shape.name, "candidate": name, "session": kind, "rows": m,
                          "us": statistics.median(us), "us_samples": us})
        log.info("%s rows %d: %s", shape.name, m, ", ".join(
            f"{c['candidate']}/{c['session']} {c['us']:.1f}" for c in cells if c["rows"] == m))
    return memory, cells


def step_totals(shapes: Sequence[Shape], cells: Sequence[dict[str, Any]],
                memory: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per candidate, session and row count measured on every shape: the products of one decode
    step, sum of count x us, and the bytes of the weights they read (sum of count x stored)."""
    counts = {s.name: s.count for s in shapes}
    stored = {(e["shape"], e["candidate"]): e["stored_bytes"] for e in memory}
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for cell in cells:
        groups.setdefault((cell["candidate"], cell["session"], cell["rows"]), []).append(cell)
    totals = []
    for (name, kind, m), group in groups.items():
        if len(group) != len(shapes):  # skipped on some shape
            continue
        totals.append({"candidate": name, "session": kind, "rows": m,
                       "us": sum(counts[c["shape"]] * c["us"] for c in group),
                       "weight_bytes": sum(counts[s.name] * stored[s.name, name] for s in shapes)})
    return totals


def run_products(settings: RowsSettings) -> dict[str, Any]:
    """Every candidate on every shape at every row count -> {"memory", "cells", "step", "fastest",
    "overhead_us", "candidates", "shapes"}."""
    rng = np.random.default_rng(settings.seed)
    memory, cells = [], []
    for shape in settings.shapes:
        shape_memory, shape_cells = measure_shape(shape, settings, rng)
        memory += shape_memory
        cells += shape_cells
    step = step_totals(settings.shapes, cells, memory)
    picks = []
    for m in settings.rows:
        pick = {"rows": m, "per_shape": {s.name: _pick(c for c in cells if c["shape"] == s.name and c["rows"] == m)
                                         for s in settings.shapes}}
        at_m = [t for t in step if t["rows"] == m]
        if at_m:
            pick["step"] = _pick(at_m)
        picks.append(pick)
    overhead = overhead_us(settings.shapes[0].k, settings.rows, settings.repeats, settings.threads)
    return {"candidates": [{"name": c.name, "summary": c.summary} for c in CANDIDATES if c.name in settings.candidates],
            "shapes": [vars(s) for s in settings.shapes], "memory": memory, "cells": cells, "step": step,
            "fastest": picks, "overhead_us": {str(m): us for m, us in overhead.items()}}


def _pick(cells) -> dict[str, Any] | None:
    """The fastest of ``cells`` (None for none): its candidate, session and us."""
    best = min(cells, key=lambda c: c["us"], default=None)
    if best is None:
        return None
    return {"candidate": best["candidate"], "session": best["session"], "us": best["us"]}


# ------------------------------------------------------------------------------------ exports
def run_exports(directories: Sequence[str], settings: RowsSettings) -> list[dict[str, Any]]:
    """Each export's greedy decode step at each of ``settings.export_rows`` rows (a batch of that
    many prompts of ``settings.context`` random tokens), the exports alternated by
    ``measurement.measure`` -> one row per export and row count: median step ms, tokens/s, the
    export's files and the resident memory its loading added."""
    from tfport.runtime import load_model

    models, loaded = {}, {}
    for directory in directories:
        before = resident_mb()
        model = load_model(directory, intra_op_threads=settings.threads)
        after = resident_mb()
        models[directory] = model
        files = sum(f.stat().st_size for f in Path(directory).iterdir() if f.is_file())
        loaded[directory] = {"files_mib": files / MIB, "quantization": export_format(model),
                             "load_mib": None if before is None or after is None else after - before}
    vocab = min(model.config.vocab_size for model in models.values())
    rng = np.random.default_rng(settings.seed)
    results = []
    for batch in settings.export_rows:
        prompts = rng.integers(0, vocab, size=(batch, settings.context), dtype=np.int64)  # [B, C]
        runs = [lambda steps, model=model: time_tfport(model, prompts, steps) for model in models.values()]
        timings = measure(runs, settings.new_tokens, settings.repeats, settings.settle_ms)
        for directory, timed in zip(models, timings):
            row = make_row("tfport", directory, batch, settings.context, timed, kv_bytes=0)
            results.append({"export": directory, **loaded[directory], "rows": batch, "context": settings.context,
                            "step_ms": row.step_ms, "tokens_per_s": row.tokens_per_s,
                            "step_ms_repeats": row.step_ms_repeats, "prefill_ms": row.prefill_ms})
            log.info("%s rows %d: step %.2f ms", directory, batch, row.step_ms)
    return results


# ------------------------------------------------------------------------------------- report
def run_rows(settings: RowsSettings, products: bool, exports: Sequence[str] = ()) -> dict[str, Any]:
    """The measurements asked for, with the settings and the machine."""
    result: dict[str, Any] = {"format": JSON_FORMAT, "settings": _settings_dict(settings, products, exports),
                              "machine": {**machine_info(DEFAULT), "load_average_before": load_average()}}
    if products:
        result["products"] = run_products(settings)
    if exports:
        result["exports"] = run_exports(exports, settings)
    result["machine"]["load_average_after"] = load_average()
    return result


def _settings_dict(settings: RowsSettings, products: bool, exports: Sequence[str]) -> dict[str, Any]:
    data = {name: getattr(settings, name) for name in ("rows", "export_rows", "repeats", "threads", "context",
                                                       "new_tokens", "settle_ms", "seed", "candidates")}
    return {**data, "products": products, "exports": list(exports), "block_size": BLOCK_SIZE,
            "sample_seconds": SAMPLE_SECONDS}


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_rows(result: dict[str, Any]) -> str:
    """The result as text tables: us per product by rows (per shape, then per step), the fastest
    per row count, and the exports' step times."""
    settings = result["settings"]
    lines = []
    if "products" in result:
        products = result["products"]
        rows = settings["rows"]
        head = f"{'candidate':<14} {'session':<15} {'weights MiB':>11} {'+session MiB':>12} " + \
            " ".join(f"{m:>8}" for m in rows)
        for shape in products["shapes"]:
            lines += ["", f"{shape['name']}: [M, {shape['k']}] @ [{shape['k']}, {shape['n']}], "
                      f"{shape['count']} per step; us per product by rows M", head, "-" * len(head)]
            for entry in (e for e in products["memory"] if e["shape"] == shape["name"]):
                if "skipped" in entry:
                    lines.append(f"{entry['candidate']:<14} skipped: {entry['skipped'][:100]}")
                    continue
                for kind in SESSIONS:
                    us = {c["rows"]: c["us"] for c in products["cells"] if c["shape"] == shape["name"]
                          and c["candidate"] == entry["candidate"] and c["session"] == kind}
                    lines.append(f"{entry['candidate']:<14} {kind:<15} {entry['stored_bytes'] / MIB:>11.2f} "
                                 f"{_mib(entry[f'{kind}_session_mib']):>12} "
                                 + " ".join(f"{us[m]:>8.1f}" for m in rows))
        lines += ["", "one decode step's products (sum of count x us) by rows M; weights: all products' bytes",
                  head, "-" * len(head)]
        for name in settings["candidates"]:
            for kind in SESSIONS:
                step = {t["rows"]: t for t in products["step"] if t["candidate"] == name and t["session"] == kind}
                if step:
                    weight = next(iter(step.values()))["weight_bytes"] / MIB
                    lines.append(f"{name:<14} {kind:<15} {weight:>11.2f} {'':>12} "
                                 + " ".join(f"{step[m]['us']:>8.0f}" for m in rows))
        lines += ["", "fastest by rows M (per step, then per shape)"]
        for pick in products["fastest"]:
            best = pick.get("step")
            shapes = ", ".join(f"{name} {p['candidate']}/{p['session']}" for name, p in pick["per_shape"].items() if p)
            lines.append(f"M={pick['rows']:<3} step: " + (f"{best['candidate']}/{best['session']} "
                                                          f"{best['us']:.0f} us" if best else "-") + f"; {shapes}")
        overhead = ", ".join(f"{us:.1f}" for us in products["overhead_us"].values())
        lines.append(f"one bound call of an Identity graph (included above): {overhead} us by rows")
    if "exports" in result:
        head = f"{'export':<40} {'quant':<7} {'files MiB':>9} {'load MiB':>8} {'rows':>4} {'step ms':>8} " \
               f"{'tokens/s':>9} {'x rows=1':>8}"
        lines += ["", f"decode steps, context {settings['context']}, median of {settings['repeats']} runs of "
                  f"{settings['new_tokens']} steps", head, "-" * len(head)]
        for row in result["exports"]:
            one = next((r for r in result["exports"] if r["export"] == row["export"] and r["rows"] == 1), None)
            ratio = f"{row['tokens_per_s'] / one['tokens_per_s']:.2f}" if one else "-"
            lines.append(f"{row['export'][-40:]:<40} {row['quantization'][:7]:<7} {row['files_mib']:>9.1f} "
                         f"{_mib(row['load_mib']):>8} {row['rows']:>4} {row['step_ms']:>8.2f} "
                         f"{row['tokens_per_s']:>9.1f} {ratio:>8}")
    lines.append(f"\n{settings['threads']} threads; load average {result['machine']['load_average_before']} -> "
                 f"{result['machine']['load_average_after']}: timings on a loaded machine mean little")
    return "\n".join(lines).lstrip("\n")


def run_rows_cli(args: argparse.Namespace) -> int:
    """``tfport bench --rows`` / ``--rows-exports``: measure, print, write ``--json``."""
    settings = rows_settings(args)
    result = run_rows(settings, products=args.rows, exports=tuple(args.rows_exports or ()))
    print(format_rows(result))
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
