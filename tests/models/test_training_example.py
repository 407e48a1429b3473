"""The training example of docs/training.md runs as written, with fewer steps: a tiny decoder and
a tiny encoder trained with dropout, saved, exported, then generating and embedding with the
runtime."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "training.md"
pytest.importorskip("tokenizers", reason="the example writes a tokenizer.json (extra 'text')")


def example_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    found = [b for b in blocks if "STEPS = 300" in b and "save_checkpoint" in b]
    assert len(found) == 1, "the training example of docs/training.md (a python block with STEPS = 300)"
    return found[0]


def test_training_example(tmp_path, monkeypatch, capsys):
    code = example_code().replace("STEPS = 300", "STEPS = 10")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    with torch.enable_grad():  # the conftest runs module tests under no_grad
        exec(compile(code, str(PAGE), "exec"), namespace)
    for path in ("tokenizer.json", "ckpt/decoder/model.safetensors", "ckpt/encoder/config.json",
                 "out/decoder/decoder.onnx", "out/encoder/encoder.onnx", "out/encoder/embedding.json"):
        assert (tmp_path / path).is_file(), path
    losses = namespace["decoder_losses"]
    assert len(losses) == 10 and np.mean(losses[-3:]) < np.mean(losses[:3])  # it learns
    assert np.isfinite(namespace["encoder_losses"]).all()
    assert namespace["vectors"].shape == (2, 32)
    np.testing.assert_allclose(np.linalg.norm(namespace["vectors"], axis=1), 1.0, rtol=1e-5)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[1].split()  # generated words
