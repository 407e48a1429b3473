"""Every family x position scheme x attention variant exports, passes the full checker, keeps the
named ai.tfport functions, and matches PyTorch at sizes other than the validation's."""

from __future__ import annotations

import onnx
import pytest

from tfport.export import export_model
from tfport.export.functions import DOMAIN
from tfport.export.parity import Case, Runner
from tfport.manifest import Manifest
from tfport.models import build_model

from tests.matrix import MATRIX, matrix_config

# Which library functions each graph must call (by configuration), as a viewer would show them.
def expected_functions(config, graph: str) -> set[str]:
    names = {"AttentionBias"}
    names.add("GroupQueryAttention" if graph == "decoder" else "ScaledDotProductAttention")
    if graph == "decoder" and config.family == "encoder-decoder":
        names.add("ScaledDotProductAttention")  # cross-attention
    if config.position == "rope":
        names.add("RotaryEmbedding")
    if config.position == "alibi":
        names.add("AlibiBias")
    if config.position == "relative":
        names.add("RelativePositionBias")
    if config.position == "disentangled":  # both terms (the default): one fused bias per layer
        names.update(("DisentangledIndex", "DisentangledBias"))
    if config.norm == "rmsnorm":
        names.add("RMSNorm")
    return names


# Sizes differ from the post-export validation (B3, S7 / P6 S1): the graphs must be dynamic.
CASES = [
    Case(batch=1, past=0, new=9, padding="none", seed=1),     # prefill
    Case(batch=4, past=0, new=5, padding="right", seed=2),    # prefill, right padding
    Case(batch=2, past=5, new=1, padding="left", seed=3),     # decode step with past
    Case(batch=2, past=4, new=3, padding="left", seed=4),     # chunk of new tokens on a past
]


@pytest.mark.parametrize("family,position,attention", MATRIX, ids=["-".join(m) for m in MATRIX])
def test_matrix_exports_and_matches_pytorch(tmp_path, family, position, attention):
    config = matrix_config(family, position, attention)
    model = build_model(config, seed=7)
    manifest = export_model(model, tmp_path / "export")  # validates prefill + decode itself
    assert Manifest.read(tmp_path / "export").graphs.keys() == manifest.graphs.keys()
    for name, spec in manifest.graphs.items():
        path = tmp_path / "export" / spec.file
        onnx.checker.check_model(str(path), full_check=True)
        proto = onnx.load(str(path))
        called = {n.op_type for n in proto.graph.node if n.domain == DOMAIN}
        local = {f.name for f in proto.functions if f.domain == DOMAIN}
        assert called == expected_functions(config, name), name
        assert called <= local, "every ai.tfport node must have its model-local function"
        assert [i.name for i in proto.graph.input] == [t.name for t in spec.inputs]
        assert [o.name for o in proto.graph.output] == [t.name for t in spec.outputs]
    runner = Runner(model, tmp_path / "export")
    for case in CASES:
        for result in runner.run(case):
            assert result.ok, result.describe()
            for diff in result.diffs:
                if diff.token_agreement is not None:
                    assert diff.token_agreement == 1.0, result.describe()
