"""tfport.integrity on its own: file records, verification modes, the settings fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from tfport import integrity
from tfport.integrity import (FINGERPRINT_KEY, SETTINGS_KEY, check_graph_metadata, export_settings,
                              graph_metadata, parse_file_records, record_files, sha256_file,
                              verify_files)
from tfport.config.rope import RopeConfig
from tfport.presets import get_preset

CONFIG = get_preset("tiny-decoder")


def settings(config=CONFIG, **overrides) -> str:
    values = dict(dtype="float32", opset=18, target="portable", layout="concat", device_refusals={})
    values.update(overrides)
    return export_settings(config, **values)


def test_sha256_streams_large_files(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_CHUNK", 7)  # many chunks, one odd-sized tail
    data = bytes(range(256)) * 5
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_records_round_trip_through_json(tmp_path):
    (tmp_path / "a.onnx").write_bytes(b"graph")
    (tmp_path / "a.onnx.data").write_bytes(b"")
    records = record_files(tmp_path, ["a.onnx.data", "a.onnx"])
    assert list(records) == ["a.onnx", "a.onnx.data"] and records["a.onnx"].size == 5
    as_json = json.loads(json.dumps({k: r.to_dict() for k, r in records.items()}))
    assert parse_file_records(as_json, "m.json") == records


@pytest.mark.parametrize("value, fragment", [
    ([], "files=[]: expected an object"),
    ({"../x": {"bytes": 1, "sha256": "0" * 64}}, "'../x' is not a file name inside"),
    ({"a/b": {"bytes": 1, "sha256": "0" * 64}}, "'a/b' is not a file name inside"),
    ({"x": {"bytes": -1, "sha256": "0" * 64}}, "files['x'].bytes=-1"),
    ({"x": {"bytes": True, "sha256": "0" * 64}}, "files['x'].bytes=True"),
    ({"x": {"bytes": 1, "sha256": "0" * 63}}, "files['x'].sha256="),
    ({"x": {"bytes": 1, "sha256": "A" * 64}}, "64 lowercase hex digits"),
    ({"x": {"bytes": 1}}, "files['x']={'bytes': 1}"),
    ({"x": "abc"}, "files['x']='abc'"),
])
def test_malformed_records_are_refused(value, fragment):
    with pytest.raises(ValueError) as info:
        parse_file_records(value, "m.json")
    assert fragment in str(info.value) and str(info.value).startswith("m.json: ")


def test_verify_modes(tmp_path, monkeypatch, caplog):
    (tmp_path / "small").write_bytes(b"s" * 10)
    (tmp_path / "big").write_bytes(b"b" * 100)
    records = record_files(tmp_path, ["small", "big"])
    verify_files(tmp_path, records, "full")
    (tmp_path / "big").write_bytes(b"B" * 100)  # same size, other bytes
    with pytest.raises(ValueError, match="model_dir=.*'big' does not match the sha256"):
        verify_files(tmp_path, records, "full")
    monkeypatch.setattr(integrity, "FAST_HASH_LIMIT", 50)
    with caplog.at_level(logging.WARNING, logger="tfport.integrity"):
        verify_files(tmp_path, records, "fast")  # big is checked by size only
    assert "verify='fast': ['big']" in caplog.text and "not hashed" in caplog.text
    (tmp_path / "small").write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match="'small' does not match"):
        verify_files(tmp_path, records, "fast")
    (tmp_path / "big").write_bytes(b"b" * 99)
    with pytest.raises(ValueError, match="'big' has 99 bytes, manifest.json records 100"):
        verify_files(tmp_path, {"big": records["big"]}, "fast")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfport.integrity"):
        verify_files(tmp_path, records, "none")
    assert "verify='none'" in caplog.text and "['big', 'small']" in caplog.text
    with pytest.raises(ValueError, match="verify='quick'"):
        verify_files(tmp_path, records, "quick")


def test_settings_are_canonical():
    base = settings()
    assert base == settings(get_preset("tiny-decoder").replace(rope=RopeConfig(theta=10000)))  # int == float
    # Fields at their defaults are left out, so adding a field to ModelConfig later (at its
    # default) keeps the fingerprint of existing exports.
    assert "rope_theta" not in json.loads(base)["config"]
    assert json.loads(settings(CONFIG.replace(max_positions=128)))["config"]["max_positions"] == 128
    assert settings(opset=19) != base and settings(dtype="float16") != base


def test_graph_metadata_check_names_the_differences():
    metadata = graph_metadata(settings())
    assert set(metadata) == {SETTINGS_KEY, FINGERPRINT_KEY}
    check_graph_metadata(metadata, settings(), "decoder.onnx")
    edited = settings(CONFIG.replace(max_positions=128, norm_eps=1e-6), opset=19)
    with pytest.raises(ValueError) as info:
        check_graph_metadata(metadata, edited, "decoder.onnx", "model_dir='m'")
    message = str(info.value)
    assert message.startswith("model_dir='m': manifest.json does not describe graph 'decoder.onnx'")
    for fragment in ("config.max_positions: manifest 128, graph 64",
                     "config.norm_eps: manifest 1e-06, graph 1e-05", "opset: manifest 19, graph 18"):
        assert fragment in message
    with pytest.raises(ValueError, match="carries no 'tfport.fingerprint' metadata"):
        check_graph_metadata({}, settings(), "decoder.onnx")
    with pytest.raises(ValueError, match="fingerprint differs"):
        check_graph_metadata({FINGERPRINT_KEY: "0" * 64, SETTINGS_KEY: settings()}, settings(),
                             "decoder.onnx")
