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


def _finite(value: object) -> float | None:
    """``value`` as a finite float64, or None (not a real number, or not finite as a float64:
    NaN, inf, ``10**400``, a numpy long double beyond float64's range)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, NUMBERS):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if np.isfinite(number) else None


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1.0 switch those filters off.
    Any positive temperature samples; tiny ones (below float32's smallest normal, 1.2e-38,
    included) pick the most likely token, as the limit says (``apply_temperature``)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        temperature, top_p = _finite(self.temperature), _finite(self.top_p)
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: expected a finite number >= 0 "
                             "(0 is greedy)")
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) \
                or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 keeps all)")
        if top_p is None or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1] (1 keeps all)")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that it is 0 in float64 (a numpy longdouble)."""
        return float(self.temperature) == 0


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
    """(logits [B, V] - each row's maximum) / temperature, in float64.

    Shifting first leaves the softmax unchanged and keeps every entry <= 0, so a tiny
    temperature (down to the smallest float64) gives -inf for all but the maximum, never inf - inf
    = NaN: sampling tends to greedy as the temperature tends to 0.
    """
    x = logits.astype(np.float64)
    with np.errstate(over="ignore"):  # -large / tiny -> -inf is the intended limit
        return (x - x.max(axis=-1, keepdims=True)) / np.float64(temperature)


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


def check_logits(logits: np.ndarray) -> np.ndarray:
    """``logits`` [B, V] with +-inf clipped to the float32 range (ordering kept); ``RuntimeError``
    if any is NaN, which no token choice can be made from (a damaged export, or float16
    overflow): argmax would silently pick the first NaN."""
    if np.isfinite(logits).all():
        return logits
    nan_rows = np.isnan(logits).any(axis=-1).nonzero()[0]
    if nan_rows.size:
        raise nan_logits(nan_rows[:8].tolist())
    limit = np.finfo(np.float32).max
    return np.clip(logits, -limit, limit)


def nan_logits(rows: list[int]) -> RuntimeError:
    """The error for NaN logits in ``rows``: no token can be chosen from them."""
    return RuntimeError(f"the model produced NaN logits (rows {rows}); no token can be chosen. "
                        "The export may be damaged (load it with verify='full') or overflow in "
                        "its dtype")


def next_token(logits: np.ndarray, params: SamplingParams,
               rng: np.random.Generator | None = None) -> np.ndarray:
    """Pick one token per row of ``logits`` [B, V] -> int64 [B]: argmax when greedy.
    ``RuntimeError`` for NaN logits (``check_logits``)."""
    logits = check_logits(logits)
    if params.greedy:
        return np.argmax(logits, axis=-1).astype(np.int64)
    if rng is None:
        raise ValueError("rng: sampling (temperature > 0) needs a numpy.random.Generator")
    return sample(distribution(logits, params), rng)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The probabilities float64 [B, V] a sampled row draws from: ``logits`` [B, V] (checked,
    ``check_logits``) at ``params.temperature``, filtered by top-k then top-p."""
    scaled = apply_temperature(check_logits(logits), params.temperature)
    return softmax(top_p_filter(top_k_filter(scaled, params.top_k), params.top_p))


def force_tokens(logits: np.ndarray, token_ids: tuple[int, ...]) -> np.ndarray:
    """Logits [B, V] that allow only ``token_ids``: 0 for them, -inf for every other token, as
    transformers' ForcedBOS / ForcedEOS logits processors set them (greedy then picks the first of
    several, sampling any of them alike)."""
    forced = np.full(logits.shape, -np.inf, dtype=np.float32)
    forced[:, list(token_ids)] = 0.0
    return forced
