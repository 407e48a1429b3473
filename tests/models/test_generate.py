"""models/generate.py: batched left-padded generation equals each prompt alone; seeded sampling."""

from __future__ import annotations

import pytest
import torch

from tfport.models.generate import generate, generate_seq2seq, next_token

from .torch_reference import left_pad, model_for, random_ids, right_pad, tiny

PROMPT_LENGTHS = [4, 2, 6]
NEW_TOKENS = 6
DECODER_PRESETS = ["tiny-decoder", "tiny-decoder-mqa", "tiny-decoder-gpt2", "tiny-decoder-alibi"]


def prompts(vocab: int) -> list[torch.Tensor]:
    return [random_ids((n,), vocab, seed=10 + i) for i, n in enumerate(PROMPT_LENGTHS)]


def check_rows(batched: torch.Tensor, alone: list[torch.Tensor], eos: int | None, pad: int) -> None:
    """Row b of ``batched`` starts with ``alone[b]``; after an EOS it is padding."""
    for b, expected in enumerate(alone):
        n = expected.shape[-1]
        assert batched[b, :n].tolist() == expected[0].tolist(), f"row {b}"
        if n < batched.shape[1]:
            assert eos is not None and expected[0, -1].item() == eos, f"row {b} stopped early"
            assert (batched[b, n:] == pad).all(), f"row {b} continues with padding after EOS"


@pytest.mark.parametrize("preset", DECODER_PRESETS)
def test_greedy_batched_left_padded_equals_each_prompt_alone(preset: str):
    # Untied: a random tied model mostly repeats its input token, which would prove little.
    config = tiny(preset).replace(tie_embeddings=False)
    model = model_for(config)
    rows = prompts(config.vocab_size)
    ids, mask = left_pad(rows, config.pad_token_id)
    batched = generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
    assert batched.shape == (len(rows), NEW_TOKENS)
    assert len(set(batched.flatten().tolist())) >= 4, f"outputs too uniform to test: {batched.tolist()}"
    check_rows(batched, [generate(model, r[None], max_new_tokens=NEW_TOKENS) for r in rows], None,
               config.pad_token_id)


def test_greedy_with_eos_pads_finished_rows():
    config = tiny("tiny-decoder")
    model = model_for(config)
    rows = prompts(config.vocab_size)
    ids, mask = left_pad(rows, config.pad_token_id)
    # Make row 0's third token the EOS, so row 0 finishes while the others go on.
    eos = int(generate(model, rows[0][None], max_new_tokens=3)[0, 2])
    batched = generate(model, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    alone = [generate(model, r[None], max_new_tokens=NEW_TOKENS, eos_token_id=eos) for r in rows]
    assert alone[0].shape[1] <= 3
    check_rows(batched, alone, eos, config.pad_token_id)


@pytest.mark.parametrize("preset", ["tiny-encoder-decoder", "tiny-encoder-decoder-gqa",
                                    "tiny-encoder-decoder-t5"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_seq2seq_greedy_batched_equals_each_source_alone(preset: str, side: str):
    config = tiny(preset, tie_embeddings=False)  # see SAMPLING_CONFIGS: tied is near-deterministic
    model = model_for(config)
    rows = prompts(config.vocab_size)
    ids, mask = (left_pad if side == "left" else right_pad)(rows, config.pad_token_id)
    batched = generate_seq2seq(model, ids, mask, max_new_tokens=NEW_TOKENS)
    check_rows(batched, [generate_seq2seq(model, r[None], max_new_tokens=NEW_TOKENS) for r in rows],
               None, config.pad_token_id)


SAMPLING = dict(temperature=1.0, top_k=20, top_p=0.9)


# Untied heads: a tied random head makes the tiny seq2seq model nearly deterministic (the residual
# stream still looks like the input embedding), so sampling would not show the seed's effect.
SAMPLING_CONFIGS = {"decoder": ("tiny-decoder", {}),
                    "encoder-decoder": ("tiny-encoder-decoder", {"tie_embeddings": False})}


@pytest.mark.parametrize("family", SAMPLING_CONFIGS)
def test_seeded_sampling_is_reproducible(family: str):
    preset, changes = SAMPLING_CONFIGS[family]
    config = tiny(preset, **changes)
    model = model_for(config)
    ids, mask = left_pad(prompts(config.vocab_size), config.pad_token_id)
    run = generate if config.family == "decoder" else generate_seq2seq
    first = run(model, ids, mask, max_new_tokens=NEW_TOKENS, seed=123, **SAMPLING)
    again = run(model, ids, mask, max_new_tokens=NEW_TOKENS, seed=123, **SAMPLING)
    assert torch.equal(first, again)
    others = [run(model, ids, mask, max_new_tokens=NEW_TOKENS, seed=s, **SAMPLING) for s in (1, 2, 3)]
    assert any(not torch.equal(first, o) for o in others), "different seeds should sample differently"


@pytest.mark.parametrize("family", SAMPLING_CONFIGS)
def test_top_k_1_equals_greedy(family: str):
    preset, changes = SAMPLING_CONFIGS[family]
    config = tiny(preset, **changes)
    model = model_for(config)
    ids, mask = left_pad(prompts(config.vocab_size), config.pad_token_id)
    run = generate if config.family == "decoder" else generate_seq2seq
    greedy = run(model, ids, mask, max_new_tokens=NEW_TOKENS)
    sampled = run(model, ids, mask, max_new_tokens=NEW_TOKENS, temperature=1.5, top_k=1, seed=7)
    assert torch.equal(sampled, greedy)


@pytest.mark.parametrize("options", [
    dict(temperature=0.0),
    dict(temperature=2.0, top_k=1),
    dict(temperature=2.0, top_p=1e-6),  # the most likely token is always kept
], ids=["greedy", "top-k-1", "tiny-top-p"])
def test_next_token_picks_argmax(options):
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, -2.0, 0.0, 4.0]])
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        assert next_token(logits, generator=generator, **options).tolist() == [1, 0]


def test_next_token_top_k_and_top_p_never_pick_outside_their_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    top_k = {next_token(logits, 1.0, top_k=2, generator=generator).item() for _ in range(200)}
    top_p = {next_token(logits, 1.0, top_p=0.75, generator=generator).item() for _ in range(200)}
    assert top_k == {0, 1}
    assert top_p == {0, 1}  # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: the nucleus is {0, 1}
