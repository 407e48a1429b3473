"""Session fixtures: SmolLM2 through tfport (module, export) and through transformers."""

from __future__ import annotations

import pytest
import torch

from .smollm2 import smollm2_export, smollm2_path, smollm2_source


@pytest.fixture(scope="session")
def smollm2():
    """``load_source`` of the GGUF file (tfport module, tokenizer.json, chat template)."""
    return smollm2_source()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    return smollm2_export(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own GGUF import of the same file, float32."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
