"""Greedy tokens from the runtime equal the PyTorch reference loops (models/generate.py).

One checker over a case table: each decoder position scheme (RoPE, learned, ALiBi) and the
encoder-decoder, unbatched and batched (left-padded, with an EOS that stops one row early).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfport.models.generate import generate, generate_seq2seq
from tfport.runtime.binding import GraphRunner, empty_cache
from tfport.runtime.decoding import layout
from tfport.runtime.decoding.concat import decoder_forward
from tfport.runtime.inputs import pad_batch

from .runtime_cases import DECODER_CASES

STEPS = 32
PROMPTS = [[1, 5, 7, 9, 11], [1, 20, 3, 44], [1, 60]]
MIN_DISTINCT = 4  # a reference that repeats one token would make the comparison vacuous


def reference(exported, prompts, eos=None, pad_side="left"):
    """Reference tokens [B, N] for ragged prompts, padded as the runtime pads them."""
    pad = exported.case.config.pad_token_id
    ids, mask = pad_batch([np.array(p) for p in prompts], pad, pad_side)
    loop = generate if exported.case.config.family == "decoder" else generate_seq2seq
    return loop(exported.model, torch.from_numpy(ids), torch.from_numpy(mask),
                max_new_tokens=STEPS, eos_token_id=eos).numpy()


def pad_side(key):
    return "right" if key == "encoder-decoder" else "left"


@pytest.mark.parametrize("key", DECODER_CASES + ["encoder-decoder"])
def test_greedy_unbatched(key, loaded):
    exported, model = loaded(key)
    for prompt in PROMPTS:
        expected = reference(exported, [prompt])
        assert len(set(expected[0].tolist())) >= MIN_DISTINCT, expected
        got = model.generate([prompt], max_new_tokens=STEPS, stop_token_ids=())
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("key", DECODER_CASES + ["encoder-decoder"])
def test_greedy_batched_with_eos(key, loaded):
    exported, model = loaded(key)
    first = reference(exported, PROMPTS[:1])[0]
    eos = int(first[6])  # row 0 stops at step <= 6, the others go on (and pad once they stop)
    expected = reference(exported, PROMPTS, eos=eos, pad_side=pad_side(key))
    got = model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=[eos])
    np.testing.assert_array_equal(got, expected)
    assert (got[0, list(first).index(eos) + 1:] == exported.case.config.pad_token_id).all()


@pytest.mark.parametrize("key", ["decoder-rope", "decoder-ort"])  # the concat and inplace layouts
def test_a_prompt_longer_than_a_prefill_piece_runs_in_pieces(key, loaded, monkeypatch):
    """A prompt of one row longer than ``PREFILL_PIECE`` is prefilled in runs of that many tokens
    on top of its cache (bounded activations and logits): the same greedy tokens as PyTorch's,
    through ``generate`` (the library) and the row batch (the server); a batch too, each row
    alone (inplace: on its slice of the buffers; concat: then laid out left-padded)."""
    exported, model = loaded(key)
    monkeypatch.setattr(layout, "PREFILL_PIECE", 2)
    runner = model.runners["decoder"]
    for prompt in PROMPTS[:2]:  # 5 and 4 tokens: 3 and 2 pieces
        expected = reference(exported, [prompt])
        before = runner.runs["own"]
        got = model.generate([prompt], max_new_tokens=STEPS, stop_token_ids=())
        np.testing.assert_array_equal(got, expected)
        assert runner.runs["own"] - before == -(-len(prompt) // 2) + STEPS - 1  # pieces, then the steps
        rows = model.decoding.rows(runner, 2, 64)
        row, logits = rows.add(np.array(prompt))
        tokens = [int(logits.argmax())]
        for _ in range(STEPS - 1):
            tokens.append(int(rows.step(np.array([tokens[-1]]))[0].argmax()))
        np.testing.assert_array_equal(tokens, expected[0])
    # a batch: each row alone, in pieces (5, 4 and 2 tokens: 3 + 2 + 1 runs)
    expected = np.concatenate([reference(exported, [prompt]) for prompt in PROMPTS])
    before = runner.runs["own"]
    np.testing.assert_array_equal(model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=()), expected)
    assert runner.runs["own"] - before == 6 + STEPS - 1


def test_a_batch_of_short_prompts_runs_in_groups_of_rows(loaded, monkeypatch):
    """In the inplace layout on the CPU, a batch of prompts of at most ``PREFILL_PIECE`` tokens is
    prefilled in groups of consecutive rows of at most that many tokens in all (each group on its
    slice of the buffers, padded to its longest row): the same greedy tokens as PyTorch's."""
    exported, model = loaded("decoder-ort")
    monkeypatch.setattr(layout, "PREFILL_PIECE", 10)
    assert layout.row_groups([5, 4, 2]) == [(0, 2), (2, 3)]  # 2 x 5 tokens, then 1 x 2
    runner = model.runners["decoder"]
    expected = np.concatenate([reference(exported, [prompt]) for prompt in PROMPTS])
    before = runner.runs["own"]
    np.testing.assert_array_equal(model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=()), expected)
    assert runner.runs["own"] - before == 2 + STEPS - 1


@pytest.mark.parametrize("key", ["decoder-rope", "decoder-ort"])  # the concat and inplace layouts
def test_score_pieces_are_the_modules_logits(key, loaded, monkeypatch):
    """``score`` yields a sequence's logits piece by piece, in runs of ``PREFILL_PIECE`` tokens
    on the cache of the runs before: joined, PyTorch's."""
    exported, model = loaded(key)
    monkeypatch.setattr(layout, "PREFILL_PIECE", 2)
    ids = np.array([PROMPTS[0]])
    pieces = list(model.decoding.score(model.runners["decoder"], ids))
    assert [len(p) for p in pieces] == [2, 2, 1]
    with torch.no_grad():
        expected = exported.model(torch.from_numpy(ids))[0][0].numpy()  # [S, V]
    np.testing.assert_allclose(np.concatenate(pieces), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("lengths", "groups"), [
    ([128] * 3, [(0, 1), (1, 2), (2, 3)]),
    ([32] * 8, [(0, 4), (4, 8)]),
    ([1] * 130, [(0, 128), (128, 130)]),
    ([100, 10, 10], [(0, 1), (1, 3)]),
    ([10, 10, 100], [(0, 2), (2, 3)]),  # the third would make the group 3 x 100 tokens
    ([60, 64, 1], [(0, 2), (2, 3)]),
])
def test_row_groups(lengths, groups):
    assert layout.PREFILL_PIECE == 128
    assert layout.row_groups(lengths) == groups
    for a, b in groups:  # every group within a piece, padded to its longest row
        assert max(lengths[a:b]) * (b - a) <= layout.PREFILL_PIECE


@pytest.mark.parametrize("key", DECODER_CASES)
def test_cache_step_equals_prefill(key, loaded):
    """Prefill of prompt + [t] gives the logits of prefill(prompt) then one cached step of t."""
    _, model = loaded(key)
    runner: GraphRunner = model.runners["decoder"]
    ids, mask = pad_batch([np.array(p) for p in PROMPTS], 0, "left")  # [B, S]
    token = np.array([[4], [8], [15]], dtype=np.int64)  # [B, 1]
    full_mask = np.concatenate([mask, np.ones_like(token)], axis=1)
    full, _ = decoder_forward(runner, np.concatenate([ids, token], axis=1), full_mask,
                              empty_cache(runner.spec, 3), {})
    _, cache = decoder_forward(runner, ids, mask, empty_cache(runner.spec, 3), {})
    config = model.config
    for name, value in cache.items():
        assert name.startswith("past_key_values.")
        assert value.device_name() == "cpu"
        # [B, Hkv, P, D]
        assert value.shape() == [3, config.kv_heads, ids.shape[1], config.dim_per_head]
    step, cache = decoder_forward(runner, token, full_mask, cache, {})
    assert next(iter(cache.values())).shape()[2] == ids.shape[1] + 1
    np.testing.assert_allclose(step, full, rtol=1e-4, atol=1e-4)  # float32: op order differs


def test_encoder_decoder_start_token(loaded):
    """The first decoder input is decoder_start_token_id (the reference's first token agrees)."""
    exported, model = loaded("encoder-decoder")
    assert model.config.decoder_start_token_id == 0
    got = model.generate([PROMPTS[0]], max_new_tokens=1, stop_token_ids=())
    np.testing.assert_array_equal(got, reference(exported, [PROMPTS[0]])[:, :1])
