"""Language-model heads (models/decoder.py, models/encoder_decoder.py): scale and tying."""

from __future__ import annotations

import pytest
import torch

from tfport.models import build_model

from .torch_reference import assert_close, random_ids, tiny


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    if model.config.family == "decoder":
        return model(ids)[0]
    return model(ids, ids[:, :3])


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-decoder-gpt2", "tiny-encoder-decoder-t5"])
def test_lm_head_scale_multiplies_the_final_states(preset: str):
    # The head is a bias-free linear map, so scaling its input by s scales the logits by s.
    base = tiny(preset, lm_head_scale=1.0)
    scaled = base.replace(lm_head_scale=0.125)
    plain_model, scaled_model = build_model(base, seed=0), build_model(scaled, seed=0)
    ids = random_ids((2, 5), base.vocab_size)
    assert_close(logits_of(scaled_model, ids), 0.125 * logits_of(plain_model, ids), preset)


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder-decoder"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_head_is_tied_to_the_token_embedding_iff_configured(preset: str, tie: bool):
    model = build_model(tiny(preset, tie_embeddings=tie), seed=0)
    assert (model.lm_head.weight is model.decoder.embed.tokens.weight) == tie
    if model.config.family == "encoder-decoder":  # one token table for both stacks
        assert model.encoder.embed.tokens.weight is model.decoder.embed.tokens.weight
