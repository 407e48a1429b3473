"""Generation features beyond parity: batching, sampling, streaming, callbacks, limits, fp16."""

from __future__ import annotations

import numpy as np
import pytest

from .runtime_cases import DECODER_CASES

PROMPTS = [[1, 5, 7, 9, 11], [1, 20, 3, 44], [1, 60]]
SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.95)


@pytest.mark.parametrize("key", DECODER_CASES + ["encoder-decoder"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_batched_rows_equal_unbatched(key, sampling, loaded):
    """Each row of a batch of different prompt lengths equals its unbatched result.

    Sampled rows draw from one generator per call, so they are compared with top_k=1
    (deterministic) and with the greedy result; greedy rows are compared directly, with an EOS
    that stops some rows early (their tail must be padding).
    """
    _, model = loaded(key)
    options = dict(temperature=0.8, top_k=1, seed=3) if sampling else {}
    alone = [model.generate([p], max_new_tokens=24, stop_token_ids=(), **options)[0]
             for p in PROMPTS]
    batch = model.generate(PROMPTS, max_new_tokens=24, stop_token_ids=(), **options)
    for row, single in zip(batch, alone):
        np.testing.assert_array_equal(row, single)
    eos = int(alone[1][3])
    batch = model.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[eos])
    for row, single in zip(batch, alone):
        hits = np.flatnonzero(single == eos)
        stop = hits[0] + 1 if hits.size else len(single)
        np.testing.assert_array_equal(row[:stop], single[:stop])
        assert (row[stop:] == model.config.pad_token_id).all()


def test_array_with_mask_equals_ragged(loaded):
    _, model = loaded("decoder-rope")
    ids = np.array([[1, 5, 7, 9, 11], [1, 20, 0, 0, 0]])
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])  # right-padded on purpose
    np.testing.assert_array_equal(model.generate(ids, mask, max_new_tokens=8),
                                  model.generate([[1, 5, 7, 9, 11], [1, 20]], max_new_tokens=8))


@pytest.mark.parametrize("key", ["decoder-rope", "encoder-decoder"])
def test_seeded_sampling(key, loaded):
    _, model = loaded(key)
    def run(seed):
        return model.generate(PROMPTS, max_new_tokens=16, stop_token_ids=(), seed=seed, **SAMPLING)

    first = run(0)
    np.testing.assert_array_equal(run(0), first)
    np.testing.assert_array_equal(run(np.random.default_rng(0)), first)
    assert any((run(seed) != first).any() for seed in (1, 2, 3))
    assert (first != model.generate(PROMPTS, max_new_tokens=16, stop_token_ids=())).any()


@pytest.mark.parametrize("key", ["decoder-alibi", "encoder-decoder"])
@pytest.mark.parametrize("options", [{}, dict(SAMPLING, seed=5)], ids=["greedy", "sampled"])
def test_stream_and_callback_equal_generate(key, options, loaded):
    _, model = loaded(key)
    expected = model.generate(PROMPTS, max_new_tokens=12, **options)
    streamed = list(model.stream(PROMPTS, max_new_tokens=12, **options))
    assert all(t.shape == (len(PROMPTS),) and t.dtype == np.int64 for t in streamed)
    np.testing.assert_array_equal(np.stack(streamed, axis=1), expected)
    seen = []
    out = model.generate(PROMPTS, max_new_tokens=12,
                         callback=lambda step, t: seen.append((step, t)), **options)
    np.testing.assert_array_equal(out, expected)
    assert [step for step, _ in seen] == list(range(expected.shape[1]))
    np.testing.assert_array_equal(np.stack([t for _, t in seen], axis=1), expected)


def test_stream_checks_arguments_before_iterating(loaded):
    _, model = loaded("decoder-rope")
    with pytest.raises(ValueError, match="input_ids"):
        model.stream([[1, 500]], max_new_tokens=4)  # no next() needed


def test_stop_ids_default_to_config_eos(loaded):
    _, model = loaded("decoder-rope")
    alone = model.generate([PROMPTS[0]], max_new_tokens=32, stop_token_ids=())[0]
    eos = model.config.eos_token_id
    out = model.generate([PROMPTS[0]], max_new_tokens=32)[0]
    if eos in alone:
        assert out.tolist() == alone[: list(alone).index(eos) + 1].tolist()
    else:
        assert out.tolist() == alone.tolist()
    two = model.generate([PROMPTS[0]], max_new_tokens=32,
                         stop_token_ids=[int(alone[9]), int(alone[4])])
    assert two.shape[1] == min(list(alone).index(alone[4]), list(alone).index(alone[9])) + 1


def test_progress_bar_on_stderr(loaded, capsys):
    _, model = loaded("decoder-rope")
    model.generate([PROMPTS[0]], max_new_tokens=8, progress=True)
    captured = capsys.readouterr()
    assert "generate" in captured.err and captured.out == ""


def test_max_positions_boundary(loaded):
    _, model = loaded("decoder-learned")  # a learned position table of max_positions rows
    limit = model.config.max_positions
    # The last new token is never fed back, so the prompt plus all but one new token fill the table.
    most = limit - len(PROMPTS[0]) + 1
    out = model.generate([PROMPTS[0]], max_new_tokens=most, stop_token_ids=())
    assert out.shape == (1, most)
    with pytest.raises(ValueError, match=rf"max_new_tokens={most + 1}: a prompt of {len(PROMPTS[0])} "
                                         rf"tokens leaves room for {most} new tokens in a context of {limit}"):
        model.generate([PROMPTS[0]], max_new_tokens=most + 1)


def test_float16_export(loaded):
    """An fp16 export keeps its cache in float16 and follows the fp32 greedy path here."""
    from tfport.runtime.binding import empty_cache

    _, fp16 = loaded("decoder-fp16")
    runner = fp16.runners["decoder"]
    assert {v.dtype for v in empty_cache(runner.spec, 2).values()} == {np.dtype(np.float16)}
    out = fp16.generate(PROMPTS, max_new_tokens=16, stop_token_ids=())
    assert out.dtype == np.int64 and ((0 <= out) & (out < fp16.config.vocab_size)).all()
    fp32 = loaded("decoder-rope")[1].generate(PROMPTS, max_new_tokens=16, stop_token_ids=())
    # fp16 rounding may flip a near-tie late in the sequence; the first tokens must agree
    np.testing.assert_array_equal(out[:, :4], fp32[:, :4])


def test_boundary_matches_the_reference(loaded):
    """At the max_positions boundary the reference and the runtime agree (neither feeds the
    last token back, so neither reads past the position table)."""
    import torch

    from tfport.models.generate import generate as reference_generate

    exported, model = loaded("decoder-learned")
    module = exported.model
    limit = model.config.max_positions
    prompt = PROMPTS[0]
    most = limit - len(prompt) + 1
    expected = reference_generate(module, torch.tensor([prompt]), max_new_tokens=most)
    got = model.generate([prompt], max_new_tokens=most, stop_token_ids=())
    assert got.tolist() == expected.tolist()


def test_stop_ids_and_sampling_arguments_accept_numpy_and_refuse_non_integers(loaded):
    _, model = loaded("decoder-rope")
    assert model.stop_ids(np.array([2, 5])) == (2, 5)
    for bad in ([2.7], ["a"], [None], [True]):
        with pytest.raises(TypeError, match="stop_token_ids"):
            model.stop_ids(bad)
    out = model.generate([PROMPTS[0]], max_new_tokens=3, temperature=np.float32(0.7),
                         top_p=np.float32(0.9), top_k=np.int64(5), seed=1, stop_token_ids=())
    assert out.shape == (1, 3)


@pytest.mark.parametrize("target", ["portable", "ort"])
def test_a_null_pad_token_pads_and_fills_with_eos(target, tmp_path):
    """pad_token_id null (the config allows it): prompts are padded and stopped rows filled with
    the eos id, as transformers does, and the tokens equal the PyTorch reference's."""
    import torch

    from tfport.export import ExportOptions, export_model
    from tfport.models import build_model
    from tfport.models.generate import generate
    from tfport.presets import get_preset
    from tfport.runtime import load_model

    config = get_preset("tiny-decoder").replace(d_model=64, tie_embeddings=False, pad_token_id=None)
    model = build_model(config, seed=0)
    export_model(model, tmp_path / "x", ExportOptions(target=target, validate=False))
    prompts = [[1, 5, 7, 9, 11], [1, 6]]
    free = load_model(tmp_path / "x").generate(prompts, max_new_tokens=6, stop_token_ids=())
    stop = int(free[1, 1])  # row 1 stops after two tokens; row 0 runs on (unless it hits it too)
    got = load_model(tmp_path / "x").generate(prompts, max_new_tokens=6, stop_token_ids=(stop,))
    for b, prompt in enumerate(prompts):  # the reference ends a row's output at its stop id
        expected = generate(model, torch.tensor([prompt]), max_new_tokens=6, eos_token_id=stop)[0].numpy()
        np.testing.assert_array_equal(got[b, :len(expected)], expected)
        assert list(got[b, len(expected):]) == [config.eos_token_id] * (6 - len(expected))
    assert list(got[1]) == [*free[1, :2], *[config.eos_token_id] * 4]


def test_a_request_object_decodes_as_its_fields_given_as_keywords(loaded):
    """``generate(ids, request=r)`` is ``generate(ids, **r's fields)``; keywords given beside a
    request replace its fields (sampled, so every sampling field and the seed must reach the
    engine for the rows to agree)."""
    from tfport.runtime import Request

    _, model = loaded("decoder-rope")
    fields = dict(max_new_tokens=12, stop_token_ids=(), seed=5, repetition_penalty=1.2, **SAMPLING)
    by_request = model.generate(PROMPTS, request=Request(**fields))
    np.testing.assert_array_equal(by_request, model.generate(PROMPTS, **fields))
    greedy = model.generate(PROMPTS, request=Request(**fields), temperature=0.0, max_new_tokens=6)
    np.testing.assert_array_equal(greedy, model.generate(PROMPTS, max_new_tokens=6, stop_token_ids=(),
                                                         repetition_penalty=1.2))
    assert by_request.shape == (3, 12) and greedy.shape == (3, 6)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['max_tokens'\]"):
        model.generate(PROMPTS, max_tokens=4)
