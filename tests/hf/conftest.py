"""Each tiny HF model is built, saved and imported once per session."""

from __future__ import annotations

import pytest
import torch

from tfport.models.hf import load_hf_model

from .cases import CASES, build_hf, save_hf


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


class Imported:
    """A case's transformers model, its saved directory and tfport's import of it."""

    def __init__(self, case, hf, directory, model):
        self.case, self.hf, self.directory, self.model = case, hf, directory, model


@pytest.fixture(scope="session")
def imported(tmp_path_factory: pytest.TempPathFactory):
    """``imported(name)`` -> Imported, cached for the session."""
    cache: dict[str, Imported] = {}

    def get(name: str) -> Imported:
        if name not in cache:
            case = CASES[name]
            hf = build_hf(case)
            directory = save_hf(hf, tmp_path_factory.mktemp(f"hf-{name}"), case)
            cache[name] = Imported(case, hf, directory, load_hf_model(directory))
        return cache[name]

    return get
