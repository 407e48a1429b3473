"""tfport/config/ and tfport/presets.py: validation, JSON round trip, preset shapes, no torch.

These tests import nothing but tfport's core and the standard library.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest

from tests.changes import changed
from tfport.config import ModelConfig
from tfport.config.rope import RopeConfig
from tfport.presets import PRESETS, get_preset


# ---------------------------------------------------------------------------------- validation
@dataclass(frozen=True)
class BadConfig:
    name: str
    preset: str
    changes: dict
    field: str  # the field the message must name ...
    shown: str  # ... and the offending value, as the message prints it


BAD_CONFIGS = [
    BadConfig("d_model-not-multiple-of-heads", "tiny-decoder", {"d_model": 30}, "d_model", "30"),
    BadConfig("heads-not-multiple-of-kv-heads", "tiny-decoder", {"n_kv_heads": 3}, "n_kv_heads", "3"),
    BadConfig("kv-heads-zero", "tiny-decoder", {"n_kv_heads": 0}, "n_kv_heads", "0"),
    BadConfig("rope-odd-head-dim-from-d_model", "tiny-decoder", {"d_model": 20}, "d_model", "20"),
    BadConfig("rope-odd-head-dim", "tiny-decoder", {"head_dim": 5}, "head_dim", "5"),
    BadConfig("family", "tiny-decoder", {"family": "decoder-only"}, "family", "'decoder-only'"),
    BadConfig("norm", "tiny-decoder", {"norm": "batchnorm"}, "norm", "'batchnorm'"),
    BadConfig("norm_position", "tiny-decoder", {"norm_position": "sandwich"}, "norm_position", "'sandwich'"),
    BadConfig("position", "tiny-decoder", {"position": "t5_bucket"}, "position", "'t5_bucket'"),
    BadConfig("activation", "tiny-decoder", {"activation": "swish"}, "activation", "'swish'"),
    BadConfig("rope.scaling", "tiny-decoder", {"rope.scaling": "xpos"}, "rope.scaling", "'xpos'"),
    BadConfig("pad-id-equals-vocab", "tiny-decoder", {"pad_token_id": 96}, "pad_token_id", "96"),
    BadConfig("eos-id-negative", "tiny-decoder", {"eos_token_id": -1}, "eos_token_id", "-1"),
    BadConfig("bos-id-beyond-vocab", "tiny-decoder", {"bos_token_id": 1000}, "bos_token_id", "1000"),
    BadConfig("decoder-start-id-beyond-vocab", "tiny-encoder-decoder", {"decoder_start_token_id": 96},
              "decoder_start_token_id", "96"),
    BadConfig("decoder-with-encoder-layers", "tiny-decoder", {"n_encoder_layers": 2}, "n_encoder_layers", "2"),
    BadConfig("decoder-without-layers", "tiny-decoder", {"n_decoder_layers": 0}, "n_decoder_layers", "0"),
    BadConfig("encoder-with-decoder-layers", "tiny-encoder", {"n_decoder_layers": 1}, "n_decoder_layers", "1"),
    BadConfig("encoder-without-layers", "tiny-encoder", {"n_encoder_layers": 0}, "n_encoder_layers", "0"),
    BadConfig("seq2seq-without-encoder", "tiny-encoder-decoder", {"n_encoder_layers": 0},
              "n_encoder_layers", "0"),
    BadConfig("seq2seq-without-start-id", "tiny-encoder-decoder", {"decoder_start_token_id": None},
              "decoder_start_token_id", "None"),
    BadConfig("negative-layers", "tiny-encoder", {"n_decoder_layers": -1}, "n_decoder_layers", "-1"),
    BadConfig("vocab-zero", "tiny-decoder", {"vocab_size": 0}, "vocab_size", "0"),
    BadConfig("bool-is-not-an-int", "tiny-decoder", {"d_ff": True}, "d_ff", "True"),
    BadConfig("rope-scaling-without-rope", "tiny-decoder-gpt2", {"rope.scaling": "linear", "rope.scaling_factor": 2.0},
              "rope.scaling", "'linear'"),
    BadConfig("scaling-factor-without-scaling", "tiny-decoder", {"rope.scaling_factor": 2.0},
              "rope.scaling_factor", "2.0"),
    BadConfig("scaling-factor-below-one", "tiny-decoder-rope-ntk", {"rope.scaling_factor": 0.5},
              "rope.scaling_factor", "0.5"),
    BadConfig("scaling-factor-nan", "tiny-decoder-rope-ntk", {"rope.scaling_factor": math.nan},
              "rope.scaling_factor", "nan"),
    BadConfig("relative-buckets-too-few", "tiny-encoder-decoder-t5", {"relative.buckets": 3},
              "relative.buckets", "3"),
    BadConfig("relative-max-distance-too-short", "tiny-encoder-decoder-t5", {"relative.max_distance": 2},
              "relative.max_distance", "2"),
    BadConfig("lm-head-scale-zero", "tiny-encoder-decoder-t5", {"lm_head_scale": 0.0}, "lm_head_scale", "0.0"),
    BadConfig("lm-head-scale-nan", "tiny-decoder", {"lm_head_scale": math.nan}, "lm_head_scale", "nan"),
    BadConfig("rope-theta-zero", "tiny-decoder", {"rope.theta": 0.0}, "rope.theta", "0.0"),
    BadConfig("norm-eps-zero", "tiny-decoder", {"norm_eps": 0.0}, "norm_eps", "0.0"),
    BadConfig("attention-scale-negative", "tiny-decoder", {"attention_scale": -1.0}, "attention_scale", "-1.0"),
    BadConfig("pooler-on-decoder", "tiny-decoder", {"pooler": True}, "pooler", "True"),
    BadConfig("mlm-head-on-seq2seq", "tiny-encoder-decoder", {"mlm_head": True}, "mlm_head", "True"),
    BadConfig("token-types-on-decoder", "tiny-decoder", {"type_vocab_size": 2}, "type_vocab_size", "2"),
    BadConfig("part-not-a-part", "tiny-decoder", {"rope": {"theta": 1.0}}, "rope", "{'theta': 1.0}"),
    BadConfig("dropout-one", "tiny-encoder", {"dropout.attention": 1.0}, "dropout.attention", "1.0"),
    BadConfig("labels-count", "tiny-encoder", {"classifier.n_labels": 2, "classifier.labels": ("a",)},
              "classifier.labels", "('a',)"),
    BadConfig("classifier-on-decoder", "tiny-decoder", {"classifier.n_labels": 2}, "classifier.n_labels", "2"),
    BadConfig("window-on-seq2seq", "tiny-encoder-decoder", {"window.size": 4}, "window.size", "4"),
    BadConfig("disentangled-without-position", "tiny-encoder", {"disentangled.max_distance": 64},
              "disentangled.max_distance", "64"),
]


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=lambda c: c.name)
def test_invalid_config_names_field_and_value(case: BadConfig):
    with pytest.raises(ValueError) as info:
        changed(PRESETS[case.preset], case.changes)
    message = str(info.value)
    assert f"config.{case.field}={case.shown}" in message, message
    assert "expected" in message, f"the message should say what was expected: {message}"


def test_rope_message_states_the_odd_head_dimension():
    with pytest.raises(ValueError, match=r"even head dimension for RoPE, got 5"):
        PRESETS["tiny-decoder"].replace(d_model=20)


def test_divisibility_messages_show_the_divisor():
    with pytest.raises(ValueError, match=r"multiple of n_heads=4"):
        PRESETS["tiny-decoder"].replace(d_model=30)
    with pytest.raises(ValueError, match=r"divisor of n_heads=4"):
        PRESETS["tiny-decoder"].replace(n_kv_heads=3)


def test_unknown_json_field_is_named():
    data = json.loads(PRESETS["tiny-decoder"].to_json())
    data["rope_type"] = "dynamic"
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['rope_type'\]"):
        ModelConfig.from_json(json.dumps(data))


def test_json_must_be_an_object():
    with pytest.raises(TypeError, match="expected a JSON object, got list"):
        ModelConfig.from_json("[1, 2]")


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"preset='llama9'.*tiny-decoder"):
        get_preset("llama9")


# Gaps in validation found while writing these tests (see the reasons).
@pytest.mark.parametrize("theta", [math.nan, math.inf], ids=["nan", "inf"])
def test_non_finite_rope_theta_is_rejected(theta):
    with pytest.raises(ValueError, match=r"config\.rope\.theta="):
        changed(PRESETS["tiny-decoder"], {"rope.theta": theta})


@pytest.mark.parametrize("max_distance", [3, 4])
def test_relative_max_distance_must_exceed_causal_exact_range(max_distance):
    with pytest.raises(ValueError, match=rf"config\.relative\.max_distance={max_distance}"):
        changed(PRESETS["tiny-encoder-decoder-t5"], {"relative.max_distance": max_distance})


def test_bool_n_kv_heads_is_rejected():
    with pytest.raises(ValueError, match=r"config\.n_kv_heads=True"):
        PRESETS["tiny-decoder"].replace(n_kv_heads=True)


def test_string_rope_theta_names_the_field():
    with pytest.raises((ValueError, TypeError), match=r"config\.rope\.theta="):
        changed(PRESETS["tiny-decoder"], {"rope.theta": "1e4"})


# -------------------------------------------------------------------------------- JSON and presets
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_json_round_trip(name: str):
    config = PRESETS[name]
    text = config.to_json()
    assert ModelConfig.from_json(text) == config
    assert ModelConfig.from_dict(json.loads(text)) == config
    assert json.loads(text) == config.to_dict()
    assert list(json.loads(text)) == sorted(json.loads(text)), "keys are sorted for stable diffs"
    assert get_preset(name) is config


def test_derived_values_are_properties_not_fields():
    config = PRESETS["tiny-decoder"]
    assert "kv_heads" not in config.to_dict() and "dim_per_head" not in config.to_dict()
    assert (config.kv_heads, config.dim_per_head, config.attention_kind) == (2, 8, "gqa")
    assert PRESETS["tiny-decoder-mha"].attention_kind == "mha"
    assert PRESETS["tiny-decoder-mqa"].attention_kind == "mqa"
    assert config.softmax_scale == 8 ** -0.5
    assert PRESETS["t5-small"].softmax_scale == 1.0


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        PRESETS["tiny-decoder"].d_model = 64  # type: ignore[misc]


# Shapes as published (model cards / original configs), written out here independently.
DOCUMENTED = {
    "llama3-8b": dict(family="decoder", n_decoder_layers=32, d_model=4096, n_heads=32, n_kv_heads=8,
                      d_ff=14336, vocab_size=128256, norm="rmsnorm", norm_position="pre",
                      activation="silu", gated_ffn=True, position="rope", **{"rope.theta": 500000.0},
                      attention_bias=False, mlp_bias=False, tie_embeddings=False),
    "bert-base": dict(family="encoder", n_encoder_layers=12, d_model=768, n_heads=12, d_ff=3072,
                      vocab_size=30522, max_positions=512, norm="layernorm", norm_position="post",
                      activation="gelu", position="learned", type_vocab_size=2),
    "gpt2-small": dict(family="decoder", n_decoder_layers=12, d_model=768, n_heads=12, d_ff=3072,
                       vocab_size=50257, max_positions=1024, norm="layernorm", norm_position="pre",
                       activation="gelu_tanh", position="learned", tie_embeddings=True),
    "t5-small": dict(family="encoder-decoder", n_encoder_layers=6, n_decoder_layers=6, d_model=512,
                     n_heads=8, d_ff=2048, vocab_size=32128, norm="rmsnorm", activation="relu",
                     position="relative", **{"relative.buckets": 32, "relative.max_distance": 128},
                     attention_scale=1.0, lm_head_scale=512 ** -0.5),
    "bloom-560m": dict(family="decoder", n_decoder_layers=24, d_model=1024, n_heads=16, d_ff=4096,
                       vocab_size=250880, position="alibi", embedding_norm=True),
}


def value(config: ModelConfig, path: str):
    """The field at ``path`` (``"rope.theta"``)."""
    for name in path.split("."):
        config = getattr(config, name)
    return config


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_preset_has_documented_shape(name: str):
    config = PRESETS[name]
    mismatched = {k: (value(config, k), v) for k, v in DOCUMENTED[name].items() if value(config, k) != v}
    assert not mismatched, f"{name}: (preset, documented) = {mismatched}"


def test_llama3_8b_derived_shape():
    config = PRESETS["llama3-8b"]
    assert (config.dim_per_head, config.kv_heads, config.attention_kind) == (128, 8, "gqa")


# ----------------------------------------------------------------------------- torch-free import
BLOCKED = ("torch", "onnxscript", "onnx", "onnxruntime")


def test_core_imports_without_torch(tmp_path):
    # Packages that raise ImportError shadow the real ones, first on PYTHONPATH.
    for name in BLOCKED:
        (tmp_path / "blocked" / name).mkdir(parents=True)
        (tmp_path / "blocked" / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked: tfport core must not import it')\n")
    script = textwrap.dedent(f"""
        import sys
        try:
            import torch
        except ImportError:
            pass
        else:
            raise SystemExit("the blocking stub did not take effect")
        import tfport, tfport.config, tfport.presets, tfport.contract, tfport.cli
        config = tfport.get_preset("tiny-decoder")
        assert tfport.config.ModelConfig.from_json(config.to_json()) == config
        loaded = sorted(m for m in {BLOCKED!r} if m in sys.modules and sys.modules[m] is not None)
        print("loaded:", loaded)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60,
                            env={"PYTHONPATH": str(tmp_path / "blocked"), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "loaded: []", result.stdout


@pytest.mark.parametrize("field", ["gated_ffn", "attention_bias", "mlp_bias", "tie_embeddings",
                                   "embedding_norm", "pooler", "mlm_head"])
def test_boolean_fields_must_be_booleans(field):
    with pytest.raises(ValueError, match=rf"config\.{field}='false': expected true or false"):
        PRESETS["tiny-encoder"].replace(**{field: "false"})


def test_ntk_scaling_needs_a_head_dim_above_two():
    base = PRESETS["tiny-decoder"]
    with pytest.raises(ValueError, match="head_dim=2: expected a head dimension above 2"):
        base.replace(head_dim=2, rope=RopeConfig(scaling="ntk", scaling_factor=2.0))
