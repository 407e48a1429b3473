"""How much memory an export will need at its peak, estimated before it starts, and the refusal
when that is more than the machine has: better a clear message in a second than the kernel's
out-of-memory killer after minutes.

A streamed export (``tfport.models.lazy``) holds throughout the interpreter with torch, onnx and
onnxruntime, and the whole model in float32 only when it is not lazy (a module built in memory)
or when a step needs it all (``max_loss``). Then, one after the other: writing the graphs holds
the largest tensor being read, quantised and written (float32, with the copies a quantiser
makes); GPTQ calibration before it holds one group of layers' Hessians and the matrices being
quantised, and its codes (half a byte per 4-bit weight) stay to the end; validating holds an ONNX Runtime
session of the written graphs (the reference's outputs are computed before it opens, reading
less than the writing did). The figures are sized from measurements of Llama-shaped exports (docs/scale.md) with a
margin, not from first principles: an estimate that errs high refuses a little early.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

GiB = 2**30
BASE_BYTES = int(0.8 * GiB)  # python with torch, onnx, onnxscript and onnxruntime imported
TENSOR_COPIES = 3  # the largest tensor: read in float32, its quantised bytes and row keys (measured 2.6 at 8B)
SESSION_OVERHEAD = 1.3  # an ONNX Runtime session over its weights' bytes (prepacked products, arena)
CODE_MARGIN = 1.1  # calibration's codes and scales, plus their row keys and zero points

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryEstimate:
    """An export's estimated peak, in bytes: ``parts`` held throughout, and ``phases`` (name ->
    parts) that follow one another, so only the largest of them adds to ``parts``."""

    parts: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values()) + max((sum(p.values()) for p in self.phases.values()), default=0)

    def part(self, name: str) -> int | None:
        """Part ``name``'s bytes, throughout or in a phase (None if there is none)."""
        for parts in (self.parts, *self.phases.values()):
            if name in parts:
                return parts[name]
        return None

    def describe(self) -> str:
        def listed(parts: dict[str, int]) -> str:
            return ", ".join(f"{name} {size / GiB:.1f} GiB" for name, size in parts.items())

        text = listed(self.parts)
        phases = {name: parts for name, parts in self.phases.items() if parts}
        if len(phases) == 1:
            return ", ".join(filter(None, [text, listed(next(iter(phases.values())))]))
        if phases:
            named = [f"{name} ({listed(parts)})" for name, parts in phases.items()]
            which = "larger" if len(named) == 2 else "largest"
            text += f"; then the {which} of " + ", ".join(named[:-1]) + " and " + named[-1]
        return text


def available_bytes() -> int | None:
    """Memory this process can still use: MemAvailable, or less under a cgroup limit; None where
    neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            room = int(limit) - used
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def stored_bytes_per_value(scheme, dtype: str) -> float:
    """Bytes one weight value takes in the export under ``scheme`` (None: the dtype's)."""
    if scheme is None:
        return 4.0 if dtype == "float32" else 2.0
    return scheme.bytes_per_value()


def estimate_export(model: nn.Module, options, scheme, calibrating: bool) -> MemoryEstimate:
    """The peak of exporting ``model`` with ``options`` (``ExportOptions``), ``scheme`` (the
    resolved quantisation or None) and GPTQ calibration or not."""
    from tfport.models.lazy import is_lazy, parameter_names

    from .calibrate import HESSIAN_BUDGET, WORK_BUDGET
    from .gptq import gptq_bytes

    params = parameter_names(model)
    values = sum(p.numel() for p in params.values())
    largest = max(params.values(), key=lambda p: p.numel(), default=None)
    parts = {"libraries": BASE_BYTES}
    if not is_lazy(model) or options.max_loss is not None:
        parts["whole model in float32"] = 4 * values
    phases = {}
    if calibrating or options.max_loss is not None:  # GPTQ: one group's Hessians, the matrices in work
        # held from calibration to the end as the export stores them (4-bit codes two per byte:
        # blocks.NibbleBlocks), with a margin
        parts["calibrated codes"] = int(CODE_MARGIN * stored_bytes_per_value(scheme, options.dtype) * values)
        work = gptq_bytes(*largest.shape) if largest is not None and largest.dim() == 2 else 0
        phases["calibrating"] = {"calibration Hessians": HESSIAN_BUDGET, "GPTQ work": max(WORK_BUDGET, work)}
    phases["writing"] = {"largest tensor in flight": TENSOR_COPIES * 4 * (0 if largest is None else largest.numel())}
    if options.validate:  # after the writing, with its references computed before the session opens
        phases["validating"] = {"validation session": int(SESSION_OVERHEAD * values
                                                          * stored_bytes_per_value(scheme, options.dtype))}
    return MemoryEstimate(parts, phases)


def check_memory(model: nn.Module, options, scheme, calibrating: bool) -> MemoryEstimate:
    """Refuse (``MemoryError`` with the estimate, what is available and what to change) an export
    whose estimated peak is more than the memory available; ``TFPORT_MEMORY_CHECK=0`` skips it."""
    estimate = estimate_export(model, options, scheme, calibrating)
    available = available_bytes()
    log.info("export memory estimate: %.1f GiB (%s); available %s", estimate.total / GiB, estimate.describe(),
             "unknown" if available is None else f"{available / GiB:.1f} GiB")
    if os.environ.get("TFPORT_MEMORY_CHECK", "1") == "0" or available is None or estimate.total <= available:
        return estimate
    advice = []
    if "validating" in estimate.phases:
        unvalidated = MemoryEstimate(estimate.parts, {k: v for k, v in estimate.phases.items() if k != "validating"})
        if unvalidated.total < estimate.total:
            advice.append(f"validate=False (--no-validate) needs about {unvalidated.total / GiB:.1f} GiB")
    if "whole model in float32" in estimate.parts:
        advice.append("export from the checkpoint or GGUF file (streamed) instead of a module in memory, "
                      "and without max_loss")
    if estimate.part("calibration Hessians") is not None:
        advice.append("calibration='none' (round-to-nearest) needs no Hessians")
    advice.append("or free memory / use a larger machine (TFPORT_MEMORY_CHECK=0 skips this check)")
    raise MemoryError(f"this export needs about {estimate.total / GiB:.1f} GiB at its peak "
                      f"({estimate.describe()}) and {available / GiB:.1f} GiB is available: "
                      + "; ".join(advice))
