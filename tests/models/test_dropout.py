"""Dropout for training: active in ``train()`` mode, absent in ``eval()`` mode and from exported
graphs (the graphs of a model with dropout equal, node for node and weight for weight, those of
the same weights without it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch

from tfport import get_preset
from tfport.config.classifier import ClassifierConfig
from tfport.config.dropout import DropoutConfig
from tfport.export import export_model
from tfport.models import build_model

DROPOUT = DropoutConfig(embedding=0.1, attention=0.2, residual=0.1, ffn=0.3)
PRESETS = ["tiny-encoder", "tiny-decoder", "tiny-encoder-decoder"]


def run(model, ids: torch.Tensor) -> torch.Tensor:
    if model.config.family == "encoder":
        return model(ids).last_hidden_state
    if model.config.family == "decoder":
        return model(ids)[0]
    return model(ids, ids[:, :3])


@pytest.mark.parametrize("preset", PRESETS)
def test_dropout_in_train_mode_only(preset):
    config = get_preset(preset)
    plain, dropped = build_model(config, seed=0), build_model(config.replace(dropout=DROPOUT), seed=0)
    ids = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = run(plain, ids)
        torch.testing.assert_close(run(dropped.eval(), ids), reference, rtol=0, atol=0)
        dropped.train()
        first, second = run(dropped, ids), run(dropped, ids)
    assert not torch.equal(first, second) and not torch.equal(first, reference)
    plain.train()  # train mode without dropout computes what eval mode computes
    with torch.no_grad():
        torch.testing.assert_close(run(plain, ids), reference, rtol=0, atol=0)


def test_each_dropout_acts_where_configured():
    """Each probability alone changes train-mode outputs (it reaches its module)."""
    config = get_preset("tiny-decoder")
    ids = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    for field, p in dataclasses.asdict(DROPOUT).items():
        model = build_model(config.replace(dropout=DropoutConfig(**{field: p})), seed=0).train()
        with torch.no_grad():
            assert not torch.equal(model(ids)[0], model(ids)[0]), field


def graphs(directory) -> dict[str, tuple]:
    """Each graph's nodes and initializers (metadata, which names the config, left out)."""
    out = {}
    for name in ("encoder", "decoder"):
        path = directory / f"{name}.onnx"
        if path.is_file():
            graph = onnx.load(str(path)).graph
            out[name] = ([n.SerializeToString() for n in graph.node],
                         {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in graph.initializer},
                         [i.SerializeToString() for i in graph.input], [o.SerializeToString() for o in graph.output])
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_exported_graphs_identical_with_and_without_dropout(preset, tmp_path):
    config = get_preset(preset)
    dropped = build_model(config.replace(dropout=DROPOUT), seed=0).train()  # export puts it in eval mode
    export_model(build_model(config, seed=0), tmp_path / "plain")
    export_model(dropped, tmp_path / "dropout")
    assert not dropped.training
    plain, with_dropout = graphs(tmp_path / "plain"), graphs(tmp_path / "dropout")
    assert plain.keys() == with_dropout.keys() and plain
    for name in plain:
        assert plain[name] == with_dropout[name], name
        assert not any(b"Dropout" in node for node in with_dropout[name][0])


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(DropoutConfig)])
@pytest.mark.parametrize("value", [-0.1, 1.0, True, "0.1"])
def test_dropout_is_validated(field, value):
    with pytest.raises(ValueError, match=rf"config\.dropout\.{field}=.*a probability in \[0, 1\)"):
        get_preset("tiny-decoder").replace(dropout=DropoutConfig(**{field: value}))


def test_config_round_trip_keeps_dropout_and_labels():
    from tfport import ModelConfig

    config = get_preset("tiny-encoder").replace(dropout=DROPOUT,
                                                classifier=ClassifierConfig(n_labels=2, labels=("no", "yes")))
    again = ModelConfig.from_json(config.to_json())
    assert again == config and hash(again) == hash(config)
    np.testing.assert_equal(again.classifier.labels, ("no", "yes"))
