"""Logits processing and sampling: small pure functions over numpy arrays [B, V].

They follow ``tfport.models.generate.next_token`` step for step (temperature, then top-k, then
top-p, then a draw from the softmax); only the random source differs (a seeded
``numpy.random.Generator`` instead of a ``torch.Generator``), so sampled tokens are reproducible
run to run but not equal to PyTorch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUMBERS = (int, float, np.integer, np.floating)


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, NUMBERS) \
                or not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: expected a finite number >= 0 "
                             "(0 is greedy)")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) \
                or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 keeps all)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, NUMBERS) \
                or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1] (1 keeps all)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    """A ``numpy.random.Generator``: ``seed`` itself, one seeded with it, or a fresh one."""
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or seed < 0):
        raise ValueError(f"seed={seed!r}: expected a non-negative integer, a "
                         "numpy.random.Generator or None")
    return np.random.default_rng(seed)


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """logits [B, V] / temperature, in float32."""
    return logits.astype(np.float32) / np.float32(temperature)


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Set logits [B, V] below each row's k-th largest to -inf (ties with the k-th are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k, axis=-1)[:, -k:].min(axis=-1, keepdims=True)  # [B, 1]
    return np.where(logits < kth, -np.inf, logits).astype(logits.dtype)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float64; -inf entries get probability 0."""
    x = logits.astype(np.float64)
    x = np.exp(x - x.max(axis=-1, keepdims=True))
    return x / x.sum(axis=-1, keepdims=True)


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filter on logits [B, V]: keep the smallest set of most likely tokens whose
    probability reaches ``p`` (the most likely token always stays), the rest -> -inf."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, axis=-1, kind="stable")  # [B, V] descending
    probs = np.take_along_axis(softmax(logits), order, axis=-1)
    drop_sorted = np.cumsum(probs, axis=-1) - probs >= p  # mass before this token already >= p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, logits).astype(logits.dtype)


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of probabilities [B, V] -> int64 [B].

    Uses the exponential race (argmax of p / Exp(1), as gpt-fast's ``multinomial_sample_one``):
    exact for the categorical distribution, vectorised, and zero-probability tokens never win.
    """
    race = rng.exponential(size=probs.shape)
    return np.argmax(probs / race, axis=-1).astype(np.int64)


def next_token(logits: np.ndarray, params: SamplingParams,
               rng: np.random.Generator | None = None) -> np.ndarray:
    """Pick one token per row of ``logits`` [B, V] -> int64 [B]: argmax when greedy."""
    if params.greedy:
        return np.argmax(logits, axis=-1).astype(np.int64)
    if rng is None:
        raise ValueError("rng: sampling (temperature > 0) needs a numpy.random.Generator")
    scaled = apply_temperature(logits, params.temperature)
    filtered = top_p_filter(top_k_filter(scaled, params.top_k), params.top_p)
    return sample(softmax(filtered), rng)
