"""The LM head and token table in their own blocks (``calibrate.head_block``): by default the
largest block size up to the scheme's that divides their width, so that a tied table is stored
once (gathered and projected from the same codes) and no head block is padded; ``head_block_size``
fixes it. Exports stay exact (validated against the fake-quantised module) and ``tfport parity``
recomputes them from the manifest, including manifests written before the rule."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tests.export.text_models import perturbed, word_tokenizer
from tests.matrix import matrix_config
from tfport.contract import MANIFEST_FILE
from tfport.export import ExportOptions, export_model
from tfport.export import calibrate as C
from tfport.export.quant import QuantScheme
from tfport.manifest import Manifest


def test_the_largest_block_that_divides_the_width():
    assert C.head_block(128, 576) == 64  # SmolLM2's E
    assert C.head_block(32, 576) == 32  # never larger than the scheme's
    assert C.head_block(128, 384) == 128  # whole blocks already
    assert C.head_block(64, 100) == 64  # no block size divides it: the scheme's, padded
    assert C.head_block(128, 576, 16) == 16  # fixed


def _config(tied: bool):
    """E = 96: whole blocks of 32, not of 64 or 128 (6 heads of 16 for the fused attention)."""
    return matrix_config("decoder", "rope", "gqa").replace(d_model=96, n_heads=6, n_kv_heads=2, tie_embeddings=tied)


def _blocks(path) -> dict[str, tuple[int, int]]:
    """Quantised node name -> (bits, block_size) of an ort-target graph."""
    graph = onnx.load(str(path), load_external_data=False).graph
    out = {}
    for node in graph.node:
        attributes = {a.name: a.i for a in node.attribute}
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            out[node.name] = (attributes["bits"], attributes["block_size"])
    return out


@pytest.mark.parametrize("calibration", ["none", "builtin"])
def test_a_tied_head_in_blocks_that_divide_it_is_stored_once_and_exact(calibration, tmp_path):
    """Blocks of 64 on E = 96: the head and its tied table take blocks of 32 (round-to-nearest too,
    which then goes through calibrate), the layers keep 64; the gather reads the head's codes
    (no second copy of the table); validation passes and parity recomputes the codes."""
    from tfport.cli import main
    from tfport.models.checkpoint import save_checkpoint

    model = perturbed(_config(tied=True))
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(model, checkpoint)
    word_tokenizer(model.config.vocab_size, checkpoint / "tokenizer.json")
    out = tmp_path / "q"
    assert main(["export", str(checkpoint), "--out", str(out), "--target", "ort", "--quantize", "int4",
                 "--block-size", "64", "--calibration", calibration]
                + (["--calibration-tokens", "256"] if calibration != "none" else [])) == 0
    quantization = Manifest.read(out).quantization
    assert (quantization["block_size"], quantization["head_block_size"]) == (64, 32)
    blocks = _blocks(out / "decoder.onnx")
    heads = {name: b for name, b in blocks.items() if "lm_head" in name or "embed" in name}
    assert heads and set(heads.values()) == {(4, 32)}, blocks
    assert {b for name, b in blocks.items() if name not in heads} == {(4, 64)}, blocks
    graph = onnx.load(str(out / "decoder.onnx"), load_external_data=False).graph
    assert not [i.name for i in graph.initializer if i.name.endswith("qrows")]  # one copy of the table
    assert main(["parity", str(out), "--against", str(checkpoint)]) == 0


def test_head_block_size_fixes_it_and_old_manifests_recompute(tmp_path):
    """``head_block_size`` equal to the layers' blocks gives what exports before the rule wrote (a
    padded head); with that field dropped from the manifest, parity still recomputes the codes
    (a manifest without it means the layers' blocks)."""
    from tfport.tools.parity.cli import reference_scheme
    from tfport.models.checkpoint import save_checkpoint

    model = perturbed(_config(tied=False))
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(model, checkpoint)
    out = tmp_path / "q"
    manifest = export_model(model, out, ExportOptions(target="ort", quantize="int4", block_size=64,
                                                      calibration="none", head_block_size=64))
    assert manifest.quantization["head_block_size"] == 64
    assert {b for name, b in _blocks(out / "decoder.onnx").items() if "lm_head" in name} == {(4, 64)}
    recorded = json.loads((out / MANIFEST_FILE).read_text())["quantization"]
    del recorded["head_block_size"]
    scheme = reference_scheme(recorded, str(checkpoint), model, None)
    head = scheme.quantize(model.lm_head.weight.detach().numpy())
    assert head.block_size == 64 and scheme.requantized == 0
    fixed = C.calibrate(model, QuantScheme(4, 64, True), None, head_block_size=16)
    assert fixed.quantize(model.lm_head.weight.detach().numpy()).block_size == 16
    layer = model.decoder.layers[0].attn.out.weight.detach().numpy()
    assert fixed.quantize(layer).block_size == 64 and np.isfinite(fixed.quantize(layer).scales).all()


def test_refusals_name_head_block_size(tmp_path):
    model = perturbed(_config(tied=True))
    with pytest.raises(ValueError, match=r"head_block_size=48: expected None or one of \[16, 32, 64, 128, 256\]"):
        export_model(model, tmp_path / "a", ExportOptions(quantize="int4", head_block_size=48))
    with pytest.raises(ValueError, match="head_block_size=32: applies to quantize='int4' or 'int8', got no quantisation"):
        export_model(model, tmp_path / "b", ExportOptions(head_block_size=32))
    with pytest.raises(ValueError, match="head_block_size=32: applies to quantize='int4' or 'int8', got quantize='w8a8'"):
        export_model(model, tmp_path / "c", ExportOptions(quantize="w8a8", head_block_size=32))
    with pytest.raises(ValueError, match="head_block_size=True: expected None or one of"):
        C.calibrate(model, QuantScheme(4, 32), None, head_block_size=True)
    assert not any((tmp_path / n).exists() for n in "abc")


def test_which_heads_take_their_own_blocks():
    """A tied head whose table stays float (``embeddings=False``) is not quantised, so it takes
    no blocks of its own; an untied head is, whatever ``embeddings`` says."""
    tied, untied = perturbed(_config(tied=True)), perturbed(_config(tied=False))
    assert C.own_head_block(tied, QuantScheme(4, 64)) and C.own_head_block(untied, QuantScheme(4, 64))
    assert not C.own_head_block(tied, QuantScheme(4, 64, embeddings=False))
    assert C.own_head_block(untied, QuantScheme(4, 64, embeddings=False))
    assert not C.own_head_block(tied, QuantScheme(4, 32))  # E = 96 is whole blocks of 32
