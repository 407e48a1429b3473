"""The sampling API of the library: penalties, logit_bias, min_p and logprobs, against numpy
references written here (loops over tokens, independent of ``tfport.runtime.sampling``),
transformers' logits processors, and the PyTorch module's own forward (no cache, the whole
sequence each step) on tiny random exports; greedy where an option changes the argmax, seeded
sampling statistically, and speculative decoding giving the tokens of plain decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tfport.runtime.decoding.speculative import Speculation, SpeculationStats
from tfport.runtime.sampling import (Logprobs, SamplingParams, log_softmax, min_p_filter, penalise,
                                     token_logprobs)

PROMPTS = [[1, 5, 7, 9, 11, 5], [1, 20, 3]]
STEPS = 12


@pytest.fixture(autouse=True)
def _torch_on_one_thread():
    """The reference forwards are tiny: a second OpenMP thread only spin-waits on shared cores
    (as tests/models/conftest.py says), which made this file 4x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- references (numpy)
def reference_penalise(logits, prompt, generated, repetition_penalty=1.0, presence_penalty=0.0,
                       frequency_penalty=0.0, logit_bias=None):
    """vLLM's order, one token at a time: bias; repetition over prompt + output (divide a
    positive logit, multiply a negative one); frequency * count + presence over the output."""
    x = np.array(logits, dtype=np.float64)
    for token, bias in (logit_bias or {}).items():
        x[token] += bias
    for token in set(prompt) | set(generated):
        x[token] = x[token] / repetition_penalty if x[token] > 0 else x[token] * repetition_penalty
    for token in set(generated):
        x[token] -= frequency_penalty * generated.count(token) + presence_penalty
    return x


def reference_log_softmax(logits):
    x = np.asarray(logits, dtype=np.float64)
    return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()


def torch_logits(module, ids):
    """The PyTorch module's last-position logits float64 [V] for the whole sequence ``ids``."""
    with torch.no_grad():
        return module(torch.tensor([ids]))[0][0, -1].double().numpy()


def reference_greedy(module, prompt, steps, **options):
    """Greedy tokens with ``options`` applied (``reference_penalise``), and the raw logits each
    token was picked from."""
    tokens, raw = [], []
    for _ in range(steps):
        logits = torch_logits(module, [*prompt, *tokens])
        raw.append(logits)
        tokens.append(int(np.argmax(reference_penalise(logits, prompt, tokens, **options))))
    return tokens, raw


# ------------------------------------------------------------------------ pure functions
def test_penalise_equals_the_token_loop():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, 50).astype(np.float32)
    prompt, generated = [3, 3, 7, 11, 40], [7, 12, 12, 12, 30, 3]
    options = dict(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=-0.8,
                   logit_bias={12: 4.0, 49: -100.0, 0: 2.5})
    got = penalise(logits, SamplingParams(**options), np.unique(prompt), generated)
    np.testing.assert_allclose(got, reference_penalise(logits, prompt, generated, **options),
                               rtol=1e-6, atol=1e-5)


def test_repetition_penalty_equals_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (1, 40)).astype(np.float32)
    seen = [1, 4, 4, 9, 22, 39]  # transformers penalises every id in input_ids (prompt + output)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), torch.from_numpy(logits.copy()))
    got = penalise(logits[0], SamplingParams(repetition_penalty=1.3), np.unique(seen[:3]), seen[3:])
    np.testing.assert_allclose(got, expected[0].numpy(), rtol=1e-6)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_equals_transformers(min_p):
    from transformers import MinPLogitsWarper

    logits = np.random.default_rng(2).normal(0, 2, (3, 30)).astype(np.float32)
    expected = MinPLogitsWarper(min_p)(None, torch.from_numpy(logits.copy())).numpy()
    np.testing.assert_array_equal(np.isinf(min_p_filter(logits, min_p)), np.isinf(expected))


def test_token_logprobs_equal_torch():
    logits = np.random.default_rng(3).normal(0, 4, (4, 64)).astype(np.float32)
    tokens = [5, 0, 63, 17]
    got = token_logprobs(logits, tokens, 5)
    expected = torch.log_softmax(torch.from_numpy(logits).double(), -1)
    top = torch.topk(expected, 5, dim=-1)
    for entry, token, row, values, ids in zip(got, tokens, expected, top.values, top.indices):
        assert entry.token == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-9)
        assert [i for i, _ in entry.top] == ids.tolist()
        np.testing.assert_allclose([v for _, v in entry.top], values.numpy(), atol=1e-9)
    assert token_logprobs(logits[:1], [5], 0)[0].top == ()


@pytest.mark.parametrize("options, match", [
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty=inf"),
    ({"presence_penalty": 2.5}, r"presence_penalty=2.5: expected a number in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
    ({"min_p": 1.5}, r"min_p=1.5: expected a number in \[0, 1\]"),
    ({"logit_bias": {3: 101.0}}, r"logit_bias\[3\]=101.0"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias: key -1"),
    ({"logit_bias": [(3, 1.0)]}, "expected a mapping"),
])
def test_bad_options_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**options)


# --------------------------------------------------------------------------- the library
CASES = {  # each changes the greedy tokens of the tied decoder, which mostly repeats itself
    "repetition": {"repetition_penalty": 1.8},
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 1.2},
    "bias": {"logit_bias": {7: 6.0, 9: -100.0}},
    "all": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
            "logit_bias": {30: 3.0}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_with_penalties_equals_the_reference(case, loaded):
    exported, model = loaded("decoder-rope")
    options = CASES[case]
    expected = [reference_greedy(exported.model, prompt, STEPS, **options)[0] for prompt in PROMPTS]
    plain = [reference_greedy(exported.model, prompt, STEPS)[0] for prompt in PROMPTS]
    assert expected != plain, "the option must change the greedy tokens (else vacuous)"
    for prompt, tokens in zip(PROMPTS, expected):
        got = model.generate([prompt], max_new_tokens=STEPS, stop_token_ids=(), **options)
        assert got[0].tolist() == tokens
    batched = model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=(), **options)
    assert batched.tolist() == expected  # each row penalised by its own prompt


def test_generation_configs_repetition_penalty_is_the_default(loaded, tmp_path, monkeypatch):
    """``repetition_penalty`` of a checkpoint's generation_config.json (transformers' field) is
    kept and read back, and applies where a request gives none, greedy included (transformers'
    generate applies it whatever ``do_sample`` says); a request's own value wins."""
    from transformers import GenerationConfig

    from tfport.generation import GenerationDefaults

    exported, model = loaded("decoder-rope")
    penalty = CASES["repetition"]["repetition_penalty"]
    hf = GenerationConfig(repetition_penalty=penalty, eos_token_id=2).to_dict()
    GenerationDefaults.from_hf(hf, None, model.config.vocab_size).write(tmp_path)
    generation = GenerationDefaults.read(tmp_path)
    assert generation.repetition_penalty == penalty
    monkeypatch.setattr(model, "generation", generation)
    penalised = [reference_greedy(exported.model, prompt, STEPS, repetition_penalty=penalty)[0]
                 for prompt in PROMPTS]
    plain = [reference_greedy(exported.model, prompt, STEPS)[0] for prompt in PROMPTS]
    assert penalised != plain, "the penalty must change the greedy tokens (else vacuous)"
    assert model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=()).tolist() == penalised
    assert model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=(),
                          repetition_penalty=1.0).tolist() == plain


def test_logprobs_are_the_models_log_softmax(loaded):
    exported, model = loaded("decoder-learned")
    options = {"repetition_penalty": 1.5, "logit_bias": {11: 2.0}}
    collected = Logprobs(top=3)
    tokens = model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=(), logprobs=collected,
                            **options)
    logprob, top_ids, top_values = collected.arrays()
    assert logprob.shape == (len(PROMPTS), STEPS) and top_ids.shape == (len(PROMPTS), STEPS, 3)
    for b, prompt in enumerate(PROMPTS):
        expected, raw = reference_greedy(exported.model, prompt, STEPS, **options)
        assert tokens[b].tolist() == expected
        for n, logits in enumerate(raw):  # raw logits: before the penalties, as OpenAI reports
            reference = reference_log_softmax(logits)
            assert logprob[b, n] == pytest.approx(reference[expected[n]], abs=2e-4)
            assert top_ids[b, n].tolist() == np.argsort(-reference)[:3].tolist()
            np.testing.assert_allclose(top_values[b, n], np.sort(reference)[::-1][:3], atol=2e-4)


def test_logprobs_stop_at_each_rows_end(loaded):
    _, model = loaded("decoder-learned")
    plain = model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=())
    stop = int(plain[0, 3])  # row 0 ends at its step 3 (or earlier), the other may go on
    collected = Logprobs()
    tokens = model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=[stop], logprobs=collected)
    for row, scores in zip(tokens, collected.rows):
        ended = list(row).index(stop) + 1 if stop in row else len(row)
        assert [s.token for s in scores] == row[:ended].tolist()
        assert all(s.top == () for s in scores)


def test_stream_reports_each_steps_logprobs_with_its_tokens(loaded):
    """When ``stream`` yields step k, every row's k + 1 logprobs are collected, the last for the
    token just yielded: those ``generate`` reports (they used to come one step late)."""
    _, model = loaded("decoder-learned")
    whole = Logprobs(top=2)
    model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=(), logprobs=whole)
    streamed = Logprobs(top=2)
    steps = model.stream(PROMPTS, max_new_tokens=STEPS, stop_token_ids=(), logprobs=streamed)
    for step, tokens in enumerate(steps):
        assert [len(row) for row in streamed.rows] == [step + 1] * len(PROMPTS), step
        assert [row[-1].token for row in streamed.rows] == tokens.tolist()
        for got, expected in zip(streamed.rows, whole.rows):
            assert got[-1].token == expected[step].token
            assert got[-1].logprob == pytest.approx(expected[step].logprob, abs=1e-6)
            assert [t for t, _ in got[-1].top] == [t for t, _ in expected[step].top]
    assert step == STEPS - 1


@pytest.mark.parametrize("key", ["decoder-rope", "decoder-learned"])
def test_speculation_with_penalties_gives_the_plain_tokens(key, loaded):
    """Penalties that favour repeats (prompt lookup's proposals mostly accepted) and that
    punish them (mostly rejected): speculative tokens and logprobs are plain decoding's."""
    _, model = loaded(key)
    accepted = 0
    for options in ({"repetition_penalty": 0.7, "presence_penalty": -0.5, "logit_bias": {12: 1.5}},
                    {"repetition_penalty": 1.4, "frequency_penalty": 0.3, "logit_bias": {12: 1.5}}):
        plain_scores, speculative_scores, stats = Logprobs(2), Logprobs(2), SpeculationStats()
        plain = model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=(),
                               logprobs=plain_scores, **options)
        speculative = model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=(),
                                     speculative=Speculation("lookup", 4, adaptive=False),
                                     speculation=stats, logprobs=speculative_scores, **options)
        np.testing.assert_array_equal(speculative, plain)
        for got, expected in zip(speculative_scores.arrays(), plain_scores.arrays()):
            np.testing.assert_allclose(got, expected, atol=1e-4)
        assert stats.proposed > 0
        accepted += stats.accepted
        assert not np.array_equal(plain, model.generate(PROMPTS, max_new_tokens=STEPS, stop_token_ids=()))
    assert accepted > 0


def test_sampling_follows_the_penalised_filtered_distribution(loaded):
    """First tokens drawn with repetition penalty, bias, temperature and min_p: no token min_p
    drops is drawn, and the counts fit the reference distribution (chi-square)."""
    from scipy.stats import chisquare

    exported, model = loaded("decoder-learned")
    prompt, draws, temperature = [1, 5, 7, 5], 3000, 0.5
    options = {"repetition_penalty": 2.0, "logit_bias": {8: 1.0}, "min_p": 0.05}
    logits = reference_penalise(torch_logits(exported.model, prompt), prompt, [],
                                repetition_penalty=2.0, logit_bias={8: 1.0}) / temperature
    probs = np.exp(logits - logits.max())
    probs = np.where(probs < 0.05 * probs.max(), 0.0, probs)  # min_p on the tempered probabilities
    probs /= probs.sum()
    assert (probs > 0).sum() >= 4 and probs.max() < 0.9, "a degenerate distribution tests nothing"
    tokens = np.concatenate([
        model.generate([prompt] * 500, max_new_tokens=1, temperature=temperature, seed=seed,
                       **options)[:, 0]
        for seed in range(draws // 500)])
    counts = np.bincount(tokens, minlength=probs.size)
    assert counts[probs == 0].sum() == 0
    big = probs * draws >= 5  # chi-square needs >= 5 expected per bin: the rest pooled in one
    observed, expected = counts[big], probs[big] * draws
    if probs[~big].sum() > 0:
        observed, expected = np.append(observed, counts[~big].sum()), np.append(expected, probs[~big].sum() * draws)
    assert chisquare(observed, expected).pvalue > 1e-3  # seeded: the draws are fixed
    unpenalised = model.generate([prompt] * 500, max_new_tokens=1, temperature=temperature, seed=0)
    assert not np.array_equal(unpenalised[:, 0], tokens[:500])


def test_logprobs_must_be_a_collector(loaded):
    _, model = loaded("decoder-rope")
    with pytest.raises(TypeError, match="logprobs=3: expected a tfport.runtime.sampling.Logprobs"):
        model.generate([[1, 5]], max_new_tokens=2, logprobs=3)
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[100000\] outside"):
        model.generate([[1, 5]], max_new_tokens=2, logit_bias={100000: 1.0})


def test_log_softmax_clips_infinities():
    got = log_softmax(np.array([[0.0, np.inf, -np.inf]], np.float32))
    assert got[0, 1] == 0.0 and np.isfinite(got).all()


def test_cli_repetition_penalty_and_min_p(loaded, capsys):
    from tfport.cli import main

    exported, _ = loaded("decoder-rope")
    expected = reference_greedy(exported.model, PROMPTS[0], STEPS, repetition_penalty=1.8)[0]
    assert exported.case.config.eos_token_id not in expected  # the run does not stop early
    code = main(["generate", str(exported.path), "--ids", ",".join(map(str, PROMPTS[0])),
                 "--max-new-tokens", str(STEPS), "--repetition-penalty", "1.8",
                 "--min-p", "0.5"])  # min_p leaves greedy picks alone
    assert code == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, expected))


def test_an_extreme_repetition_penalty_saturates_without_nan_or_warning():
    """r = 1e-300 (0 in float32, which the API's r > 0 allows): seen positive logits become +inf
    and are picked among evenly, the rest get no mass; no NaN and no numpy warning."""
    import warnings

    from tfport.runtime.sampling import distribution

    params = SamplingParams(temperature=1.0, repetition_penalty=1e-300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = penalise(np.array([1.0, 2.0, -1.0, 0.5], dtype=np.float32), params, np.array([0, 1, 2]), [])
        p = distribution(x[None], params)[0]
    np.testing.assert_allclose(p, [0.5, 0.5, 0.0, 0.0])
