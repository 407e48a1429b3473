"""One benchmark run: export per target, open the exports, time every cell, assemble the result.

Target names stay strings here: they go to ``ExportOptions(target=name)`` and name the rows;
the only decision made on a name is ``_required_target``.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tfport.presets import get_preset

from tfport.export.targets import DEFAULT_TARGET
from .measurement import (BenchSettings, Row, RunTiming, load_average, machine_info, make_row,
                          mark_memory, measure, time_tfport, time_torch)
from .report import BenchResult, Skipped, fill_comparisons, step_growth
from .roofline import fill_roofline, kv_cache_bytes, measure_bandwidth, weight_bytes_per_token

log = logging.getLogger(__name__)


def _required_target(target: str) -> bool:
    """Whether a failure of ``target`` ends the run instead of skipping the target: true for the
    exporter's default target, which every decoder must export to and run."""
    return target == DEFAULT_TARGET


def export_targets(module: nn.Module, targets: Sequence[str], root: Path, dtype: str = "float32"
                   ) -> tuple[dict[str, Path], list[Skipped]]:
    """Export ``module`` once per target into ``root/<target>``.

    A ``TypeError``/``ValueError`` from ``export_model`` for a target other than the required one
    (an unknown name, or a target that refuses this model) makes it a skipped target with the
    reason.
    """
    from tfport.export.exporter import export_model
    from tfport.export.options import ExportOptions

    exports, skipped = {}, []
    for target in targets:
        try:
            export_model(module, root / target, ExportOptions(dtype=dtype, target=target, validate=True))
        except (TypeError, ValueError) as err:
            if _required_target(target):
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
            if _required_target(target):
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
    load_before = load_average()
    memory = [mark_memory("start")]
    module = build_model(config, seed=settings.seed)
    memory.append(mark_memory("model built"))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="tfport-bench-") as tmp:
            exports, skipped = export_targets(module, settings.targets, Path(tmp), settings.dtype)
            memory.append(mark_memory("exported"))
            models, load_skipped = load_exports(exports, settings)
            skipped += load_skipped
            memory.append(mark_memory("sessions loaded"))
            module = module.to(device, getattr(torch, settings.dtype))  # the PyTorch side in the bench's dtype
            weight_bytes = weight_bytes_per_token(module)  # as stored: widened on CPU (see BenchSettings)
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
    model_info = {"preset": settings.preset, "dtype": settings.dtype, "parameters": params,
                  "weight_bytes_per_token": weight_bytes, "config": config.to_dict()}
    machine = {**machine_info(settings), "load_average_before": load_before,
               "load_average_after": load_average()}
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
            timings = measure([run for _, _, run in sides], steps, repeats, settings.settle_ms)
            for (side, target, _), runs in zip(sides, timings):
                row = make_row(side, target, batch, context, runs, kv_bytes)
                log.info("%s batch %d context %d: prefill %.1f ms, step %.2f ms (%.1f tokens/s)",
                         row.label, batch, context, row.prefill_ms, row.step_ms,
                         row.tokens_per_s)
                rows.append(row)
    return rows
