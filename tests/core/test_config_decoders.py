"""Validation and JSON round trip of the options the deployed decoders need (issue #12)."""

from __future__ import annotations

import pytest

from tfport.config import ModelConfig
from tfport.presets import PRESETS

BASE = PRESETS["tiny-decoder"]  # 4 heads of 8 channels, 2 layers, RoPE


@pytest.mark.parametrize("changes,field", [
    (dict(rope_scaling="llama3", rope_scaling_factor=8.0), "rope_original_max_positions"),
    (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_positions=16,
          rope_low_freq_factor=4.0, rope_high_freq_factor=1.0), "rope_high_freq_factor"),
    (dict(rope_low_freq_factor=2.0), "rope_low_freq_factor"),
    (dict(rope_scaling="longrope", rope_original_max_positions=8, rope_short_factor=(1.0,),
          rope_long_factor=(1.0,) * 4), "rope_short_factor"),
    (dict(rope_attention_factor=1.2), "rope_attention_factor"),
    (dict(local_layers=(0,)), "local_layers"),
    (dict(sliding_window=4, local_layers=(2,)), "local_layers"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(rope_local_theta=1000.0), "rope_local_theta"),
    (dict(rotary_dim=3), "rotary_dim"),
    (dict(rotary_dim=16), "rotary_dim"),
    (dict(qk_norm=True, norm="layernorm"), "qk_norm"),
    (dict(norm_weight_offset=1.0, norm="layernorm"), "norm_weight_offset"),
    (dict(attn_logit_softcap=0.0), "attn_logit_softcap"),
    (dict(alibi_slopes="bloom"), "alibi_slopes"),
    (dict(rope_interleaved=True, position="alibi"), "rope_interleaved"),
    (dict(parallel_residual=True, norm_position="post"), "parallel_residual"),
])
def test_bad_options_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"config\.{field}="):
        BASE.replace(**changes)


def test_tuple_fields_round_trip_through_json_and_stay_hashable():
    config = BASE.replace(d_model=64, sliding_window=4, local_layers=(1,), rope_local_theta=1000.0,
                          rope_scaling="longrope", rope_original_max_positions=8,
                          rope_short_factor=tuple(1.0 + i / 8 for i in range(8)),
                          rope_long_factor=tuple(2.0 + i for i in range(8)), rope_attention_factor=1.1)
    again = ModelConfig.from_json(config.to_json())  # JSON lists come back as tuples
    assert again == config and hash(again) == hash(config)
    assert [config.is_local(i) for i in range(2)] == [False, True]
