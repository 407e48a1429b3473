"""A bounded soak (issue 27): ~15 s of mixed traffic from 12 clients against the session's server
on 127.0.0.1 (completions, chats, streams read to the end, streams and waits abandoned midway,
embeddings, malformed JSON, bodies over the limit, clients that send their body slowly), while
a prober times /health. Then: every request got exactly one answer of the status its kind
expects (and the server counted each one once), /health answered throughout, the running and
waiting gauges are back to 0, and the process's memory stayed bounded."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.timing  # latency bounds: make test runs these alone, after the rest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from .test_hardening import assert_idle  # noqa: E402

SECONDS = float(os.environ.get("TFPORT_SOAK_SECONDS", "15"))
CLIENTS = 12
MiB = 1 << 20
DECODERS = ("dec-ort", "dec-portable")


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def raw_exchange(url: str, head: bytes, body_parts: list[bytes], pause: float) -> bytes:
    """Send ``head`` then each of ``body_parts`` ``pause`` seconds apart on one connection
    (``Connection: close``) and read until the server closes it -> everything it sent."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)
        for part in body_parts:
            time.sleep(pause)
            sock.sendall(part)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


def statuses(data: bytes) -> list[int]:
    """The status of each HTTP response in ``data`` (a pipelined or repeated answer shows twice)."""
    return [int(line.split()[1]) for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]


class Soak:
    """The request kinds, each a method returning the statuses its one request got (a stream's
    own checks raise ``AssertionError``)."""

    def __init__(self, url: str):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=60)

    def completion(self, i: int) -> list[int]:
        body = {"model": DECODERS[i % 2], "prompt": [1, 5 + i % 50, 9], "max_tokens": 1 + i % 24,
                "n": 1 + i % 3, "ignore_eos": True, "seed": i, "temperature": 0.7}
        response = self.http.post("/v1/completions", json=body)
        if response.status_code == 200:
            choices = response.json()["choices"]
            assert len(choices) == body["n"] and all(len(c["token_ids"]) == body["max_tokens"]
                                                     for c in choices), response.text[:300]
        return [response.status_code]

    def chat(self, i: int) -> list[int]:
        body = {"model": DECODERS[i % 2], "messages": [{"role": "user", "content": f"w{5 + i % 50} w7"}],
                "max_tokens": 1 + i % 16}
        return [self.http.post("/v1/chat/completions", json=body).status_code]

    def stream(self, i: int) -> list[int]:
        body = {"model": DECODERS[i % 2], "prompt": [1, 6, 7 + i % 40], "max_tokens": 1 + i % 20,
                "stream": True, "ignore_eos": True}
        with self.http.stream("POST", "/v1/completions", json=body) as response:
            events = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
        if response.status_code == 200:
            assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
            tokens = sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-1])
            assert tokens == body["max_tokens"], (tokens, body)
        return [response.status_code]

    def abandoned_stream(self, i: int) -> list[int]:
        body = {"model": DECODERS[i % 2], "prompt": [1, 8, 9], "max_tokens": 60, "stream": True,
                "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=60) as http:  # closed: the connection goes
            with http.stream("POST", "/v1/completions", json=body) as response:
                next(line for line in response.iter_lines() if line.startswith("data:"))
        return [response.status_code]

    def abandoned_wait(self, i: int) -> list[int]:
        body = {"model": DECODERS[i % 2], "prompt": [1, 8, 10], "max_tokens": 60, "ignore_eos": True}
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(self.url + "/v1/completions", json=body, timeout=0.05)
        return [0]  # the client left after 50 ms, before the answer (60 tokens) was read

    def embeddings(self, i: int) -> list[int]:
        inputs = [f"w{5 + (i + k) % 50} w9" for k in range(1 + i % 8)]
        response = self.http.post("/v1/embeddings", json={"model": "enc", "input": inputs})
        if response.status_code == 200:
            assert len(response.json()["data"]) == len(inputs)
        return [response.status_code]

    def malformed(self, i: int) -> list[int]:
        return [self.http.post("/v1/chat/completions", content=b'{"model": "dec-ort", "mess',
                               headers={"content-type": "application/json"}).status_code]

    def oversize(self, i: int) -> list[int]:
        """A body of 5 MiB declared: refused before it is sent (test_limits sends one too)."""
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % (5 * MiB))
        return statuses(raw_exchange(self.url, head, [], 0))

    def slow(self, i: int) -> list[int]:
        """A body in 4 parts, 0.2 s apart."""
        body = json.dumps({"model": DECODERS[i % 2], "prompt": [1, 5, 6], "max_tokens": 2}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        quarter = len(body) // 4 + 1
        return statuses(raw_exchange(self.url, head, [body[k:k + quarter] for k in range(0, len(body), quarter)], 0.2))


# kind -> the statuses one request of it may get (0: the client left before any answer)
EXPECTED = {"completion": {200}, "chat": {200}, "stream": {200}, "abandoned_stream": {200},
            "abandoned_wait": {0}, "embeddings": {200}, "malformed": {400}, "oversize": {413},
            "slow": {200}}
KINDS = ["completion", "chat", "stream", "completion", "embeddings", "abandoned_stream", "malformed",
         "stream", "slow", "abandoned_wait", "completion", "oversize"]


def requests_counted(state) -> float:
    """Every HTTP request the server has counted (``tfport_requests_total``), read in-process
    (a /metrics request would count itself)."""
    return sum(sample.value for family in state.metrics.requests.collect()
               for sample in family.samples if sample.name == "tfport_requests_total")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from Linux's /proc")
def test_soak(server):
    url, state = server
    soak = Soak(url)
    rss_before, counted_before = rss_mib(), requests_counted(state)
    stop = threading.Event()
    health: list[float] = []
    peak = [rss_before]

    def probe() -> None:
        while not stop.is_set():
            start = time.monotonic()
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            health.append(time.monotonic() - start)
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.05)

    def client(worker: int) -> list[tuple[str, list[int]]]:
        done, i = [], worker
        while not stop.is_set():
            kind = KINDS[i % len(KINDS)]
            done.append((kind, getattr(soak, kind)(i)))
            i += CLIENTS
        return done

    with concurrent.futures.ThreadPoolExecutor(CLIENTS + 1) as pool:
        prober = pool.submit(probe)
        clients = [pool.submit(client, worker) for worker in range(CLIENTS)]
        time.sleep(SECONDS)
        stop.set()
        results = [item for future in clients for item in future.result(timeout=120)]
        prober.result(timeout=60)

    wrong = [(kind, got) for kind, got in results if len(got) != 1 or got[0] not in EXPECTED[kind]]
    assert not wrong, wrong[:10]
    assert {kind for kind, _ in results} == set(EXPECTED)
    sent = len(results) + len(health)
    deadline = time.monotonic() + 10  # an abandoned request is counted once its handler ends
    while requests_counted(state) - counted_before < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert requests_counted(state) - counted_before == sent, "each request is answered once"
    for name in DECODERS:
        assert_idle(url, name)
    assert len(health) > SECONDS and max(health) < 1.0, (len(health), sorted(health)[-5:])
    assert peak[0] - rss_before < 500 and rss_mib() - rss_before < 300, (rss_before, peak[0], rss_mib())
