"""The server's request limits (body bytes, embedding inputs, chat messages), each a ``tfport
serve`` option answered with an OpenAI-shaped error naming it, and big requests tokenised off the
event loop, against servers on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.timing  # latency bounds: make test runs these alone, after the rest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from .conftest import running_server  # noqa: E402

MiB = 1 << 20


def raw_response(url: str, request: bytes, timeout: float = 10) -> tuple[int, bytes]:
    """Send ``request`` bytes to the server at ``url`` on a plain socket -> (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 62


def test_a_declared_body_over_the_limit_is_refused_before_it_is_sent(server):
    """Content-Length 5 MiB, no body sent: the default limit (4 MiB) answers 413 at once."""
    status, body = raw_response(server[0], b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                                           b"content-type: application/json\r\n"
                                           b"content-length: %d\r\n\r\n" % (5 * MiB))
    assert status == 413, body
    assert b"--max-body-bytes" in body and b"4,194,304" in body


def test_a_chunked_body_over_the_limit_is_refused_before_it_is_parsed(serve_exports):
    with running_server([serve_exports["enc"]], max_body_bytes=4096) as (url, _):
        def chunks():  # not JSON at all: a parser would say 400
            for _ in range(8):
                yield b"x" * 1024

        response = httpx.post(url + "/v1/embeddings", content=chunks(), timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert "--max-body-bytes" in error["message"] and "4,096" in error["message"], error
        small = httpx.post(url + "/v1/embeddings", json={"model": "enc", "input": "w5"}, timeout=30)
        assert small.status_code == 200, small.text
        assert httpx.get(url + "/health").status_code == 200


def test_embedding_inputs_per_request_are_limited(server):
    response = httpx.post(server[0] + "/v1/embeddings", timeout=60,
                          json={"model": "enc", "input": ["w5"] * 2049})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "input" and "--max-embedding-inputs" in error["message"], error


def test_messages_per_chat_are_limited(server):
    messages = [{"role": "user", "content": "w5"}] * 2049
    response = httpx.post(server[0] + "/v1/chat/completions", timeout=60,
                          json={"model": "dec-ort", "messages": messages})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "messages" and "--max-messages" in error["message"], error


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "dec-ort", "prompt": "w5 " * 400_000, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "dec-ort", "messages": [{"role": "user", "content": "w5 " * 400_000}]}),
], ids=["completion", "chat"])
def test_health_answers_while_a_big_request_is_tokenised(server, monkeypatch, path, body):
    """A 1.2 MB prompt whose tokenisation is held until /health has answered: /health must not
    wait for it (on the event loop it would, for the 5 s the tokenizer is held)."""
    url, state = server
    served = state.models["dec-ort"]  # a prompt over --max-prompt-chars is never tokenised
    monkeypatch.setattr(served, "options", dataclasses.replace(served.options, max_prompt_chars=10**7))
    tokenizer = served.model.tokenizer
    encode = tokenizer.encode
    started, release = threading.Event(), threading.Event()

    def held_encode(text, *args, **kwargs):
        if len(text) > 100_000:
            started.set()
            release.wait(5)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, url + path, json=body, timeout=60)
        assert started.wait(30), "the big request was never tokenised"
        start = time.monotonic()
        health = httpx.get(url + "/health", timeout=30)
        elapsed = time.monotonic() - start
        release.set()
        assert health.status_code == 200 and elapsed < 1.0, elapsed
        response = big.result(timeout=60)
    assert response.status_code == 400, response.text[:300]  # longer than the context of 64


def test_serve_options_come_from_the_command_line():
    from tfport.cli import build_parser
    from tfport.runtime.serve.cli import serve_options

    args = build_parser("serve").parse_args(["serve", "out/dec", "--max-body-bytes", "1000",
                                             "--max-embedding-inputs", "7", "--max-messages", "9"])
    options = serve_options(args)
    assert (options.max_body_bytes, options.max_inputs, options.max_messages) == (1000, 7, 9)
    defaults = serve_options(build_parser("serve").parse_args(["serve", "out/dec"]))
    assert (defaults.max_body_bytes, defaults.max_inputs, defaults.max_messages) == (4 * MiB, 2048, 2048)


def test_health_answers_while_the_tokenizer_works(server, monkeypatch):
    """The same with nothing held: a 2.4 MB prompt takes the tokenizer seconds, during which it
    must let go of the GIL (``tokenizers``' encode does not; its encode_batch does)."""
    url, state = server
    served = state.models["dec-ort"]  # a prompt over --max-prompt-chars is never tokenised
    monkeypatch.setattr(served, "options", dataclasses.replace(served.options, max_prompt_chars=10**7))
    tokenizer = served.model.tokenizer
    encode = tokenizer.encode
    working = threading.Event()

    def watched_encode(text, *args, **kwargs):
        working.set()
        try:
            return encode(text, *args, **kwargs)
        finally:
            working.clear()

    monkeypatch.setattr(tokenizer, "encode", watched_encode)
    body = {"model": "dec-ort", "prompt": "w5 " * 800_000, "max_tokens": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
        assert working.wait(30), "the big request was never tokenised"
        during = []
        while working.is_set() and len(during) < 1000:
            start = time.monotonic()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            if working.is_set():
                during.append(time.monotonic() - start)
        response = big.result(timeout=120)
    assert response.status_code == 400, response.text[:300]  # longer than the context of 64
    assert during and max(during) < 1.0, during
