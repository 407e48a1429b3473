"""The OpenAI-compatible server (runtime/serve/app.py) through the official ``openai`` client,
against a server on 127.0.0.1: completions, chat, embeddings, streaming, errors, limits."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="needs the 'dev' extra's openai client")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from tfport.runtime import load_model  # noqa: E402

from .conftest import running_server  # noqa: E402


def solo_ids(directory, prompt: list[int], max_tokens: int, stops=()) -> list[int]:
    model = load_model(directory, intra_op_threads=1)
    tokens = model.generate([prompt], max_new_tokens=max_tokens, stop_token_ids=stops)[0].tolist()
    return [t for t in tokens[:next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]]


def words(ids) -> str:
    """The word-level tokenizer's text of ``ids`` (ids 0-3 are special: not shown)."""
    return " ".join(f"w{i}" for i in ids if i >= 4)


def test_models_health_and_metrics(server, client):
    url, _ = server
    assert sorted(m.id for m in client.models.list().data) == ["dec-ort", "dec-portable", "enc"]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["models"]["dec-ort"]["alive"]
    client.completions.create(model="dec-ort", prompt="w5 w6", max_tokens=3, temperature=0)
    text = httpx.get(url + "/metrics").text
    for name in ("tfport_requests_total", "tfport_queue_depth", "tfport_tokens_per_second",
                 "tfport_time_to_first_token_seconds_bucket", "tfport_generated_tokens_total"):
        assert name in text, name
    assert 'tfport_requests_total{endpoint="/v1/completions",status="200"}' in text


@pytest.mark.parametrize("name", ["dec-ort", "dec-portable"])
def test_completion_text_and_ids_equal_solo(server, client, serve_exports, name):
    prompt = [1, 17, 33, 8, 40]  # "[BOS] w17 ..." as the tokenizer writes "w17 w33 w8 w40"
    expected = solo_ids(serve_exports[name], prompt, 12, stops=(2,))
    out = client.completions.create(model=name, prompt=words(prompt[1:]), max_tokens=12,
                                    temperature=0)
    choice = out.choices[0]
    assert choice.token_ids == expected
    assert choice.text == words(expected)
    assert choice.finish_reason == ("stop" if len(expected) < 12 else "length")
    stopped = choice.finish_reason == "stop"  # the end-of-text generated counts (not in token_ids)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == len(expected) + stopped
    by_ids = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
    assert by_ids.choices[0].token_ids == expected


def test_sixteen_concurrent_greedy_requests_equal_their_solo_outputs(server, serve_exports):
    """16 clients at once on 16 rows: each answer is its solo output, every request answered
    exactly once, and the decode steps really were shared."""
    url, state = server
    rng = np.random.default_rng(0)
    prompts = [[1, *rng.integers(4, 96, size=int(rng.integers(2, 10))).tolist()] for _ in range(16)]
    lengths = [8 + i % 9 for i in range(16)]
    expected = [solo_ids(serve_exports["dec-ort"], p, n) for p, n in zip(prompts, lengths)]
    sample = state.metrics.registry.get_sample_value
    labels = {"model": "dec-ort"}
    steps_before = sample("tfport_decode_batch_rows_count", labels) or 0
    rows_before = sample("tfport_decode_batch_rows_sum", labels) or 0

    start = threading.Barrier(16)

    def ask(i):
        with httpx.Client(timeout=60) as http:
            start.wait()  # all 16 at once
            response = http.post(url + "/v1/completions", json={
                "model": "dec-ort", "prompt": prompts[i], "max_tokens": lengths[i],
                "temperature": 0, "ignore_eos": True})
            return i, response

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert sorted(i for i, _ in answers) == list(range(16))
    for i, response in answers:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected[i], i
    steps = sample("tfport_decode_batch_rows_count", labels) - steps_before
    rows = sample("tfport_decode_batch_rows_sum", labels) - rows_before
    assert rows == sum(lengths) - 16  # every token after a request's first is one row of a step
    assert steps < rows  # ... and rows shared steps (how many depends on arrival times)


def test_stream_completion_pieces_add_up(server, client, serve_exports):
    prompt = [1, 9, 21, 44]
    expected = solo_ids(serve_exports["dec-ort"], prompt, 10)
    chunks = list(client.completions.create(model="dec-ort", prompt=prompt, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [i for c in chunks if c.choices for i in c.choices[0].token_ids]
    assert ids == expected and text == words(expected)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_n_and_seed_sampling(server, client):
    kwargs = dict(model="dec-portable", prompt="w5 w9", max_tokens=8, temperature=1.0, top_p=0.9,
                  n=3, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    assert len({tuple(c.token_ids) for c in first.choices}) > 1  # each choice its own seed
    assert [c.index for c in first.choices] == [0, 1, 2]


def test_stop_string_cuts_the_text(server, client, serve_exports):
    prompt = [1, 9, 21, 44]
    expected = solo_ids(serve_exports["dec-ort"], prompt, 12, stops=())
    stop = f"w{expected[3]}"
    cut = words(expected).split(stop)[0]
    for stream in (False, True):
        out = client.completions.create(model="dec-ort", prompt=prompt, max_tokens=12,
                                        temperature=0, stop=[stop], stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")


def test_chat_uses_the_template(server, client, serve_exports):
    from tfport.runtime.chat import chat_format

    model = load_model(serve_exports["dec-ort"], intra_op_threads=1)
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    fmt = chat_format(model)
    prompt = fmt.prompt_ids(messages)
    tokens = model.generate([prompt], max_new_tokens=10, stop_token_ids=fmt.stop_ids)[0].tolist()
    expected = tokens[:next((i for i, t in enumerate(tokens) if t in fmt.stop_ids), len(tokens))]
    out = client.chat.completions.create(model="dec-ort", messages=messages, max_tokens=10,
                                         temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == words(expected)
    assert out.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model="dec-ort", messages=messages,
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == words(expected)


def test_embeddings_equal_the_runtime(server, client, serve_exports):
    """What ``tfport embed`` gives: the export's own pooling and normalisation (this one has no
    embedding.json: mean pooling, not normalised); test_embeddings.py checks sentence-transformers
    pipelines against SentenceTransformer.encode."""
    model = load_model(serve_exports["enc"], intra_op_threads=1)
    texts = ["w5 w6 w7", "w9"]
    expected = model.embed_text(texts)
    out = client.embeddings.create(model="enc", input=texts)
    assert [d.index for d in out.data] == [0, 1]
    np.testing.assert_allclose(np.array([d.embedding for d in out.data]), expected, atol=1e-6)
    packed = client.embeddings.create(model="enc", input=texts, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in packed.data]
    np.testing.assert_allclose(np.array(decoded), expected, atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"model": "dec-ort", "prompt": "w5", "max_tokens": 0}, "max_tokens"),
    ({"model": "dec-ort", "prompt": "w5", "temperature": -1}, "temperature"),
    ({"model": "dec-ort", "prompt": "w5", "temperature": 2.5}, "temperature"),  # OpenAI's 0-2
    ({"model": "dec-ort", "prompt": "w5", "max_tokens": 70}, "max_tokens"),  # context 64
    ({"model": "dec-ort", "prompt": [500]}, "prompt"),
    ({"model": "dec-ort", "prompt": "w5", "logprobs": 6}, "logprobs"),  # OpenAI's 0-5
    ({"model": "dec-ort"}, "prompt"),
    ({"model": "enc", "prompt": "w5"}, "model"),
    ({"model": "dec-ort", "prompt": [1] * 70}, "prompt"),  # longer than the context of 64
    ({"model": "dec-ort", "prompt": [True, False]}, "prompt[0]"),  # booleans are not token ids
    ({"model": "dec-ort", "prompt": "w5", "max_tokens": True}, "max_tokens"),
    ({"model": "dec-ort", "prompt": "w5", "stop_token_ids": [2.0]}, "stop_token_ids[0]"),
    ({"model": "dec-ort", "prompt": "w5", "top_logprobs": 21}, "top_logprobs"),  # 0-20
    ({"model": "dec-ort", "prompt": "w5", "response_format": {"type": "json_object"}}, "response_format"),
    ({"model": "dec-ort", "prompt": [[5]] * 5, "n": 16}, "n"),  # 80 sequences, queue of 64
])
def test_bad_parameters_get_400_with_an_openai_error(server, body, param):
    response = httpx.post(server[0] + "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"]


def test_a_refused_request_queues_nothing(server):
    """stop is checked before the rows are queued: a 400 leaves no row generating."""
    url, state = server
    scheduler = state.models["dec-ort"].scheduler
    response = httpx.post(url + "/v1/completions", json={"model": "dec-ort", "prompt": [1, 5], "n": 8,
                                                        "max_tokens": 40, "ignore_eos": True, "stop": [""]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
    assert scheduler.waiting == 0 and scheduler.running == 0


def test_an_infinite_temperature_names_the_field(server):
    response = httpx.post(server[0] + "/v1/completions", headers={"content-type": "application/json"},
                          content=b'{"model": "dec-ort", "prompt": "w5", "temperature": Infinity}')
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature", response.text


def test_chat_refuses_roles_and_functions_it_would_ignore(server):
    for body, param in (({"messages": [{"role": "bogus", "content": "w5"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": "w5"}], "functions": [{"name": "f"}]},
                         "functions")):
        response = httpx.post(server[0] + "/v1/chat/completions", json={"model": "dec-ort", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_malformed_json_and_unknown_model(server, client):
    response = httpx.post(server[0] + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="dec-ort", input="w5")
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.completions.create(model="nope", prompt="w5")
    assert httpx.get(server[0] + "/health").status_code == 200  # the server carries on


def test_queue_full_is_429_and_timeout_is_504(serve_exports):
    with running_server([serve_exports["dec-ort"]], idle=True, max_queue=1) as (url, state):
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
        scheduler = state.models["dec-ort"].scheduler
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # fills the queue of 1
            waiting = pool.submit(httpx.post, url + "/v1/completions", timeout=30,
                                  json={"model": "dec-ort", "prompt": [1, 6], "max_tokens": 2})
            deadline = time.monotonic() + 10
            while scheduler.waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(model="dec-ort", prompt=[1, 7], max_tokens=2)
            assert err.value.status_code == 429 and "max_queue=1" in err.value.message
            scheduler.stop()  # cancels the waiting request: answered, not lost
            assert waiting.result(timeout=30).status_code == 503
    with running_server([serve_exports["dec-ort"]], max_rows=1, timeout=1e-3) as (url, _):
        response = httpx.post(url + "/v1/completions", json={
            "model": "dec-ort", "prompt": [1, 5], "max_tokens": 60, "ignore_eos": True})
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"


def test_disconnect_mid_stream_frees_the_row(server):
    url, state = server
    scheduler = state.models["dec-portable"].scheduler
    body = {"model": "dec-portable", "prompt": [1, 5], "max_tokens": 60, "ignore_eos": True,
            "stream": True}
    finished = state.metrics.finished.labels("dec-portable", "cancelled")
    before = finished._value.get()
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    json.loads(line[5:])
                    break
    deadline = time.monotonic() + 10
    while (scheduler.running or finished._value.get() == before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running == 0 and finished._value.get() == before + 1


def test_sampling_defaults_come_from_the_exports_generation_config(server, serve_exports, monkeypatch):
    """An export whose generation_config.json samples: fields the request leaves out take its
    values, as Model.generate does, so a seeded request draws generate's tokens."""
    from tfport.generation import GenerationDefaults

    url, state = server
    defaults = GenerationDefaults(do_sample=True, temperature=0.6, top_k=5, top_p=0.9)
    monkeypatch.setattr(state.models["dec-portable"].model, "generation", defaults)
    prompt = [1, 17, 33, 8, 40]
    response = httpx.post(url + "/v1/completions", json={
        "model": "dec-portable", "prompt": prompt, "max_tokens": 8, "seed": 1, "temperature": 0.7,
        "ignore_eos": True})
    model = load_model(serve_exports["dec-portable"], intra_op_threads=1)
    model.generation = defaults
    expected = model.generate([prompt], max_new_tokens=8, temperature=0.7, seed=1, stop_token_ids=())[0].tolist()
    assert response.json()["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize("do_sample", [None, False, True],
                         ids=["no-generation-config", "do-sample-false", "do-sample-true"])
def test_omitted_sampling_fields_follow_the_export_else_openai(server, serve_exports, monkeypatch, do_sample):
    """A request that leaves temperature, top_k and top_p out samples with the export's
    generation_config.json where it samples (as ``Model.generate`` does), else with the OpenAI
    API's default temperature 1 (where ``Model.generate`` is greedy)."""
    from tfport.generation import GenerationDefaults

    url, state = server
    defaults = None if do_sample is None else GenerationDefaults(do_sample=do_sample, temperature=0.9, top_k=7)
    monkeypatch.setattr(state.models["dec-portable"].model, "generation", defaults)
    prompt = [1, 17, 33, 8, 40]
    response = httpx.post(url + "/v1/completions", json={
        "model": "dec-portable", "prompt": prompt, "max_tokens": 8, "seed": 3, "ignore_eos": True})
    model = load_model(serve_exports["dec-portable"], intra_op_threads=1)
    sampling = {"temperature": 0.9, "top_k": 7, "top_p": 1.0} if do_sample else \
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    expected = model.generate([prompt], max_new_tokens=8, seed=3, stop_token_ids=(), **sampling)[0].tolist()
    assert response.json()["choices"][0]["token_ids"] == expected
