"""Localisation (export/parity/localize.py) runs the graph as parity runs it.

A quantised export is compared with the fake-quantised module at float32 tolerances because
parity runs its 4-bit products with float activations (``export.quant.exact_graph`` and
``EXACT_SESSION_CONFIG``). The tap session that localises a failure must run the same way: with
ONNX Runtime's default (int8 activations in ``MatMulNBits`` and in the fused portable
DequantizeLinear + MatMul) every tap after the first product differs by the activation rounding
and a real divergence is blamed on layer 0's attention.
"""

from __future__ import annotations

import onnx
import pytest

from tests.matrix import ort_config
from tfport.export import ExportOptions, export_model
from tfport.export.parity import CASES, Runner, first_divergence, localize
from tfport.export.quant import QuantScheme, fake_quantize
from tfport.export.targets import TARGETS
from tfport.models import build_model

SCHEME = QuantScheme(4, 16, symmetric=False)


@pytest.mark.parametrize("target", list(TARGETS))
def test_taps_of_a_quantised_export_match_the_fake_quantised_reference(target, tmp_path):
    model = build_model(ort_config("gqa"), seed=7)
    export_model(model, tmp_path / "q", ExportOptions(target=target, quantize=SCHEME, validate=False))
    runner = Runner(fake_quantize(model, SCHEME), tmp_path / "q")
    case = next(c for c in CASES if c.past and c.new == 1)  # a decode step with a past
    assert all(r.ok for r in runner.run(case)), [r.describe() for r in runner.run(case)]
    diffs = localize(runner, case)
    assert len(diffs) > 4 * model.config.n_decoder_layers  # norms, attention, FFN of every layer
    assert first_divergence(diffs) is None, first_divergence(diffs)


@pytest.mark.parametrize("target", ["ort", "portable"])
def test_a_quantised_export_with_external_data_is_run_in_place(target, tmp_path):
    """Weights in decoder.onnx.data: the exact graph is serialised without them (bytes over 2 GiB
    cannot be a protobuf) and its sessions read them from the export's directory; validation at
    export, parity and the taps all run."""
    from tfport.export.quant import exact_graph

    model = build_model(ort_config("gqa"), seed=7)
    export_model(model, tmp_path / "q", ExportOptions(target=target, quantize=SCHEME, external_data_threshold=0))
    graph, data = tmp_path / "q" / "decoder.onnx", tmp_path / "q" / "decoder.onnx.data"
    with_data = len(onnx.load(str(graph)).SerializeToString())  # the weights loaded into the message
    assert len(exact_graph(graph)) < with_data - data.stat().st_size * 0.9
    runner = Runner(fake_quantize(model, SCHEME), tmp_path / "q")
    case = next(c for c in CASES if c.past and c.new == 1)
    assert all(r.ok for r in runner.run(case))
    assert first_divergence(localize(runner, case)) is None
