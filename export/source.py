"""Resolve what a user names as a model: a preset, a tfport checkpoint or a Hugging Face directory.

Export, parity and the benchmark all take such a ``source``; this is the one place that decides
what it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from tfport.contract import TOKENIZER_FILE
from tfport.presets import PRESETS


@dataclass
class Source:
    """A loaded reference module and, when the source ships one, its ``tokenizer.json``."""

    model: nn.Module
    tokenizer: Path | None = None


def load_source(source: str, seed: int = 0, argument: str = "source") -> Source:
    """``source``: a preset name (random weights from ``seed``), a tfport checkpoint directory or a
    Hugging Face model directory. ``argument`` names the option in error messages."""
    from tfport.models import build_model
    from tfport.models.checkpoint import load_checkpoint
    from tfport.models.hf import is_hf_checkpoint, load_hf_model

    path = Path(source)
    if path.is_dir():
        model = load_hf_model(path) if is_hf_checkpoint(path) else load_checkpoint(path)
        tokenizer = path / TOKENIZER_FILE
        return Source(model, tokenizer if tokenizer.is_file() else None)
    if source in PRESETS:
        return Source(build_model(PRESETS[source], seed=seed))
    raise ValueError(f"{argument}={source!r}: expected a preset name ({', '.join(sorted(PRESETS))}), "
                     "a tfport checkpoint directory (config.json + model.safetensors) or a Hugging "
                     "Face model directory")
