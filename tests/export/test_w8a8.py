"""``--quantize w8a8`` (export/quant/w8a8.py): int8 weights per output channel, int8 activations per row.

The codes are checked against values worked out by hand. Every export below is validated by
``export_model`` against the module with the same dequantised weights (float32 tolerances),
running the graph's products on float activations (``float_activations``), on every target; the
shipped graph, which rounds each row's activations, is compared with a reference that rounds
them in PyTorch (``W8A8.reference(activations=True)``), and with the float-activation one to
show the rounding is there. The accuracy on real weights is in tests/gguf/test_quantized.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.matrix import matrix_config, ort_config
from tfport.export import ExportOptions, export_model
from tfport.export.quant import exact_graph
from tfport.export.targets import TARGETS
from tfport.export.quant.w8a8 import W8A8, quantize_channels, round_rows
from tfport.manifest import Manifest
from tfport.models import build_model
from tfport.runtime import load_model
from tfport.runtime.sampling import Logprobs


def test_weight_codes_have_one_scale_per_row_and_seven_bits():
    """Row 0: max 126 -> scale 2, codes to +-63; row 1 all zero: scale 1, codes 0."""
    q = quantize_channels(np.array([[126.0, -31.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32))
    np.testing.assert_array_equal(q.scales, [2.0, 1.0])
    np.testing.assert_array_equal(q.codes, [[63, -16, 0, 0], [0, 0, 0, 0]])  # -15.5 -> -16, 0.5 -> 0 (half to even)
    np.testing.assert_array_equal(q.dequantize(), [[126.0, -32.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert q.codes.dtype == np.int8


def test_activations_are_rounded_per_row():
    """Row 0: max 254 -> steps of 2; row 1: max 1.27 -> steps of 0.01; a zero row stays zero."""
    x = torch.tensor([[254.0, 3.0, -5.2], [1.27, 0.004, 0.006], [0.0, 0.0, 0.0]])
    expected = torch.tensor([[254.0, 4.0, -6.0], [1.27, 0.0, 0.01], [0.0, 0.0, 0.0]])  # 1.5 -> 2, -2.6 -> -3
    torch.testing.assert_close(round_rows(x), expected)


def _export(model, path, target="ort", **options):
    return export_model(model, path, ExportOptions(target=target, quantize="w8a8", **options))


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_target_exports_a_decoder_exactly(target, tie, tmp_path):
    """Validated on export against the dequantised weights; only standard operators are added,
    every weight matrix and token table is int8, and parity runs no integer product."""
    config = (ort_config("gqa") if target == "ort" else matrix_config("decoder", "rope", "gqa")).replace(
        tie_embeddings=tie)
    manifest = _export(build_model(config, seed=0), tmp_path / "q", target)
    assert manifest.quantization == Manifest.read(tmp_path / "q").quantization == W8A8().to_dict()
    assert "MatMulInteger takes int8 x int8 only" in manifest.device_refusals["cuda"]  # uint8 would run on the CPU
    graph = onnx.load(str(tmp_path / "q" / "decoder.onnx"))
    floats = [t.name for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
              and len(t.dims) == 2 and min(t.dims) >= 16]
    assert not floats, floats
    products = [n for n in graph.graph.node if n.op_type == "MatMulInteger"]
    # q|k|v, out, gate|up, down per layer, and the head
    assert len(products) == 4 * config.n_decoder_layers + 1
    assert not [n.op_type for n in graph.graph.node if n.op_type == "MatMul" and n.domain == ""]
    exact = onnx.load_from_string(exact_graph(tmp_path / "q" / "decoder.onnx"))
    assert not [n for n in exact.graph.node if n.op_type in ("MatMulInteger", "QuantizeLinear")]


@pytest.mark.parametrize("family,position", [("encoder", "learned"), ("encoder-decoder", "relative")])
def test_other_families_export_exactly(family, position, tmp_path):
    _export(build_model(matrix_config(family, position, "mha"), seed=0), tmp_path / "q", "portable")


@pytest.mark.parametrize("target", ["ort", "portable"])
def test_the_shipped_graph_rounds_each_rows_activations(target, tmp_path):
    """Every position's logits of a prompt, as the runtime computes them, against PyTorch with
    the same rounding (close) and without it (far: the rounding is really there)."""
    config = ort_config("gqa") if target == "ort" else matrix_config("decoder", "rope", "gqa")
    model = build_model(config, seed=0)
    _export(model, tmp_path / "q", target)
    runtime = load_model(tmp_path / "q")
    ids = np.random.default_rng(1).integers(0, config.vocab_size, size=(1, 11))
    got = runtime.decoding.logits(runtime.runners["decoder"], ids)  # [S, V]
    with torch.no_grad():
        x = torch.from_numpy(ids)
        rounded = W8A8().reference(model, activations=True)(x, torch.ones_like(x))[0][0].numpy()
        unrounded = W8A8().reference(model)(x, torch.ones_like(x))[0][0].numpy()
    rounding = np.abs(rounded - unrounded).max()
    assert np.abs(got - rounded).max() < 1e-4 * np.abs(rounded).max()
    assert rounding > 100 * np.abs(got - rounded).max(), rounding


@pytest.mark.parametrize("target", ["ort", "portable"])
def test_a_rows_logits_do_not_depend_on_the_other_rows(target, tmp_path):
    """Each row is quantised on its own: a prompt's logits and its next step's are the same
    bits alone and among two other rows, in the row batch (each prompt prefilled alone, steps
    together), where one scale per step would make them depend on the others; on the inplace
    layout also in a batched prefill (``generate``). The concat layout pads a batch's prompts to
    one length, which changes the float kernels' shapes and with them the activations' rounding."""
    config = ort_config("gqa") if target == "ort" else matrix_config("decoder", "rope", "gqa")
    _export(build_model(config, seed=0), tmp_path / "q", target)
    runtime = load_model(tmp_path / "q")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, config.vocab_size, size=n) for n in (7, 5, 9)]

    def run(rows_prompts):
        rows = runtime.decoding.rows(runtime.runners["decoder"], 3, 32, 0)
        first = [rows.add(p)[1].copy() for p in rows_prompts]
        step = rows.step(np.array([int(f.argmax()) for f in first]))
        return first[0], np.array(step[0])

    alone, together = run(prompts[:1]), run(prompts)
    assert np.array_equal(alone[0], together[0]) and np.array_equal(alone[1], together[1])
    if target != "ort":
        return
    logprobs = {}
    for count in (1, 3):
        logprobs[count] = Logprobs()
        runtime.generate(prompts[:count], max_new_tokens=6, stop_token_ids=(), logprobs=logprobs[count])
    assert np.array_equal(logprobs[1].arrays()[0][0], logprobs[3].arrays()[0][0])


def test_refusals_name_the_option(tmp_path):
    model = build_model(ort_config("gqa"), seed=0)
    cases = [({"block_size": 64}, "block_size=64: applies to quantize='int4' or 'int8'; quantize='w8a8'"),
             ({"symmetric": True}, "symmetric=True: applies to quantize='int4' or 'int8'; quantize='w8a8'"),
             ({"dtype": "float16"}, "quantize='w8a8' with dtype='float16'"),
             ({"calibration": "builtin"}, "calibration='builtin'"),
             ({"head_bits": 8}, "head_bits=8"),
             ({"max_loss": "5%"}, "max_loss='5%'.*got quantize='w8a8'")]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            _export(model, tmp_path / "x", **options)
        assert not (tmp_path / "x").exists()


def test_cli(tmp_path, capsys):
    from tfport.cli import main

    assert main(["export", "tiny-decoder", "--out", str(tmp_path / "q"), "--quantize", "w8a8"]) == 0
    assert "w8a8: int8 weights per output channel, int8 activations per token" in capsys.readouterr().out
    assert Manifest.read(tmp_path / "q").quantization["format"] == "w8a8"
