"""``--quantize keep``: a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks become the export's quantised
weights without re-quantising. Checked on tiny files written with gguf-py's own quantiser: the
blocks decoded by ``export.gguf_keep`` dequantise bit for bit to gguf-py's dequantisation, every
weight matrix is kept (none re-quantised), and the export matches the imported module (whose
weights *are* the dequantised blocks) with float32 tolerances on every target."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the 'dev' extra installs gguf-py")

from tfport.contract import Manifest  # noqa: E402
from tfport.export import export_checkpoint_or_preset  # noqa: E402
from tfport.export.gguf_keep import KeptQuantization, decode_blocks, gguf_values  # noqa: E402

from .tiny import write_tiny_llama  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q8_0")


def _encode(values, kind):
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep")
    return {kind: write_tiny_llama(root / f"{kind}.gguf", _encode, kind, tied=kind == "Q8_0") for kind in TYPES}


@pytest.mark.parametrize("kind", TYPES)
def test_blocks_dequantise_as_gguf_does(kind):
    values = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    stored = _encode(values, kind)
    expected = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[kind])
    blocks = decode_blocks(kind, stored.view(np.uint8).reshape(6, -1))
    np.testing.assert_array_equal(gguf_values(blocks), expected)
    np.testing.assert_allclose(blocks.dequantize(), expected, rtol=1e-6, atol=1e-7)  # Q4_1: re-centred
    assert blocks.bits == (8 if kind == "Q8_0" else 4) and (blocks.offsets is not None) == (kind == "Q4_1")


@pytest.mark.parametrize("target", ["portable", "ort"])
@pytest.mark.parametrize("kind", TYPES)
def test_export_keeps_every_matrix_exactly(kind, target, files, tmp_path):
    """Validated by export against the imported module itself (float32 tolerances)."""
    path = files[kind].path
    keep = KeptQuantization(path)
    manifest = export_checkpoint_or_preset(str(path), tmp_path / "k", target=target, quantize=keep)
    assert keep.requantized == 0 and keep.kept > 0
    assert manifest.quantization["format"] == "keep" and manifest.quantization["types"] == [kind]
    assert Manifest.read(tmp_path / "k").quantization["types"] == [kind]


def test_keep_needs_a_gguf_source(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF file"):
        export_checkpoint_or_preset("tiny-decoder", tmp_path / "x", quantize="keep")
