"""What a hostile or careless client sends (issue 27): text that is not Unicode, huge rejected
values, fields named as the client wrote them, and gauges that read 0 once every row has ended,
against servers on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")
parser = pytest.importorskip("prometheus_client.parser", reason="needs the 'serve' extra")

from .conftest import running_server  # noqa: E402

LONE = "\ud800"  # a lone surrogate: valid in JSON ("\ud800"), not encodable as UTF-8


def post_raw(url: str, body: dict) -> httpx.Response:
    """POST ``body`` as ASCII JSON (a lone surrogate travels as the escape ``\\ud800``, as a client
    in a language with UTF-16 strings may send it)."""
    return httpx.post(url, content=json.dumps(body).encode("ascii"), timeout=60,
                      headers={"content-type": "application/json"})


def assert_error(response: httpx.Response, status: int, param: str) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == param, error
    return error


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "dec-ort", "prompt": LONE}, "prompt"),
    ("/v1/completions", {"model": "dec-ort", "prompt": ["w5", "w6" + LONE]}, "prompt[1]"),
    ("/v1/completions", {"model": "dec-ort", "prompt": "w5", "stop": ["w6", LONE]}, "stop[1]"),
    ("/v1/embeddings", {"model": "enc", "input": LONE}, "input"),
    ("/v1/embeddings", {"model": "enc", "input": ["w5", LONE]}, "input[1]"),
    (CHAT, {"model": "dec-ort", "messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    (CHAT, {"model": "dec-ort", "messages": [{"role": "user", "content": "w5"},
                                             {"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[1].content[0].text"),
], ids=["prompt", "prompts", "stop", "input", "inputs", "chat", "chat-parts"])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    error = assert_error(post_raw(server[0] + path, body), 400, param)
    assert error["type"] == "invalid_request_error" and "surrogate" in error["message"], error
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"


MB = "w5" * 500_000  # 1 MB of a valid word-level text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "dec-ort", "prompt": "w5", "stop": [MB[:700_000]] * 5}, "stop"),
    ("/v1/completions", {"model": MB, "prompt": "w5"}, "model"),
    ("/v1/completions", {"model": "dec-ort", "prompt": "w5", "response_format": {"type": MB}},
     "response_format"),
    ("/v1/completions", {"model": "dec-ort", "prompt": "w5", "logit_bias": {MB: "x"}}, None),
    (CHAT, {"model": "dec-ort", "messages": [{"role": MB, "content": "w5"}]}, "messages[0].role"),
], ids=["stops", "model", "response-format", "dict-key", "role"])
def test_errors_quote_a_short_prefix_of_a_rejected_value(server, path, body, param):
    response = httpx.post(server[0] + path, json=body, timeout=60)
    assert 400 <= response.status_code < 500 and len(response.content) < 2_000, \
        (response.status_code, len(response.content))
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    else:  # the param names the field, the key shortened
        assert error["param"].startswith("logit_bias") and len(error["param"]) < 200, error
    assert "w5w5w5" in error["message"] or "w5w5w5" in error["param"], error  # a prefix is shown


@pytest.mark.parametrize("extra, param", [
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),  # over --max-tokens
    ({"max_completion_tokens": 60}, "max_completion_tokens"),  # past the context of 64
    ({"max_completion_tokens": True}, "max_completion_tokens"),  # not an integer
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "w5"}, {"role": "user", "content": {"a": 1}}]},
     "messages[1].content"),
], ids=["over-cap", "past-context", "bool", "content-int", "content-dict"])
def test_chat_errors_name_the_field_the_client_sent(server, extra, param):
    body = {"model": "dec-ort", "messages": [{"role": "user", "content": "w5 w6 w7 w8 w9"}], **extra}
    error = assert_error(httpx.post(server[0] + CHAT, json=body, timeout=60), 400, param)
    assert "max_tokens" not in error["message"], error


def test_an_overlong_chat_names_messages(server):
    body = {"model": "dec-ort", "messages": [{"role": "user", "content": "w5 " * 80}]}
    assert_error(httpx.post(server[0] + CHAT, json=body, timeout=60), 400, "messages")


# ------------------------------------------------------------------------------ gauges
def gauges(url: str, model: str) -> tuple[float, float]:
    """(running rows, queue depth) of ``model`` as /metrics reports them."""
    values = {}
    for family in parser.text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.labels.get("model") == model:
                values[sample.name] = sample.value
    return values["tfport_running_rows"], values["tfport_queue_depth"]


def assert_idle(url: str, model: str) -> None:
    """/health reaches 0 running, 0 waiting within 10 s, and /metrics then says the same."""
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(url + "/health").json()["models"][model]
        if health["running"] == 0 and health["waiting"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.02)
    assert gauges(url, model) == (0, 0)


def test_gauges_read_zero_after_every_kind_of_ending(serve_exports, monkeypatch, caplog):
    """Length, stop, a client that goes away, a timeout and a failed step each end with 0 running
    and 0 waiting on /health and /metrics; a 500 shows a request id, the log the exception."""
    name = "dec-portable"
    with running_server([serve_exports[name]], max_rows=4) as (url, state):
        served = state.models[name]
        finished = state.metrics.finished
        completions = url + "/v1/completions"
        base = {"model": name, "prompt": [1, 17, 33], "temperature": 0}

        length = httpx.post(completions, json={**base, "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert length.json()["choices"][0]["finish_reason"] == "length"
        assert_idle(url, name)

        stop_id = length.json()["choices"][0]["token_ids"][1]
        stop = httpx.post(completions, json={**base, "max_tokens": 4, "stop_token_ids": [stop_id]},
                          timeout=60)
        assert stop.json()["choices"][0]["finish_reason"] == "stop"
        assert_idle(url, name)

        cancelled = finished.labels(name, "cancelled")._value.get()
        step = served.scheduler.batch.step

        def slow_step(tokens):  # 60 steps take 3 s: live when we look, past a timeout of 0.2 s
            time.sleep(0.05)
            return step(tokens)

        monkeypatch.setattr(served.scheduler.batch, "step", slow_step)
        with httpx.Client(timeout=30) as http:
            body = {**base, "max_tokens": 60, "ignore_eos": True, "stream": True}
            with http.stream("POST", completions, json=body) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                assert gauges(url, name)[0] == 1  # live while the stream runs
                assert httpx.get(url + "/health").json()["models"][name]["running"] == 1
        deadline = time.monotonic() + 10
        while finished.labels(name, "cancelled")._value.get() == cancelled:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert_idle(url, name)

        monkeypatch.setattr(served, "options", dataclasses.replace(served.options, timeout=0.2))
        timeout = httpx.post(completions, json={**base, "max_tokens": 60, "ignore_eos": True},
                             timeout=60)
        assert timeout.status_code == 504, timeout.text
        assert_idle(url, name)
        monkeypatch.undo()

        def fail(tokens):
            raise RuntimeError("a decode step failed (test)")

        monkeypatch.setattr(served.scheduler.batch, "step", fail)  # the next batch is a fresh one
        error = httpx.post(completions, json={**base, "max_tokens": 8, "ignore_eos": True}, timeout=60)
        assert error.status_code == 500, error.text
        assert "RuntimeError" not in error.text and "test" not in error.text  # no exception text
        request_id = error.json()["error"]["message"].split("request id ")[1].split(")")[0]
        assert any(request_id in r.getMessage() and r.exc_info and "(test)" in str(r.exc_info[1])
                   for r in caplog.records), "the log has the exception under the request id"
        assert_idle(url, name)
        ok = httpx.post(completions, json={**base, "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert ok.json()["choices"][0]["token_ids"] == length.json()["choices"][0]["token_ids"]
        assert_idle(url, name)


def test_a_500_shows_a_request_id_and_logs_the_exception(server, monkeypatch, caplog):
    url, state = server

    def broken(inputs):
        raise RuntimeError("secret detail of a bug (test)")

    monkeypatch.setattr(state.models["enc"], "embedding_inputs", broken)
    response = httpx.post(url + "/v1/embeddings", json={"model": "enc", "input": "w5"}, timeout=60)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert "secret" not in response.text and "RuntimeError" not in response.text, error
    request_id = error["message"].split("request id ")[1].split(")")[0]
    assert any(request_id in r.getMessage() and "secret detail" in str(r.exc_info[1])
               for r in caplog.records if r.exc_info), "the log has the exception under the request id"
    assert httpx.get(url + "/health").status_code == 200
