"""Export dtypes and the KV cache dtype: what is recorded, what is refused and how it is said.

Parity of these exports is in tests/parity/test_dtypes.py.
"""

from __future__ import annotations

import json

import pytest

from tfport.cli import main
from tfport.contract import MANIFEST_FILE
from tfport.export import ExportOptions, export_model
from tfport.export.targets import TARGETS
from tfport.manifest import Manifest
from tfport.models import build_model
from tfport.presets import PRESETS


@pytest.mark.parametrize("argv,needle", [
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64' (choose from 'float32', 'float16', "
                             "'bfloat16')"),
    (["--kv-dtype", "bfloat16"], "argument --kv-dtype: invalid choice: 'bfloat16' (choose from 'float32', "
                                 "'float16')"),
])
def test_cli_refuses_unknown_dtypes_naming_the_choices(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "tiny-decoder", "--out", str(tmp_path / "x"), *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("preset,argv,needle", [
    ("tiny-decoder", ["--dtype", "float16", "--kv-dtype", "float32"],
     "kv_dtype='float32': a dtype='float16' export keeps its KV cache in one of ['float16']"),
    ("tiny-encoder", ["--kv-dtype", "float16"],
     "kv_dtype='float16': family='encoder' models have no KV cache"),
    ("tiny-decoder", ["--dtype", "bfloat16", "--quantize", "int8"],
     "quantize='int8' with dtype='bfloat16'"),
])
def test_cli_refuses_combinations_naming_the_argument(tmp_path, capsys, preset, argv, needle):
    assert main(["export", preset, "--out", str(tmp_path / "x"), *argv]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_kv_dtype_is_recorded_and_fingerprinted(tmp_path, capsys):
    """--kv-dtype float16 is in the manifest, the CLI's summary and the graphs' settings (so a graph
    copied in from a float32-cache export is refused); the default adds nothing to the settings,
    so exports made before the option keep their fingerprints."""
    assert main(["export", "tiny-decoder", "--out", str(tmp_path / "kv"), "--kv-dtype", "float16"]) == 0
    assert "float32, KV cache float16" in capsys.readouterr().out
    manifest = Manifest.read(tmp_path / "kv")
    assert manifest.kv_dtype == "float16" and '"kv_dtype":"float16"' in manifest.settings
    export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "plain", ExportOptions(validate=False))
    plain = Manifest.read(tmp_path / "plain")
    assert plain.kv_dtype == "float32" and "kv_dtype" not in plain.settings


def test_manifest_with_a_bad_kv_dtype_is_refused(tmp_path):
    export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "m", ExportOptions(
        dtype="float16", validate=False))
    path = tmp_path / "m" / MANIFEST_FILE
    data = json.loads(path.read_text())
    data["kv_dtype"] = "float32"  # a float16 export's cache is float16
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"kv_dtype='float32': expected one of \['float16'\] for dtype 'float16'"):
        Manifest.read(tmp_path / "m")


def test_ort_on_cuda_needs_a_float16_cache():
    """GroupQueryAttention runs in the cache dtype, and ONNX Runtime has no float32 CUDA kernel:
    the refusal follows the cache dtype, not the weights'."""
    ort = TARGETS["ort"]
    assert "--kv-dtype float16" in ort.device_refusals("float32")["cuda"]
    assert "cuda" in ort.device_refusals("bfloat16", "float32")
    assert ort.device_refusals("float32", "float16") == ort.device_refusals("float16") == {}
