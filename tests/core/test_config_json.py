"""ModelConfig's JSON forms: the nested one it writes, and the flat one tfport wrote before the
config was grouped into parts (``config.json`` and ``manifest.json`` of existing exports), which
must load to the same config with the same settings fingerprint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tfport.config import ModelConfig
from tfport.config.classifier import ClassifierConfig
from tfport.config.dropout import DropoutConfig
from tfport.config.positions import DisentangledConfig, RelativeConfig
from tfport.config.rope import RopeConfig
from tfport.config.window import WindowConfig
from tfport.contract import CONFIG_FILE, MANIFEST_FILE
from tfport.integrity import export_settings, fingerprint, record_files
from tfport.manifest import Manifest
from tfport.presets import PRESETS

# Written by tfport before the grouping (see its _comment): name -> {config, fingerprint}.
FLAT = {name: entry for name, entry in json.loads(
    (Path(__file__).parent / "data" / "flat_configs.json").read_text()).items() if name != "_comment"}

_D = dict(vocab_size=96, d_model=32, n_heads=4, d_ff=64, max_positions=64, pad_token_id=0)
# The same configs, written here with the parts (the values the flat files hold, by hand).
EXPECTED = {
    "llama3-window": ModelConfig(
        family="decoder", n_decoder_layers=4, n_kv_heads=2, norm="rmsnorm", activation="silu",
        gated_ffn=True, position="rope", qk_norm=True, eos_token_id=2, bos_token_id=1, **_D,
        rope=RopeConfig(theta=500000.0, scaling="llama3", scaling_factor=8.0, original_max_positions=32,
                        low_freq_factor=1.5, high_freq_factor=3.0, local_theta=10000.0),
        window=WindowConfig(size=8, layers=(0, 2)),
        dropout=DropoutConfig(embedding=0.1, attention=0.2, residual=0.05, ffn=0.3)),
    "yarn-partial": ModelConfig(
        family="decoder", n_decoder_layers=2, position="rope", eos_token_id=2, **_D,
        rope=RopeConfig(scaling="yarn", scaling_factor=4.0, original_max_positions=16, attention_factor=1.2,
                        beta_fast=16.0, beta_slow=2.0, truncate=False, rotary_dim=4, interleaved=True)),
    "longrope": ModelConfig(
        family="decoder", n_decoder_layers=2, position="rope", eos_token_id=2, **_D,
        rope=RopeConfig(scaling="longrope", original_max_positions=16, short_factor=(1.0, 1.5, 2.0, 2.5),
                        long_factor=(3.0, 3.5, 4.0, 4.5), attention_factor=1.1),
        window=WindowConfig(size=16)),
    "dynamic": ModelConfig(
        family="decoder", n_decoder_layers=2, position="rope", **_D,
        rope=RopeConfig(scaling="dynamic", scaling_factor=2.0, original_max_positions=32)),
    "deberta-classifier": ModelConfig(
        family="encoder", n_encoder_layers=2, position="disentangled", **_D,
        disentangled=DisentangledConfig(buckets=16, max_distance=32, terms=("c2p",)),
        classifier=ClassifierConfig(n_labels=3, labels=("neg", "neu", "pos"), pooling="mean",
                                    activation="gelu", norm=True)),
    "t5-relative": ModelConfig(
        family="encoder-decoder", n_encoder_layers=1, n_decoder_layers=1, position="relative",
        norm="rmsnorm", decoder_start_token_id=0, eos_token_id=1, **_D,
        relative=RelativeConfig(buckets=8, max_distance=20)),
    "mbart-classifier": ModelConfig(
        family="encoder-decoder", n_encoder_layers=1, n_decoder_layers=1, position="learned",
        decoder_start_token_id=2, eos_token_id=2, **_D,
        classifier=ClassifierConfig(n_labels=2, pooling="last_eos", decoder_start="last_token")),
    "modernbert-window": ModelConfig(
        family="encoder", n_encoder_layers=3, position="rope", first_attn_norm=False, **_D,
        rope=RopeConfig(theta=160000.0, local_theta=10000.0), window=WindowConfig(size=8, layers=(1, 2))),
    "alibi-mpt": ModelConfig(
        family="decoder", n_decoder_layers=2, position="alibi", alibi_slopes="mpt",
        **{**_D, "n_heads": 3, "d_model": 33}),
    **{f"preset:{name}": config for name, config in PRESETS.items()},
}


def _settings(config: ModelConfig) -> str:
    return export_settings(config, "float32", 18, "portable", "concat", {})


def test_every_flat_file_has_its_expected_config():
    assert sorted(FLAT) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_flat_config_from_before_the_grouping_loads_to_the_same_config(name):
    flat = FLAT[name]["config"]
    assert "rope_theta" in flat and "rope" not in flat  # the old form, every field written out
    config = ModelConfig.from_dict(flat)
    assert config == EXPECTED[name]
    assert ModelConfig.from_json(json.dumps(flat)) == EXPECTED[name]
    # The settings fingerprint the graphs of an existing export carry still matches.
    assert fingerprint(_settings(config)) == FLAT[name]["fingerprint"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_nested_form_round_trips(name):
    config = EXPECTED[name]
    data = json.loads(config.to_json())
    assert {"rope", "window", "relative", "disentangled", "classifier", "dropout"} <= set(data)
    assert not {"rope_theta", "sliding_window", "n_labels", "embedding_dropout"} & set(data)
    assert data["rope"]["theta"] == config.rope.theta and data["classifier"]["n_labels"] == config.classifier.n_labels
    again = ModelConfig.from_json(config.to_json())
    assert again == config and hash(again) == hash(config)  # JSON lists come back as tuples
    # Grouping is how the config is written, not what it is: the fingerprint of the flat file.
    assert fingerprint(_settings(again)) == FLAT[name]["fingerprint"]


def test_a_manifest_written_before_the_grouping_loads(tmp_path):
    name = "llama3-window"
    manifest = Manifest(config=EXPECTED[name])
    for graph in manifest.graphs.values():
        (tmp_path / graph.file).write_bytes(b"graph")
    (tmp_path / CONFIG_FILE).write_text(json.dumps(FLAT[name]["config"]))
    data = dataclasses.replace(manifest, files=record_files(tmp_path, manifest.required_files())).to_dict()
    assert data["config"]["rope"]["scaling"] == "llama3"  # written nested ...
    data["config"] = FLAT[name]["config"]  # ... and as the previous version wrote it
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(data))
    read = Manifest.read(tmp_path)
    assert read.config == EXPECTED[name]
    assert fingerprint(read.settings) == FLAT[name]["fingerprint"]


@pytest.mark.parametrize("edit, error, match", [
    # a field given flat and grouped
    (lambda d: d.update(rope_theta=5.0), ValueError, r"rope\.theta is given twice \(grouped and as 'rope_theta'\)"),
    # an unknown field of a part, named by its path
    (lambda d: d["rope"].update(type="dynamic"), ValueError,
     r"unknown field\(s\) \['rope\.type'\]; known fields are \[.*'rope\.theta'"),
    (lambda d: d.update(window=4), TypeError, r"config\.window: expected a JSON object, got int"),
], ids=["flat-and-grouped", "unknown-part-field", "part-not-an-object"])
def test_malformed_config_json_is_refused_naming_the_field(edit, error, match):
    data = PRESETS["tiny-decoder"].to_dict()
    edit(data)
    with pytest.raises(error, match=match):
        ModelConfig.from_dict(data)


def test_a_part_validates_itself_naming_the_full_path():
    with pytest.raises(ValueError, match=r"config\.rope\.scaling_factor=0\.5: expected a finite number >= 1"):
        RopeConfig(scaling="linear", scaling_factor=0.5)
    with pytest.raises(ValueError, match=r"config\.window\.layers=\(1, 1\): expected distinct layer indices"):
        WindowConfig(size=4, layers=(1, 1))
