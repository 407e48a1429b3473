"""How many tokens to propose: ``KPolicy`` chooses K per row and step (and tells a draft model
when to stop drafting) from the row's running acceptance and the measured cost of verifying
(``measure_costs``, then the decoding's own forwards: ``VerifyCosts``): the K that maximises the
expected tokens per unit of target time, 0 (a plain step) when speculating does not pay."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from tfport.config.checks import is_int

from .rows import RowBatch


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification of k proposals yields when each is accepted with probability
    ``alpha`` independently: 1 + alpha + ... + alpha^k (Leviathan et al. 2023, eq. 1)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


class KPolicy:
    """K per row: argmax over k in 0..``k_max`` of expected_tokens(alpha, k) / ``time(k)``, where
    time(k) = cost(k + 1) + draft_feed + (k - 1) draft_cost (time(0) = 1); alpha (``alpha``) is
    the row's running acceptance rate per proposed token (each verification observes its
    accepted proposals and, if one was rejected, that one: the ones after it say nothing;
    observations are averaged with weight ``decay`` ** age, starting from ``prior`` counted as
    ``prior_weight`` observations: with one, a first rejection cut alpha to 0.28 and switched an
    int4 self-draft off for good on open chat); ``cost(s)`` is the measured time of feeding s
    tokens per row relative to one; ``draft_feed`` / ``draft_cost`` are the measured times of a
    draft model's first forward of a proposal (it also feeds the row's new tokens: a chunk) and of
    each further drafting step, relative to the same (0 for prompt lookup). Charging every
    drafted token its proposal's average read a short proposal's chunk as the price of each token
    and switched an int4 draft off for good. Without a cost function, always ``k_max``.

    A row whose best k is 0 would never update its alpha again, so with a drafter that costs
    nothing (prompt lookup) it probes: after ``PROBE_AFTER`` plain steps it proposes
    ``PROBE_TOKENS``, and each probe that does not make speculation pay doubles the wait (up to
    ``PROBE_MAX``). A draft model's row does not probe once it has drafted: before drafting again
    it must be fed every token since it last drafted, at several-row cost (SmolLM2's int4 draft on
    open chat, where it agrees on 37% of its tokens: 0.75x plain decoding with probes, as a probe
    after a row's acceptance dipped kept it switching on and off).

    A new row starts from the acceptance pooled over the rows before it (``pooled``: every
    observation, weighted ``POOL_DECAY`` ** age, from the prior), not from the fixed prior: a
    server's later requests start from what its earlier ones saw. With the fixed prior and an int4
    self-draft on an AVX2 CPU (a drafting step 0.45 of a float32 target step), no new request
    drafted once the draft's costs were known, at any acceptance the earlier requests had shown.
    A new row for which even that does not pay makes a first proposal of ``PROBE_TOKENS`` anyway
    (a steered draft: as far as ``keep_drafting`` says) after ``PROBE_AFTER`` such rows (the wait doubling up to ``PROBE_MAX``, back to
    ``PROBE_AFTER`` once a new row drafts on its own merit): otherwise the pooled acceptance, and
    with it every later row, would never change again.

    A draft model that gives its confidence in each token (its own probability of it) is not
    held to k: while drafting it asks ``keep_drafting``, which estimates each drafted token's
    acceptance from its confidence (``acceptance``: the rate observed for drafts of about that
    confidence) and goes on while one more forward raises the expected tokens per unit of
    target time. A run the draft is sure of grows up to ``k_max``; it stops at a token the draft
    doubts, where the target is likely to reject it and every later draft forward is wasted.
    """

    PROBE_AFTER, PROBE_MAX, PROBE_TOKENS = 8, 128, 2
    POOL_DECAY = 0.99  # per observation, for the acceptance pooled over rows (a new row's start)
    BINS = 10  # confidence bins of ``acceptance``: [0, 0.1), [0.1, 0.2), ... [0.9, 1]

    def __init__(self, k_max: int, cost: Callable[[int], float] | None, prior: float = 0.6,
                 decay: float = 0.9, prior_weight: float = 4.0):
        if not is_int(k_max) or k_max < 1:
            raise ValueError(f"draft_tokens={k_max!r}: expected a positive integer")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight={prior_weight!r}: expected a positive number of observations")
        self.k_max, self.cost, self.prior, self.decay = k_max, cost, prior, decay
        self.prior_weight = prior_weight
        self.draft_cost = 0.0  # a drafting step, relative to a target step
        self.draft_feed = 0.0  # a proposal's first draft forward (it feeds the new tokens), the same
        self.counts: dict[Hashable, tuple[float, float]] = {}  # key -> decayed (accepted, observed)
        self.by_confidence = np.zeros((2, self.BINS))  # (accepted, observed) drafts per confidence bin
        self.waits: dict[Hashable, tuple[int, int]] = {}  # key -> (plain steps since a proposal, wait)
        self.pooled = (prior * prior_weight, prior_weight)  # decayed (accepted, observed) of all rows
        self.asked: set[Hashable] = set()  # rows k was chosen for
        self.new_rows = (0, self.PROBE_AFTER)  # (new rows a draft model skipped since one drafted, wait)

    def k(self, key: Hashable) -> int:
        if self.cost is None:
            return self.k_max
        new = key not in self.asked and key not in self.counts
        self.asked.add(key)
        alpha = self.alpha(key)
        gains = [expected_tokens(alpha, k) / self.time(k) for k in range(self.k_max + 1)]
        best = int(np.argmax(gains))
        if best:
            self.waits.pop(key, None)
            if new:
                self.new_rows = (0, self.PROBE_AFTER)
            return best
        if self.draft_cost or self.draft_feed:  # a draft model: a probe feeds it every token since it drafted
            return self._probe_new_row() if new else 0
        plain, wait = self.waits.get(key, (0, self.PROBE_AFTER))
        if plain + 1 < wait:
            self.waits[key] = (plain + 1, wait)
            return 0
        self.waits[key] = (0, min(2 * wait, self.PROBE_MAX))
        return min(self.k_max, self.PROBE_TOKENS)

    def pays_for_batch(self, keys: Sequence[Hashable], ks: Sequence[int]) -> bool:
        """Whether one forward of the rows ``keys`` with these proposal counts (from ``k``)
        yields more tokens per unit of target time than a plain step of every row. The rows'
        chunks go in one forward, which costs about what every row feeding the longest does (the
        ``concat`` layout pads the short ones; ``inplace`` runs each row on its own once one has
        several tokens): so each row's k is paid by every row. With n rows: whether sum over
        rows of expected_tokens(alpha, k) / ``time``(max k) exceeds n. Per-row choices alone
        made prompt lookup run a served float32 SmolLM2 at 4 concurrent requests at 0.58x plain
        (96 against 165 tokens/s, ``inplace``): one row's proposal made the others' steps run one
        row at a time."""
        if self.cost is None or len(keys) < 2 or not any(ks):
            return True
        tokens = sum(expected_tokens(self.alpha(key), k) for key, k in zip(keys, ks))
        return tokens / self.time(max(ks)) > len(keys)

    def _probe_new_row(self) -> int:
        """k for a new row of a draft model that would not draft it: ``PROBE_TOKENS`` once every
        ``new_rows`` wait (doubling), else 0."""
        skipped, wait = self.new_rows
        if skipped + 1 < wait:
            self.new_rows = (skipped + 1, wait)
            return 0
        self.new_rows = (0, min(2 * wait, self.PROBE_MAX))
        return min(self.k_max, self.PROBE_TOKENS)

    def acceptance(self, key: Hashable, confidence: float) -> float:
        """The estimated probability that row ``key``'s target accepts a draft token of this
        confidence: the acceptance observed in its confidence bin (all rows), shrunk towards the
        row's alpha by one pseudo-observation."""
        accepted, observed = self.by_confidence[:, self._bin(confidence)]
        return float((accepted + self.alpha(key)) / (observed + 1.0))

    def keep_drafting(self, key: Hashable, confidences: Sequence[float]) -> bool:
        """Whether row ``key``, having drafted j tokens with ``confidences``, should draft one
        more: with c_i the product of the first i tokens' ``acceptance`` and T = ``time``,
        whether (1 + c_1 + ... + c_j + c_j * alpha) / T(j + 1) exceeds (1 + c_1 + ... + c_j) /
        T(j) (the next token's confidence is unknown: alpha stands for it). Without a cost
        function, always."""
        if self.cost is None:
            return True
        chain, tokens = 1.0, 1.0
        for confidence in confidences:
            chain *= self.acceptance(key, confidence)
            tokens += chain
        j = len(confidences)
        return (tokens + chain * self.alpha(key)) / self.time(j + 1) > tokens / self.time(j)

    def time(self, k: int) -> float:
        """A verification of k proposals in target steps: cost(k + 1), and drafting them, one
        feeding forward and k - 1 drafting steps (0 for prompt lookup)."""
        return self.cost(k + 1) + (self.draft_feed + (k - 1) * self.draft_cost if k else 0.0)

    def record(self, key: Hashable, proposed: int, accepted: int,
               confidences: Sequence[float] | None = None) -> None:
        """A verification of ``proposed`` tokens accepted the first ``accepted``: that many
        acceptances, then one rejection if any was rejected (the ones after it say nothing). A
        round of 6 rejected at its first token is one rejection, not six (a per-round rate read
        it as alpha 0 and cut K to 1 after a long accepted run, climbing back over several
        rounds). ``confidences`` (the drafter's, per proposed token) count in their bins."""
        if not proposed:
            return
        for i, confidence in enumerate((confidences or [])[:accepted + 1]):
            self.by_confidence[:, self._bin(confidence)] += (i < accepted, 1)
        hits, seen = self.counts.get(key) or self._start()
        pool, pooled = self.pooled
        for hit in [1.0] * accepted + [0.0] * (accepted < proposed):
            hits, seen = self.decay * hits + hit, self.decay * seen + 1.0
            pool, pooled = self.POOL_DECAY * pool + hit, self.POOL_DECAY * pooled + 1.0
        self.counts[key] = hits, seen
        self.pooled = pool, pooled

    def alpha(self, key: Hashable) -> float:
        """Row ``key``'s running acceptance rate per proposed token (before any, the rate pooled
        over the rows before it)."""
        hits, seen = self.counts.get(key) or self._start()
        return hits / seen

    def _start(self) -> tuple[float, float]:
        """A new row's (accepted, observed): the pooled rate, counted as ``prior_weight``
        observations."""
        hits, seen = self.pooled
        return hits / seen * self.prior_weight, self.prior_weight

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.BINS), self.BINS - 1)

    def forget(self, key: Hashable) -> None:
        self.counts.pop(key, None)
        self.waits.pop(key, None)
        self.asked.discard(key)


class VerifyCosts:
    """The time of a target forward feeding s tokens per row relative to one (``cost(s)``) for
    one row count, and of one such step in seconds (``step_seconds``): first from
    ``measure_costs``' timed calls, then from the decoding's own forwards (``observe``). Per
    chunk size, the median of the last ``KEEP`` forwards replaces the measured time once it holds
    ``MIN_SEEN``. Sizes between are interpolated; a cost never falls as the chunk grows.

    The measurement alone is a few calls at one moment of a shared machine: on SmolLM2 float32 it
    once read a 2-token chunk as costing no more than a step (later runs: 1.02-1.16), so prompt
    lookup proposed one token at acceptance rates near 0 all along an open chat, at 0.93x plain
    decoding. With ``learn`` False the measured figures stay (tests that set the costs)."""

    KEEP, MIN_SEEN = 16, 4

    def __init__(self, seconds: dict[int, float], learn: bool = True):
        if 1 not in seconds or not all(t > 0 for t in seconds.values()):
            raise ValueError(f"seconds={seconds!r}: expected positive seconds per chunk size, size 1 among them")
        self.learn = learn
        self.points = dict(seconds)  # chunk size -> seconds: measured, or the observed median
        self.seen: dict[int, deque[float]] = {}  # chunk size -> seconds of the latest forwards
        self._tabulate()

    def observe(self, size: int, seconds: float) -> None:
        """A forward of ``size`` tokens per row took ``seconds`` (not positive: ignored)."""
        if self.learn and seconds > 0:
            times = self.seen.setdefault(size, deque(maxlen=self.KEEP))
            times.append(seconds)
            median = statistics.median(times) if len(times) >= self.MIN_SEEN else None
            if median is not None and median != self.points.get(size):  # numpy's median: 2% of a step
                self.points[size] = median
                self._tabulate()

    def __call__(self, size: float) -> float:
        cost = self.whole.get(size)  # the policy asks for whole sizes, several times a step
        return float(np.interp(size, self.sizes, self.relative)) if cost is None else cost

    def _tabulate(self) -> None:
        points = self.points
        self.sizes = sorted(points)
        self.step_seconds = points[1]
        self.relative = list(itertools.accumulate((points[size] / points[1] for size in self.sizes), max))
        whole = range(1, self.sizes[-1] + 1)
        self.whole = dict(zip(whole, np.interp(whole, self.sizes, self.relative).tolist()))


def measure_costs(batch: RowBatch, k_max: int, repeats: int = 3) -> VerifyCosts:
    """The costs of verifying on ``batch``: the medians of ``repeats`` timed calls of
    ``batch.extend`` each at s = 1, 2 and k_max + 1 tokens per live row (after one untimed
    round), the sizes taking turns so that a change in the machine's speed reaches all of them.
    The second token is measured on its own: a chunk runs other kernels than a step (SmolLM2
    int4 on an AVX2 CPU: 1.43x a step for 2 tokens, 4.97x for 9, where a line through 1 and 9
    tokens said 1.31x and left speculation on at acceptances where it lost). Each call is
    rewound: the rows are unchanged."""
    last = [np.array([0], np.int64) for _ in batch.rows]  # token 0: the values do not matter
    sizes = sorted({1, 2, k_max + 1})
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for attempt in range(repeats + 1):
        for size in sizes:
            start = time.perf_counter()
            batch.extend([np.repeat(t, size) for t in last])
            if attempt:
                times[size].append(time.perf_counter() - start)
            for row in batch.rows:
                batch.rewind(row, size)
    return VerifyCosts({size: float(np.median(t)) for size, t in times.items()})
