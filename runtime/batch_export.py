"""A batch export: another export of the same model whose sessions run the graph runs of many
rows (``Model.load(batch_export=...)``, ``tfport serve --batch-export``): opened and checked
against the model's contract (``attach_batch_export``), and the row count from which it takes
over, given or measured where the two exports' speeds cross (``use_batch_export``)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np

from tfport.config.checks import is_int
from tfport.manifest import Manifest

from .binding import GraphRunner
from .opening import open_export
from .session import SessionSettings

logger = logging.getLogger(__name__)


# ``batch_rows="auto"`` (the default) measures from how many rows the batch export is faster
# (``measure_batch_rows``); where it cannot be measured (not a decoder), this many: on the 2-core
# AMD EPYC (AVX2) VM, SmolLM2-135M int4 against w8a8 (tfport bench --rows-exports): 10.4 against
# 11.1 ms a step at 4 rows, 17.2 against 14.5 at 8, 31.4 against 22.7 at 16.
AUTO = "auto"
BATCH_ROWS = 8
PROBE_ROWS = (1, 2, 4, 8, 16, 32)  # prompt lengths measure_batch_rows times on each session


def check_batch_rows(batch_rows) -> None:
    """``ValueError`` unless ``batch_rows`` is "auto" or a positive integer."""
    if batch_rows != AUTO and (not is_int(batch_rows) or batch_rows < 1):
        raise ValueError(f"batch_rows={batch_rows!r}: expected {AUTO!r} or a positive integer (rows, batch "
                         "x new tokens)")


def measure_batch_rows(runner: GraphRunner, score: Callable[[GraphRunner, np.ndarray], Iterator[np.ndarray]],
                       vocab: int, max_rows: int, repeats: int = 3) -> tuple[int | None, dict[int, tuple[float, float]]]:
    """From how many rows ``runner.batch_session`` runs a decoder faster than ``runner.session``
    -> (``crossover`` of the times, {rows: (own, batch) median seconds}). Each probe (``PROBE_ROWS``
    up to ``max_rows``) scores one prompt of that many tokens (``score``: the layout's, one
    sequence's logits) on each session, a warm-up then ``repeats`` runs taking turns. The
    products decide it (attention and the rest are the same float kernels on both sides), and a
    prompt of S tokens feeds them S rows as a decode step of S rows does."""
    own = GraphRunner(runner.session, runner.spec, runner.device_id)
    other = GraphRunner(runner.batch_session, runner.spec, runner.device_id)
    probes = [rows for rows in PROBE_ROWS if rows <= max_rows]
    ids = np.random.default_rng(0).integers(0, vocab, size=(1, max(probes)))
    times = {}
    for rows in probes:
        samples: dict[int, list[float]] = {0: [], 1: []}
        for side in (own, other):
            collections.deque(score(side, ids[:, :rows]), maxlen=0)  # run it: score yields its pieces
        for _ in range(repeats):
            for index, side in enumerate((own, other)):
                start = time.perf_counter()
                collections.deque(score(side, ids[:, :rows]), maxlen=0)
                samples[index].append(time.perf_counter() - start)
        times[rows] = (statistics.median(samples[0]), statistics.median(samples[1]))
    return crossover(times), times


def crossover(times: dict[int, tuple[float, float]]) -> int | None:
    """{rows: (own seconds, batch seconds)} -> the fewest rows from which the batch side is faster
    at every larger size measured, or None where it is not faster at the largest."""
    found = None
    for rows in sorted(times, reverse=True):
        own, batch = times[rows]
        if batch >= own:
            break
        found = rows
    return found


def attach_batch_export(runners: dict[str, GraphRunner], manifest: Manifest, batch_export: str | os.PathLike,
                        settings: SessionSettings, verify: str = "full", batch_rows: int = BATCH_ROWS) -> Manifest:
    """Open ``batch_export`` with ``settings`` and hand each runner its session of the same graph,
    for runs of at least ``batch_rows`` rows (``GraphRunner.session_for``) -> its manifest.

    The two exports must be of one model with one contract (config, cache layout and dtype,
    every graph's inputs and outputs), so that a row's KV cache written by one session is read
    by the other; their weights may differ (int4 for few rows, w8a8 for many: export/w8a8.py),
    and are not compared (two fine-tunes of one architecture pass the check). A row's tokens
    then depend on how many rows its steps had."""
    check_batch_rows(batch_rows)
    if batch_rows == AUTO:
        raise ValueError(f"batch_rows={AUTO!r}: measured by Model.load; attach_batch_export takes a number")
    try:
        directory, other, batch_runners, _ = open_export(batch_export, settings, verify)
    except (ValueError, TypeError) as err:  # they name model_dir
        shown = str(batch_export) if isinstance(batch_export, (str, os.PathLike)) else batch_export
        raise type(err)(f"batch_export={shown!r}: {err}") from None
    mine, theirs = _contract(manifest), _contract(other)
    for field in mine:
        if mine[field] != theirs[field]:
            if field == "config":  # name the first config field that differs
                ours, other_config = dataclasses.asdict(manifest.config), dataclasses.asdict(other.config)
                field = "config's " + next(k for k in ours if ours[k] != other_config.get(k))
            raise ValueError(f"batch_export={str(directory)!r}: its {field} differs from the model's; "
                             "expected an export of the same model with the same target, dtype and "
                             "cache (only the quantisation may differ, e.g. --quantize w8a8)")
    for name, runner in runners.items():
        if batch_runners[name].device != runner.device:
            raise ValueError(f"batch_export={str(directory)!r}: its {name} graph runs on "
                             f"{batch_runners[name].device}, the model's on {runner.device}")
        runner.batch_session, runner.batch_rows = batch_runners[name].session, batch_rows
    return other


def _contract(manifest: Manifest) -> dict:
    """What two exports must share for one to run the other's rows (``attach_batch_export``)."""
    return {"config": manifest.config, "layout": manifest.layout, "dtype": manifest.dtype,
            "kv_dtype": manifest.kv_dtype,
            "graphs": {name: (graph.inputs, graph.outputs) for name, graph in manifest.graphs.items()}}


def use_batch_export(model, batch_export: str | os.PathLike | None, batch_rows: int | str,
                     verify: str = "full") -> None:
    """``Model.load``'s ``batch_export`` and ``batch_rows`` for ``model`` (just opened): the batch
    export attached to every runner (``model.batch_manifest`` set), from ``batch_rows`` rows or,
    with "auto", from the measured crossover (decoders; other families ``BATCH_ROWS``); where
    the batch export is never faster, it is detached with a warning, ``batch_manifest`` staying,
    so that what depends on a batch export having been asked for (the refusal of exact
    speculation) does not depend on a timing."""
    check_batch_rows(batch_rows)
    if batch_export is None:
        if batch_rows != AUTO:
            raise ValueError(f"batch_rows={batch_rows!r}: applies with batch_export (none given)")
        return
    runners = model.runners
    measured = batch_rows == AUTO and model.config.family == "decoder"
    model.batch_manifest = attach_batch_export(runners, model.manifest, batch_export, model.settings, verify,
                                               BATCH_ROWS if batch_rows == AUTO else batch_rows)
    if not measured:
        logger.info("batch_export %s: runs of %d rows or more%s", batch_export, next(iter(runners.values())).batch_rows,
                    " ('auto' is measured for decoders only)" if batch_rows == AUTO else "")
        return
    rows, times = measure_batch_rows(runners["decoder"], model.decoding.score, model.config.vocab_size,
                                     model.config.max_positions)
    table = ", ".join(f"{n}: {own * 1e3:.1f}/{batch * 1e3:.1f}" for n, (own, batch) in times.items())
    if rows is None:
        logger.warning("batch_export %s: not faster than the model's own export at any row count "
                       "measured (rows: own/batch ms %s); not used", batch_export, table)
    else:
        logger.info("batch_export %s: runs of %d rows or more, measured (rows: own/batch ms %s)",
                    batch_export, rows, table)
    for runner in runners.values():
        if rows is None:
            runner.batch_session = None
        else:
            runner.batch_rows = rows
