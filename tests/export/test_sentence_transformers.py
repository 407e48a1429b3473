"""sentence-transformers pipelines: what is read from a checkpoint directory, what is refused, and
the runtime's pooling modes against sentence-transformers' own Pooling module."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tfport.embedding import POOLINGS, EmbeddingSettings
from tfport.export.sentence_transformers import read_sentence_transformers
from tfport.runtime.encoding import pool

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}


def write(directory: Path, modules: list, pooling: dict | None = None, bert_config: dict | None = None,
          tokenizer_config: dict | None = None) -> Path:
    (directory / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if bert_config is not None:
        (directory / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def test_no_modules_json_is_no_pipeline(tmp_path):
    assert read_sentence_transformers(tmp_path) is None


@pytest.mark.parametrize("pooling, expected", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean_sqrt_len_tokens"),
    ({"pooling_mode": "lasttoken"}, "lasttoken"),  # sentence-transformers >= 5 writes one key
    ({"pooling_mode": ["max"]}, "max"),
])
def test_pipeline(tmp_path, pooling, expected):
    write(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], pooling, {"max_seq_length": 200, "do_lower_case": True})
    assert read_sentence_transformers(tmp_path) == EmbeddingSettings(expected, True, 200, True)


def test_max_seq_length_falls_back_to_the_tokenizer(tmp_path):
    """Without max_seq_length, sentence-transformers truncates at model_max_length; a tokenizer
    without a limit (transformers writes 1e30) leaves it to the model."""
    write(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode": "mean"}, {}, {"model_max_length": 384})
    assert read_sentence_transformers(tmp_path) == EmbeddingSettings("mean", False, 384)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 10**30}))
    assert read_sentence_transformers(tmp_path).max_seq_length is None


@pytest.mark.parametrize("modules, pooling, fragments", [
    ([TRANSFORMER, POOLING, DENSE], {"pooling_mode": "mean"}, ("Dense", "not reproduced")),
    ([TRANSFORMER, POOLING], {"pooling_mode": "weightedmean"}, ("weightedmean", "lasttoken")),
    ([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
     ("['cls', 'mean']", "concatenation")),
    ([TRANSFORMER, POOLING], {"pooling_mode": "mean", "include_prompt": False}, ("include_prompt",)),
    ([TRANSFORMER], None, ("Pooling module",)),
    ([POOLING], {"pooling_mode": "mean"}, ("Transformer module",)),
])
def test_refused(tmp_path, modules, pooling, fragments):
    write(tmp_path, modules, pooling)
    with pytest.raises(ValueError) as info:
        read_sentence_transformers(tmp_path)
    assert all(f in str(info.value) for f in fragments), str(info.value)


@pytest.mark.parametrize("data, fragment", [
    ({"pooling": "median"}, "embedding.pooling='median'"),
    ({"normalize": 1}, "embedding.normalize=1"),
    ({"max_seq_length": 0}, "embedding.max_seq_length=0"),
    ({"stride": 3}, "unknown field(s) ['stride']"),
])
def test_settings_are_validated(data, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        EmbeddingSettings.from_dict(data)


@pytest.mark.parametrize("mode", POOLINGS)
def test_pooling_matches_sentence_transformers(mode):
    """The runtime's pooling of right-padded states equals sentence-transformers' Pooling."""
    st = pytest.importorskip("sentence_transformers")
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(3, 5, 8, generator=generator)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    module = st.sentence_transformer.modules.Pooling(8, pooling_mode=mode)
    expected = module({"token_embeddings": states, "attention_mask": mask})["sentence_embedding"]
    got = pool(states.numpy(), mask.numpy(), mode, normalize=False)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6, atol=1e-6)
