"""Padding invariance: a padded batch equals each sequence run alone, at its real positions.

Padding slots are filled with an ordinary token (not the pad id): whatever sits there must not
leak into real positions. A fully padded row must stay finite in every family.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from .torch_reference import assert_close, left_pad, model_for, random_ids, right_pad, tiny

FILLER = 5  # token placed in padding slots
LENGTHS = [5, 3, 6]
PADDERS = {"left": left_pad, "right": right_pad}


def rows_for(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    return [random_ids((n,), vocab, seed=seed + i) for i, n in enumerate(LENGTHS)]


@dataclass(frozen=True)
class PadCase:
    preset: str
    changes: tuple = ()  # (field, value) pairs

    @property
    def config(self):
        return tiny(self.preset, **dict(self.changes))

    @property
    def name(self) -> str:
        return "-".join([self.preset] + [f"{k}={v}" for k, v in self.changes])


DECODER_CASES = [
    PadCase("tiny-decoder"),  # rope, GQA
    PadCase("tiny-decoder-mqa"),
    PadCase("tiny-decoder-gpt2"),  # learned
    PadCase("tiny-decoder-alibi"),
    PadCase("tiny-decoder", (("position", "sinusoidal"),)),
    PadCase("tiny-decoder", (("position", "relative"),)),
    PadCase("tiny-decoder", (("position", "none"),)),
]
ENCODER_CASES = [
    PadCase("tiny-encoder"),  # learned, post-norm, token types, pooler, MLM head
    PadCase("tiny-encoder-rope"),
    PadCase("tiny-encoder", (("position", "alibi"),)),
    PadCase("tiny-encoder", (("position", "relative"),)),
]
SEQ2SEQ_CASES = [PadCase("tiny-encoder-decoder"), PadCase("tiny-encoder-decoder-gqa"),
                 PadCase("tiny-encoder-decoder-t5")]


def real_slice(side: str, length: int, total: int) -> slice:
    return slice(total - length, total) if side == "left" else slice(0, length)


@pytest.mark.parametrize("side", PADDERS)
@pytest.mark.parametrize("case", DECODER_CASES, ids=lambda c: c.name)
def test_decoder_padded_batch_equals_rows_alone(case: PadCase, side: str):
    config = case.config
    model = model_for(config)
    rows = rows_for(config.vocab_size)
    ids, mask = PADDERS[side](rows, FILLER)
    logits, cache = model(ids, mask)
    for b, row in enumerate(rows):
        alone, alone_cache = model(row[None])
        where = real_slice(side, len(row), ids.shape[1])
        assert_close(logits[b, where], alone[0], f"{case.name} {side} row {b} logits")
        for (k, _), (ak, _) in zip(cache.layers, alone_cache.layers):
            assert_close(k[b, :, where], ak[0], f"{case.name} {side} row {b} present key")


@pytest.mark.parametrize("side", PADDERS)
@pytest.mark.parametrize("case", ENCODER_CASES, ids=lambda c: c.name)
def test_encoder_padded_batch_equals_rows_alone(case: PadCase, side: str):
    config = case.config
    model = model_for(config)
    rows = rows_for(config.vocab_size)
    ids, mask = PADDERS[side](rows, FILLER)
    types = None
    if config.type_vocab_size:
        # second half of every row is segment 1; padding slots get segment 1 too (must not leak)
        types = torch.ones_like(ids)
        for b, row in enumerate(rows):
            where = real_slice(side, len(row), ids.shape[1])
            types[b, where] = torch.tensor([0] * (len(row) // 2) + [1] * (len(row) - len(row) // 2))
    out = model(ids, mask, types)
    for b, row in enumerate(rows):
        where = real_slice(side, len(row), ids.shape[1])
        alone = model(row[None], None, None if types is None else types[b:b + 1, where])
        assert_close(out.last_hidden_state[b, where], alone.last_hidden_state[0], f"{side} row {b} states")
        if out.logits is not None:
            assert_close(out.logits[b, where], alone.logits[0], f"{side} row {b} MLM logits")
        if out.pooler_output is not None and side == "right":
            # The pooler reads slot 0 ([CLS]); that is a real token only with right padding.
            assert_close(out.pooler_output[b], alone.pooler_output[0], f"row {b} pooled")


@pytest.mark.parametrize("side", PADDERS)
@pytest.mark.parametrize("case", SEQ2SEQ_CASES, ids=lambda c: c.name)
def test_encoder_decoder_padded_encoder_equals_rows_alone(case: PadCase, side: str):
    config = case.config
    model = model_for(config)
    rows = rows_for(config.vocab_size)
    ids, mask = PADDERS[side](rows, FILLER)
    dec = random_ids((len(rows), 4), config.vocab_size, seed=9)
    states = model.encode(ids, mask)
    logits = model(ids, dec, mask)
    for b, row in enumerate(rows):
        where = real_slice(side, len(row), ids.shape[1])
        assert_close(states[b, where], model.encode(row[None])[0], f"{side} row {b} encoder states")
        # Cross-attention must ignore the padded memory slots.
        assert_close(logits[b], model(row[None], dec[b:b + 1])[0], f"{side} row {b} decoder logits")


# ----------------------------------------------------------------------------- fully padded rows
FAMILY_PRESETS = ["tiny-encoder", "tiny-decoder", "tiny-decoder-alibi", "tiny-encoder-decoder",
                  "tiny-encoder-decoder-t5"]


def outputs_and_first_row(model, ids: torch.Tensor, mask: torch.Tensor):
    """(every output of ``model`` on the batch, its row-0 result, row 0 run alone)."""
    config = model.config
    if config.family == "encoder":
        out = model(ids, mask)
        everything = [out.last_hidden_state, out.logits, out.pooler_output]
        return everything, out.last_hidden_state[:1], model(ids[:1]).last_hidden_state
    if config.family == "decoder":
        logits, cache = model(ids, mask)
        return [logits] + [t for kv in cache.layers for t in kv], logits[:1], model(ids[:1])[0]
    dec = random_ids((ids.shape[0], 3), config.vocab_size, seed=3)
    logits = model(ids, dec, mask)
    return [logits, model.encode(ids, mask)], logits[:1], model(ids[:1], dec[:1])


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_fully_padded_row_stays_finite(preset: str):
    config = tiny(preset)
    model = model_for(config)
    ids = random_ids((2, 4), config.vocab_size)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    everything, first, alone = outputs_and_first_row(model, ids, mask)
    for t in everything:
        assert torch.isfinite(t).all(), f"{preset}: NaN/inf from a fully padded row"
    assert_close(first, alone, f"{preset}: the real row next to a fully padded one")
