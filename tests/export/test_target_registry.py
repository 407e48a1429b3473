"""A target added through the registry alone reaches export, parity and the runtime.

The test target lowers RMSNorm with a body of its own (the mean square as ReduceSumSquare / E
instead of Pow + ReduceMean: the same function, other operators), so its graphs are really its
own; nothing outside this file knows its name.
"""

from __future__ import annotations

import onnx
import pytest
import torch
from onnxscript import FLOAT, script
from onnxscript import opset18 as op

from tfport.export import ExportOptions, export_model
from tfport.export.functions import tfport
from tfport.export.parity import CASES, Runner
from tfport.export.targets import TARGETS, PortableTarget, get_target, register_target
from tfport.manifest import Manifest
from tfport.models import build_model
from tfport.models.generate import generate
from tfport.presets import PRESETS
from tfport.runtime import load_model


@script(tfport, default_opset=op)
def RMSNormBySumSquare(x, weight, epsilon: float):
    """x / sqrt(sum(x^2) / E + epsilon) * weight, in float32 (ai.tfport.RMSNorm's meaning)."""
    xf = op.Cast(x, to=FLOAT.dtype)
    width = op.Cast(op.Shape(xf, start=-1), to=FLOAT.dtype)
    mean_square = op.Div(op.ReduceSumSquare(xf, op.Constant(value_ints=[-1]), keepdims=1), width)
    normed = op.Div(xf, op.Sqrt(op.Add(mean_square, op.Constant(value_float=epsilon))))
    return op.Mul(op.CastLike(normed, x), weight)


class SumSquareTarget(PortableTarget):
    name = "test-sum-square"
    summary = "portable, with RMSNorm lowered through ReduceSumSquare"
    bodies = {"RMSNorm": RMSNormBySumSquare}

    def check(self, config, dtype, opset):
        if config.norm != "rmsnorm":
            raise ValueError(f"target='test-sum-square' lowers RMSNorm only; norm={config.norm!r}")


@pytest.fixture
def registered(monkeypatch):
    target = SumSquareTarget()
    monkeypatch.setitem(TARGETS, target.name, target)  # removed again after the test
    return target


def test_a_registered_target_reaches_export_parity_and_runtime(registered, tmp_path):
    config = PRESETS["tiny-decoder"].replace(tie_embeddings=False)
    assert config.norm == "rmsnorm"
    model = build_model(config, seed=7)
    with torch.no_grad():  # norms away from 1 so a wrong norm body would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.3)
    out = tmp_path / "x"
    export_model(model, out, ExportOptions(target=registered.name))  # validated against PyTorch on export
    manifest = Manifest.read(out)
    assert (manifest.target, manifest.layout) == (registered.name, "concat")
    graph = onnx.load(str(out / "decoder.onnx"), load_external_data=False)
    body = {f.name: f for f in graph.functions}["RMSNorm"]
    assert "ReduceSumSquare" in {n.op_type for n in body.node}  # its own body, under the library's name

    runner = Runner(model, out)
    for case in CASES:
        assert all(r.ok for r in runner.run(case)), [r.describe() for r in runner.run(case)]

    prompts = [[5, 17, 33, 8, 61], [44, 9]]
    tokens = load_model(out).generate(prompts, max_new_tokens=8, stop_token_ids=())
    for row, prompt in zip(tokens, prompts):
        assert row.tolist() == generate(model, torch.tensor([prompt]), max_new_tokens=8)[0].tolist()


def test_a_registered_target_refuses_through_its_own_check(registered, tmp_path):
    model = build_model(PRESETS["tiny-decoder"].replace(norm="layernorm"), seed=0)
    with pytest.raises(ValueError, match="norm='layernorm'"):
        export_model(model, tmp_path / "x", ExportOptions(target=registered.name))
    assert not (tmp_path / "x").exists()


def test_unknown_target_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"target='tensorrt': expected one of \['portable'"):
        get_target("tensorrt")


def test_register_target_makes_a_name_exportable(monkeypatch):
    monkeypatch.setattr("tfport.export.targets.TARGETS", dict(TARGETS))
    from tfport.export import targets

    target = register_target(SumSquareTarget())
    assert targets.TARGETS[target.name] is target and get_target(target.name) is target
