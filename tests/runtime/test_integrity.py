"""Exports that verify themselves: every file's sha256 in the manifest, the export settings'
fingerprint in each graph; a damaged, swapped or edited export fails at load, naming the file."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

from tfport import integrity
from tfport.contract import MANIFEST_FILE
from tfport.integrity import FINGERPRINT_KEY, SETTINGS_KEY, fingerprint, sha256_file
from tfport.manifest import FORMAT_VERSION, Manifest
from tfport.runtime import load_model

hypothesis = pytest.importorskip("hypothesis", reason="fuzz tests need 'hypothesis' (extra 'dev')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DEC, EXT, TEXT = "decoder-rope", "decoder-external", "decoder-text"
FUZZ = settings(max_examples=int(os.environ.get("TFPORT_FUZZ_EXAMPLES", "0")) or 25,
                derandomize="TFPORT_FUZZ_EXAMPLES" not in os.environ, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_manifest(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads((path / MANIFEST_FILE).read_text())
    change(data)
    (path / MANIFEST_FILE).write_text(json.dumps(data))


def rehash(path: Path, name: str) -> None:
    """Record ``name``'s current size and sha256 in the manifest (as a careless repair would)."""
    def change(data):
        data["files"][name] = {"bytes": (path / name).stat().st_size, "sha256": sha256_file(path / name)}
    edit_manifest(path, change)


# ------------------------------------------------------------------------------- what is written
@pytest.mark.parametrize("key", [DEC, EXT, TEXT, "encoder-decoder"])
def test_manifest_records_every_file(exports, key):
    path = exports(key).path
    manifest = Manifest.read(path)
    on_disk = sorted(p.name for p in path.iterdir() if p.name != MANIFEST_FILE)
    assert sorted(manifest.files) == on_disk
    assert json.loads((path / MANIFEST_FILE).read_text())["format_version"] == FORMAT_VERSION == 3
    for name, record in manifest.files.items():
        assert record.size == (path / name).stat().st_size
        assert record.sha256 == sha256_file(path / name)
    if key == EXT:
        assert "decoder.onnx.data" in manifest.files
    if key == TEXT:
        assert "tokenizer.json" in manifest.files


def test_each_graph_carries_the_settings_fingerprint(exports):
    path = exports("encoder-decoder").path
    manifest = Manifest.read(path)
    for spec in manifest.graphs.values():
        session = ort.InferenceSession(str(path / spec.file), providers=["CPUExecutionProvider"])
        metadata = session.get_modelmeta().custom_metadata_map
        assert metadata[SETTINGS_KEY] == manifest.settings
        assert metadata[FINGERPRINT_KEY] == fingerprint(manifest.settings)
        assert json.loads(metadata[SETTINGS_KEY])["config"]["max_positions"] == 64


def test_external_data_is_readable_by_everyone(exports):
    # onnx writes external data with mode 0600; the export is for other users too (umask 022 here)
    path = exports(EXT).path
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes


# ----------------------------------------------------------------------------- corruption cases
@dataclass(frozen=True)
class Corruption:
    """Break a copy of the ``key`` export with ``apply(path, exports)``; loading with ``verify``
    must raise ValueError containing every fragment."""

    name: str
    key: str
    apply: Callable[[Path, object], None]
    fragments: tuple[str, ...]
    verify: str = "full"


def zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def manifest_edit(**config):
    return lambda path, _: edit_manifest(path, lambda d: d["config"].update(config))


def top_level_edit(key, value):
    return lambda path, _: edit_manifest(path, lambda d: d.update({key: value}))


def swap_graph(source: str, rehashed: bool):
    def apply(path: Path, exports) -> None:
        shutil.copy(exports(source).path / "decoder.onnx", path / "decoder.onnx")
        if rehashed:
            rehash(path, "decoder.onnx")
    return apply


CORRUPTIONS = [
    Corruption("zeroed external data", EXT, lambda p, _: zero(p / "decoder.onnx.data"),
               ("'decoder.onnx.data' does not match the sha256",)),
    Corruption("flipped weight byte", EXT, lambda p, _: flip(p / "decoder.onnx.data", 4099),
               ("'decoder.onnx.data' does not match the sha256",)),
    Corruption("flipped graph byte", DEC, lambda p, _: flip(p / "decoder.onnx", 777),
               ("'decoder.onnx' does not match the sha256",)),
    Corruption("graph of another export, same I/O", DEC, swap_graph("decoder-seed1", False),
               ("'decoder.onnx' does not match the sha256",)),
    Corruption("edited tokenizer", TEXT, lambda p, _: flip(p / "tokenizer.json", 10),
               ("'tokenizer.json' does not match",)),
    Corruption("edited config.json", DEC, lambda p, _: (p / "config.json").write_text("{}"),
               ("'config.json' has 2 bytes",)),
    Corruption("missing external data", EXT, lambda p, _: (p / "decoder.onnx.data").unlink(),
               ("'decoder.onnx.data', listed in manifest.json, is missing",)),
    Corruption("truncated external data (fast)", EXT,
               lambda p, _: (p / "decoder.onnx.data").write_bytes(b"\0" * 10),
               ("'decoder.onnx.data' has 10 bytes",), verify="fast"),
    # The manifest's own fields against the graph's fingerprint.
    Corruption("max_positions", DEC, manifest_edit(max_positions=128),
               ("graph 'decoder.onnx'", "config.max_positions: manifest 128, graph 64")),
    Corruption("rope.theta", DEC, lambda p, _: edit_manifest(p, lambda d: d["config"]["rope"].update(theta=500000.0)),
               ("config.rope.theta: manifest 500000.0, graph 10000.0",)),
    Corruption("norm_eps", DEC, manifest_edit(norm_eps=1e-6), ("config.norm_eps",)),
    Corruption("eos id", DEC, manifest_edit(eos_token_id=5), ("config.eos_token_id",)),
    Corruption("opset", DEC, top_level_edit("opset", 19), ("opset: manifest 19, graph 18",)),
    Corruption("target", DEC, top_level_edit("target", "onnx23"), ("target: manifest 'onnx23'",)),
    Corruption("refusals", DEC, top_level_edit("device_refusals", {"cuda": "no"}),
               ("device_refusals",)),
    # Still caught with the file checks off, or with the hashes 'repaired'.
    Corruption("graph of another config, rehashed", DEC, swap_graph("decoder-theta", True),
               ("config.rope.theta: manifest 10000.0, graph 20000.0",)),
    Corruption("graph of another config, verify=none", DEC, swap_graph("decoder-theta", False),
               ("config.rope.theta",), verify="none"),
    # The manifest's files map itself.
    Corruption("opset not a number", DEC, top_level_edit("opset", "abc"),
               ("manifest.json: opset='abc': expected a positive integer",)),
    Corruption("files missing", DEC, lambda p, _: edit_manifest(p, lambda d: d.pop("files")),
               ("manifest.json is incomplete", "'files'")),
    Corruption("graph not recorded", DEC,
               lambda p, _: edit_manifest(p, lambda d: d["files"].pop("decoder.onnx")),
               ("files does not record ['decoder.onnx']",)),
    Corruption("bad digest", DEC, lambda p, _: edit_manifest(
        p, lambda d: d["files"]["decoder.onnx"].update(sha256="xyz")), ("files['decoder.onnx'].sha256",)),
    Corruption("path outside the export", DEC, lambda p, _: edit_manifest(
        p, lambda d: d["files"].update({"../manifest.json": d["files"]["config.json"]})),
        ("'../manifest.json' is not a file name inside the export",)),
    Corruption("tokenizer outside the export", TEXT, top_level_edit("tokenizer", "/etc/passwd"),
               ("tokenizer='/etc/passwd': expected null or 'tokenizer.json'",)),
]


@pytest.fixture(scope="module")
def more_exports(exports, tmp_path_factory):
    """``exports`` plus two decoders with the I/O of decoder-rope: other weights, other rope.theta."""
    from tfport.config.rope import RopeConfig
    from tfport.export import ExportOptions, export_model
    from tfport.models import build_model
    from tfport.presets import get_preset

    root = tmp_path_factory.mktemp("other-exports")
    made = {}
    for key, config, seed in (("decoder-seed1", get_preset("tiny-decoder"), 1),
                              ("decoder-theta", get_preset("tiny-decoder").replace(rope=RopeConfig(theta=20000.0)), 0)):
        export_model(build_model(config, seed=seed), root / key, ExportOptions(validate=False))
        made[key] = root / key

    def get(key):
        return SimpleNamespace(path=made[key]) if key in made else exports(key)
    return get


@pytest.mark.parametrize("case", CORRUPTIONS, ids=lambda c: c.name)
def test_corruption_fails_at_load(case, more_exports, tmp_path):
    path = copy(more_exports(case.key).path, tmp_path / "m")
    case.apply(path, more_exports)
    with pytest.raises(ValueError) as info:
        load_model(path, verify=case.verify)
    for fragment in case.fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@FUZZ
@given(name=st.sampled_from(["decoder.onnx", "decoder.onnx.data", "config.json"]),
       offset=st.integers(0, 2**40), bit=st.integers(0, 7))
def test_any_flipped_bit_fails_at_load(exports, name, offset, bit):
    with tempfile.TemporaryDirectory() as tmp:
        path = copy(exports(EXT).path, Path(tmp) / "m")
        data = bytearray((path / name).read_bytes())
        data[offset % len(data)] ^= 1 << bit
        (path / name).write_bytes(bytes(data))
        with pytest.raises(ValueError, match=f"'{name}' does not match the sha256"):
            load_model(path)


MANIFEST_KEYS = ["dtype", "opset", "target", "layout", "tokenizer", "chat_template", "logits", "quantization",
                 "device_refusals", "graphs", "files", "format_version", "config"]
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=8),
              st.floats(allow_nan=False, allow_infinity=False)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


@FUZZ
@given(data=st.data())
def test_edited_manifest_fails_at_load_or_means_the_same(exports, data):
    """Replace a top-level or config field with any JSON value: loading raises ValueError, or the
    edit changed nothing the runtime reads (same settings, same files)."""
    source = exports(DEC).path
    original = Manifest.read(source)
    config_keys = sorted(json.loads((source / MANIFEST_FILE).read_text())["config"])
    where = data.draw(st.sampled_from(MANIFEST_KEYS + [f"config.{k}" for k in config_keys]))
    value = data.draw(json_values)
    with tempfile.TemporaryDirectory() as tmp:
        path = copy(source, Path(tmp) / "m")
        if where.startswith("config."):
            edit_manifest(path, lambda d: d["config"].update({where[7:]: value}))
        else:
            edit_manifest(path, lambda d: d.update({where: value}))
        try:
            model = load_model(path)
        except ValueError:
            return
        assert model.manifest.settings == original.settings
        assert (model.manifest.tokenizer, model.manifest.chat_template) == (None, None)
        assert model.manifest.files == original.files


def test_the_graph_id_names_are_checked_even_without_hashes(exports, tmp_path):
    # A flipped byte inside an input name used to surface as a bare UnicodeDecodeError.
    path = copy(exports(DEC).path, tmp_path / "m")
    graph = path / "decoder.onnx"
    graph.write_bytes(graph.read_bytes().replace(b"input_ids", b"input_i\xffs"))
    with pytest.raises(ValueError, match="graph 'decoder.onnx' has unreadable input/output names"):
        load_model(path, verify="none")
    with pytest.raises(ValueError, match="'decoder.onnx' does not match the sha256"):
        load_model(path)


# ------------------------------------------------------------------------ opting out, old exports
def test_fast_hashes_small_files_and_says_what_it_skips(exports, tmp_path, monkeypatch, caplog):
    path = copy(exports(EXT).path, tmp_path / "m")
    flip(path / "decoder.onnx.data", 4099)  # a changed weight, same size
    monkeypatch.setattr(integrity, "FAST_HASH_LIMIT", 64 * 1024)  # the weights count as huge here
    with caplog.at_level(logging.WARNING, logger="tfport.integrity"):
        model = load_model(path, verify="fast")  # the graph is hashed, the weights only sized
    assert "verify='fast': ['decoder.onnx.data']" in caplog.text and "not hashed" in caplog.text
    assert model.generate([[1, 2, 3]], max_new_tokens=2).shape == (1, 2)
    flip(path / "decoder.onnx", 50)
    with pytest.raises(ValueError, match="'decoder.onnx' does not match"):
        load_model(path, verify="fast")


def test_none_says_what_it_skips(exports, caplog):
    with caplog.at_level(logging.WARNING, logger="tfport.integrity"):
        load_model(exports(DEC).path, verify="none")
    assert "verify='none'" in caplog.text and "'decoder.onnx'" in caplog.text


@pytest.mark.parametrize("verify", ["yes", True, None, "FULL"])
def test_verify_argument(exports, verify):
    with pytest.raises(ValueError, match=f"verify={verify!r}"):
        load_model(exports(DEC).path, verify=verify)


def test_format_2_exports_load_only_unverified_with_a_warning(exports, tmp_path, caplog):
    path = copy(exports(DEC).path, tmp_path / "m")
    edit_manifest(path, lambda d: (d.pop("files"), d.update(format_version=2)))
    with pytest.raises(ValueError, match="verify='full' cannot check it"):
        load_model(path)  # tests/runtime/test_manifest_versions.py has the rest (issue 27)
    with caplog.at_level(logging.WARNING, logger="tfport.runtime.opening"):
        model = load_model(path, verify="none")
    assert "manifest format 2" in caplog.text and "nothing is verified" in caplog.text
    tokens = model.generate([[1, 2, 3]], max_new_tokens=3)
    np.testing.assert_array_equal(tokens, load_model(exports(DEC).path).generate([[1, 2, 3]], max_new_tokens=3))
