"""Logits processing and sampling: small pure functions over numpy arrays [B, V].

They follow ``tfport.models.generate.next_token`` step for step (temperature, then top-k, then
top-p, then a draw from the softmax); only the random source differs (a seeded
``numpy.random.Generator`` instead of a ``torch.Generator``), so sampled tokens are reproducible
run to run but not equal to PyTorch's.

The OpenAI / vLLM request options are applied in vLLM's order, each as its reference defines it:

1. ``logit_bias`` {id: bias} is added to the raw logits (OpenAI);
2. ``repetition_penalty`` r (transformers / vLLM): every token of the prompt or the output so far
   has its logit divided by r when positive, multiplied by r otherwise (1 is off);
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI), over the output's token counts c:
   ``logit[j] -= f * c[j] + p * (c[j] > 0)``;
4. temperature, top-k, top-p, then ``min_p`` (transformers' ``MinPLogitsWarper``, in its order:
   tokens whose probability is below ``min_p`` times the most likely one's are dropped).

1-3 (``penalise``) change what greedy decoding picks too; 4 only what sampling draws from.
Log-probabilities reported to a caller (``token_logprobs``) are those of the model itself, the
log-softmax of the raw logits before any of these steps, as OpenAI and vLLM report them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tfport.config.checks import is_integer

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
    """``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1.0 and ``min_p`` 0 switch those
    filters off. Any positive temperature samples; tiny ones (below float32's smallest normal,
    1.2e-38, included) pick the most likely token, as the limit says (``apply_temperature``).

    Penalties (the module docstring says how each applies; all off by default):
    ``repetition_penalty`` > 0 (1 is off), ``presence_penalty`` and ``frequency_penalty`` in
    [-2, 2], ``logit_bias`` token id -> bias in [-100, 100] (ids are checked against a vocabulary
    where one is known: ``Penalties``)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        temperature, top_p = _finite(self.temperature), _finite(self.top_p)
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: expected a finite number >= 0 "
                             "(0 is greedy)")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 keeps all)")
        if top_p is None or not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1] (1 keeps all)")
        _check_range("min_p", self.min_p, 0.0, 1.0, "(0 keeps all)")
        repetition = _finite(self.repetition_penalty)
        if repetition is None or repetition <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r}: expected a finite "
                             "number > 0 (1 is off)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_range(name, getattr(self, name), -2.0, 2.0, "(0 is off)")
        if not isinstance(self.logit_bias, Mapping):
            raise ValueError(f"logit_bias={self.logit_bias!r}: expected a mapping of token id -> "
                             "bias in [-100, 100]")
        for token, bias in self.logit_bias.items():
            if not is_integer(token) or token < 0:
                raise ValueError(f"logit_bias: key {token!r}: expected a token id (an integer >= 0)")
            _check_range(f"logit_bias[{token}]", bias, -100.0, 100.0, "")

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that it is 0 in float64 (a numpy longdouble)."""
        return float(self.temperature) == 0

    @property
    def penalised(self) -> bool:
        """Whether a penalty or bias changes the logits (then ``Penalties`` applies them)."""
        return (float(self.repetition_penalty) != 1 or float(self.presence_penalty) != 0
                or float(self.frequency_penalty) != 0 or any(self.logit_bias.values()))


def _check_range(name: str, value: object, low: float, high: float, note: str) -> None:
    number = _finite(value)
    if number is None or not low <= number <= high:
        raise ValueError(f"{name}={value!r}: expected a number in [{low:g}, {high:g}] {note}".rstrip())


def make_rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    """A ``numpy.random.Generator``: ``seed`` itself, one seeded with it, or a fresh one."""
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is not None and (not is_integer(seed) or seed < 0):
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


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens of logits [B, V] (at their temperature) whose probability is below ``min_p``
    times their row's largest -> -inf (transformers' ``MinPLogitsWarper``; the most likely token
    always stays)."""
    if min_p <= 0:
        return logits
    probs = softmax(logits)
    drop = probs < min_p * probs.max(axis=-1, keepdims=True)
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
    ``check_logits``) at ``params.temperature``, filtered by top-k, top-p then min-p."""
    scaled = apply_temperature(check_logits(logits), params.temperature)
    kept = top_p_filter(top_k_filter(scaled, params.top_k), params.top_p)
    return softmax(min_p_filter(kept, params.min_p))


def force_tokens(logits: np.ndarray, token_ids: tuple[int, ...]) -> np.ndarray:
    """Logits [B, V] that allow only ``token_ids``: 0 for them, -inf for every other token, as
    transformers' ForcedBOS / ForcedEOS logits processors set them (greedy then picks the first of
    several, sampling any of them alike)."""
    forced = np.full(logits.shape, -np.inf, dtype=np.float32)
    forced[:, list(token_ids)] = 0.0
    return forced


def penalise(logits: np.ndarray, params: SamplingParams, prompt_ids: np.ndarray,
             generated: Sequence[int]) -> np.ndarray:
    """Logits float32 [V] with ``params``' bias and penalties applied (steps 1-3 of the module
    docstring): ``prompt_ids`` are the distinct token ids of the prompt (repetition penalty),
    ``generated`` the output's tokens so far (all three penalties). A new array."""
    x = np.array(logits, dtype=np.float32)
    vocab = x.shape[-1]
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
        x[ids] += np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias))
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=vocab)  # [V]
    if params.repetition_penalty != 1:
        seen = np.union1d(prompt_ids, np.flatnonzero(counts))
        with np.errstate(divide="ignore", over="ignore"):  # an extreme r gives +-inf, clipped when picking
            x[seen] = np.where(x[seen] > 0, x[seen] / params.repetition_penalty,
                               x[seen] * params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        x -= (params.frequency_penalty * counts + params.presence_penalty * (counts > 0)).astype(np.float32)
    return x


def check_bias_ids(params: SamplingParams, vocab_size: int) -> None:
    """``ValueError`` for a ``params.logit_bias`` id outside [0, ``vocab_size``)."""
    bad = [int(t) for t in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"logit_bias: token ids {bad[:8]} outside [0, {vocab_size}) (the "
                         "model's vocab_size)")


class Penalties:
    """The logits processor (``decoding.engine.LogitsProcessor``) of one sequence's bias and
    penalties: ``params`` over ``prompt`` (token ids) and the tokens generated so far.
    ``ValueError`` for a ``logit_bias`` id outside [0, ``vocab_size``)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int], vocab_size: int):
        check_bias_ids(params, vocab_size)
        self.params = params
        self.prompt_ids = np.unique(np.asarray(prompt, dtype=np.int64))

    def __call__(self, tokens: Sequence[int], logits: np.ndarray) -> np.ndarray:
        return penalise(logits, self.params, self.prompt_ids, tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen ``token``, its ``logprob`` under the model (the log-softmax of the raw logits),
    and ``top``: the most likely (id, logprob) pairs there, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis in float64 (``check_logits``: NaN refused, +-inf clipped)."""
    x = check_logits(np.asarray(logits)).astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """For logits [n, V] and the token chosen after each (n ids): the token's log-probability
    and the ``top`` most likely tokens' (ties: the lower id first)."""
    logp = log_softmax(logits)  # [n, V]
    order = np.zeros((len(logp), 0), np.int64)
    if top > 0:
        order = np.argpartition(-logp, min(top, logp.shape[-1]) - 1, axis=-1)[:, :top]  # [n, top]
        order = np.array([best[np.lexsort((best, -row[best]))] for row, best in zip(logp, order)])
    return [TokenLogprob(int(t), float(row[t]), tuple((int(i), float(row[i])) for i in best))
            for t, row, best in zip(tokens, logp, order)]


@dataclass
class Logprobs:
    """What ``Model.generate`` / ``stream`` fill in when passed one (``logprobs=Logprobs(top=5)``):
    ``rows[b]`` holds row b's ``TokenLogprob`` per generated token (its stop token included,
    nothing after its end), each with the ``top`` most likely alternatives."""

    top: int = 0
    rows: list[list[TokenLogprob]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not is_integer(self.top) or self.top < 0:
            raise ValueError(f"top={self.top!r}: expected an integer >= 0 (alternatives per token)")

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(logprobs float64 [B, N], top ids int64 [B, N, top], top logprobs float64
        [B, N, top]); N is the longest row, shorter rows padded with NaN and id -1."""
        steps = max((len(row) for row in self.rows), default=0)
        logprob = np.full((len(self.rows), steps), np.nan)
        ids = np.full((len(self.rows), steps, self.top), -1, np.int64)
        top = np.full((len(self.rows), steps, self.top), np.nan)
        for b, row in enumerate(self.rows):
            for n, entry in enumerate(row):
                logprob[b, n] = entry.logprob
                for k, (token, value) in enumerate(entry.top):
                    ids[b, n, k], top[b, n, k] = token, value
        return logprob, ids, top
