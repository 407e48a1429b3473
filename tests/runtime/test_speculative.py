"""Speculative decoding (runtime/decoding/speculative.py): greedy tokens equal plain greedy
decoding's on both cache layouts for every drafter, with rows accepting different counts, stops
inside an accepted run and the token budget running out mid-run; sampled tokens follow the
target's distribution (a chi-square test against the distribution computed from the model's own
logits); bad arguments are refused."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tfport.export import ExportOptions, export_model
from tfport.models import build_model
from tfport.presets import get_preset
from tfport.runtime import load_model
from tfport.runtime.decoding.drafters import DraftModel, PromptLookup, Proposal
from tfport.runtime.decoding.engine import SequenceState
from tfport.runtime.decoding.policy import KPolicy, VerifyCosts, expected_tokens
from tfport.runtime.decoding.speculative import Speculation, SpeculationStats
from tfport.runtime.sampling import SamplingParams, distribution

# (target, preset): both cache layouts; on concat, each way positions enter (RoPE, learned
# absolute, ALiBi), since rewound tokens stay as masked columns there.
TARGETS = [("portable", "tiny-decoder"), ("portable", "tiny-decoder-gpt2"),
           ("portable", "tiny-decoder-alibi"), ("ort", "tiny-decoder")]


def _export(root, name, preset, target, seed, overrides=None, **options):
    config = get_preset(preset).replace(tie_embeddings=False, d_model=64, max_positions=128, **(overrides or {}))
    model = build_model(config, seed=seed)
    with torch.no_grad():  # every parameter off its initial value, for varied continuations
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    export_model(model, root / name, ExportOptions(target=target, **options))
    return load_model(root / name, intra_op_threads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    out = {(t, p): _export(root, f"{t}-{p}", p, t, seed=5) for t, p in TARGETS}
    out["draft"] = _export(root, "draft", "tiny-decoder", "portable", seed=9)  # same vocabulary, other weights
    return out


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    base = rng.integers(4, vocab, size=10).tolist()
    return [base * 3, rng.integers(4, vocab, size=7).tolist(), (base[:4] * 5)[:13]]


class Scripted:
    """Proposes, per row, the first ``right[key]`` tokens of the known greedy continuation, then
    a wrong token: rows accept exactly what the script says, different counts per row."""

    name = "scripted"

    def __init__(self, truth: list[list[int]], prompt_lengths: list[int], right: list[int], vocab: int):
        self.truth, self.lengths, self.right, self.vocab = truth, prompt_lengths, right, vocab

    def start(self, capacity, max_length):
        return self

    def forget(self, key):
        pass

    def propose(self, keys, contexts, ks, states):
        out = []
        for key, context, k in zip(keys, contexts, ks):
            done = len(context) - self.lengths[key]  # tokens generated so far
            follow = self.truth[key][done:done + min(k, self.right[key])]
            wrong = [(t + 1) % self.vocab for t in self.truth[key][done + len(follow):done + len(follow) + 1]]
            out.append(Proposal((follow + wrong)[:k]))
        return out


@pytest.mark.parametrize("drafter", ["lookup", "draft", "self"])
@pytest.mark.parametrize("key", TARGETS, ids=lambda k: "-".join(k))
def test_greedy_tokens_equal_plain_decoding(models, key, drafter):
    model = models[key]
    rows = prompts(model.config.vocab_size)
    plain = model.generate(rows, max_new_tokens=30, stop_token_ids=())
    drafts = {"lookup": "lookup", "draft": models["draft"], "self": model}
    # K fixed at 4: the same proposals every run (the adaptive K depends on measured times).
    speculative = Speculation(drafts[drafter], 4, adaptive=False)
    stats = SpeculationStats()
    tokens = model.generate(rows, max_new_tokens=30, stop_token_ids=(), speculative=speculative,
                            speculation=stats)
    np.testing.assert_array_equal(tokens, plain)
    assert stats.tokens == plain.size - len(rows) and stats.proposed > 0  # the prefill picks the first
    if drafter == "self":  # the target drafting for itself is always right
        assert stats.accepted == stats.proposed and stats.tokens_per_forward > 2


@pytest.mark.parametrize("key", TARGETS, ids=lambda k: "-".join(k))
def test_rows_accepting_different_counts_stops_and_budget(models, key):
    model = models[key]
    rows = prompts(model.config.vocab_size)
    plain = model.generate(rows, max_new_tokens=24, stop_token_ids=()).tolist()
    scripted = Scripted(plain, [len(r) for r in rows], [8, 0, 3], model.config.vocab_size)
    stats = SpeculationStats()
    tokens = model.generate(rows, max_new_tokens=24, stop_token_ids=(),
                            speculative=Speculation(scripted, 8, adaptive=False), speculation=stats)
    assert tokens.tolist() == plain
    assert 0 < stats.accepted < stats.proposed  # some rows accepted runs, others nothing

    # A stop id inside row 0's accepted run ends it there; the others go on (they rarely hit it).
    stop = plain[0][5]
    expected = model.generate(rows, max_new_tokens=24, stop_token_ids=[stop])
    got = model.generate(rows, max_new_tokens=24, stop_token_ids=[stop],
                         speculative=Speculation(Scripted(plain, [len(r) for r in rows], [8, 8, 8],
                                                          model.config.vocab_size), adaptive=False))
    np.testing.assert_array_equal(got, expected)
    assert got[0].tolist().index(stop) <= 5

    # The budget runs out in the middle of a run of 8 correct proposals.
    budget = model.generate(rows, max_new_tokens=6, stop_token_ids=(),
                            speculative=Speculation(Scripted(plain, [len(r) for r in rows], [8, 8, 8],
                                                             model.config.vocab_size), adaptive=False))
    assert budget.tolist() == [row[:6] for row in plain]


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic of ``counts`` against ``probs`` (inf when a count falls outside the
    support)."""
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum():
        return float("inf")
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


class Favourite:
    """A deterministic drafter (q one-hot): proposes a fixed token per last token."""

    name = "favourite"

    def __init__(self, table: dict[int, int]):
        self.table = table

    def start(self, capacity, max_length):
        return self

    def forget(self, key):
        pass

    def propose(self, keys, contexts, ks, states):
        return [Proposal([self.table[context[-1]]] if k else []) for context, k in zip(contexts, ks)]


@pytest.mark.parametrize("drafter", ["deterministic", "draft"])
def test_sampled_tokens_follow_the_target_distribution(models, drafter):
    """Tokens 1 and 2 of many sampled rows (token 2 verified against one proposal) against
    p(t1) p(t2 | t1) computed from the target's own logits, top-k 4 (16 cells): chi-square below
    the 0.1% critical value for 15 degrees of freedom (37.70). The same counts against
    p(t1) q(t2 | t1), what accepting every draft proposal would give, are far off."""
    model, draft = models[("portable", "tiny-decoder")], models["draft"]
    params = SamplingParams(temperature=1.5, top_k=4)
    prompt = prompts(model.config.vocab_size)[0][:9]

    def next_probs(source, context) -> np.ndarray:
        logits = source.decoding.logits(source.runners["decoder"], np.array([context]))
        return distribution(logits[-1:], params)[0]

    first = next_probs(model, prompt)
    target, accept_all = np.zeros((2, first.size, first.size))
    favourite = {}  # t1 -> the most likely t2: what the deterministic drafter proposes
    for t1 in np.nonzero(first)[0]:
        target[t1] = first[t1] * next_probs(model, prompt + [int(t1)])
        accept_all[t1] = first[t1] * next_probs(draft, prompt + [int(t1)])
        favourite[int(t1)] = int(np.argmax(target[t1]))

    counts = np.zeros_like(target)
    stats = SpeculationStats()
    rng = np.random.default_rng(1234)
    speculative = Speculation(Favourite(favourite) if drafter == "deterministic" else draft, 1, adaptive=False)
    for _ in range(6):
        tokens = model.generate([prompt] * 400, max_new_tokens=3, stop_token_ids=(), temperature=1.5,
                                top_k=4, seed=rng, speculative=speculative, speculation=stats)
        np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    assert stats.proposed == 2400  # every token 2 was a verification
    assert 0 < stats.accepted < stats.proposed
    assert _chi_square(counts, target) < 37.70
    if drafter == "draft":
        assert _chi_square(counts, accept_all) > 10 * 37.70


class Doubting:
    """The draft model, told to stop drafting a row at a token it gives under ``doubt`` (its own
    probability): how long a run is depends on what the draft sampled."""

    name = "doubting"

    def __init__(self, draft, doubt: float):
        self.draft, self.doubt = DraftModel(draft), doubt
        self.decisions = collections.Counter()  # keep's answers

    def start(self, capacity, max_length):
        rows = self.draft.start(capacity, max_length)
        rows.keep = self.keep
        return rows

    def keep(self, key, confidences) -> bool:
        self.decisions[confidences[-1] >= self.doubt] += 1
        return confidences[-1] >= self.doubt


def test_a_draft_that_stops_on_its_own_doubt_keeps_the_target_distribution(models):
    """Tokens 1-3 of many sampled rows, tokens 2 and 3 verified against up to two proposals of
    a draft that stops after a token it doubts (so the run's length depends on its own sample),
    against p(t1) p(t2 | t1) p(t3 | t1, t2) from the target's logits, top-k 4 (64 cells):
    chi-square below the 0.1% critical value for 63 degrees of freedom (103.4)."""
    model, draft = models[("portable", "tiny-decoder")], models["draft"]
    params = SamplingParams(temperature=1.5, top_k=4)
    prompt = prompts(model.config.vocab_size)[0][:9]

    def next_probs(context) -> np.ndarray:
        logits = model.decoding.logits(model.runners["decoder"], np.array([context]))
        return distribution(logits[-1:], params)[0]

    first = next_probs(prompt)
    target = np.zeros((first.size,) * 3)
    for t1 in np.nonzero(first)[0]:
        second = next_probs(prompt + [int(t1)])
        for t2 in np.nonzero(second)[0]:
            target[t1, t2] = first[t1] * second[t2] * next_probs(prompt + [int(t1), int(t2)])
    counts = np.zeros_like(target)
    stats = SpeculationStats()
    rng = np.random.default_rng(4321)
    doubting = Doubting(draft, 0.3)
    for _ in range(6):  # a 4th token, so that the 2nd and 3rd can be one verified run
        tokens = model.generate([prompt] * 400, max_new_tokens=4, stop_token_ids=(), temperature=1.5, top_k=4,
                                seed=rng, speculative=Speculation(doubting, 2, adaptive=False),
                                speculation=stats)
        np.add.at(counts, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    assert doubting.decisions[True] > 100 and doubting.decisions[False] > 100  # both run lengths drafted
    assert 0 < stats.accepted < stats.proposed
    assert _chi_square(counts, target) < 103.4


def test_acceptance_counts_tokens_not_rounds():
    """A verification observes its accepted proposals and the first rejected one (not the ones
    after it), averaged with weight decay ** age from the prior: a round rejected at its first
    token after a long accepted run is one rejection."""
    policy = KPolicy(8, None, prior=0.6, decay=0.9)
    for proposed, accepted in [(8, 8), (6, 0), (4, 2), (3, 3), (0, 0)]:
        policy.record("row", proposed, accepted)
    seen = [1] * 8 + [0] + [1, 1, 0] + [1] * 3  # the round of nothing proposed observes nothing
    weights = 0.9 ** np.arange(len(seen))[::-1]
    prior = policy.prior_weight * 0.9 ** len(seen)
    want = (0.6 * prior + weights @ seen) / (prior + weights.sum())
    assert policy.alpha("row") == pytest.approx(want)
    assert policy.alpha("row") > 0.75  # a per-round average would read the (6, 0) round as alpha 0


def test_the_policy_drafts_on_while_the_draft_is_sure():
    """``keep_drafting``: each drafted token's acceptance is estimated from the rate observed at
    its confidence; one more draft forward is taken while it raises the expected tokens per unit
    of target time, computed here directly."""
    cost = lambda size: 1.0 + 0.05 * (size - 1)  # noqa: E731
    policy = KPolicy(8, cost)
    policy.draft_cost, policy.draft_feed = 0.3, 0.45
    for _ in range(20):  # sure drafts are accepted, doubted ones rejected
        policy.record("row", 3, 2, [0.95, 0.97, 0.2])
    assert policy.acceptance("row", 0.96) > 0.95 and policy.acceptance("row", 0.25) < 0.1

    def direct(confidences):
        rates = []
        for j in (len(confidences), len(confidences) + 1):
            accepts = [policy.acceptance("row", c) for c in confidences] + [policy.alpha("row")]
            tokens = 1 + sum(np.prod(accepts[:i + 1]) for i in range(j))
            rates.append(tokens / (cost(j + 1) + policy.draft_feed + (j - 1) * policy.draft_cost))
        return rates[1] > rates[0]

    for confidences in ([0.95], [0.95, 0.97, 0.99], [0.95, 0.2], [0.15], [0.99] * 7):
        assert policy.keep_drafting("row", confidences) == direct(confidences), confidences
    assert policy.keep_drafting("row", [0.95, 0.97]) and not policy.keep_drafting("row", [0.95, 0.2])


def test_the_draft_model_stops_a_row_where_keep_says(models):
    """A draft model with ``keep`` drafts a row until keep says no (each further token would be a
    forward), not up to its k; without it, every row gets its k."""
    draft = models["draft"]
    context = prompts(draft.config.vocab_size)[0]
    rows = DraftModel(draft).start(2, 64)
    asked = []
    rows.keep = lambda key, confidences: asked.append((key, list(confidences))) or len(confidences) < 2
    forwards = [0.0]  # a clock the batch's forwards advance: 1 per feeding forward, 0.001 per step
    rows.batch = Clocked(rows.batch, forwards, feed=1.0, step=0.001)
    out = rows.propose([0], [context], [6], [SequenceState(SamplingParams(), None, 30)])
    assert len(out[0].tokens) == 2 and len(out[0].confidences) == 2
    assert all(0 < c <= 1 for c in out[0].confidences) and [len(c) for _, c in asked] == [1, 2]
    assert forwards[0] == pytest.approx(1.001)  # the feeding forward and one step
    rows.keep = None
    assert len(rows.propose([0], [context + out[0].tokens], [5], [SequenceState(SamplingParams(), None, 30)])[0].tokens) == 5


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.0, 4) == 1


def test_prompt_lookup_proposes_what_followed_the_last_match():
    rows = PromptLookup(max_ngram=2).start(1, 32)
    context = [5, 6, 7, 8, 9, 5, 6]
    assert rows.propose([0], [context], [3], [None])[0].tokens == [7, 8, 9]
    assert rows.propose([0], [context + [1]], [3], [None])[0].tokens == []  # 1 never occurred before
    assert rows.propose([0], [context + [7]], [2], [None])[0].tokens == [8, 9]


def test_bad_arguments_are_refused(models, tmp_path):
    model = models[("portable", "tiny-decoder")]
    with pytest.raises(TypeError, match="speculative=3"):
        model.generate([[5, 6]], speculative=3)
    with pytest.raises(ValueError, match="speculative='nope'"):
        model.generate([[5, 6]], speculative="nope")
    with pytest.raises(ValueError, match="draft_tokens=0"):
        model.generate([[5, 6]], speculative="lookup", draft_tokens=0)
    with pytest.raises(ValueError, match="draft_tokens=4: applies with speculative"):
        model.generate([[5, 6]], draft_tokens=4)
    other = _export(tmp_path, "other-vocab", "tiny-decoder", "portable", seed=1,
                    overrides={"vocab_size": model.config.vocab_size + 8})
    with pytest.raises(ValueError, match="vocab_size"):
        model.generate([[5, 6]], speculative=other)
    from tfport.runtime.decoding.speculative import open_drafter  # the CLI's and the server's --speculative
    with pytest.raises(ValueError, match=r"--speculative='nowhere': expected 'lookup' or the directory of a draft"):
        open_drafter("nowhere", model, "--speculative")
    assert open_drafter("lookup", model, "--speculative") == "lookup"


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
@pytest.mark.parametrize("key", [("portable", "tiny-decoder"), ("ort", "tiny-decoder")], ids=lambda k: "-".join(k))
def test_the_scheduler_speculates_with_continuous_batching(models, key, drafter):
    """Requests joining and leaving a speculating running batch get their solo greedy tokens,
    with stop ids and budgets of their own; the proposals are counted per request."""
    from tfport.runtime.serve.scheduler import GenerationRequest, Scheduler, SchedulerLimits

    model = models[key]
    speculation = Speculation("lookup" if drafter == "lookup" else models["draft"])
    scheduler = Scheduler(model, SchedulerLimits(max_rows=3, max_queue=16), speculation=speculation).start()
    try:
        rows = prompts(model.config.vocab_size) * 2
        budgets = [20, 9, 14, 5, 25, 12]
        solos = [model.generate([p], max_new_tokens=n, stop_token_ids=())[0].tolist()
                 for p, n in zip(rows, budgets)]
        stops = [(), (), (solos[2][4],), (), (), ()]
        handles = scheduler.submit([GenerationRequest(p, n, stop_ids=s) for p, n, s in zip(rows, budgets, stops)])
        results = [handle.result() for handle in handles]
    finally:
        scheduler.stop()
    for i, ((tokens, reason), solo) in enumerate(zip(results, solos)):
        if stops[i]:
            end = solo.index(stops[i][0]) + 1
            assert (tokens, reason) == (solo[:end], "stop"), i
        else:
            assert (tokens, reason) == (solo, "length"), i
    assert scheduler.speculation_stats.proposed == sum(h.proposed for h in handles) > 0
    assert scheduler.speculation_stats.accepted == sum(h.accepted for h in handles)
    if drafter == "lookup":  # these prompts repeat themselves; the other random model rarely agrees
        assert scheduler.speculation_stats.accepted > 0


class Oracle:
    """Proposes the target's own greedy continuation (``replies``: prompt -> its solo greedy
    tokens), reporting draft forwards that cost ``step`` / ``feed`` of a target step (the
    verification costs are patched to take 1 second a step)."""

    name = "oracle"

    def __init__(self, replies: dict[tuple[int, ...], list[int]], step: float, feed: float):
        self.replies, self.step_seconds, self.feed_seconds = replies, step, feed

    def start(self, capacity: int, max_length: int) -> "Oracle":
        return self

    def propose(self, keys, contexts, ks, states):
        out = []
        for context, k in zip(contexts, ks):
            prompt = next(p for p in self.replies if tuple(context[:len(p)]) == p)
            whole = [*prompt, *self.replies[prompt]]
            out.append(Proposal(whole[len(context):len(context) + k]))
        return out

    def forget(self, key) -> None:
        pass


def test_a_server_s_later_requests_draft_from_the_acceptance_earlier_ones_showed(models, monkeypatch):
    """A scheduler's speculator outlives its requests: once a draft's costs are known (here a
    drafting step 0.45 of a target step, an int4 self-draft's on an AVX2 CPU), a new request
    whose acceptance started from the fixed prior (0.6) never drafted. It starts from the
    acceptance pooled over the earlier requests, and drafts (with the solo greedy tokens)."""
    from tfport.runtime.decoding import speculative
    from tfport.runtime.serve.scheduler import GenerationRequest, Scheduler, SchedulerLimits

    # A target step of 1 s: the oracle's draft times are relative to it (learn=False: the tiny
    # model's own forwards, in milliseconds, do not replace it).
    cost = VerifyCosts({1: 1.0, 2: 1.05, 9: 1.25}, learn=False)
    monkeypatch.setattr(speculative, "measure_costs", lambda batch, k_max: cost)
    monkeypatch.setattr(speculative, "_COSTS", "oracle-costs")  # not the costs earlier tests measured
    model = models["portable", "tiny-decoder"]
    rows = prompts(model.config.vocab_size)[:2]
    solos = [model.generate([p], max_new_tokens=24, stop_token_ids=())[0].tolist() for p in rows]
    oracle = Oracle({tuple(p): solo for p, solo in zip(rows, solos)}, step=0.45, feed=0.63)
    policy = KPolicy(8, cost)
    policy.draft_cost, policy.draft_feed = 0.45, 0.63
    assert policy.k("fresh") == 0  # the fixed prior does not pay at these costs
    scheduler = Scheduler(model, SchedulerLimits(max_rows=2, max_queue=4),
                          speculation=Speculation(oracle)).start()
    try:
        handles = []
        for prompt in rows:  # one after the other: the second starts with the costs known
            handles += scheduler.submit([GenerationRequest(prompt, 24)])
            assert handles[-1].result() == (solos[len(handles) - 1], "length")
    finally:
        scheduler.stop()
    assert handles[0].accepted == handles[0].proposed > 0
    assert handles[1].accepted == handles[1].proposed > 0


@pytest.mark.parametrize("key", [("portable", "tiny-decoder"), ("ort", "tiny-decoder")], ids=lambda k: "-".join(k))
def test_a_single_prompt_speculates_from_the_prefix_cache_and_leaves_its_tokens(models, key):
    """As plain decoding does: the second call finds the first one's prompt and output cached
    (a chat's next turn is not prefilled again), with the plain tokens both times."""
    from tfport.runtime.decoding.prefix import PrefixCache

    model = models[key]
    prompt = prompts(model.config.vocab_size)[0]
    plain = model.generate([prompt], max_new_tokens=20, stop_token_ids=())
    model.prefix_cache, kept = PrefixCache.from_mb(16, block_size=4), model.prefix_cache
    try:
        first = model.generate([prompt], max_new_tokens=20, stop_token_ids=(), speculative="lookup")
        assert model.prefix_cache.hit_tokens == 0 and model.prefix_cache.bytes > 0
        follow = [*prompt, *first[0].tolist(), *prompt[:5]]  # the next turn: the conversation so far and more
        again = model.generate([follow], max_new_tokens=8, stop_token_ids=(), speculative="lookup")
        assert model.prefix_cache.hit_tokens >= len(prompt)
    finally:
        model.prefix_cache = kept
    np.testing.assert_array_equal(first, plain)
    np.testing.assert_array_equal(again, model.generate([follow], max_new_tokens=8, stop_token_ids=()))


def test_a_batch_export_makes_speculation_inexact(models, tmp_path):
    """Verification steps (several rows) would run on the batch export, plain steps on the
    model's own: refused unless exact=False."""
    _export(tmp_path, "w8a8", "tiny-decoder", "ort", seed=5, quantize="w8a8")
    mixed = load_model(models["ort", "tiny-decoder"].directory, intra_op_threads=1, batch_export=tmp_path / "w8a8",
                       batch_rows=2)
    rows = prompts(mixed.config.vocab_size)
    with pytest.raises(ValueError, match=r"batch export \(batch_export\).*exact=False"):
        mixed.generate(rows, max_new_tokens=8, speculative="lookup")
    assert mixed.generate(rows, max_new_tokens=8, speculative=Speculation("lookup", exact=False)).shape == (3, 8)


def test_a_quantised_target_is_refused_unless_inexact_is_accepted(models, tmp_path):
    """ONNX Runtime's MatMulNBits computes several rows differently from one (int8 activations),
    so exact speculation refuses quantised targets; exact=False runs them."""
    quantised = _export(tmp_path, "int4", "tiny-decoder", "ort", seed=5, quantize="int4")
    rows = prompts(quantised.config.vocab_size)
    with pytest.raises(ValueError, match=r"quantised \(int4\).*exact=False"):
        quantised.generate(rows, max_new_tokens=8, speculative="lookup")
    tokens = quantised.generate(rows, max_new_tokens=8, speculative=Speculation("lookup", exact=False))
    assert tokens.shape == (len(rows), 8)


def test_cli_speculative_prints_the_plain_tokens_and_a_summary(models, capsys):
    from tfport.cli import main

    model = models[("portable", "tiny-decoder")]
    ids = ",".join(str(t) for t in prompts(model.config.vocab_size)[0])
    assert main(["generate", str(model.directory), "--ids", ids, "--max-new-tokens", "20"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", str(model.directory), "--ids", ids, "--max-new-tokens", "20",
                 "--speculative", "lookup", "--draft-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "speculative:" in captured.err and "accepted" in captured.err
    with pytest.raises(SystemExit):
        main(["generate", str(model.directory), "--ids", ids, "--draft-tokens", "0", "--speculative", "lookup"])


def test_cli_with_a_draft_directory_shares_one_pool_and_prints_the_plain_tokens(models):
    """``tfport generate --speculative DRAFT_DIR`` opens the target and the draft on one shared
    pool (it says so at debug level) and prints plain decoding's tokens. In a child process: the
    pool is process-wide."""
    model, draft = models[("ort", "tiny-decoder")], models["draft"]
    ids = ",".join(str(t) for t in prompts(model.config.vocab_size)[0])
    common = ["generate", str(model.directory), "--ids", ids, "--max-new-tokens", "20", "--threads", "2"]

    def run(*extra):
        code = "import sys; from tfport.cli import main; sys.exit(main(sys.argv[1:]))"
        return subprocess.run([sys.executable, "-c", code, "-v", *common, *extra], capture_output=True,
                              text=True, timeout=300)

    plain, drafted = run(), run("--speculative", str(draft.directory), "--draft-tokens", "3")
    assert plain.returncode == 0 and drafted.returncode == 0, drafted.stderr[-3000:]
    assert drafted.stdout == plain.stdout and "speculative:" in drafted.stderr
    assert "on the shared thread pool" in drafted.stderr and "on the shared thread pool" not in plain.stderr


@pytest.mark.parametrize("key", TARGETS[:1] + TARGETS[-1:], ids=lambda k: "-".join(k))
def test_adaptive_k_keeps_the_plain_tokens(models, key):
    """K chosen from the measured costs and acceptance (so the proposals depend on timing):
    whatever it picks, the tokens are plain decoding's."""
    model = models[key]
    rows = prompts(model.config.vocab_size)
    plain = model.generate(rows, max_new_tokens=30, stop_token_ids=())
    for drafter in ("lookup", models["draft"]):
        np.testing.assert_array_equal(
            model.generate(rows, max_new_tokens=30, stop_token_ids=(), speculative=drafter), plain)


def test_verification_costs_are_measured_at_one_two_and_k_plus_one_tokens(monkeypatch):
    """``measure_costs`` on a batch whose extend takes a known time per chunk size (a fake clock):
    2 tokens are measured on their own (a chunk's kernels differ from a step's), sizes between
    are interpolated, and a cost never falls as the chunk grows."""
    from tfport.runtime.decoding import policy as policy_module

    clock = [0.0]
    monkeypatch.setattr(policy_module.time, "perf_counter", lambda: clock[0])

    class Batch:
        rows = [object()]

        def __init__(self, seconds):
            self.seconds, self.sizes = seconds, []

        def extend(self, chunks):
            self.sizes.append(len(chunks[0]))
            clock[0] += self.seconds[len(chunks[0])]

        def rewind(self, row, count):
            pass

    batch = Batch({1: 0.02, 2: 0.03, 9: 0.1})
    cost = policy_module.measure_costs(batch, 8)
    assert batch.sizes == [1, 2, 9] * 4  # the sizes take turns: one untimed round, three timed
    assert cost.step_seconds == pytest.approx(0.02)
    assert [cost(s) for s in (1, 2, 9)] == pytest.approx([1.0, 1.5, 5.0])
    assert cost(5) == pytest.approx(1.5 + 3 * 3.5 / 7)
    cost = policy_module.measure_costs(Batch({1: 0.02, 2: 0.01, 9: 0.1}), 8)  # a noisy 2
    assert cost(2) == 1.0 and cost(9) == pytest.approx(5.0)


def test_the_policy_counts_k_draft_forwards_for_k_tokens():
    """Drafting k tokens takes one feeding forward (it also feeds the row's new tokens) and k - 1
    drafting steps: the policy's k is the argmax of the expected tokens over that cost, computed
    here directly."""
    cost = lambda size: 1.0 + 0.05 * (size - 1)  # noqa: E731
    policy = KPolicy(8, cost)
    for alpha, draft_cost, feed in [(0.8, 0.35, 0.35), (0.95, 0.2, 0.5), (0.6, 0.1, 0.1), (0.9, 0.6, 0.6)]:
        policy.counts["row"], policy.draft_cost, policy.draft_feed = (alpha, 1.0), draft_cost, feed
        rates = [sum(alpha ** i for i in range(k + 1)) / (cost(k + 1) + (feed + (k - 1) * draft_cost if k else 0))
                 for k in range(9)]
        want = int(np.argmax(rates))
        assert want > 0 and policy.k("row") == want, (alpha, draft_cost, rates)


def test_a_row_that_stopped_speculating_probes_again():
    """k = 0 never updates a row's acceptance, so a row probes with PROBE_TOKENS after
    PROBE_AFTER plain steps, each failed probe doubling the wait; a probe whose tokens were
    accepted brings speculation back."""
    policy = KPolicy(8, lambda size: 1.0 + 0.05 * (size - 1))
    policy.counts["row"] = (0.02, 1.0)  # speculation does not pay at this acceptance, with prompt lookup
    ks = [policy.k("row") for _ in range(KPolicy.PROBE_AFTER * 7)]
    probes = [i for i, k in enumerate(ks) if k]
    assert all(ks[i] == KPolicy.PROBE_TOKENS for i in probes)
    waits = np.diff([-1] + probes).tolist()
    assert waits == [KPolicy.PROBE_AFTER * 2 ** n for n in range(len(waits))] and len(waits) == 3
    for _ in range(4):  # probes whose tokens were all accepted
        policy.record("row", 2, 2)
    assert policy.k("row") > 0
    policy.forget("row")
    assert "row" not in policy.counts and "row" not in policy.waits
    policy.counts["row"], policy.draft_cost = (0.05, 1.0), 0.4  # a draft model: no probes (feeding it costs)
    assert not any(policy.k("row") for _ in range(KPolicy.PROBE_MAX * 2))


class Clocked:
    """A draft row batch on a fake clock: a feeding forward (``extend``) takes ``feed`` seconds,
    a drafting step ``step``."""

    def __init__(self, batch, clock, feed: float, step: float):
        self.batch, self.clock, self.feed, self.step_time = batch, clock, feed, step

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def extend(self, chunks):
        self.clock[0] += self.feed
        return self.batch.extend(chunks)

    def step(self, tokens):
        self.clock[0] += self.step_time
        return self.batch.step(tokens)


def test_the_draft_costs_are_medians_of_feeding_and_drafting_forwards(models, monkeypatch):
    """``DraftModelRows.feed_seconds`` and ``step_seconds`` (the policy's draft_feed and
    draft_cost): the medians of recent feeding forwards and drafting steps, not swayed by one
    slow forward."""
    from tfport.runtime.decoding import drafters as drafters_module

    clock = [0.0]
    monkeypatch.setattr(drafters_module.time, "perf_counter", lambda: clock[0])
    draft = models["draft"]
    context = prompts(draft.config.vocab_size)[0]
    rows = DraftModel(draft).start(1, 96)
    rows.batch = Clocked(rows.batch, clock, feed=0.05, step=0.01)
    greedy = SequenceState(SamplingParams(), None, 60)
    tokens = rows.propose([0], [context], [3], [greedy])[0].tokens
    assert (rows.feed_seconds, rows.step_seconds) == pytest.approx((0.05, 0.01))
    rows.batch.feed, rows.batch.step_time = 1.0, 0.5  # one slow round
    tokens = rows.propose([0], [context + tokens], [2], [greedy])[0].tokens
    rows.batch.feed, rows.batch.step_time = 0.05, 0.01
    rows.propose([0], [context + tokens], [3], [greedy])
    assert (rows.feed_seconds, rows.step_seconds) == pytest.approx((0.05, 0.01))


SHARED_POOL_SCRIPT = """
import os, sys
import numpy as np
from tfport.runtime import load_model
from tfport.runtime.decoding import Speculation
from tfport.runtime.threads import share_pool

def threads():
    return len(os.listdir("/proc/self/task"))

target_dir, draft_dir, plain_file = sys.argv[1:]
own = load_model(draft_dir, intra_op_threads=2)  # a pool of its own, made before the shared one
target = load_model(target_dir, intra_op_threads=2, shared_threads=True)
before = threads()
draft = load_model(draft_dir, intra_op_threads=2, shared_threads=True)
later = load_model(draft_dir, intra_op_threads=2)  # after: on the shared pool too
os.environ["TFPORT_THREADS"] = "1"
unpinned = load_model(draft_dir)  # no thread count asked for: joins the pool as it is
assert threads() == before, (before, threads())
rows = [[int(t) for t in row.split()] for row in open(plain_file).read().split(",")[1:]]
plain = np.array([[int(t) for t in row.split()] for row in open(plain_file).read().split(",")[0].split(";")])
for drafter in (draft, own, later):
    out = target.generate(rows, max_new_tokens=12, stop_token_ids=(), speculative=Speculation(drafter, 3))
    assert np.array_equal(out, plain), (out, plain)
for call in (lambda: share_pool(3), lambda: load_model(draft_dir, intra_op_threads=1)):
    try:
        call()
    except ValueError as err:
        assert "shared pool of 2 threads" in str(err), err
    else:
        raise AssertionError("another pool size was accepted")
print("ok")
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_target_and_its_draft_share_one_thread_pool(models, tmp_path):
    """``shared_threads``: a target and its draft run on ONNX Runtime's process-wide pool (a
    second shared model starts no thread), decode the tokens the target decodes alone, and a
    session asking for another thread count afterwards is refused (one that asked for none joins
    it). In a child process: the
    pool is process-wide and every later session must run on it."""
    target, draft = models[("ort", "tiny-decoder")], models["draft"]
    rows = prompts(target.config.vocab_size)
    plain = target.generate(rows, max_new_tokens=12, stop_token_ids=())
    data = tmp_path / "rows.txt"
    data.write_text(";".join(" ".join(map(str, row)) for row in plain.tolist()) + ","
                    + ",".join(" ".join(map(str, row)) for row in rows))
    result = subprocess.run([sys.executable, "-c", SHARED_POOL_SCRIPT, str(target.directory),
                             str(draft.directory), str(data)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    with pytest.raises(ValueError, match="shared_threads='yes'"):
        load_model(draft.directory, shared_threads="yes")


def test_a_draft_model_starts_new_rows_from_its_own_prefix_cache(models, tmp_path):
    """The draft model's ``prefix_cache`` serves its rows: a second request resending the first
    one's prompt and reply (a chat's next turn) is not prefilled again by the draft, and both get
    the target's solo greedy tokens."""
    from tfport.runtime.decoding.prefix import PrefixCache

    target = models[("ort", "tiny-decoder")]
    draft = _export(tmp_path, "draft-ort", "tiny-decoder", "ort", seed=9)
    draft.prefix_cache = PrefixCache(2**24, block_size=4)
    first = prompts(target.config.vocab_size)[0]
    reply = target.generate([first], max_new_tokens=10, stop_token_ids=())[0].tolist()
    second = first + reply + [7, 8, 9]
    for prompt in (first, second):
        solo = target.generate([prompt], max_new_tokens=10, stop_token_ids=())
        np.testing.assert_array_equal(target.generate([prompt], max_new_tokens=10, stop_token_ids=(),
                                                      speculative=Speculation(draft, 3, adaptive=False)), solo)
    cache = draft.prefix_cache
    assert cache.hit_tokens >= len(first) - 4 and len(cache) > 0, (cache.hit_tokens, cache.miss_tokens)
