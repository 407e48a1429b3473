"""``tfport bench-scale`` and its random-weight models of real shapes (``scale_models``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")

from tfport.cli import main  # noqa: E402
from tfport.tools.bench.scale_models import SHAPES, write_gguf, write_safetensors  # noqa: E402
from tfport.models.gguf import load_gguf  # noqa: E402
from tfport.models.gguf.reader import GGUFFile  # noqa: E402
from tfport.models.hf import load_hf_model  # noqa: E402
from tfport.models.lazy import parameter_names  # noqa: E402


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b"])
def test_shapes_count_the_parameters_of_the_real_models(name):
    """Published sizes: Llama-3.2-1B 1.24B, Llama-3.1-8B 8.03B, Qwen2.5-7B 7.62B parameters."""
    published = {"llama-3.2-1b": 1.236e9, "llama-3.1-8b": 8.030e9, "qwen2.5-7b": 7.616e9}[name]
    assert SHAPES[name].parameters() == pytest.approx(published, rel=2e-3)


def test_written_models_load_with_the_shape_they_say(tmp_path):
    """The GGUF file and the safetensors directory import as modules whose parameter count is
    the shape's (lazily: nothing is read)."""
    shape = SHAPES["test-tiny"]
    path = write_gguf(shape, "Q8_0", tmp_path / "tiny.gguf")
    assert GGUFFile(path).tensor_type("blk.0.attn_q.weight") == "Q8_0"
    for model in (load_gguf(path, lazy=True).model, load_hf_model(write_safetensors(shape, tmp_path / "hf"), lazy=True)):
        assert sum(p.numel() for p in parameter_names(model).values()) == shape.parameters()
        assert model.config.n_kv_heads == shape.kv_heads and model.config.tie_embeddings == shape.tied


def test_bench_scale_reports_export_and_decode(tmp_path, capsys):
    """One row per export, with ``--activations int8,float``: one on int8 and one on float
    activations (an export directory each)."""
    from tfport.manifest import Manifest

    out, work = tmp_path / "scale.json", tmp_path / "work"
    code = main(["bench-scale", "--shapes", "test-tiny", "--formats", "Q4_0", "--work", str(work),
                 "--prompt", "40", "--new-tokens", "3", "--rows", "2", "--repeats", "1", "--no-llama-cpp",
                 "--activations", "int8,float", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| test-tiny | Q4_0, int8 activations | tfport |" in table
    assert "| test-tiny | Q4_0, float activations | tfport |" in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["Q4_0, int8 activations", "Q4_0, float activations"]
    for row in rows:
        assert row["export_seconds"] > 0 and row["export_peak"] > row["weight_bytes"] > 0
        run = row["engines"]["tfport"]
        assert run["decode1"] > 0 and run["decoden"] > 0 and run["peak"] >= run["loaded"] > 0
        assert run["cached"] > 0  # the prefix cache's keys and values of the prompts, counted as KV
        assert run["peak_since_load"] and run["load_peak"] >= run["loaded"]  # the peak is the running's
    assert "activation_type" not in Manifest.read(work / "test-tiny.Q4_0.gguf.export.int8").quantization
    assert Manifest.read(work / "test-tiny.Q4_0.gguf.export.float").quantization["activation_type"] == "float"


def test_bench_scale_refuses_unknown_shapes(capsys):
    with pytest.raises(SystemExit):
        main(["bench-scale", "--shapes", "llama-9000b"])
    assert "expected shape names from" in capsys.readouterr().err


def test_bench_scale_exports_with_the_default_int4(tmp_path):
    """``--quantize int4`` exports a Q8_0 GGUF file with tfport's default int4 (GPTQ on the built-in
    text, through the tokenizer the file ships; a 4-bit file would keep its blocks) into an export
    directory of its own."""
    from tfport.manifest import Manifest

    work = tmp_path / "work"
    code = main(["bench-scale", "--shapes", "test-tiny", "--formats", "Q8_0", "--quantize", "int4", "--work",
                 str(work), "--prompt", "16", "--new-tokens", "3", "--rows", "1", "--repeats", "1", "--no-llama-cpp",
                 "--no-validate", "--json", str(tmp_path / "scale.json")])
    assert code == 0
    row = json.loads((tmp_path / "scale.json").read_text())["rows"][0]
    assert row["format"] == "Q8_0 -> int4" and row["export_seconds"] > 0
    manifest = Manifest.read(work / "test-tiny.Q8_0.gguf.int4.export")
    quantization = manifest.quantization
    assert quantization["format"] == "int4" and quantization["method"] == "gptq"
    assert quantization["calibration"]["text"] == "builtin"
