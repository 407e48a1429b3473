"""Logits processing and sampling (runtime/sampling.py) against literal expectations."""

from __future__ import annotations

import numpy as np
import pytest

from tfport.runtime.sampling import (SamplingParams, apply_temperature, make_rng, next_token,
                                     sample, softmax, top_k_filter, top_p_filter)

NEG = -np.inf


def test_temperature_shifts_then_divides():
    logits = np.array([[2.0, -4.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(apply_temperature(logits, 2.0), [[0.0, -3.0, -1.0]])


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-40, 5e-324, np.float32(1e-45)])
def test_tiny_temperatures_pick_the_most_likely_token(temperature):
    # Below float32's smallest normal (1.2e-38), logits / temperature used to overflow to inf,
    # inf - inf gave NaN and argmax picked token 0.
    logits = np.array([[100.0, 300.0, -50.0, 299.0], [-1.0, -3.0, -2.0, 5.0]], dtype=np.float32)
    scaled = apply_temperature(logits, temperature)
    assert not np.isnan(scaled).any()
    params = SamplingParams(temperature=temperature, top_k=3, top_p=0.9)
    np.testing.assert_array_equal(next_token(logits, params, make_rng(0)), [1, 3])


def test_temperature_zero_in_float64_is_greedy():
    assert SamplingParams(temperature=np.longdouble("1e-4000")).greedy  # x87 long double: > 0


def test_nan_logits_are_refused_and_inf_is_the_maximum():
    with pytest.raises(RuntimeError, match="NaN logits"):
        next_token(np.array([[0.0, np.nan, 1.0]], np.float32), SamplingParams())
    with pytest.raises(RuntimeError, match="NaN logits"):
        next_token(np.array([[0.0, np.nan, 1.0]], np.float32), SamplingParams(1.0), make_rng(0))
    logits = np.array([[0.0, np.inf, 1.0, -np.inf]], np.float32)
    assert next_token(logits, SamplingParams()).tolist() == [1]
    assert next_token(logits, SamplingParams(0.5), make_rng(0)).tolist() == [1]


@pytest.mark.parametrize("k, expected", [
    (0, [[3.0, 1.0, 2.0, 0.0]]),  # 0 keeps all
    (1, [[3.0, NEG, NEG, NEG]]),
    (2, [[3.0, NEG, 2.0, NEG]]),
    (4, [[3.0, 1.0, 2.0, 0.0]]),  # k >= V keeps all
    (9, [[3.0, 1.0, 2.0, 0.0]]),
])
def test_top_k(k, expected):
    logits = np.array([[3.0, 1.0, 2.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(top_k_filter(logits, k), expected)


def test_top_k_keeps_ties_with_the_kth():
    logits = np.array([[1.0, 2.0, 2.0, 0.0]], dtype=np.float32)
    np.testing.assert_array_equal(top_k_filter(logits, 1), [[NEG, 2.0, 2.0, NEG]])


@pytest.mark.parametrize("p, kept", [
    # probabilities 0.5, 0.25, 0.125, 0.125 (logits are their logs)
    (1.0, [0, 1, 2, 3]),
    (0.5, [0]),        # mass before token 1 is already 0.5 >= p
    (0.6, [0, 1]),
    (0.75, [0, 1]),    # mass before token 2 is 0.75 >= p
    (0.8, [0, 1, 2]),  # tokens 2 and 3 tie; the stable sort puts 3 last, mass before it 0.875
    (0.01, [0]),       # the most likely token always stays
])
def test_top_p(p, kept):
    probs = np.array([[0.5, 0.25, 0.125, 0.125]])
    logits = np.log(probs).astype(np.float32)
    out = top_p_filter(logits, p)
    assert np.isfinite(out[0]).nonzero()[0].tolist() == kept


def test_top_p_permutation_invariant():
    probs = np.array([[0.125, 0.5, 0.125, 0.25]])
    out = top_p_filter(np.log(probs).astype(np.float32), 0.6)
    assert np.isfinite(out[0]).nonzero()[0].tolist() == [1, 3]


def test_softmax_masks_and_sums_to_one():
    probs = softmax(np.array([[0.0, NEG, 0.0], [1000.0, 0.0, NEG]], dtype=np.float32))
    np.testing.assert_allclose(probs, [[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]], atol=1e-12)


def test_sample_follows_the_distribution():
    probs = np.tile(np.array([[0.7, 0.2, 0.1, 0.0]]), (20000, 1))
    tokens = sample(probs, np.random.default_rng(0))
    freq = np.bincount(tokens, minlength=4) / len(tokens)
    np.testing.assert_allclose(freq, [0.7, 0.2, 0.1, 0.0], atol=0.01)  # ~3 sigma at n=20000
    assert tokens.dtype == np.int64


def test_next_token_greedy_is_argmax_first_index():
    logits = np.array([[0.0, 5.0, 5.0], [9.0, 1.0, 2.0]], dtype=np.float32)
    np.testing.assert_array_equal(next_token(logits, SamplingParams()), [1, 0])


def test_next_token_sampling_is_seeded():
    logits = np.random.default_rng(1).normal(size=(4, 50)).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    draws = [next_token(logits, params, make_rng(7)) for _ in range(2)]
    np.testing.assert_array_equal(draws[0], draws[1])
    others = [next_token(logits, params, make_rng(seed)) for seed in range(8, 16)]
    assert any((o != draws[0]).any() for o in others)


def test_top_k_1_sampling_equals_greedy():
    logits = np.random.default_rng(2).normal(size=(8, 30)).astype(np.float32)
    got = next_token(logits, SamplingParams(temperature=0.7, top_k=1), make_rng(0))
    np.testing.assert_array_equal(got, logits.argmax(-1))


def test_sampling_without_rng_is_refused():
    with pytest.raises(ValueError, match="rng"):
        next_token(np.zeros((1, 3), np.float32), SamplingParams(temperature=1.0))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_params_validation(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True])
def test_make_rng_rejects(seed):
    with pytest.raises(ValueError, match="seed"):
        make_rng(seed)


def test_make_rng_passes_generators_through():
    rng = np.random.default_rng(3)
    assert make_rng(rng) is rng
    assert make_rng(5).integers(1 << 30) == np.random.default_rng(5).integers(1 << 30)
