"""Prefix caching in the server (``tfport serve --prefix-cache-mb``): continuous batching returns
the same greedy and seeded-sampled tokens with the cache on and off on both cache layouts, for
concurrent requests sharing a system prompt and for multi-turn conversations; ``/metrics``
counts the cache's hits, misses and evictions; ``--prefix-cache-mb 0`` turns it off. Chunked
prefill (``--prefill-chunk``): a long prompt is prefilled a chunk per step boundary while a
stream decodes a token at each, with the tokens of a whole prefill."""

from __future__ import annotations

import argparse
import concurrent.futures
import re

import httpx
import numpy as np
import pytest

from tests.runtime.serve.conftest import running_server
from tfport.runtime import load_model
from tfport.runtime.decoding.prefix import PrefixCache
from tfport.runtime.decoding.speculative import Speculation
from tfport.runtime.sampling import SamplingParams
from tfport.runtime.serve.scheduler import Finished, GenerationRequest, Scheduler, SchedulerLimits, Token

VOCAB = 96  # the serve exports' vocabulary


def _requests(round_: int, histories: list[list[int]], sampled: bool) -> list[GenerationRequest]:
    """One turn of every conversation: its history plus new tokens; odd conversations sampled."""
    rng = np.random.default_rng(round_)
    out = []
    for c, history in enumerate(histories):
        history += rng.integers(4, VOCAB, size=int(rng.integers(1, 6))).tolist()
        params = SamplingParams(temperature=1.2, top_k=30) if sampled and c % 2 else SamplingParams()
        out.append(GenerationRequest(prompt=list(history), max_new_tokens=5, params=params, seed=100 * round_ + c))
    return out


def _serve(model, prefix: PrefixCache | None, rounds: int = 3, conversations: int = 12,
           sampled: bool = True, speculation: Speculation | None = None) -> list[list[int]]:
    """Every conversation's turns, all conversations' turn submitted at once to 4 rows; each
    reply is appended to its history -> the replies, turn by turn."""
    system = np.random.default_rng(99).integers(4, VOCAB, size=10).tolist()  # shared by all
    histories = [list(system) for _ in range(conversations)]
    scheduler = Scheduler(model, SchedulerLimits(max_rows=4, max_queue=64), speculation=speculation,
                          prefix=prefix).start()
    replies = []
    try:
        for round_ in range(rounds):
            handles = scheduler.submit(_requests(round_, histories, sampled))
            for history, handle in zip(histories, handles):
                events = list(handle)
                assert isinstance(events[-1], Finished), events[-1]
                reply = [event.id for event in events if isinstance(event, Token)]
                replies.append(reply)
                history += reply
    finally:
        scheduler.stop()
    return replies


@pytest.mark.parametrize("name", ["dec-ort", "dec-portable"])
def test_the_cache_changes_no_token(serve_exports, name):
    model = load_model(serve_exports[name], intra_op_threads=1)
    expected = _serve(model, None)
    cache = PrefixCache(1 << 24, block_size=4)
    assert _serve(model, cache) == expected
    assert len({tuple(r) for r in expected}) > len(expected) // 2  # varied replies: not vacuous
    assert cache.hit_tokens > cache.miss_tokens  # the system prompt and earlier turns were reused
    small = PrefixCache(8 * 1024, block_size=4)  # a few blocks: evictions all along
    assert _serve(model, small) == expected
    assert small.evicted_tokens > 0 and small.bytes <= small.max_bytes


@pytest.mark.parametrize("name", ["dec-ort", "dec-portable"])
def test_speculation_with_the_cache_keeps_plain_greedy_tokens(serve_exports, name):
    """Rewound proposals must not reach the cache: a row's kept tokens are those it accepted."""
    model = load_model(serve_exports[name], intra_op_threads=1)
    expected = _serve(model, None, sampled=False)
    cache = PrefixCache(1 << 24, block_size=4)
    lookup = Speculation("lookup", draft_tokens=4, adaptive=False)
    assert _serve(model, cache, sampled=False, speculation=lookup) == expected
    assert cache.hit_tokens > cache.miss_tokens


def _metric(text: str, name: str, model: str) -> float:
    match = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_metrics_count_hits_and_misses_and_zero_turns_it_off(serve_exports):
    name = "dec-ort"
    prompt = np.random.default_rng(5).integers(4, VOCAB, size=40).tolist()  # one 32-token block
    body = {"model": name, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    answers = {}
    for megabytes in (16, 0):
        with running_server([serve_exports[name]], prefix_cache_mb=megabytes) as (url, _):
            for _ in range(2):
                response = httpx.post(url + "/v1/completions", json=body, timeout=60)
                assert response.status_code == 200, response.text
            answers[megabytes] = response.json()["choices"][0]["token_ids"]
            metrics = httpx.get(url + "/metrics").text
        if megabytes:
            # the first request misses its 40 tokens; the second reads the first 32 (one block)
            assert _metric(metrics, "tfport_prefix_cache_hits_total", name) == 32
            assert _metric(metrics, "tfport_prefix_cache_misses_total", name) == 40 + 8
            assert _metric(metrics, "tfport_prefix_cache_evicted_total", name) == 0
            assert _metric(metrics, "tfport_prefix_cache_bytes", name) > 0
        else:
            assert f'tfport_prefix_cache_hits_total{{model="{name}"}}' not in metrics
    assert answers[16] == answers[0]


def test_concurrent_clients_sharing_a_prompt_get_the_tokens_of_no_cache(serve_exports):
    """16 clients at once over HTTP, one 36-token system prompt and their own questions."""
    name = "dec-portable"
    rng = np.random.default_rng(11)
    system = rng.integers(4, VOCAB, size=36).tolist()
    prompts = [system + rng.integers(4, VOCAB, size=int(rng.integers(1, 8))).tolist() for _ in range(16)]

    def ask(url: str, prompt: list[int]) -> list[int]:
        response = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": name, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    answers = {}
    for megabytes in (0, 16):
        with running_server([serve_exports[name]], max_rows=6, prefix_cache_mb=megabytes) as (url, _):
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                answers[megabytes] = list(pool.map(lambda p: ask(url, p), prompts))
            metrics = httpx.get(url + "/metrics").text
    assert answers[16] == answers[0]
    assert _metric(metrics, "tfport_prefix_cache_hits_total", name) >= 32 * 10  # all but the first rows


def test_the_options_reach_the_scheduler():
    from tfport.runtime.serve.cli import add_model_options, serve_options

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    assert serve_options(parser.parse_args(["d", "--prefix-cache-mb", "0"])).prefix_cache_mb == 0
    assert serve_options(parser.parse_args(["d"])).prefix_cache_mb == 256
    assert serve_options(parser.parse_args(["d"])).limits.prefill_chunk == 256
    assert serve_options(parser.parse_args(["d", "--prefill-chunk", "0"])).limits.prefill_chunk is None
    assert serve_options(parser.parse_args(["d", "--prefill-chunk", "64"])).limits.prefill_chunk == 64
    with pytest.raises(ValueError, match="prefix_cache_mb=-1"):
        serve_options(parser.parse_args(["d", "--prefix-cache-mb", "-1"]))


# ------------------------------------------------------------------------------ chunked prefill
def _admit_long_prompt_while_streaming(model, chunk: int | None) -> tuple[list[int], list[int], list[int]]:
    """A stream runs; a 44-token prompt arrives. Step boundaries by hand -> (the stream's
    tokens, the long prompt's tokens, tokens the stream had at each boundary until the long
    prompt's first token)."""
    prefix = PrefixCache(1 << 24, block_size=4)
    scheduler = Scheduler(model, SchedulerLimits(max_rows=4, prefill_chunk=chunk), prefix=prefix)
    rng = np.random.default_rng(8)
    stream = scheduler.submit(GenerationRequest(prompt=rng.integers(4, VOCAB, size=5).tolist(), max_new_tokens=18))
    scheduler.run_once()
    long = scheduler.submit(GenerationRequest(prompt=rng.integers(4, VOCAB, size=44).tolist(), max_new_tokens=4))
    progress = []
    while not long.tokens:
        scheduler.run_once()
        progress.append(len(stream.tokens))
    while not (stream.done and long.done):
        scheduler.run_once()
    return stream.tokens, long.tokens, progress


@pytest.mark.parametrize("name", ["dec-ort", "dec-portable"])
def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(serve_exports, name):
    """Chunks of 8 tokens: the long prompt's first 40 tokens take 5 step boundaries (more than 8
    are left until then), its own prefill of the last 4 the 6th; the stream gets a token at
    every one of them; every token equals the unchunked run's."""
    model = load_model(serve_exports[name], intra_op_threads=1)
    whole = _admit_long_prompt_while_streaming(model, None)
    chunked = _admit_long_prompt_while_streaming(model, 8)
    assert chunked[:2] == whole[:2]
    # the stream has 2 tokens (its prefill's and one step's) when the long prompt arrives
    assert whole[2] == [3]  # unchunked: admitted at the next boundary
    assert chunked[2] == [3, 4, 5, 6, 7, 8]  # one stream token per boundary while the chunks run


def test_prefill_chunk_options_are_checked(serve_exports):
    model = load_model(serve_exports["dec-ort"], intra_op_threads=1)
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        SchedulerLimits(prefill_chunk=0)
    with pytest.raises(ValueError, match="prefill_chunk=16: expected at least the prefix cache's block of 32"):
        Scheduler(model, SchedulerLimits(prefill_chunk=16), prefix=PrefixCache(1 << 20))
