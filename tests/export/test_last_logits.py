"""The decoder's ``last_logits`` input: false, every new token's logits [B, S, V]; true, each
row's last new token's alone [B, 1, V] (the head runs once per row).

Every target's export is validated in both modes against the reference (left-padded concat
rows: S - 1; inplace rows: each row's last new token), a graph that returns the wrong position
is refused by that validation, and the runtime (which asks for the last position at a prefill
and for every position when scoring) generates the module's own tokens.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.matrix import matrix_config
from tfport.config.classifier import ClassifierConfig
from tfport.contract import LAST_LOGITS, LAYOUTS, graph_specs
from tfport.export import ExportOptions, export_model
from tfport.export.parity import CASES, Runner
from tfport.export.parity.runner import LAST_POSITIONS
from tfport.export.targets import TARGETS
from tfport.models import build_model
from tfport.models.generate import generate
from tfport.runtime import load_model


def _decoder_for(target):
    for config in (matrix_config("decoder", "rope", "gqa"), matrix_config("decoder", "rope", "gqa").replace(d_model=64)):
        try:
            target.check(config, "float32", target.default_opset)
            return config
        except ValueError:
            continue
    pytest.fail(f"target {target.name!r} takes no decoder of the matrix")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_contract(layout):
    config = matrix_config("decoder", "rope", "gqa")
    decoder = graph_specs(config, layout=layout)["decoder"]
    assert decoder.input(LAST_LOGITS).dtype == "bool" and decoder.input(LAST_LOGITS).shape == ()
    assert decoder.outputs[0].shape == ("batch", "positions", config.vocab_size)
    # a seq2seq decoder takes it too; an encoder's MLM logits or a classifier's have no next token
    assert graph_specs(matrix_config("encoder-decoder", "relative", "mha"))["decoder"].input(LAST_LOGITS)
    for other in (matrix_config("encoder", "learned", "mha").replace(mlm_head=True),
                  matrix_config("encoder-decoder", "relative", "mha").replace(
                      classifier=ClassifierConfig(n_labels=3, pooling="last_eos"))):
        assert all(spec.input(LAST_LOGITS) is None for spec in graph_specs(other).values())


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_target_parity_and_generation(target, tmp_path):
    target = TARGETS[target]
    model = build_model(_decoder_for(target).replace(tie_embeddings=False), seed=1)
    export_model(model, tmp_path / "export", ExportOptions(target=target))  # validated in both modes
    runner = Runner(model, tmp_path / "export")
    both = 0
    for case in CASES:  # every padding and phase: both modes compared where several tokens are new
        for result in runner.run(case):
            assert result.ok, result.describe()
            if result.graph == "decoder" and result.case.new > 1:
                assert LAST_POSITIONS in {d.output for d in result.diffs}, result.describe()
                both += 1
    assert both >= 3
    prompts = [[1, 5, 7, 9, 11], [4, 2]]
    got = load_model(tmp_path / "export").generate(prompts, max_new_tokens=6)
    for prompt, row in zip(prompts, got):
        expected = generate(model, torch.tensor([prompt]), max_new_tokens=6)[0].numpy()
        np.testing.assert_array_equal(row[:len(expected)], expected)


def test_the_head_runs_on_the_chosen_positions(tmp_path):
    model = build_model(matrix_config("decoder", "rope", "gqa"), seed=0)
    export_model(model, tmp_path / "export", ExportOptions(validate=False))
    nodes = onnx.load(str(tmp_path / "export" / "decoder.onnx")).graph.node
    head = next(n for n in nodes if n.name == "lm_head")
    assert head.input[0].startswith("logits_positions")


@pytest.mark.parametrize("target", ["portable", "ort"])
def test_validation_refuses_a_wrong_last_position(target, tmp_path, monkeypatch):
    """A graph whose ``last_logits`` picks the first position instead is refused at export."""
    target = TARGETS[target]
    model = build_model(_decoder_for(target), seed=2)

    def first_position(g, states, inputs):
        return g.op("Slice", states, g.const([0], name="s"), g.const([1], name="e"), g.const([1], name="a"),
                    name="logits_positions")

    original = type(target).last_positions

    def wrong(self, g, states, inputs):
        right = original(self, g, states, inputs)
        return g.op("Where", inputs[LAST_LOGITS], first_position(g, states, inputs), right)

    monkeypatch.setattr(type(target), "last_positions", wrong)
    with pytest.raises(RuntimeError, match=r"export validation failed[\s\S]*logits \(last_logits\)"):
        export_model(model, tmp_path / "export", ExportOptions(target=target))
    assert not (tmp_path / "export").exists()
