"""Validation and JSON round trip of the options the deployed decoders need (issue #12)."""

from __future__ import annotations

import pytest

from tests.changes import changed
from tfport.config import ModelConfig
from tfport.config.rope import RopeConfig
from tfport.config.window import WindowConfig
from tfport.presets import PRESETS

BASE = PRESETS["tiny-decoder"]  # 4 heads of 8 channels, 2 layers, RoPE


@pytest.mark.parametrize("changes,field", [
    ({"rope.scaling": "llama3", "rope.scaling_factor": 8.0}, "rope.original_max_positions"),
    ({"rope.scaling": "llama3", "rope.scaling_factor": 8.0, "rope.original_max_positions": 16,
      "rope.low_freq_factor": 4.0, "rope.high_freq_factor": 1.0}, "rope.high_freq_factor"),
    ({"rope.low_freq_factor": 2.0}, "rope.low_freq_factor"),
    ({"rope.scaling": "longrope", "rope.original_max_positions": 8, "rope.short_factor": (1.0,),
      "rope.long_factor": (1.0,) * 4}, "rope.short_factor"),
    ({"rope.attention_factor": 1.2}, "rope.attention_factor"),
    ({"window.layers": (0,)}, "window.layers"),
    ({"window.size": 4, "window.layers": (2,)}, "window.layers"),
    ({"window.size": 0}, "window.size"),
    ({"rope.local_theta": 1000.0}, "rope.local_theta"),
    ({"rope.rotary_dim": 3}, "rope.rotary_dim"),
    ({"rope.rotary_dim": 16}, "rope.rotary_dim"),
    (dict(qk_norm=True, norm="layernorm"), "qk_norm"),
    (dict(norm_weight_offset=1.0, norm="layernorm"), "norm_weight_offset"),
    (dict(attn_logit_softcap=0.0), "attn_logit_softcap"),
    (dict(alibi_slopes="bloom"), "alibi_slopes"),
    ({"rope.interleaved": True, "position": "alibi"}, "rope.interleaved"),
    (dict(parallel_residual=True, norm_position="post"), "parallel_residual"),
])
def test_bad_options_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"config\.{field}="):
        changed(BASE, changes)


def test_tuple_fields_round_trip_through_json_and_stay_hashable():
    config = BASE.replace(d_model=64, window=WindowConfig(size=4, layers=(1,)),
                          rope=RopeConfig(local_theta=1000.0, scaling="longrope", original_max_positions=8,
                                          short_factor=tuple(1.0 + i / 8 for i in range(8)),
                                          long_factor=tuple(2.0 + i for i in range(8)), attention_factor=1.1))
    again = ModelConfig.from_json(config.to_json())  # JSON lists come back as tuples
    assert again == config and hash(again) == hash(config)
    assert [config.is_local(i) for i in range(2)] == [False, True]
