"""``--activations``: what a quantised product computes its activations in (tfport.contract.ACTIVATIONS).

"int8" (the default) lets ONNX Runtime's MatMulNBits round them per block (accuracy level 4);
"float" keeps them float32 (level 1 in the ``ort`` target's MatMulNBits, the session's fusion
level for the ``portable`` target's DequantizeLinear + MatMul, set by the runtime from the
manifest); "mixed" keeps them float32 for the products in FLOAT_PRODUCTS alone (target ``ort``,
whose MatMulNBits carries a level per product). The reference is the fake-quantised PyTorch module (the same dequantised weights, float
activations): a float-activation export must match it to float32 rounding through the runtime,
while the int8 default differs from it by its activations' rounding.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest

from tests.matrix import matrix_config
from tfport.cli import main
from tfport.contract import FLOAT_PRODUCTS, QDQ_ACCURACY_CONFIG
from tfport.export import ExportOptions, export_model
from tfport.export.quant import QuantScheme, fake_quantize
from tfport.manifest import Manifest
from tfport.models import build_model
from tfport.runtime.session import export_config
from tfport.tools.parity.accuracy import export_logits, reference_logits

SCHEME = QuantScheme(4, 16, symmetric=True)
IDS = np.array([3, 17, 42, 9, 88, 20, 5, 61, 33, 7, 95, 14], dtype=np.int64)  # < the vocabulary (96)


def _product_levels(path) -> dict[str, int]:
    """MatMulNBits node name -> its accuracy level."""
    graph = onnx.load(str(path), load_external_data=False)
    return {n.name: a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "accuracy_level"}


def _levels(path) -> set[int]:
    return set(_product_levels(path).values())


@pytest.fixture(scope="module")
def decoder():
    config = matrix_config("decoder", "rope", "gqa").replace(d_model=64, tie_embeddings=False)
    return build_model(config, seed=0)


@pytest.fixture(scope="module")
def exports(decoder, tmp_path_factory):
    """(target, activations) -> export directory, validated against the fake-quantised module."""
    out = {}
    for target in ("ort", "portable"):
        for activations in ("int8", "float"):
            path = tmp_path_factory.mktemp(f"{target}-{activations}")
            export_model(decoder, path / "q", ExportOptions(target=target, quantize=SCHEME, activations=activations,
                                                            overwrite=True))
            out[target, activations] = path / "q"
    path = tmp_path_factory.mktemp("ort-mixed")
    export_model(decoder, path / "q", ExportOptions(target="ort", quantize=SCHEME, activations="mixed", overwrite=True))
    out["ort", "mixed"] = path / "q"
    return out


def test_the_manifest_and_the_graph_say_what_the_products_compute_in(exports):
    assert _levels(exports["ort", "int8"] / "decoder.onnx") == {4}
    assert _levels(exports["ort", "float"] / "decoder.onnx") == {1}
    assert "activation_type" not in Manifest.read(exports["ort", "int8"]).quantization  # the default: as before
    for target in ("ort", "portable"):
        assert Manifest.read(exports[target, "float"]).quantization["activation_type"] == "float"
    assert export_config(Manifest.read(exports["portable", "float"]).quantization) == {QDQ_ACCURACY_CONFIG: "1"}
    assert export_config(Manifest.read(exports["portable", "int8"]).quantization) == {}


def test_mixed_activations_are_float_for_the_outlier_products_alone(decoder, exports):
    """Level 1 for the query/key/value and down projections, 4 for the others (attention output,
    up projection, head), by the products' graph names; through the runtime the logits sit
    between the float and the int8 exports'."""
    levels = _product_levels(exports["ort", "mixed"] / "decoder.onnx")
    kinds = {name.rsplit(".", 1)[-1] for name in levels}
    assert {"qkv", "down"} <= kinds and kinds - set(FLOAT_PRODUCTS), kinds  # both sorts present
    for name, level in levels.items():
        assert level == (1 if name.rsplit(".", 1)[-1] in FLOAT_PRODUCTS else 4), (name, level)
    quantization = Manifest.read(exports["ort", "mixed"]).quantization
    assert quantization["activation_type"] == "mixed" and export_config(quantization) == {}
    reference = reference_logits(fake_quantize(decoder, SCHEME), IDS)
    error = {a: np.abs(export_logits(exports["ort", a], IDS) - reference).max() for a in ("float", "mixed", "int8")}
    assert error["mixed"] > 20 * max(error["float"], 1e-7 * np.abs(reference).max()), error
    assert error["mixed"] < 2 * error["int8"], error


@pytest.mark.parametrize("target", ["ort", "portable"])
def test_float_activations_compute_what_the_dequantised_module_computes(decoder, exports, target):
    """Through the runtime: float activations match the module with the dequantised weights to
    float32 rounding; int8 activations differ by their rounding, far more (so the portable
    export's float result shows the runtime set the session's fusion level)."""
    reference = reference_logits(fake_quantize(decoder, SCHEME), IDS)
    scale = np.abs(reference).max()
    exact = np.abs(export_logits(exports[target, "float"], IDS) - reference).max() / scale
    rounded = np.abs(export_logits(exports[target, "int8"], IDS) - reference).max() / scale
    assert exact < 1e-5, exact
    assert rounded > 20 * max(exact, 1e-7), (rounded, exact)


def test_refusals_name_the_option(decoder, tmp_path):
    with pytest.raises(ValueError, match="activations='float': applies to a quantised export"):
        export_model(decoder, tmp_path / "a", ExportOptions(activations="float"))
    with pytest.raises(ValueError, match="activations='float' with quantize='w8a8'"):
        export_model(decoder, tmp_path / "b", ExportOptions(quantize="w8a8", activations="float"))
    with pytest.raises(ValueError, match=r"activations='mixed' with target='portable': .* --target ort"):
        export_model(decoder, tmp_path / "d", ExportOptions(quantize="int4", activations="mixed"))
    with pytest.raises(ValueError, match=r"activations='fp16': expected one of \['int8', 'float', 'mixed'\]"):
        export_model(decoder, tmp_path / "c", ExportOptions(quantize="int4", activations="fp16"))
    assert not any(p.exists() for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"))
    with pytest.raises(ValueError, match="activation_type='fp16'"):
        export_config({"format": "int4", "activation_type": "fp16"})


def test_an_8_bit_product_on_float_activations_warns_once(decoder, tmp_path, caplog):
    """ONNX Runtime has no float-activation kernel for 8-bit blocks: the export says so, once."""
    with caplog.at_level(logging.WARNING, logger="tfport.export.targets.ort"):
        export_model(decoder, tmp_path / "q", ExportOptions(target="ort", quantize="int8", activations="float",
                                                            validate=False))
    warnings = [r for r in caplog.records if "no float-activation kernel for 8-bit blocks" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert _levels(tmp_path / "q" / "decoder.onnx") == {1}


def test_the_cli_flag(tmp_path, capsys):
    assert main(["export", "tiny-decoder", "--out", str(tmp_path / "q"), "--quantize", "int4",
                 "--activations", "float", "--no-validate"]) == 0
    assert "float activations" in capsys.readouterr().out
    assert Manifest.read(tmp_path / "q").quantization["activation_type"] == "float"
    assert main(["export", "llama-55m", "--out", str(tmp_path / "m"), "--quantize", "int4", "--target", "ort",
                 "--activations", "mixed", "--no-validate"]) == 0
    assert "float activations for the qkv/q/kv/down products, int8 for the rest" in capsys.readouterr().out
    assert main(["export", "tiny-decoder", "--out", str(tmp_path / "f"), "--activations", "float"]) == 2
    assert "activations='float': applies to a quantised export" in capsys.readouterr().err
