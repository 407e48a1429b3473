"""The float32 rounding floor under parity's tolerance (``ROUNDING_FACTOR`` x the float32
reference's own difference from float64, export/parity/cases.py).

It exists for real models whose residual stream is far larger than their outputs (SmolLM2-135M:
values up to 2e4 in one channel, float32 logits 1e-4..7e-4 from float64); on the tiny test models
it must stay below the table's tolerance, so the matrix is checked as tightly as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfport.export import ExportOptions, export_model
from tfport.export.parity import CASES, Runner
from tfport.export.parity.cases import Diff, _compare
from tfport.models import build_model
from tfport.presets import PRESETS


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder-decoder", "tiny-encoder"])
def test_floor_is_below_the_table_on_tiny_models(preset, tmp_path):
    model = build_model(PRESETS[preset], seed=3)
    export_model(model, tmp_path / "out", ExportOptions(validate=False))
    runner = Runner(model, tmp_path / "out")
    rtol, atol = runner.tolerance
    checked = 0
    with torch.no_grad():
        for case in CASES:
            for prepared in runner.prepare(case):
                exact = runner.float64_outputs(prepared)
                for name, tensor in prepared.reference().items():
                    real = runner._real(name, tensor.float().numpy(), prepared)
                    floor = runner.rounding_floor(tensor, exact[name], real)
                    values = tensor.float().numpy()[np.broadcast_to(real, tensor.shape)]
                    scale = max(1.0, float(np.sqrt(np.mean(values.astype(np.float64) ** 2))))
                    assert 0.0 < floor < atol * scale, (case.label, name, floor, atol * scale)
                    checked += 1
    assert checked >= len(CASES)


def test_floor_never_tightens_and_a_difference_beyond_it_fails():
    expected = np.linspace(-3.0, 3.0, 12, dtype=np.float32).reshape(1, 3, 4)
    real = np.ones((1, 3, 1), dtype=bool)
    off = expected + np.float32(5e-4)
    table = (1e-4, 1e-4)
    assert not _compare("logits", expected, off, real, table).ok
    assert _compare("logits", expected, off, real, table, floor=1e-3).ok
    assert not _compare("logits", expected, expected + np.float32(2e-3), real, table, floor=1e-3).ok
    assert _compare("logits", expected, expected + np.float32(5e-5), real, table, floor=1e-9).ok
    assert isinstance(_compare("x", expected, off, real, table), Diff)


def test_the_float64_copy_is_made_only_for_a_case_the_table_fails(tmp_path):
    import copy

    model = build_model(PRESETS["tiny-decoder"], seed=3)
    export_model(model, tmp_path / "out", ExportOptions(validate=False))
    runner = Runner(model, tmp_path / "out")
    assert all(result.ok for result in runner.run(CASES[0]))
    assert runner._float64 is None  # nothing failed: no float64 module was built
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        next(wrong.parameters()).add_(0.05)  # a reference the export does not match
    runner = Runner(wrong, tmp_path / "out")
    assert not all(result.ok for result in runner.run(CASES[0]))
    assert runner._float64 is not None  # the failure was judged with the floor too, and still fails
