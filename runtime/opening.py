"""Opening an export directory (``Model.load``): its manifest read and checked, its files
verified against the sizes and sha256 the manifest records (``tfport.integrity``), one ONNX
Runtime session per graph with its settings fingerprint checked, and the manifest's device
refusals applied."""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tfport.contract import MANIFEST_FILE
from tfport.integrity import VERIFY_MODES, check_graph_metadata, verify_files
from tfport.manifest import Manifest

from .binding import GraphRunner
from .session import SessionSettings, graph_metadata, open_session

logger = logging.getLogger(__name__)


def open_export(model_dir: str | os.PathLike, settings: SessionSettings, verify: str = "full"
                ) -> tuple[Path, Manifest, dict[str, GraphRunner], SessionSettings]:
    """Open ``model_dir`` with ``settings``, checked as ``verify`` says (see ``Model.load``) ->
    (the directory, its manifest, graph name -> runner, the settings the sessions got: provider
    ``"auto"`` resolved to the first graph's device)."""
    if not isinstance(model_dir, (str, os.PathLike)) or isinstance(os.fspath(model_dir), bytes):
        raise TypeError(f"model_dir: expected a path, got {type(model_dir).__name__} (pass a "
                        "str or os.PathLike)")
    if not isinstance(verify, str) or verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: expected one of {list(VERIFY_MODES)}")
    directory = Path(model_dir)
    try:
        manifest = Manifest.read(directory)  # ValueError naming model_dir when not an export
    except (KeyError, TypeError) as err:
        raise ValueError(f"model_dir={str(directory)!r}: {MANIFEST_FILE} is incomplete or "
                         f"malformed ({type(err).__name__}: {err}); re-export it") from None
    if manifest.files is None:
        if verify != "none":
            raise ValueError(f"model_dir={str(directory)!r}: written by an older tfport (manifest "
                             f"format 2), which records no file hashes or settings fingerprints, "
                             f"so verify={verify!r} cannot check it; re-export it, or load it "
                             "unverified with verify='none' (--verify none)")
        logger.warning("model_dir=%r: written by an older tfport (manifest format 2), which "
                       "records no file hashes or settings fingerprints: nothing is verified; "
                       "re-export to get the checks", str(directory))
    else:
        verify_files(directory, manifest.files, verify)
    runners = {}
    for name, spec in manifest.graphs.items():
        session = open_session(directory / spec.file, spec, settings)
        if manifest.files is not None:
            check_graph_metadata(graph_metadata(session, spec.file), manifest.settings,
                                 spec.file, f"model_dir={str(directory)!r}")
        runners[name] = GraphRunner(session, spec, settings.device_id)
        if settings.provider == "auto":  # the other graphs follow the first one's device
            chosen = "cuda" if runners[name].device == "cuda" else "cpu"
            settings = dataclasses.replace(settings, provider=chosen)
    for device in {r.device for r in runners.values()} & set(manifest.device_refusals):
        raise ValueError(f"model_dir={str(directory)!r}: {manifest.device_refusals[device]}")
    return directory, manifest, runners, settings


# ``batch_rows="auto"`` (the default) measures from how many rows the batch export is faster
# (``measure_batch_rows``); where it cannot be measured (not a decoder), this many: on the 2-core
# AMD EPYC (AVX2) VM, SmolLM2-135M int4 against w8a8 (tfport bench --rows-exports): 10.4 against
# 11.1 ms a step at 4 rows, 17.2 against 14.5 at 8, 31.4 against 22.7 at 16.
AUTO = "auto"
BATCH_ROWS = 8
PROBE_ROWS = (1, 2, 4, 8, 16, 32)  # prompt lengths measure_batch_rows times on each session


def check_batch_rows(batch_rows) -> None:
    """``ValueError`` unless ``batch_rows`` is "auto" or a positive integer."""
    if batch_rows != AUTO and (isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1):
        raise ValueError(f"batch_rows={batch_rows!r}: expected {AUTO!r} or a positive integer (rows, batch "
                         "x new tokens)")


def measure_batch_rows(runner: GraphRunner, score: Callable[[GraphRunner, np.ndarray], np.ndarray],
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
            score(side, ids[:, :rows])
        for _ in range(repeats):
            for index, side in enumerate((own, other)):
                start = time.perf_counter()
                score(side, ids[:, :rows])
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
