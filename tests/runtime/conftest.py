"""Exports shared by the runtime tests: each tiny model is built and exported once per session.

The runtime itself never imports torch; the tests do (to build, export and compute references).
"""

from __future__ import annotations

import pytest

from .runtime_cases import ExportStore


@pytest.fixture(scope="session")
def exports(tmp_path_factory: pytest.TempPathFactory) -> ExportStore:
    return ExportStore(tmp_path_factory.mktemp("runtime-exports"))


@pytest.fixture(scope="session")
def loaded(exports: ExportStore):
    """``loaded(key)`` -> (Exported, tfport.runtime.Model on the CPU), cached."""
    from tfport.runtime import load_model

    cache = {}

    def get(key: str):
        if key not in cache:
            exported = exports(key)
            cache[key] = (exported, load_model(exported.path, "cpu"))
        return cache[key]

    return get
