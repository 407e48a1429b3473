"""Connection hygiene and what a server exposes (issue 27, findings 4 and 5): slowloris and
silent connections closed at their read deadlines while a normal client is served, the keep-alive
bound, the connection limit, CORS only for the configured origins, and /docs, /openapi.json and
/metrics switched off; against ``tfport serve`` processes on 127.0.0.1 and raw sockets."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.timing  # latency bounds: make test runs these alone, after the rest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from .conftest import running_server  # noqa: E402
from .processes import serve_process  # noqa: E402

HEADER_S = BODY_S = KEEP_ALIVE_S = 1.0  # the test server's --header/--body/--keep-alive-timeout
SLACK_S = 2.0  # how late a close may come on a loaded 2-core machine
DRIP_S = 0.25  # a slowloris client's pace: a byte every DRIP_S
LIMIT = 32  # --limit-concurrency
ORIGIN, OTHER_ORIGIN = "http://app.example", "http://localhost:3000"  # --cors-origin, twice
STRANGER = "http://evil.example"
COMPLETION = {"model": "dec-portable", "prompt": [1, 5, 7], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(serve_exports):
    """A server with short read deadlines, a connection limit, two CORS origins, no docs and no
    metrics."""
    with serve_process(serve_exports["dec-portable"], "--header-timeout", str(HEADER_S),
                       "--body-timeout", str(BODY_S), "--keep-alive-timeout", str(KEEP_ALIVE_S),
                       "--limit-concurrency", str(LIMIT), "--cors-origin", ORIGIN,
                       "--cors-origin", OTHER_ORIGIN, "--no-docs", "--no-metrics") as server:
        yield server


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.setblocking(False)
    return sock


def read_response(sock: socket.socket, timeout: float = 10) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length from ``sock`` -> (status, body)."""
    data, deadline = b"", time.monotonic() + timeout
    while True:
        head, _, body = data.partition(b"\r\n\r\n")
        if _:
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(body) >= length:
                return int(head.split(b" ")[1]), body[:length]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no complete response in {timeout} s: {data[:200]!r}")
        try:
            data += sock.recv(65536)
        except BlockingIOError:
            time.sleep(0.01)


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset); never blocks."""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset: closed with our bytes unread
        return True


def request(path: str, **headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class Abuser:
    """A connection that never completes what it started: ``drip`` is sent a byte every DRIP_S;
    ``since`` is when its deadline (``limit`` seconds) started."""

    kind: str
    sock: socket.socket
    since: float
    limit: float
    drip: bytes = b""
    closed: float | None = None

    def tick(self, now: float) -> None:
        if self.closed is None and is_closed(self.sock):
            self.closed = now
        elif self.closed is None and self.drip:
            try:
                self.sock.send(self.drip[:1])
            except OSError:
                self.closed = now
            self.drip = self.drip[1:]


def abusers(server) -> list[Abuser]:
    """16 connections dripping a request head, 2 silent ones, 2 dripping a body and 2 that drip
    their second request's head after a first answered one."""
    head = request("/v1/models", **{f"X-Drip-{i}": "x" * 20 for i in range(20)})[:-2]  # never ends
    out = []
    for kind, count in (("head", 16), ("silent", 2), ("body", 2), ("next head", 2)):
        for _ in range(count):
            sock = connect(server)
            drip, limit = head, HEADER_S
            if kind == "silent":
                drip = b""
            elif kind == "body":
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
                drip, limit = b'{"model": "dec-portable", "prompt": "' + b"a" * 1000, BODY_S
            elif kind == "next head":
                sock.sendall(request("/health"))
                assert read_response(sock)[0] == 200
            out.append(Abuser(kind, sock, time.monotonic(), limit, drip))
    return out


def test_slow_and_silent_connections_are_closed_while_a_client_is_served(guarded):
    served, stop = [], threading.Event()

    def client():  # a normal client, a new connection per request
        while not stop.is_set():
            start = time.monotonic()
            response = httpx.post(guarded.url + "/v1/completions", json=COMPLETION, timeout=30)
            served.append((response.status_code, time.monotonic() - start))
            time.sleep(0.1)

    connections = abusers(guarded)
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    deadline = time.monotonic() + max(HEADER_S, BODY_S) + SLACK_S + 1
    try:
        while time.monotonic() < deadline and any(c.closed is None for c in connections):
            now = time.monotonic()
            for connection in connections:
                connection.tick(now)
            time.sleep(DRIP_S)
    finally:
        stop.set()
        thread.join(30)
        for connection in connections:
            connection.sock.close()
    for c in connections:
        assert c.closed is not None, f"a {c.kind!r} connection is still open after {c.limit:g} s"
        # not before its deadline (a drip every 0.25 s would not save it), nor long after
        assert c.limit - 0.1 <= c.closed - c.since <= c.limit + SLACK_S, (c.kind, c.closed - c.since)
    assert len(served) >= 3 and all(status == 200 for status, _ in served), served
    assert max(seconds for _, seconds in served) < SLACK_S, served


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(guarded):
    sock = connect(guarded)
    sock.sendall(request("/health"))
    assert read_response(sock)[0] == 200
    answered = time.monotonic()
    while not is_closed(sock) and time.monotonic() < answered + KEEP_ALIVE_S + SLACK_S:
        time.sleep(0.02)
    idle = time.monotonic() - answered
    sock.close()
    assert KEEP_ALIVE_S - 0.1 <= idle <= KEEP_ALIVE_S + SLACK_S, idle  # uvicorn's default is 5 s


def test_past_the_connection_limit_requests_get_503_until_idle_ones_are_closed(guarded):
    idle = [connect(guarded) for _ in range(LIMIT)]
    time.sleep(0.3)  # accepted by the server
    try:
        refused = httpx.get(guarded.url + "/v1/models", timeout=10)
        assert refused.status_code == 503, refused.text
        # answered as every other error, not uvicorn's plain "Service Unavailable"
        assert refused.headers["content-type"] == "application/json"
        error = refused.json()["error"]
        assert error["type"] == "service_unavailable" and "--limit-concurrency" in error["message"]
        assert refused.headers["retry-after"].isdigit()
        # silent connections hold their slots only until --header-timeout closes them
        deadline = time.monotonic() + HEADER_S + SLACK_S
        while not all(is_closed(sock) for sock in idle) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(is_closed(sock) for sock in idle)
        assert httpx.get(guarded.url + "/v1/models", timeout=10).status_code == 200
    finally:
        for sock in idle:
            sock.close()


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", timeout=10, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_answers_only_the_configured_origins(guarded):
    for origin in (ORIGIN, OTHER_ORIGIN):
        response = httpx.post(guarded.url + "/v1/completions", json=COMPLETION,
                              headers={"Origin": origin}, timeout=30)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == origin
        allowed = preflight(guarded.url, origin)
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["access-control-allow-origin"] == origin
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert {"authorization", "content-type"} <= {
            h.strip().lower() for h in allowed.headers["access-control-allow-headers"].split(",")}
        assert "access-control-allow-credentials" not in allowed.headers  # the key is a header
    stranger = httpx.get(guarded.url + "/v1/models", headers={"Origin": STRANGER}, timeout=10)
    assert stranger.status_code == 200 and "access-control-allow-origin" not in stranger.headers
    refused = preflight(guarded.url, STRANGER)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_a_preflight_needs_no_key_and_a_refusal_carries_cors_headers(serve_exports):
    key = "tfport-test-key-c0r5"
    with running_server([serve_exports["dec-portable"]], api_key=key, cors_origins=(ORIGIN,)) as (url, _):
        allowed = preflight(url, ORIGIN)  # a browser sends it without the key
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
        refused = httpx.post(url + "/v1/completions", json=COMPLETION, headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # and the page can read why
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        answered = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30,
                              headers={"Origin": ORIGIN, "Authorization": f"Bearer {key}"})
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == ORIGIN


def test_cors_is_off_by_default(server):
    url, _ = server
    response = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("access-control-")], response.headers
    answer = preflight(url, ORIGIN)
    assert answer.status_code != 200 and "access-control-allow-origin" not in answer.headers


@pytest.mark.parametrize("path, option", [("/docs", "--no-docs"), ("/redoc", "--no-docs"),
                                          ("/openapi.json", "--no-docs"), ("/metrics", "--no-metrics")])
def test_docs_and_metrics_can_be_switched_off(guarded, server, path, option):
    response = httpx.get(guarded.url + path, timeout=10)
    assert response.status_code == 404, response.text
    assert option in response.json()["error"]["message"]
    assert httpx.get(server[0] + path, timeout=10).status_code == 200  # served by default
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("origin", ["http://app.example/", "http://app.example/path", "app.example",
                                    "ftp://app.example", "http://App.example", ""])
def test_a_cors_origin_is_one_a_browser_sends(origin):
    from tfport.runtime.serve.options import ServeOptions

    with pytest.raises(ValueError, match="cors origin"):
        ServeOptions(cors_origins=(origin,))
    assert ServeOptions(cors_origins=("*", ORIGIN, "https://a.example:8443")).cors_origins[0] == "*"


@pytest.mark.parametrize("field, value", [("header_timeout", 0), ("body_timeout", -1.0),
                                          ("keep_alive_timeout", float("nan")), ("shutdown_timeout", 0),
                                          ("limit_concurrency", 0), ("limit_concurrency", True)])
def test_connection_options_are_checked(field, value):
    from tfport.runtime.serve.options import ServeOptions

    with pytest.raises(ValueError, match=f"^{field}="):
        ServeOptions(**{field: value})
