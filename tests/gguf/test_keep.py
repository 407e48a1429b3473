"""``--quantize keep``: a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks and Q4_K / Q5_K / Q6_K
super-blocks become the export's quantised weights without re-quantising. Checked on tiny files
(legacy types written with gguf-py's own quantiser; K-quants as random blocks, which gguf-py
cannot write): the blocks decoded by ``export.gguf_keep`` dequantise bit for bit to gguf-py's
dequantisation, every weight matrix is kept (none re-quantised), and the export matches the
imported module (whose weights *are* the dequantised blocks) with float32 tolerances on every
target."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest

gguf = pytest.importorskip("gguf", reason="the 'dev' extra installs gguf-py")

from tfport.export import ExportOptions, export_checkpoint_or_preset  # noqa: E402
from tfport.export.gguf_keep import decode_blocks, gguf_values  # noqa: E402
from tfport.export.quant import KeptQuantization  # noqa: E402
from tfport.manifest import Manifest  # noqa: E402

from .tiny import K_BLOCKS, random_super_blocks, write_tiny_llama  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
TIED = ("Q8_0", "Q6_K", "Q4_1", "Q4_K")  # the table is the head too; the others have both
# the export's (bits, block size, whether blocks carry offsets) for each type
LAYOUT = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q5_0": (8, 32, False), "Q5_1": (8, 32, True),
          "Q8_0": (8, 32, False),
          "Q4_K": (4, 32, True), "Q5_K": (8, 32, True), "Q6_K": (8, 16, False)}


def _encode(values, kind, rng=None):
    if kind in K_BLOCKS:
        return random_super_blocks(kind, values.shape, rng or np.random.default_rng(1))
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep")
    return {kind: write_tiny_llama(root / f"{kind}.gguf", _encode, kind, tied=kind in TIED) for kind in TYPES}


@pytest.mark.parametrize("kind", TYPES)
def test_blocks_dequantise_as_gguf_does(kind):
    values = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    stored = _encode(values, kind)
    expected = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind])
    blocks = decode_blocks(kind, stored.view(np.uint8).reshape(6, -1))
    np.testing.assert_array_equal(gguf_values(blocks), expected)
    np.testing.assert_allclose(blocks.dequantize(), expected, rtol=1e-6, atol=1e-7)  # offsets: re-centred
    assert (blocks.bits, blocks.block_size, blocks.offsets is not None) == LAYOUT[kind]


@pytest.mark.parametrize("target", ["portable", "ort"])
@pytest.mark.parametrize("kind", TYPES)
def test_export_keeps_every_matrix_exactly(kind, target, files, tmp_path):
    """Validated by export against the imported module itself (float32 tolerances)."""
    path = files[kind].path
    keep = KeptQuantization(path)
    manifest = export_checkpoint_or_preset(str(path), tmp_path / "k", ExportOptions(target=target, quantize=keep))
    assert keep.requantized == 0 and keep.kept > 0
    assert manifest.quantization["format"] == "keep" and manifest.quantization["types"] == [kind]
    assert manifest.quantization["block_sizes"] == {kind: LAYOUT[kind][1]}
    # the token table is gathered from its quantised rows (block offsets added after the gather),
    # never stored as float rows [V, E]
    graph = onnx.load(str(tmp_path / "k" / "decoder.onnx"), load_external_data=False)
    vocab, width = manifest.config.vocab_size, manifest.config.d_model
    floats = [t.name for t in graph.graph.initializer if list(t.dims) == [vocab, width] and t.data_type == 1]
    assert not floats, floats
    assert Manifest.read(tmp_path / "k").quantization["types"] == [kind]


@pytest.mark.parametrize("target", ["portable", "ort"])
def test_a_product_of_two_types_keeps_both(target, tmp_path):
    """Q4_K_M-style: Q4_K query and key, Q6_K value and FFN down; the fused QKV product is two
    products (one per type) side by side, nothing re-quantised, validated against the module."""
    path = write_tiny_llama(tmp_path / "mixed.gguf", _encode, "Q4_K",
                            tensor_types={"attn_v": "Q6_K", "ffn_down": "Q6_K"}).path
    keep = KeptQuantization(path)
    manifest = export_checkpoint_or_preset(str(path), tmp_path / "k", ExportOptions(target=target, quantize=keep))
    assert keep.requantized == 0 and keep.kept > 0
    assert manifest.quantization["types"] == ["Q4_K", "Q6_K"]
    graph = onnx.load(str(tmp_path / "k" / "decoder.onnx"), load_external_data=False)
    parts = [n for n in graph.graph.node if n.op_type == "Concat" and n.name.endswith(".parts")]
    assert len(parts) == 2 and all(len(n.input) == 2 for n in parts)  # one QKV per layer: Q4_K | Q6_K


def test_keep_needs_a_gguf_source(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF file"):
        export_checkpoint_or_preset("tiny-decoder", tmp_path / "x", ExportOptions(quantize="keep"))


def test_matrices_in_other_types_are_requantised_counted_and_reported(tmp_path, caplog, capsys):
    """A Q4_0 file whose FFN down matrices are F16 (not a kept type): those are re-quantised with
    the fallback, which the export warns about, the manifest counts and the CLI prints."""
    from tfport.cli import main

    from .tiny import LAYERS

    path = write_tiny_llama(tmp_path / "partly.gguf", _encode, "Q4_0", tensor_types={"ffn_down": "F16"}).path
    with caplog.at_level("WARNING", logger="tfport.export.exporter"):
        assert main(["export", str(path), "--out", str(tmp_path / "k"), "--quantize", "keep"]) == 0
    quantization = Manifest.read(tmp_path / "k").quantization
    # per layer the products QKV, output and gate|up are kept (and the untied table and head), down is not
    assert quantization["requantized"] == LAYERS
    assert quantization["kept"] == 3 * LAYERS + 2
    warning = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"{LAYERS} of {4 * LAYERS + 2} weight products" in m and "int8" in m for m in warning), warning
    assert f"keep Q4_0: {3 * LAYERS + 2} weight products kept, {LAYERS} re-quantised as int8" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_keep_refuses_a_float16_export(dtype, files, tmp_path):
    """The blocks keep float32 scales: a float16 export would have re-quantised every matrix."""
    with pytest.raises(ValueError, match=f"quantize='keep' with dtype='{dtype}'"):
        export_checkpoint_or_preset(str(files["Q4_0"].path), tmp_path / "k", ExportOptions(
            quantize="keep", dtype=dtype))
    assert not (tmp_path / "k").exists()


def test_int4_alone_of_a_four_bit_file_keeps_its_blocks_on_mixed_activations(files, tmp_path, capsys, caplog):
    """Issue 43: re-quantising a 4-bit file's weights to 4 bits loses answers its own blocks keep
    (SmolLM2: 5 of 10 against 9 of 10, tests/gguf/test_quantized.py), so ``--quantize int4``
    alone of a Q4_0 / Q4_1 / Q4_K file exports those blocks, on mixed activations for ``ort``."""
    from tfport.cli import main

    with caplog.at_level(logging.INFO, logger="tfport.export.exporter"):
        assert main(["export", str(files["Q4_1"].path), "--out", str(tmp_path / "k"), "--target", "ort",
                     "--quantize", "int4"]) == 0
    quantization = Manifest.read(tmp_path / "k").quantization
    assert quantization["format"] == "keep" and quantization["types"] == ["Q4_1"]
    assert quantization["activation_type"] == "mixed" and quantization["requantized"] == 0
    assert "keep Q4_1" in capsys.readouterr().out  # the export's own line
    assert "a file of 4-bit blocks: its own blocks are kept" in caplog.text  # and why, once


@pytest.mark.parametrize("kind, options, kept, activations", [
    ("Q4_0", {"target": "ort"}, True, "mixed"),
    ("Q4_K", {"target": "portable"}, True, None),  # one accuracy level per session: int8 as ever
    ("Q4_0", {"target": "ort", "activations": "int8"}, True, "int8"),  # asked for: kept
    ("Q4_0", {"target": "ort", "calibration": "builtin"}, False, None),  # GPTQ asked for
    ("Q4_0", {"target": "ort", "block_size": 64}, False, None),
    ("Q4_0", {"target": "ort", "head_bits": 8}, False, None),
    ("Q4_0", {"target": "ort", "dtype": "float16"}, False, None),  # blocks keep float32 scales
    ("Q8_0", {"target": "ort"}, False, None),  # not 4-bit: re-quantised as before
    ("Q5_0", {"target": "ort"}, False, None),
])
def test_which_int4_exports_keep_the_files_blocks(kind, options, kept, activations, files):
    from tfport.export import source_options

    resolved = source_options(ExportOptions(quantize="int4", **options), str(files[kind].path))
    assert isinstance(resolved.quantize, KeptQuantization) == kept
    if not kept:
        assert resolved == ExportOptions(quantize="int4", **options)
    assert resolved.activations == activations


def test_four_bit_share_counts_the_layers_values(tmp_path):
    """A Q4_K_M-style file: the share of its layers' values in 4-bit blocks, against gguf-py's own
    reading of the same file's tensor types and shapes."""
    from tfport.export.quant.keep import four_bit_share

    path = write_tiny_llama(tmp_path / "m.gguf", _encode, "Q4_K", tensor_types={"attn_v": "Q6_K"}).path
    tensors = [t for t in gguf.GGUFReader(path).tensors if t.name.startswith("blk.") and len(t.shape) >= 2]
    four = sum(int(t.n_elements) for t in tensors if t.tensor_type.name == "Q4_K")
    assert 0 < four < sum(int(t.n_elements) for t in tensors)
    assert four_bit_share(path) == pytest.approx(four / sum(int(t.n_elements) for t in tensors))
