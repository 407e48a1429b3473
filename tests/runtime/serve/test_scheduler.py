"""Continuous batching (runtime/serve/scheduler.py over runtime/decoding/rows.py): rows join and
leave at step boundaries, and each request gets exactly its solo result."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tfport.runtime import load_model
from tfport.runtime.decoding import DECODINGS
from tfport.runtime.sampling import SamplingParams
from tfport.runtime.serve.handles import NullObserver
from tfport.runtime.serve.scheduler import (Failed, Finished, GenerationRequest, QueueFull,
                                            Scheduler, SchedulerLimits, Token)

LAYOUT_EXPORTS = {"inplace": "dec-ort", "concat": "dec-portable"}


@pytest.fixture(scope="module", params=sorted(DECODINGS))
def model(request, serve_exports):
    loaded = load_model(serve_exports[LAYOUT_EXPORTS[request.param]], intra_op_threads=1)
    assert loaded.manifest.layout == request.param
    return loaded


@pytest.fixture
def scheduler(model):
    scheduler = Scheduler(model, SchedulerLimits(max_rows=4, max_queue=64)).start()
    yield scheduler
    scheduler.stop()


def prompts(count: int, seed: int = 0, vocab: int = 96) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=int(rng.integers(1, 12))).tolist() for _ in range(count)]


def solo(model, prompt, max_tokens, **kwargs) -> list[int]:
    return model.generate([prompt], max_new_tokens=max_tokens, **kwargs)[0].tolist()


def test_row_batch_greedy_equals_solo_as_rows_come_and_go(model):
    """The RowBatch alone: rows admitted when others are mid-way, removed when done."""
    cases = [(p, 3 + i % 7) for i, p in enumerate(prompts(9, seed=1))]
    batch = model.decoding.rows(model.runners["decoder"], 3, 64)
    out, live, waiting = {}, {}, list(range(len(cases)))
    while waiting or live:
        while waiting and len(batch.rows) < batch.capacity:
            i = waiting.pop(0)
            row, logits = batch.add(np.array(cases[i][0]))
            out[i], live[i] = [int(logits.argmax())], row
        for i in [i for i in live if len(out[i]) == cases[i][1]]:
            batch.remove(live.pop(i))
        order = sorted(live, key=lambda i: live[i].index)
        assert [live[i] for i in order] == batch.rows
        if order:
            logits = batch.step(np.array([out[i][-1] for i in order]))
            for b, i in enumerate(order):
                out[i].append(int(logits[b].argmax()))
    for i, (prompt, n) in enumerate(cases):
        assert out[i] == solo(model, prompt, n, stop_token_ids=()), i


def test_concurrent_greedy_requests_equal_their_solo_results(model, scheduler):
    """20 requests of different lengths through 4 rows: every one answered once, with exactly
    its solo tokens, while the others join and leave the batch around it."""
    cases = [(p, 2 + (i * 5) % 13) for i, p in enumerate(prompts(20))]
    handles = scheduler.submit([GenerationRequest(p, n) for p, n in cases])
    for (prompt, n), handle in zip(cases, handles):
        events = list(handle)
        tokens = [e.id for e in events if isinstance(e, Token)]
        assert sum(not isinstance(e, Token) for e in events) == 1
        assert tokens == solo(model, prompt, n, stop_token_ids=()), prompt
        assert events[-1] == Finished("length")
    assert scheduler.running == 0 and scheduler.waiting == 0


def test_stop_id_ends_the_row(model, scheduler):
    prompt = prompts(1, seed=3)[0]
    full = solo(model, prompt, 12, stop_token_ids=())
    stop = full[4]
    tokens, reason = scheduler.submit(GenerationRequest(prompt, 12, stop_ids=(stop,))).result()
    assert reason == "stop" and tokens == full[:full.index(stop) + 1]


def test_sampled_rows_are_reproducible_and_leave_greedy_rows_alone(model, scheduler):
    """A seeded sampled row draws what Model.generate draws with that seed (its own generator),
    and greedy neighbours still get their solo tokens."""
    params = SamplingParams(temperature=1.5, top_k=20, top_p=0.9)
    cases = prompts(6, seed=4)
    requests = [GenerationRequest(p, 10, params, seed=i) if i % 2 else GenerationRequest(p, 10)
                for i, p in enumerate(cases)]
    for i, handle in enumerate(scheduler.submit(requests)):
        expected = solo(model, cases[i], 10, stop_token_ids=(),
                        **({"temperature": 1.5, "top_k": 20, "top_p": 0.9, "seed": i} if i % 2 else {}))
        assert handle.result() == (expected, "length")


def test_cancel_and_timeout_free_the_row(model, monkeypatch):
    scheduler = Scheduler(model, SchedulerLimits(max_rows=1, max_queue=4))
    # decode steps wait until the request is cancelled, so it cannot finish first on a busy machine
    cancelled, step = threading.Event(), scheduler.batch.step
    monkeypatch.setattr(scheduler.batch, "step", lambda tokens: cancelled.wait(30) and step(tokens))
    scheduler.start()
    try:
        long = scheduler.submit(GenerationRequest([5, 6], 60))
        first = next(iter(long))
        assert isinstance(first, Token)
        long.cancel()
        cancelled.set()
        assert list(long)[-1] == Finished("cancelled")
        slow = scheduler.submit(GenerationRequest([5, 6], 60, timeout=1e-4))
        assert list(slow)[-1] == Finished("timeout")
        assert scheduler.submit(GenerationRequest([5, 6], 3)).result()[1] == "length"
        assert scheduler.running == 0
    finally:
        scheduler.stop()


def test_queue_bound_and_request_checks(model):
    scheduler = Scheduler(model, SchedulerLimits(max_rows=1, max_queue=2))  # not started: all wait
    scheduler.submit([GenerationRequest([5], 2), GenerationRequest([6], 2)])
    with pytest.raises(QueueFull, match="max_queue=2"):
        scheduler.submit(GenerationRequest([7], 2))
    with pytest.raises(ValueError, match="lower max_new_tokens to at most 61"):
        scheduler.check(GenerationRequest([5] * 4, 62))  # max_positions 64
    with pytest.raises(ValueError, match=r"outside \[0, 96\)"):
        scheduler.check(GenerationRequest([500], 2))
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        scheduler.check(GenerationRequest([5], 0))
    scheduler.stop()


def test_a_failing_request_fails_alone(model, scheduler, monkeypatch):
    """An exception in one prompt's prefill fails that request; one in a decode step fails the
    rows of that step; the scheduler serves the next requests either way."""
    add = scheduler.batch.add

    def failing_add(prompt):
        if prompt[0] == 77:
            raise RuntimeError("boom in prefill")
        return add(prompt)

    monkeypatch.setattr(scheduler.batch, "add", failing_add)
    good, bad = scheduler.submit([GenerationRequest([5, 6], 4), GenerationRequest([77, 6], 4)])
    with pytest.raises(RuntimeError, match="boom in prefill"):
        bad.result()
    assert good.result()[1] == "length"

    def failing_step(tokens):
        raise RuntimeError("boom in step")

    monkeypatch.setattr(scheduler.batch, "step", failing_step)
    events = list(scheduler.submit(GenerationRequest([5, 6], 4)))
    assert isinstance(events[-1], Failed) and "boom in step" in str(events[-1].error)
    # a fresh batch replaced the failed one: the next request is served normally
    prompt = prompts(1, seed=9)[0]
    assert scheduler.submit(GenerationRequest(prompt, 5)).result() == \
        (solo(model, prompt, 5, stop_token_ids=()), "length")
    deadline = time.monotonic() + 5
    while scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running == 0


def test_nan_logits_fail_their_row_only(model, scheduler, monkeypatch):
    """A greedy row whose step logits are NaN ends with Failed (argmax would have picked the first
    NaN as a token); the row beside it still gets its solo tokens."""
    step, calls = scheduler.batch.step, []

    def nan_in_row_0(tokens):
        logits = step(tokens)
        calls.append(len(tokens))
        if len(calls) == 2:
            logits[0] = np.nan
        return logits

    monkeypatch.setattr(scheduler.batch, "step", nan_in_row_0)
    first, second = prompts(2, seed=11)
    hit, other = scheduler.submit([GenerationRequest(first, 6), GenerationRequest(second, 6)])
    events = list(hit)
    assert calls[:2] == [2, 2]  # both rows were in the batch when row 0 got NaN
    assert [type(e) for e in events] == [Token, Token, Failed] and "NaN" in str(events[-1].error)
    assert [e.id for e in events[:2]] == solo(model, first, 2, stop_token_ids=())
    assert other.result() == (solo(model, second, 6, stop_token_ids=()), "length")


def test_the_exports_forced_tokens_are_forced_as_generate_forces_them(model, scheduler, monkeypatch):
    """generation_config's forced_eos_token_id (the last step) and forced_bos_token_id (step 0 of
    a one-token prompt): served tokens equal Model.generate's, which differ from unforced ones."""
    from tfport.generation import GenerationDefaults

    monkeypatch.setattr(model, "generation", GenerationDefaults(forced_bos_token_id=9, forced_eos_token_ids=(7, 8)))
    cases = [([5], 5), (prompts(1, seed=12)[0], 4)]
    results = [h.result() for h in scheduler.submit([GenerationRequest(p, n) for p, n in cases])]
    for (prompt, n), (tokens, reason) in zip(cases, results):
        assert reason == "length" and tokens == solo(model, prompt, n, stop_token_ids=())
        assert tokens[-1] in (7, 8)
    assert results[0][0][0] == 9
    assert solo(model, [5], 5, stop_token_ids=(), forced_bos_token_id=(), forced_eos_token_id=()) != results[0][0]


def test_stop_cancels_and_forgets_waiting_and_running_requests(model):
    """After stop, every request got Finished('cancelled') and the counts read 0 (they kept the
    cancelled handles before)."""
    endings: list[str] = []

    class Endings(NullObserver):
        def finished(self, reason, seconds):
            endings.append(reason)

    scheduler = Scheduler(model, SchedulerLimits(max_rows=2, max_queue=16), observer=Endings())  # never started
    handles = scheduler.submit([GenerationRequest(p, 8) for p in prompts(5, seed=4)])
    assert scheduler.waiting == 5
    scheduler.stop()
    assert (scheduler.waiting, scheduler.running) == (0, 0)
    assert all(h.result() == ([], "cancelled") for h in handles)
    assert endings == ["cancelled"] * 5  # tfport_sequences_finished counts them (it missed them before)
