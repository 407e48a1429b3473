"""Property-based requests against a live server on 127.0.0.1: bodies of every endpoint with fields
of any JSON type (lone surrogates, huge integers, NaN, nesting) never get a 5xx, every refusal is
OpenAI's error shape and short, and the server is idle and healthy after each one."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")
hypothesis = pytest.importorskip("hypothesis", reason="needs the 'dev' extra (hypothesis)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TEXT = st.one_of(st.sampled_from(["w5", "w5 w6 w7", "", "\ud800", "w4\udfff", "[BOS]", "\x00", "é🙂"]),
                 st.text(max_size=40))
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 200), st.sampled_from([10 ** 30, -(10 ** 30)]),
                   st.floats(allow_nan=True, allow_infinity=True), TEXT)
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=3)),
                     max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), VALUE),
                                 "content": st.one_of(TEXT, VALUE)})

ENDPOINTS = {
    "/v1/completions": ("dec-ort", {
        "prompt": st.one_of(TEXT, st.lists(st.integers(0, 95), min_size=1, max_size=6), VALUE),
        "max_tokens": st.one_of(st.integers(1, 8), VALUE), "temperature": VALUE, "top_p": VALUE,
        "top_k": VALUE, "n": st.one_of(st.integers(1, 3), VALUE), "stream": st.booleans(),
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=5), VALUE), "seed": VALUE,
        "ignore_eos": VALUE, "stop_token_ids": VALUE, "logit_bias": VALUE, "response_format": VALUE,
        "best_of": VALUE, "echo": VALUE, "suffix": VALUE, "stream_options": VALUE, "user": VALUE}),
    "/v1/chat/completions": ("dec-portable", {
        "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), VALUE),
        "max_tokens": st.one_of(st.integers(1, 8), VALUE), "max_completion_tokens": VALUE,
        "stop": VALUE, "n": VALUE, "stream": st.booleans(), "temperature": VALUE, "tools": VALUE,
        "logprobs": VALUE}),
    "/v1/embeddings": ("enc", {
        "input": st.one_of(TEXT, st.lists(TEXT, max_size=3), VALUE),
        "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), VALUE),
        "dimensions": VALUE, "user": VALUE}),
}


@st.composite
def requests(draw):
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    model, fields = ENDPOINTS[path]
    names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=4))
    body = {"model": draw(st.one_of(st.just(model), VALUE))} if draw(st.integers(0, 9)) else {}
    body.update({name: draw(fields[name]) for name in names})
    if path != "/v1/embeddings":
        body.setdefault("max_tokens", 4)  # short rows: the run stays quick
    return path, body


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
def test_any_body_gets_an_answer_and_never_a_5xx(server, request):
    url, state = server
    path, body = request
    content = json.dumps(body, allow_nan=True).encode("ascii")  # surrogates travel as escapes
    response = httpx.post(url + path, content=content, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text[:500])
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert len(response.content) < 2_000, len(response.content)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n") and "internal_error" not in response.text
    else:
        assert "choices" in response.json() or "data" in response.json()
    deadline = time.monotonic() + 10  # every row of the request ends (a stop string: next step)
    while any(s.health().get("running", 0) or s.health().get("waiting", 0) for s in state.models.values()):
        assert time.monotonic() < deadline, {name: s.health() for name, s in state.models.items()}
        time.sleep(0.01)
