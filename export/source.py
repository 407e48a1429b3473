"""Resolve what a user names as a model: a preset, a tfport checkpoint, a Hugging Face directory or
a GGUF file.

Export, parity and the benchmark all take such a ``source``; this is the one place that decides
what it is.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from tfport.contract import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from tfport.embedding import EmbeddingSettings
from tfport.generation import GENERATION_CONFIG_FILE, GenerationDefaults
from tfport.presets import PRESETS

HF_TOKENIZER_CONFIG = "tokenizer_config.json"


@dataclass
class Source:
    """A loaded reference module and, when the source ships them, its ``tokenizer.json``, chat
    template (Jinja text) and sentence-embedding pipeline (sentence-transformers' modules)."""

    model: nn.Module
    tokenizer: Path | None = None
    chat_template: str | None = None
    # Holds a tokenizer.json generated from GGUF metadata; removed with the Source.
    workdir: Any = None
    embedding: EmbeddingSettings | None = None
    generation: GenerationDefaults | None = None  # stop ids and sampling defaults (HF checkpoints)


def _chat_template(directory: Path) -> str | None:
    """A checkpoint directory's chat template: ``chat_template.jinja``, else Hugging Face's
    ``tokenizer_config.json``'s ``chat_template`` (a string; of a list of named templates, the
    one named ``default``)."""
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text()
    config = directory / HF_TOKENIZER_CONFIG
    if not config.is_file():
        return None
    try:
        template = json.loads(config.read_text()).get("chat_template")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{config}: not a readable JSON object ({err})") from None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _gguf_source(path: Path, lazy: bool) -> Source:
    from tfport.models.gguf import load_gguf

    checkpoint = load_gguf(path, lazy=lazy)
    if checkpoint.tokenizer_json is None:
        return Source(checkpoint.model, chat_template=checkpoint.chat_template)
    workdir = tempfile.TemporaryDirectory(prefix="tfport-gguf-")
    tokenizer = Path(workdir.name) / TOKENIZER_FILE
    tokenizer.write_text(checkpoint.tokenizer_json)
    return Source(checkpoint.model, tokenizer, checkpoint.chat_template, workdir)


def _generation(directory: Path, model: nn.Module) -> GenerationDefaults | None:
    """A Hugging Face checkpoint's stop ids and sampling defaults (``generation_config.json``,
    else a list ``eos_token_id`` in ``config.json``); None for tfport checkpoints and models that
    do not generate."""
    from tfport.models.hf import is_hf_checkpoint
    from tfport.models.hf.configs import CONFIG_FILE, read_json

    if not is_hf_checkpoint(directory) or model.config.family == "encoder" or model.config.classifier.n_labels:
        return None  # an encoder, or a classifier: nothing generates
    generation = directory / GENERATION_CONFIG_FILE
    return GenerationDefaults.from_hf(read_json(generation) if generation.is_file() else None,
                                      read_json(directory / CONFIG_FILE), model.config.vocab_size)


def load_source(source: str, seed: int = 0, argument: str = "source", lazy: bool = False) -> Source:
    """``source``: a preset name (random weights from ``seed``), a tfport checkpoint directory, a
    Hugging Face model directory or a ``.gguf`` file. ``argument`` names the option in error
    messages. With ``lazy``, a checkpoint's or file's weights stay in it until read
    (``tfport.models.lazy``: what a streamed export reads one tensor at a time)."""
    from tfport.models import build_model
    from tfport.models.checkpoint import load_checkpoint
    from tfport.models.hf import is_hf_checkpoint, load_hf_model

    path = Path(source)
    if path.is_dir():
        model = load_hf_model(path, lazy) if is_hf_checkpoint(path) else load_checkpoint(path, lazy)
        from .sentence_transformers import read_sentence_transformers

        tokenizer = path / TOKENIZER_FILE
        return Source(model, tokenizer if tokenizer.is_file() else None, _chat_template(path),
                      embedding=read_sentence_transformers(path), generation=_generation(path, model))
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf_source(path, lazy)
    if source in PRESETS:
        return Source(build_model(PRESETS[source], seed=seed))
    raise ValueError(f"{argument}={source!r}: expected a preset name ({', '.join(sorted(PRESETS))}), "
                     "a tfport checkpoint directory (config.json + model.safetensors), a Hugging "
                     "Face model directory or a .gguf file")
