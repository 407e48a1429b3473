"""Loading an export directory: every broken directory is a ValueError naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tfport.runtime import SessionSettings, load_model
from tfport.runtime.session import external_data_files


def broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_loads_and_checks_each_graph(loaded):
    _, model = loaded("encoder-decoder")
    assert sorted(model.runners) == ["decoder", "encoder"]
    assert model.config.family == "encoder-decoder"


def test_not_a_directory(tmp_path, exports):
    file = exports("decoder-rope").path / "manifest.json"
    with pytest.raises(ValueError, match="model_dir=.*expected a directory"):
        load_model(file)
    with pytest.raises(ValueError, match="model_dir=.*expected a directory"):
        load_model(tmp_path / "nowhere")


def test_model_dir_type():
    with pytest.raises(TypeError, match="model_dir: expected a path, got int"):
        load_model(3)


def test_no_manifest(tmp_path):
    with pytest.raises(ValueError, match="model_dir=.*no manifest.json"):
        load_model(tmp_path)


def test_malformed_manifest(tmp_path, exports):
    path = broken_copy(exports("decoder-rope").path, tmp_path / "m")
    (path / "manifest.json").write_text("{ not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(path)
    data = json.loads((exports("decoder-rope").path / "manifest.json").read_text())
    del data["config"]
    (path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="model_dir=.*manifest.json is incomplete"):
        load_model(path)


def test_missing_graph(tmp_path, exports):
    path = broken_copy(exports("decoder-rope").path, tmp_path / "m")
    (path / "decoder.onnx").unlink()
    with pytest.raises(ValueError, match="model_dir=.*'decoder.onnx' is missing"):
        load_model(path)


def test_truncated_graph(tmp_path, exports):
    path = broken_copy(exports("decoder-rope").path, tmp_path / "m")
    graph = path / "decoder.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    with pytest.raises(ValueError, match="model_dir=.*'decoder.onnx' has .* bytes, manifest.json records"):
        load_model(path)
    # without the manifest's check, ONNX Runtime's failure is still named
    with pytest.raises(ValueError, match="model_dir: graph file 'decoder.onnx' is truncated"):
        load_model(path, verify="none")


def test_external_data_is_found(exports):
    path = exports("decoder-external").path
    assert external_data_files(path / "decoder.onnx") == ["decoder.onnx.data"]
    assert external_data_files(exports("decoder-rope").path / "decoder.onnx") == []
    load_model(path)  # loads with the data file in place


def test_missing_external_data(tmp_path, exports):
    path = broken_copy(exports("decoder-external").path, tmp_path / "m")
    (path / "decoder.onnx.data").unlink()
    with pytest.raises(ValueError, match="model_dir=.*'decoder.onnx.data', listed in manifest.json, is missing"):
        load_model(path)
    with pytest.raises(ValueError,
                       match=r"model_dir: external-data file\(s\) \['decoder.onnx.data'\]"):
        load_model(path, verify="none")


def test_truncated_external_data(tmp_path, exports):
    path = broken_copy(exports("decoder-external").path, tmp_path / "m")
    data = path / "decoder.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ValueError, match="'decoder.onnx.data' has 100 bytes"):
        load_model(path, verify="fast")
    with pytest.raises(ValueError, match=r"model_dir: the external-data file\(s\) "
                                         r"\['decoder.onnx.data'\] of graph 'decoder.onnx' "
                                         "could not be read in full"):
        load_model(path, verify="none")


def test_graph_that_breaks_the_contract(tmp_path, exports):
    path = broken_copy(exports("decoder-rope").path, tmp_path / "m")
    shutil.copy(exports("encoder").path / "encoder.onnx", path / "decoder.onnx")
    with pytest.raises(ValueError, match=r"'decoder.onnx' has \d+ bytes, manifest.json records"):
        load_model(path)
    with pytest.raises(ValueError, match="model_dir: graph 'decoder.onnx' has inputs"):
        load_model(path, verify="none")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(provider="tpu"), "provider='tpu'"),
    (dict(graph_optimization="max"), "graph_optimization='max'"),
    (dict(intra_op_threads=-1), "intra_op_threads=-1"),
    (dict(device_id=1.0), "device_id=1.0"),
])
def test_settings_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        SessionSettings(**kwargs)
