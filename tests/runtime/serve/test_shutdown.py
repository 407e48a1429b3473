"""Graceful shutdown (issue 27, finding 6), against ``tfport serve`` processes on 127.0.0.1 with a
model slowed to ``STEP_S`` a token: on SIGTERM /health and new requests answer 503 with
Retry-After, streams that can finish within --shutdown-timeout do, the rest end at the timeout
with a last chunk (finish reason "abort") and ``[DONE]`` (a JSON request gets a 503), the process
exits; a second SIGTERM exits at once."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest

pytestmark = pytest.mark.timing  # latency bounds: make test runs these alone, after the rest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from .conftest import running_server  # noqa: E402
from .processes import serve_process  # noqa: E402

MODEL = "dec-portable"
STEP_S = 0.1  # seconds per token of the slowed model
SHUTDOWN_S = 3.0  # --shutdown-timeout
SHORT, LONG = 15, 50  # tokens: 1.5 s, within the shutdown timeout; 5 s, past it
SLACK_S = 2.0  # how late an event may come on a loaded 2-core machine
EXIT_S = 8.0  # after the streams end: uvicorn closes connections, the interpreter exits


def body(tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": [1, 5, 7], "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


@dataclass
class Stream:
    """A streamed completion read in a thread: each event's data with the time it came."""

    url: str
    tokens: int
    events: list[tuple[float, str]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)

    def start(self) -> "Stream":
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body(self.tokens, True),
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
                        self.started.set()
        except httpx.HTTPError as err:  # a cut stream
            self.events.append((time.monotonic(), f"cut: {err!r}"))
        finally:
            self.started.set()

    def chunks(self) -> list[dict]:
        return [json.loads(data) for _, data in self.events if data.startswith("{")]

    def token_ids(self) -> list[int]:
        return [t for chunk in self.chunks() for choice in chunk.get("choices", [])
                for t in choice["token_ids"]]


def wait_for_shutdown(url: str) -> httpx.Response:
    """/health once it says the server is shutting down (the drain starts within a tick)."""
    deadline = time.monotonic() + SLACK_S
    while True:
        health = httpx.get(url + "/health", timeout=5)
        if health.status_code != 200 or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_sigterm_drains_then_ends_the_streams_left_cleanly(serve_exports):
    with serve_process(serve_exports["dec-portable"], "--shutdown-timeout", str(SHUTDOWN_S),
                       step_s=STEP_S) as server:
        answer: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: answer.append(httpx.post(
            server.url + "/v1/completions", json=body(LONG, False), timeout=60)), daemon=True)
        waiting.start()
        long = Stream(server.url, LONG).start()
        assert long.started.wait(30)
        short = Stream(server.url, SHORT).start()  # started last: running when the signal comes
        assert short.started.wait(30)
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)

        health = wait_for_shutdown(server.url)  # answered, not refused
        assert health.status_code == 503 and health.json()["status"] == "shutting down", health.text
        for path, request in (("/v1/completions", body(2, False)), ("/v1/completions", body(2, True)),
                              ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "w1"}]})):
            refused = httpx.post(server.url + path, json=request, timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "shutting_down"
            assert int(refused.headers["retry-after"]) > 0

        for thread in (short.thread, long.thread, waiting):
            thread.join(SHUTDOWN_S + SLACK_S + 5)
        # the short stream finished as if nothing happened
        assert short.events[-1][1] == "[DONE]" and len(short.token_ids()) == SHORT, short.events
        assert short.events[-1][0] > signalled
        assert short.chunks()[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in chunk for chunk in short.chunks())
        # the long one ran until the timeout, then ended cleanly: a last chunk and [DONE]
        *_, (last_at, last), (_, done) = long.events
        assert done == "[DONE]" and json.loads(last)["choices"][0]["finish_reason"] == "abort", long.events[-3:]
        assert not any("error" in chunk for chunk in long.chunks())
        assert 0 < len(long.token_ids()) < LONG
        assert SHUTDOWN_S - 0.2 <= last_at - signalled <= SHUTDOWN_S + SLACK_S, last_at - signalled
        # a request waiting for its JSON answer got a 503
        assert answer and answer[0].status_code == 503, answer
        assert answer[0].json()["error"]["code"] == "shutting_down"

        assert server.process.wait(EXIT_S) == 0, server.output()
        assert time.monotonic() - signalled <= SHUTDOWN_S + EXIT_S


def test_streams_end_at_the_timeout_whatever_step_is_under_way(serve_exports):
    """A step that runs past the deadline (a long prefill; here a model slowed to 3 s a step)
    does not hold the streams' ends: they end at --shutdown-timeout, cleanly as the openai
    client reads them (chat and completion); before, they ended with an error event once the
    step was over."""
    openai = pytest.importorskip("openai", reason="the client of the dev extra")
    step_s, shutdown_s = 3.0, 1.0
    with serve_process(serve_exports["dec-portable"], "--shutdown-timeout", str(shutdown_s),
                       step_s=step_s) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        ends: dict[str, tuple[float, str | None]] = {}
        first = {kind: threading.Event() for kind in ("chat", "completion")}

        def read(kind: str) -> None:
            kwargs = dict(model=MODEL, max_tokens=LONG, temperature=0, stream=True,
                          extra_body={"ignore_eos": True})
            stream = (client.chat.completions.create(messages=[{"role": "user", "content": "w5"}], **kwargs)
                      if kind == "chat" else client.completions.create(prompt=[1, 5, 7], **kwargs))
            reason = None
            for chunk in stream:  # raises on an error event
                if chunk.choices and (chunk.choices[0].finish_reason or getattr(chunk.choices[0], "text", "")
                                      or getattr(getattr(chunk.choices[0], "delta", None), "content", "")):
                    first[kind].set()
                reason = chunk.choices[0].finish_reason if chunk.choices else reason
            ends[kind] = (time.monotonic(), reason)

        threads = [threading.Thread(target=read, args=(kind,), daemon=True) for kind in first]
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in first.values())  # the first tokens: a step just began
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)
        for thread in threads:
            thread.join(step_s + SLACK_S + 5)
        assert sorted(ends) == ["chat", "completion"], (ends, server.output())
        for kind, (ended, reason) in ends.items():
            assert reason == "abort", kind
            assert ended - signalled <= shutdown_s + 0.8, (kind, ended - signalled)  # the step ran to 3 s
        assert server.process.wait(step_s + EXIT_S) == 0, server.output()


def test_a_second_sigterm_exits_at_once(serve_exports):
    with serve_process(serve_exports["dec-portable"], "--shutdown-timeout", "60",
                       step_s=STEP_S) as server:
        long = Stream(server.url, LONG).start()
        assert long.started.wait(30)
        server.signal(signal.SIGTERM)
        assert wait_for_shutdown(server.url).status_code == 503  # draining, for up to 60 s
        signalled = time.monotonic()
        server.signal(signal.SIGTERM)
        server.process.wait(EXIT_S)
        assert time.monotonic() - signalled < EXIT_S
        long.thread.join(10)
        assert len(long.token_ids()) < LONG, "the stream was not cut"  # it needed 5 s


def test_a_request_reaching_a_stopped_scheduler_gets_503(serve_exports):
    """One that passed the shutdown check while the drain ended (tokenising in a worker thread)."""
    with running_server([serve_exports["dec-portable"]]) as (url, state):
        state.models[MODEL].scheduler.stop()
        refused = httpx.post(url + "/v1/completions", json=body(2, False), timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert int(refused.headers["retry-after"]) > 0
