"""The engine comparison of ``tfport bench`` (export/bench/compare.py): bytes per token from the
graph against hand counts, and a seconds-long run (no speeds asserted)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.matrix import matrix_config
from tfport.export import ExportOptions, export_model
from tfport.tools.bench.compare import format_compare, product_weight_bytes, run_compare
from tfport.tools.bench.measurement import QUICK
from tfport.models import build_model


@pytest.fixture(scope="module")
def model():
    return build_model(matrix_config("decoder", "rope", "gqa").replace(d_model=64, tie_embeddings=True), seed=0)


def _products(model) -> list[tuple[int, int]]:
    """(N, K) of every weight product: per layer qkv, out, gate+up (one), down; the tied head."""
    c = model.config
    d = c.dim_per_head
    per_layer = [((c.n_heads + 2 * c.kv_heads) * d, c.d_model), (c.d_model, c.n_heads * d),
                 (2 * c.d_ff, c.d_model), (c.d_model, c.d_ff)]
    return per_layer * c.n_decoder_layers + [(c.vocab_size, c.d_model)]


def test_float_bytes_are_every_product_matrix_once(model, tmp_path):
    export_model(model, tmp_path / "f", ExportOptions(validate=False))
    assert product_weight_bytes(tmp_path / "f" / "decoder.onnx") == 4 * sum(n * k for n, k in _products(model))


@pytest.mark.parametrize("target", ["ort", "portable"])
def test_int4_bytes_are_codes_and_scales(model, target, tmp_path):
    """Symmetric int4 in blocks of 16: K/2 bytes of codes and K/16 float32 scales per row."""
    export_model(model, tmp_path / "q", ExportOptions(target=target, quantize="int4", symmetric=True, block_size=16,
                                                      validate=False))
    expected = sum(n * k // 2 + 4 * n * k // 16 for n, k in _products(model))
    assert product_weight_bytes(tmp_path / "q" / "decoder.onnx") == expected


def test_quick_run_has_a_row_per_side():
    settings = dataclasses.replace(QUICK, batches=(1,), contexts=(8,), targets=("portable",))
    result = run_compare(settings, "tiny-decoder", ("int4",), thread_sweep=True)
    labels = [row["label"] for row in result["rows"]]
    assert labels[:2] == ["tfport portable fp32", "tfport portable int4"]
    assert len(labels) == 5 and result["rows"][0]["vs_tfport_fp32"] == 1.0
    assert "tfport portable int4" in format_compare(result)


def test_half_precision_rows_are_named_by_their_dtype():
    settings = dataclasses.replace(QUICK, batches=(1,), contexts=(8,), targets=("portable",), dtype="float16")
    result = run_compare(settings, "tiny-decoder", ("int4",))
    rows = result["rows"]
    assert [row["label"] for row in rows] == ["tfport portable fp16", "tfport portable int4 fp16"]
    assert rows[0]["vs_tfport_fp32"] == 1.0  # the ratio is to the unquantised export of this dtype
    assert rows[1]["vs_tfport_fp32"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])
    assert result["settings"]["dtype"] == "float16"


def test_cuda_is_asked_for_and_never_replaced_by_the_cpu():
    from tfport.export.validate import cuda_available

    if cuda_available()[0]:
        pytest.skip("CUDA is usable here: the refusal is for machines without it")
    settings = dataclasses.replace(QUICK, batches=(1,), contexts=(8,), targets=("portable",), provider="cuda",
                                   torch=False)
    with pytest.raises((RuntimeError, ValueError), match="CUDA|cuda"):
        run_compare(settings, "tiny-decoder", ())
    with pytest.raises(ValueError, match="peers .*run on the CPU"):
        run_compare(settings, "tiny-decoder", (), genai=("some-genai-dir",))


def test_keep_is_refused_before_anything_is_timed(tmp_path):
    """keep needs a GGUF source and float32 (its blocks keep float32 scales)."""
    settings = dataclasses.replace(QUICK, batches=(1,), contexts=(8,), targets=("portable",))
    with pytest.raises(ValueError, match="not a GGUF file"):
        run_compare(settings, "tiny-decoder", ("int4", "keep"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(20))  # only the magic is read before the refusal
    with pytest.raises(ValueError, match="quantize='keep' with dtype='float16'"):
        run_compare(dataclasses.replace(settings, dtype="float16"), str(gguf), ("keep",))


def test_int4_of_a_4bit_gguf_file_is_what_export_makes_of_it(tmp_path):
    """``--quantize int4`` of a Q4_0 file times the export's int4 of it (the file's own blocks,
    mixed activations on ``ort``), and says so; portable has no per-product activations."""
    gguf = pytest.importorskip("gguf", reason="the 'dev' extra installs gguf-py")
    from tests.gguf.tiny import write_tiny_llama

    def encode(values, kind):
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])

    path = write_tiny_llama(tmp_path / "q4.gguf", encode, "Q4_0", tied=False).path
    settings = dataclasses.replace(QUICK, batches=(1,), contexts=(8,), targets=("ort", "portable"), torch=False)
    labels = [row["label"] for row in run_compare(settings, str(path), ("int4",))["rows"]]
    assert labels == ["tfport ort fp32", "tfport ort int4 (the file's blocks, mixed activations)",
                      "tfport portable fp32", "tfport portable int4 (the file's blocks, int8 activations)"]


def test_bfloat16_bytes_are_read_through_the_cast(model, tmp_path):
    """bfloat16 weights reach their products through a Cast to float32: 2 bytes a weight."""
    export_model(model, tmp_path / "b", ExportOptions(dtype="bfloat16", validate=False))
    assert product_weight_bytes(tmp_path / "b" / "decoder.onnx") == 2 * sum(n * k for n, k in _products(model))


def test_options_it_would_misread_are_refused():
    settings = dataclasses.replace(QUICK, batches=(1,), contexts=(8,), targets=("portable",))
    for formats in (("fp32",), ("int4", "int4"), ("int5",)):
        with pytest.raises(ValueError, match="expected distinct formats among int4, int8"):
            run_compare(settings, "tiny-decoder", formats)
    with pytest.raises(ValueError, match="times one prompt length"):
        run_compare(dataclasses.replace(settings, contexts=(8, 32)), "tiny-decoder", ())
