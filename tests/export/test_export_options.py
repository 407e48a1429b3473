"""Export options: external data, fp16, opsets, atomic writes, refusals, the CLI."""

from __future__ import annotations

import os

import onnx
import pytest

from tfport.cli import main
from tfport.contract import MANIFEST_FILE
from tfport.export import ExportOptions, export_model
from tfport.export.parity import Case, Runner
from tfport.models import build_model
from tfport.presets import PRESETS


def test_external_data_when_over_threshold(tmp_path):
    model = build_model(PRESETS["tiny-encoder-decoder-gqa"], seed=1)
    out = tmp_path / "ext"
    export_model(model, out, ExportOptions(external_data_threshold=10_000))
    files = sorted(os.listdir(out))
    assert "decoder.onnx.data" in files and "encoder.onnx.data" in files
    proto = onnx.load(str(out / "decoder.onnx"), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    for result in Runner(model, out).run(Case(batch=2, past=3, new=2, padding="left")):
        assert result.ok, result.describe()


def test_small_model_keeps_weights_inline(tmp_path):
    export_model(build_model(PRESETS["tiny-decoder"], seed=1), tmp_path / "inline")
    assert not any(name.endswith(".data") for name in os.listdir(tmp_path / "inline"))


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder", "tiny-encoder-decoder"])
def test_fp16_export_runs_on_cpu_provider(tmp_path, preset):
    model = build_model(PRESETS[preset], seed=2)
    export_model(model, tmp_path / "fp16", ExportOptions(dtype="float16"))  # validates against the fp16 module
    proto = onnx.load(str(tmp_path / "fp16" / ("decoder.onnx" if "decoder" in preset else "encoder.onnx")))
    dtypes = {t.data_type for t in proto.graph.initializer if t.dims and len(t.dims) == 2}
    assert onnx.TensorProto.FLOAT16 in dtypes


@pytest.mark.parametrize("opset", [18, 21, 23])
def test_target_opsets(tmp_path, opset):
    export_model(build_model(PRESETS["tiny-decoder-alibi"], seed=3), tmp_path / "o", ExportOptions(opset=opset))
    proto = onnx.load(str(tmp_path / "o" / "decoder.onnx"))
    assert {o.domain: o.version for o in proto.opset_import}[""] == opset


@pytest.mark.parametrize("kwargs,needle", [
    ({"dtype": "float64"}, "dtype='float64': expected one of"),
    ({"opset": 17}, "opset=17"),
    ({"tokenizer": "/nonexistent/tokenizer.json"}, "tokenizer="),
])
def test_bad_options_are_refused_and_leave_nothing(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "bad", ExportOptions(**kwargs))
    assert not (tmp_path / "bad").exists()
    assert os.listdir(tmp_path) == []


def test_options_must_be_export_options(tmp_path):
    """One options object: a dict (or the keywords export_model once took) is refused by name."""
    model = build_model(PRESETS["tiny-decoder"], seed=0)
    with pytest.raises(TypeError, match=r"options=\{'dtype': 'float16'\}: expected an ExportOptions or None"):
        export_model(model, tmp_path / "bad", {"dtype": "float16"})
    with pytest.raises(TypeError, match="dtype"):
        export_model(model, tmp_path / "bad", dtype="float16")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("content, needle", [
    ("root:x:0:0:root:/root:/bin/bash\n", "not a tokenizer.json (not JSON"),  # tfport export --tokenizer /etc/passwd
    ('{"version": "1.0"}', "no 'model' object"),
    ('{"model": {"type": "Nonsense"}}', "the 'tokenizers' library cannot read it"),
])
def test_tokenizer_must_be_a_tokenizer_json(tmp_path, content, needle):
    if "library" in needle:
        pytest.importorskip("tokenizers")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "t.json").write_text(content)
    with pytest.raises(ValueError, match=f"tokenizer=.*t.json.*{needle}".replace("(", r"\(")):
        export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "out", ExportOptions(
            tokenizer=tmp_path / "in" / "t.json", validate=False))
    assert os.listdir(tmp_path) == ["in"]


def test_failed_export_leaves_no_partial_directory(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("tfport.export.parity.validate_export", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "out")
    assert os.listdir(tmp_path) == []


def test_existing_directory_needs_overwrite(tmp_path):
    model = build_model(PRESETS["tiny-decoder"], seed=0)
    export_model(model, tmp_path / "out")
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_model(model, tmp_path / "out")
    export_model(model, tmp_path / "out", ExportOptions(overwrite=True))
    assert (tmp_path / "out" / MANIFEST_FILE).is_file()


def test_cli_export_preset_and_checkpoint(tmp_path, capsys):
    from tfport.models.checkpoint import save_checkpoint

    assert main(["export", "tiny-encoder", "--out", str(tmp_path / "a"), "--seed", "3"]) == 0
    assert (tmp_path / "a" / "encoder.onnx").is_file()
    ckpt = save_checkpoint(build_model(PRESETS["tiny-decoder-gpt2"], seed=4), tmp_path / "ckpt")
    assert main(["export", str(ckpt), "--out", str(tmp_path / "b"), "--dtype", "float16"]) == 0
    assert "decoder.onnx" in capsys.readouterr().out
    assert main(["export", "no-such-preset", "--out", str(tmp_path / "c")]) == 2
    assert "source='no-such-preset'" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_out_dir_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("not a directory")
    model = build_model(PRESETS["tiny-decoder"], seed=0)
    for target in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(ValueError, match="exists and is not a directory"):
            export_model(model, target)
    assert main(["export", "tiny-decoder", "--out", str(tmp_path / "afile")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "not a directory"


def test_fp16_export_leaves_the_callers_model_in_float32(tmp_path):
    import torch

    model = build_model(PRESETS["tiny-decoder"], seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_model(model, tmp_path / "fp16", ExportOptions(dtype="float16"))  # validation runs an fp16 copy
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())
