"""What the exporter runs an export it wrote with: the one module of ``tfport.export`` that
imports ``tfport.runtime`` (``tests/core/test_imports.py`` holds it to that).

- ``make_session``: a graph's ONNX Runtime session as the parity runner opens it (on the runtime's
  process-wide thread pool once that exists); ``cuda_available`` probes for a CUDA one.
- ``relayout_for``: how a parity case made in the ``concat`` cache layout is fed to another
  layout's graph, which that layout's runtime module knows (``LayoutDecoding.relayout``).
- ``export_speed``: an export's decode tokens/s (an encoder's sentences/s) under the runtime, with
  its timing primitive ``time_tfport``: ``--max-loss`` times its candidate layouts with it, the
  benchmarks (``tfport.tools.bench``) every tfport side.

The post-export validation itself, ``validate_export``, is the parity runner's
(``export/parity/runner.py``), built on these.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tfport.runtime import load_model
from tfport.runtime.decoding import decoding_for
from tfport.runtime.threads import shared_pool

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
SPEED_STEPS, SPEED_REPEATS = 16, 3  # export_speed: decode steps per timed run, runs (the median)


def make_session(model: str | Path | bytes, provider: str = "cpu",
                 config: dict[str, str] | None = None) -> ort.InferenceSession:
    """An ONNX Runtime session on ``provider`` (``config``: session config entries); raises if
    CUDA was asked for and not obtained."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if shared_pool() is not None:  # once ONNX Runtime's process-wide pool exists, every session runs on it
        options.use_per_session_threads = False
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    source = model if isinstance(model, bytes) else str(model)
    session = ort.InferenceSession(source, options, providers=PROVIDERS[provider])
    if provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"provider='cuda': ONNX Runtime could not create a CUDA session "
                           f"(got {session.get_providers()})")
    return session


def cuda_available() -> tuple[bool, str]:
    """(usable, reason): whether a CUDA session can really be created here."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    ort.set_default_logger_severity(4)  # the probe's failure is reported by the return value
    try:
        make_session(model.SerializeToString(), "cuda")
    except Exception as err:  # noqa: BLE001 - any failure means "not usable", with its reason
        return False, f"CUDA execution provider not usable here: {str(err).splitlines()[0][:200]}"
    finally:
        ort.set_default_logger_severity(2)
    return True, "CUDA execution provider creates sessions"


def relayout_for(layout: str) -> Callable:
    """``layout``'s ``relayout``: a parity case made in the ``concat`` layout, as that layout's
    graph is fed (``tfport.runtime.decoding``'s module of the layout)."""
    return decoding_for(layout).relayout


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


def export_speed(export_dir: str | Path, steps: int = SPEED_STEPS, repeats: int = SPEED_REPEATS) -> float:
    """Decode tokens/s of the export in ``export_dir`` under the runtime: batch 1, a prompt of 16
    random ids, the median of ``repeats`` runs' median step of ``steps`` greedy steps, after a
    warm-up (an encoder: sentences/s of a batch of 8 x 64 ids, the median of ``repeats``)."""
    runtime = load_model(export_dir)
    config = runtime.config
    rng = np.random.default_rng(0)
    if config.family == "decoder":
        prompt = rng.integers(min(100, config.vocab_size // 2), config.vocab_size, size=(1, 16))
        time_tfport(runtime, prompt, 2)  # warm-up
        medians = [statistics.median(time_tfport(runtime, prompt, steps).step_ms) for _ in range(repeats)]
        return 1e3 / statistics.median(medians)
    batch = rng.integers(min(100, config.vocab_size // 2), config.vocab_size, size=(8, 64))
    runtime.encode(batch)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runtime.encode(batch)
        times.append(time.perf_counter() - start)
    return len(batch) / statistics.median(times)
