"""``tfport.generation.GenerationDefaults``: a generation_config.json's values are checked when
read, each refusal naming the field, so a bad file fails at load and not at the first request."""

from __future__ import annotations

import math

import pytest

from tfport.generation import GenerationDefaults


@pytest.mark.parametrize("field, value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -0.5), ("temperature", True),
    ("top_k", -1), ("top_k", 2.0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("repetition_penalty", 0.0), ("repetition_penalty", math.inf), ("do_sample", 1),
    ("eos_token_ids", [2]), ("forced_bos_token_id", -3),
])
def test_a_bad_value_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=rf"generation\.{field}="):
        GenerationDefaults(**{field: value})


def test_good_values_are_kept():
    defaults = GenerationDefaults(eos_token_ids=(2, 7), do_sample=True, temperature=0, top_k=0, top_p=1,
                                  repetition_penalty=1.1, forced_bos_token_id=3)
    assert defaults.sampling == {"temperature": 0, "top_k": 0, "top_p": 1}
    assert GenerationDefaults(do_sample=False, temperature=0.7).sampling["temperature"] == 0.0
