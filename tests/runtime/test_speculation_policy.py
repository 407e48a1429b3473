"""``KPolicy``'s start for new rows (runtime/decoding/policy.py): the acceptance pooled over
earlier rows, computed here directly, and the first proposals that new rows of a costly draft
make anyway, on a doubling wait; the verification costs it reads, learnt from the forwards."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tfport.runtime.decoding.drafters import PromptLookup
from tfport.runtime.decoding.policy import KPolicy, VerifyCosts
from tfport.runtime.decoding.speculative import Speculation, Speculator


def cost(size: int) -> float:
    return float(np.interp(size, [1, 2, 9], [1.0, 1.05, 1.25]))


def test_a_new_row_starts_from_the_acceptance_pooled_over_earlier_rows():
    """Every observation of every row counts in the pool with weight POOL_DECAY ** age, from the
    prior counted as ``prior_weight`` observations; a new row's alpha is the pooled rate, which
    its own counts start from (as ``prior_weight`` observations)."""
    policy = KPolicy(8, cost, prior=0.6, prior_weight=4.0)
    seen = []
    for key, proposed, accepted in [("a", 8, 8), ("b", 4, 1), ("a", 3, 3), ("c", 5, 0), ("b", 0, 0)]:
        policy.record(key, proposed, accepted)
        seen += [1] * accepted + [0] * (accepted < proposed)
    weights = KPolicy.POOL_DECAY ** np.arange(len(seen))[::-1]
    prior = 4.0 * KPolicy.POOL_DECAY ** len(seen)
    pooled = (0.6 * prior + weights @ seen) / (prior + weights.sum())
    assert policy.alpha("new") == pytest.approx(pooled)
    assert pooled != pytest.approx(0.6, abs=0.05)  # the observations moved it off the prior
    policy.record("new", 2, 2)
    assert policy.alpha("new") == pytest.approx((4 * pooled * 0.81 + 0.9 + 1) / (4 * 0.81 + 0.9 + 1))


def test_new_rows_start_drafting_once_earlier_rows_showed_it_pays():
    """At these costs (a drafting step 0.45 of a target step), the prior does not pay for a draft
    model; a row that starts after rows whose drafts were accepted does."""
    policy = KPolicy(8, cost)
    policy.draft_cost, policy.draft_feed = 0.45, 0.63
    assert policy.alpha("first") == 0.6 and policy.k("first") == 0
    for _ in range(6):
        policy.record("earlier", 5, 5)
    assert policy.k("later") > 0


def test_new_rows_of_a_costly_draft_probe_on_a_doubling_wait():
    """Where even the pooled acceptance does not pay, new rows do not draft, except one in
    PROBE_AFTER (the wait doubling after each such row, up to PROBE_MAX), which proposes
    PROBE_TOKENS: otherwise nothing would ever be observed again. A row counts once however often
    it is asked, and a row that drafted and stopped does not probe."""
    policy = KPolicy(8, cost)
    policy.draft_cost, policy.draft_feed = 0.45, 0.63
    for _ in range(60):
        policy.record("earlier", 4, 0)
    ks = []
    for row in range(KPolicy.PROBE_AFTER * 7):
        ks.append(policy.k(row))
        policy.k(row)  # asked again: still one row (the waits below would halve otherwise)
    probes = [row for row, k in enumerate(ks) if k]
    assert all(ks[row] == KPolicy.PROBE_TOKENS for row in probes)
    waits = np.diff([-1] + probes).tolist()
    assert waits == [KPolicy.PROBE_AFTER * 2 ** n for n in range(len(waits))] and len(waits) == 3
    policy.record(probes[0], 2, 0)  # the probe was rejected: that row stops, for good
    assert not any(policy.k(probes[0]) for _ in range(KPolicy.PROBE_MAX * 2))
    for _ in range(30):  # later rows' drafts are accepted: new rows draft on their own merit
        policy.record("recovered", 6, 6)
    assert policy.k("next") > 0 and policy.new_rows == (0, KPolicy.PROBE_AFTER)
    policy.forget(probes[0])  # a key reused by a later request (a server's id(handle)) is new again
    assert probes[0] not in policy.asked and policy.k(probes[0]) > 0


def test_prompt_lookup_rows_start_from_the_pool_and_probe_as_before():
    """Prompt lookup costs nothing to draft: a new row whose pooled start does not pay waits
    PROBE_AFTER plain steps of its own and then probes (rows are not skipped whole)."""
    policy = KPolicy(8, cost)
    for _ in range(60):
        policy.record("earlier", 4, 0)
    ks = [policy.k("new") for _ in range(KPolicy.PROBE_AFTER)]
    assert ks == [0] * (KPolicy.PROBE_AFTER - 1) + [KPolicy.PROBE_TOKENS]


def test_a_row_with_no_room_left_is_not_put_to_the_policy():
    """The speculator asks the policy for K only for rows with token budget and cache room left:
    a row on its last token would otherwise spend a new row's probe (and its place on the
    doubling wait) with nothing proposed."""
    from tfport.runtime.decoding.engine import SequenceState
    from tfport.runtime.sampling import SamplingParams

    class Recording(KPolicy):
        asked_for: list = []

        def k(self, key):
            self.asked_for.append(key)
            return super().k(key)

    batch = SimpleNamespace(capacity=3, max_length=32, rows=[0, 1, 2])
    runner = SimpleNamespace(kept={"verify-costs": {(3, 8): VerifyCosts({1: 1.0, 2: 1.05, 9: 1.25})}})  # given
    speculator = Speculator(batch, runner, Speculation("lookup"), PromptLookup())
    speculator.policy = Recording(8, None)
    states = [SequenceState(SamplingParams(), None, n) for n in (1, 6, 6)]  # budget: none, 5, 5
    rows = [SimpleNamespace(length=10), SimpleNamespace(length=10), SimpleNamespace(length=31)]  # room: -, -, none
    context = [5, 6, 7, 5, 6, 7, 5, 6]
    proposals = speculator.propose(["last", "open", "full"], [context] * 3, states, rows)
    assert Recording.asked_for == ["open"]
    assert [len(p.tokens) for p in proposals] == [0, 3, 0]  # what followed the match, to the context's end


def test_verification_costs_follow_the_forwards_observed():
    """``VerifyCosts``: a chunk size's measured time gives way to the median of its latest
    observed forwards once there are ``MIN_SEEN``; the policy's K follows. A measurement that
    read a 2-token chunk as costing one step (1.0) kept K = 1 at an acceptance of 3%; forwards
    showing it costs 1.2 steps make the row step plainly. With ``learn`` False nothing changes."""
    measured = {1: 0.02, 2: 0.02, 9: 0.03}
    for learn in (True, False):
        costs = VerifyCosts(measured, learn=learn)
        policy = KPolicy(8, costs)
        policy.counts["row"] = (0.03, 1.0)
        assert costs(2) == 1.0 and policy.k("row") == 1
        for seconds in (0.019, 0.021, 0.020, 0.020):
            costs.observe(1, seconds)
        for seconds in (0.023, 0.025, 0.024):
            costs.observe(2, seconds)
        assert costs(2) == pytest.approx(1.0 if learn else 1.0)  # three are not enough
        costs.observe(2, 0.024)
        if learn:
            assert costs.step_seconds == pytest.approx(0.02)
            assert costs(2) == pytest.approx(0.024 / 0.02) and costs(9) == pytest.approx(1.5)
            assert costs(5) == pytest.approx(1.2 + 3 * 0.3 / 7)
            assert policy.k("row") == 0
        else:
            assert (costs.step_seconds, costs(2), policy.k("row")) == (0.02, 1.0, 1)


def test_the_speculator_times_its_verifying_forwards(monkeypatch):
    """``Speculator.forward`` times the target's forward (a fake clock: seconds per chunk size)
    into the costs ``propose`` measured, when every row feeds as many tokens."""
    from tfport.runtime.decoding import policy as policy_module

    clock = [0.0]
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: clock[0])

    class Batch:
        capacity, max_length = 2, 100

        def __init__(self):
            self.rows, self.seconds = [SimpleNamespace(length=5), SimpleNamespace(length=5)], {1: 0.02, 2: 0.02, 9: 0.03}

        def extend(self, chunks):
            clock[0] += self.seconds[max(len(c) for c in chunks)]
            return [np.zeros((len(c), 4), np.float32) for c in chunks]

        def rewind(self, row, count):
            pass

    batch = Batch()
    speculator = Speculator(batch, SimpleNamespace(kept={}), Speculation("lookup"), PromptLookup())
    states = [SimpleNamespace(max_tokens=50, tokens=[]) for _ in batch.rows]
    speculator.propose(["a", "b"], [[1, 2, 3, 1, 2], [4, 5, 6]], states, batch.rows)  # measures
    costs = speculator.verify_costs
    assert speculator.policy.cost is costs and costs(2) == 1.0
    batch.seconds = {1: 0.02, 2: 0.03}
    for size in (1, 2):
        for _ in range(VerifyCosts.MIN_SEEN):
            speculator.forward([np.zeros(size, np.int64), np.zeros(size, np.int64)])
    speculator.forward([np.zeros(1, np.int64), np.zeros(2, np.int64)])  # rows feeding unlike counts: not a cost
    assert costs(2) == pytest.approx(1.5) and costs.step_seconds == pytest.approx(0.02)
    assert {size: len(times) for size, times in costs.seen.items()} == {1: 4, 2: 4}


def test_verification_costs_refuse_what_would_divide_by_zero():
    """Measured seconds must include one token's and be positive; an observed forward of no time
    (a coarse clock) is ignored rather than made a step that costs nothing."""
    for seconds in ({2: 0.02}, {1: 0.0, 2: 0.02}, {1: 0.02, 9: -1.0}):
        with pytest.raises(ValueError, match="seconds="):
            VerifyCosts(seconds)
    costs = VerifyCosts({1: 0.02, 2: 0.03})
    for _ in range(VerifyCosts.MIN_SEEN):
        costs.observe(1, 0.0)
    assert costs.step_seconds == 0.02 and costs(2) == pytest.approx(1.5)


def test_a_batch_speculates_only_when_its_forward_pays_for_every_row():
    """One row's proposal makes the whole forward cost cost(k + 1) (padded, or rows run one at a
    time): a batch speculates when the rows' expected tokens over that time exceed a plain step's
    one token per row, computed here directly. One row, or none proposing, is the row's own call."""
    costly = lambda size: 1.0 + 0.35 * (size - 1)  # noqa: E731  rows run one at a time: 3.8 at 9
    padded = lambda size: 1.0 + 0.04 * (size - 1)  # noqa: E731  one padded forward: 1.32 at 9
    alphas = {"sure": 0.95, "a": 0.05, "b": 0.05, "c": 0.05}
    for cost in (costly, padded):
        policy = KPolicy(8, cost)
        for key, alpha in alphas.items():
            policy.counts[key] = (alpha, 1.0)
        keys = list(alphas)
        ks = [policy.k(key) for key in keys]
        assert ks[0] > 0  # the sure row alone would speculate at either cost
        tokens = sum(sum(alphas[key] ** i for i in range(k + 1)) for key, k in zip(keys, ks))
        assert policy.pays_for_batch(keys, ks) == (tokens / cost(max(ks) + 1) > len(keys))
        assert policy.pays_for_batch(keys, ks) == (cost is padded)
        assert policy.pays_for_batch(["sure"], [8]) and policy.pays_for_batch(keys, [0] * 4)


def test_the_speculator_proposes_nothing_when_the_batch_would_not_pay():
    """Two rows on a layout whose chunked forward costs 4.5 steps at 9 tokens: the sure row's k
    would pay for it alone, but not for both rows (7.3 + 1 expected tokens against 2 x 4.5), so
    neither row proposes; two sure rows do."""
    from tfport.runtime.decoding.engine import SequenceState
    from tfport.runtime.sampling import SamplingParams

    batch = SimpleNamespace(capacity=2, max_length=64, rows=[0, 1])
    costs = VerifyCosts({1: 1.0, 2: 1.4375, 9: 4.5}, learn=False)
    runner = SimpleNamespace(kept={"verify-costs": {(2, 8): costs}})
    context = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6]  # lookup finds "5 6" and follows it
    rows = [SimpleNamespace(length=20), SimpleNamespace(length=20)]
    for alphas, proposing in [((0.95, 0.05), [False, False]), ((0.95, 0.95), [True, True])]:
        speculator = Speculator(batch, runner, Speculation("lookup"), PromptLookup())
        speculator.policy.counts.update({"x": (alphas[0], 1.0), "y": (alphas[1], 1.0)})
        states = [SequenceState(SamplingParams(), None, 40) for _ in rows]
        assert speculator.policy.k("x") == 8
        proposals = speculator.propose(["x", "y"], [context, context], states, rows)
        assert [bool(p.tokens) for p in proposals] == proposing
