"""``tfport bench --embed DIR[,DIR...]``: encoder exports' throughput in sentences per second.

Each export embeds the same ``sentences`` random sentences of ``length`` tokens (token ids drawn
from the vocabulary with ``seed``; the compute does not depend on the words), in batches of each
of ``batches`` sizes, with ``Model.embed`` (the encoder graph and the pooling, as ``embed_text``
runs them after tokenising). The exports alternate in ``repeats`` rounds
(``measurement.measure``: a burst of load hits every side, a pause of ``settle_ms`` before each
run); the table gives the median sentences per second, and ``--json`` every repeat.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tfport.files import write_text_atomic

from .measurement import DEFAULT, check_counts, export_format, load_average, machine_info, measure

log = logging.getLogger(__name__)

JSON_FORMAT = "tfport-bench-embed/1"


@dataclass(frozen=True)
class EmbedSettings:
    """What ``--embed`` measures: ``batches`` sizes, sentences of ``length`` tokens, ``sentences``
    per timed run (each run embeds all of them), ``repeats`` runs per cell, ONNX Runtime
    ``threads``."""

    batches: tuple[int, ...] = (1, 32)
    length: int = 20
    sentences: int = 64
    repeats: int = 5
    threads: int = 2
    settle_ms: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        check_counts(self, lists=("batches",), positive=("length", "sentences", "repeats", "threads"),
                     non_negative=("settle_ms",))


QUICK_EMBED = EmbedSettings(batches=(1, 2), length=8, sentences=4, repeats=1, threads=1, settle_ms=0)


def embed_settings(args: argparse.Namespace) -> EmbedSettings:
    """``tfport bench --embed`` options -> settings: ``QUICK_EMBED`` with ``--quick``, else the
    defaults; ``--batch`` the batch sizes, ``--contexts`` (its first) the sentence length."""
    changes: dict[str, Any] = {}
    if args.batch:
        changes["batches"] = tuple(args.batch)
    if args.contexts:
        changes["length"] = args.contexts[0]
    for option in ("repeats", "threads", "settle_ms", "seed"):
        if getattr(args, option) is not None:
            changes[option] = getattr(args, option)
    return replace(QUICK_EMBED if args.quick else EmbedSettings(), **changes)


def run_embed(directories: Sequence[str], settings: EmbedSettings) -> dict[str, Any]:
    """Every export at every batch size -> the result (rows: export, quantisation, batch,
    sentences/s and the seconds of each repeat). Raises ``ValueError`` naming ``--embed`` for an
    export that is not an encoder."""
    from tfport.runtime import load_model

    models = {}
    for directory in directories:
        model = load_model(directory, intra_op_threads=settings.threads)
        if model.config.family != "encoder":
            raise ValueError(f"--embed {directory!r}: a {model.config.family} export; expected encoder "
                             "exports (sentence embeddings)")
        models[directory] = model
    vocab = min(model.config.vocab_size for model in models.values())
    ids = np.random.default_rng(settings.seed).integers(min(100, vocab // 2), vocab,
                                                        size=(settings.sentences, settings.length))  # [N, L]
    result: dict[str, Any] = {"format": JSON_FORMAT, "settings": asdict(settings), "exports": list(directories),
                              "machine": {**machine_info(DEFAULT), "load_average_before": load_average()},
                              "rows": []}
    for batch in settings.batches:
        runs = [lambda _steps, model=model, batch=batch: _embed_all(model, ids, batch) for model in models.values()]
        for (directory, model), seconds in zip(models.items(), measure(runs, 1, settings.repeats, settings.settle_ms)):
            per_s = settings.sentences / statistics.median(seconds)
            result["rows"].append({"export": directory, "quantization": export_format(model), "batch": batch,
                                   "sentences_per_s": per_s, "seconds_repeats": seconds})
            log.info("%s batch %d: %.1f sentences/s", directory, batch, per_s)
    result["machine"]["load_average_after"] = load_average()
    return result


def _embed_all(model, ids: np.ndarray, batch: int) -> float:
    """Seconds to embed every row of ``ids`` [N, L], ``batch`` rows per call."""
    start = time.perf_counter()
    for first in range(0, len(ids), batch):
        model.embed(ids[first:first + batch])
    return time.perf_counter() - start


def format_embed(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [f"{settings['sentences']} sentences of {settings['length']} tokens per run, median of "
             f"{settings['repeats']}, {settings['threads']} threads", "",
             f"{'export':44s} {'format':8s} {'batch':>5s} {'sentences/s':>12s}"]
    for row in result["rows"]:
        lines.append(f"{Path(row['export']).name[:44]:44s} {row['quantization']:8s} {row['batch']:5d} "
                     f"{row['sentences_per_s']:12.1f}")
    return "\n".join(lines)


def run_embed_cli(args: argparse.Namespace) -> int:
    """``tfport bench --embed``: measure, print, write ``--json``."""
    result = run_embed(args.embed, embed_settings(args))
    print(format_embed(result))
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
