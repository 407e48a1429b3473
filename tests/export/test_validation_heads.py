"""Export validation compares every head an encoder export has -- a wrong classifier or pooler is
caught at export time, not only by the transformers tests."""

from __future__ import annotations

import pytest
import torch

from tfport.config.classifier import ClassifierConfig
from tfport.presets import get_preset

pytest.importorskip("onnxruntime", reason="validation runs ONNX Runtime")

from tfport.export import ExportOptions, export_model  # noqa: E402
from tfport.export.parity import validate_export  # noqa: E402
from tfport.models import build_model  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    config = get_preset("tiny-encoder").replace(classifier=ClassifierConfig(n_labels=3, labels=("a", "b", "c")),
                                                pooler=True)
    torch.manual_seed(3)
    model = build_model(config).eval()
    directory = tmp_path_factory.mktemp("heads") / "export"
    export_model(model, directory, ExportOptions(validate=False))
    return model, directory


def test_validation_compares_class_logits(exported):
    model, directory = exported
    names = {d.output for r in validate_export(model, directory) for d in r.diffs}
    assert {"class_logits", "pooler_output", "last_hidden_state"} <= names


@pytest.mark.parametrize("head", ["classifier.out.bias", "pooler.bias"])
def test_validation_catches_a_wrong_head(exported, head):
    model, directory = exported
    altered = build_model(model.config).eval()
    altered.load_state_dict(model.state_dict())
    with torch.no_grad():
        altered.get_parameter(head).add_(0.5)
    with pytest.raises(RuntimeError, match="class_logits" if "classifier" in head else "pooler_output"):
        validate_export(altered, directory)
