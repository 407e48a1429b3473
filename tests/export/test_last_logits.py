"""``logits="last"``: the decoder returns only the logits the next token is picked from.

Every target's export is validated against the reference at that position (left-padded concat
rows: S - 1; inplace rows: each row's last new token), and the runtime generates the same tokens
from it as from the "all" export of the same module.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from tests.matrix import matrix_config
from tfport.config.classifier import ClassifierConfig
from tfport.contract import graph_specs
from tfport.export import ExportOptions, export_model
from tfport.export.parity import CASES, Runner
from tfport.export.targets import TARGETS
from tfport.manifest import Manifest
from tfport.models import build_model
from tfport.runtime import load_model


def _decoder_for(target):
    for config in (matrix_config("decoder", "rope", "gqa"), matrix_config("decoder", "rope", "gqa").replace(d_model=64)):
        try:
            target.check(config, "float32", target.default_opset)
            return config
        except ValueError:
            continue
    pytest.fail(f"target {target.name!r} takes no decoder of the matrix")


def test_contract_shape():
    config = matrix_config("decoder", "rope", "gqa")
    assert graph_specs(config, logits="last")["decoder"].outputs[0].shape == ("batch", 1, config.vocab_size)
    assert graph_specs(config)["decoder"].outputs[0].shape == ("batch", "sequence", config.vocab_size)
    with pytest.raises(ValueError, match="logits='first'"):
        graph_specs(config, logits="first")
    # an encoder's MLM logits or a classifier's have no "next token": refused, not ignored
    for other in (matrix_config("encoder", "learned", "mha").replace(mlm_head=True),
                  matrix_config("encoder-decoder", "relative", "mha").replace(
                      classifier=ClassifierConfig(n_labels=3, pooling="last_eos"))):
        with pytest.raises(ValueError, match="logits='last': applies to a decoder's next-token logits"):
            graph_specs(other, logits="last")


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_target_parity_and_generation(target, tmp_path):
    target = TARGETS[target]
    model = build_model(_decoder_for(target).replace(tie_embeddings=False), seed=1)
    export_model(model, tmp_path / "all", ExportOptions(target=target))
    export_model(model, tmp_path / "last", ExportOptions(target=target, logits="last"))  # validated at the last position
    assert Manifest.read(tmp_path / "last").logits == "last"
    runner = Runner(model, tmp_path / "last")
    for case in CASES:  # every padding and phase, compared where the graph has logits
        assert all(result.ok for result in runner.run(case)), case
    prompts = [[1, 5, 7, 9, 11], [4, 2]]
    expected = load_model(tmp_path / "all").generate(prompts, max_new_tokens=6)
    np.testing.assert_array_equal(load_model(tmp_path / "last").generate(prompts, max_new_tokens=6), expected)


def test_the_head_runs_on_one_position(tmp_path):
    model = build_model(matrix_config("decoder", "rope", "gqa"), seed=0)
    export_model(model, tmp_path / "last", ExportOptions(logits="last", validate=False))
    nodes = onnx.load(str(tmp_path / "last" / "decoder.onnx")).graph.node
    head = next(n for n in nodes if n.name == "lm_head")
    assert any(n.name == "last_position" for n in nodes) and head.input[0].startswith("last_position")
