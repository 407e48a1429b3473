"""A hostile client for a ``tfport serve`` on this machine (issue 27's proof).

    python -m tfport.tools.hostile --url http://127.0.0.1:8000 --model dec \\
        [--embed-model enc] [--requests 11800] [--abusive 63] [--clients 16] [--json out.json]

``--clients`` threads send the kinds in ``MIX`` in turn (valid requests, checked; streams left
midway; oversize, malformed and hostile bodies), ``--abusive`` raw connections (slowloris heads,
bodies dripped a byte a ``DRIP_S``, silent ones) wait to be closed, and a probe times ``/health``
every 0.1 s. The run fails (exit status 1) on a 5xx, a hang (no answer within ``--hang-s``), an
outcome its kind does not expect (``EXPECTED``; ``+long``: an error body over ``ERROR_BYTES``),
``/health`` over ``HEALTH_S``, gauges not 0 at the end, or the server's RSS (the pid ``/health``
gives) ending ``--rss-slack-mib`` over its start. Loopback URLs only.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import logging
import select
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from .serve_bench import check_loopback

logger = logging.getLogger(__name__)

DRIP_S = 1.0  # a slow client's pause between bytes
ERROR_BYTES = 4096  # an error body longer than this echoes the request
HEALTH_S = 1.0  # /health must answer within this
CHUNK = 64 * 1024  # bytes per send of an oversize body
SETTLE_S = 2.0  # after the run: for the rows of abandoned requests, and the last big request's trim
KEEP_ALIVE = httpx.Limits(keepalive_expiry=2.0)  # idle connections closed before the server's 5 s
MIX = ["completion", "stream", "chat", "embeddings", "disconnect", "malformed", "surrogate", "bad_params",
       "oversize"] * 2 + ["completion", "stream", "chat", "chat_stream", "huge_stop", "long_prompt",
                          "huge_prompt", "many_inputs"]  # heavy kinds once a turn
ABUSIVE = ["slowloris"] * 6 + ["silent", "slow_body"]  # in turn: 63 -> 48, 8 and 7
EXPECTED = {**{kind: {"200"} for kind in MIX}, **{kind: {"closed"} for kind in ABUSIVE},
            "malformed": {"400"}, "surrogate": {"400"}, "bad_params": {"400", "404"},
            "huge_stop": {"200", "400"}, "long_prompt": {"400"}, "many_inputs": {"400", "413"},
            "oversize": {"413"}, "huge_prompt": {"413"}}
COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
BAD_PARAMS = [{"max_tokens": -1}, {"temperature": -1}, {"n": 0}, {"top_p": 2}, {"max_tokens": "x"},
              {"logprobs": 99}, {"prompt": None}, {"stop": [""]}, {"logit_bias": {"x": 1}},
              {"presence_penalty": 5}, {"n": 10**9}, {"model": "no-such-model"}, {"seed": 1.5}]
MALFORMED = [b'{"model": "dec", "prom', b"not json", b'{"model": "\xff\xfe"}', b"[1, 2]",
             b"[" * 100_000, b'{"model": ' + b"1" * 100_000 + b"}"]


def rss_mib(pid: int | None) -> int | None:
    """The resident memory of process ``pid`` in MiB (None where it cannot be read)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        return int(next(line for line in lines if line.startswith("VmRSS:")).split()[1]) // 1024
    return None


def encode(body: dict) -> bytes:
    return json.dumps(body).encode()  # ASCII: a lone surrogate goes as its escape


class Hostile:
    """The clients of each kind: ``request(kind, i)`` -> the outcome: the status as text,
    ``bad`` for a 200 whose content is wrong, ``closed`` for a connection ended without an
    answer, ``hang``. ``i``, the kind's turn, picks its variant (``variants``: the kinds that
    only send a body, each a list of (``post``, ``length`` or ``chunked``, path, body))."""

    def __init__(self, url: str, model: str, embed_model: str | None = None, hang_s: float = 90.0):
        self.url, self.model, self.embed_model, self.hang_s = check_loopback(url), model, embed_model, hang_s
        self.host, _, port = self.url.removeprefix("http://").rpartition(":")
        self.port = int(port)
        self.local = threading.local()
        tiny, encoder = {"model": model, "prompt": "w5"}, embed_model or model
        huge = encode({"model": model, "prompt": "w5 w7 " * ((20 << 20) // 6)})  # 20 MB
        self.variants = {
            "malformed": [("post", COMPLETIONS, body) for body in MALFORMED],
            "surrogate": [("post", COMPLETIONS, encode({**tiny, "prompt": "w5 \ud800"})),
                          ("post", CHAT, encode({"model": model, "messages": [{"role": "user", "content": "\udfff"}]})),
                          ("post", EMBEDDINGS, encode({"model": encoder, "input": ["ok", "\ud83d"]}))],
            "bad_params": [("post", COMPLETIONS, encode({**tiny, **bad})) for bad in BAD_PARAMS],
            "huge_stop": [("post", COMPLETIONS, encode({**tiny, "max_tokens": 4, "stop": stop}))
                          for stop in (["s" * 700_000] * 5, "s" * 3_000_000)],  # 5 stops (4 allowed), 3 MB
            "long_prompt": [("post", COMPLETIONS, encode({**tiny, "prompt": "w5 " * n}))
                            for n in (1_000_000, 300_000)],  # over the characters, over the tokens
            "many_inputs": [("length", EMBEDDINGS, encode({"model": encoder, "input": ["w5"] * 1_000_000})),
                            ("post", EMBEDDINGS, encode({"model": encoder, "input": ["a"] * 800_000}))],
            "oversize": [("length", COMPLETIONS, b"x" * (50 << 20)),  # declared; 51 MB in chunks:
                         ("chunked", COMPLETIONS, encode({**tiny, "prompt": "w5 " * (17 << 20)}))],
            "huge_prompt": [("length", COMPLETIONS, huge), ("chunked", COMPLETIONS, huge)]}

    def request(self, kind: str, i: int) -> str:
        if kind in self.variants:
            how, path, body = self.variants[kind][i % len(self.variants[kind])]
            return self.post(path, body)[0] if how == "post" else self.upload(path, body, how == "chunked")
        if kind in ABUSIVE:
            return self.abuse(kind)
        if kind in ("stream", "chat_stream", "disconnect"):
            return self.stream(i, chat=kind == "chat_stream", leave=kind == "disconnect")
        return self.valid(kind if self.embed_model or kind != "embeddings" else "completion", i)

    def post(self, path: str, body: bytes) -> tuple[str, httpx.Response]:
        if not hasattr(self.local, "client"):
            self.local.client = httpx.Client(base_url=self.url, timeout=self.hang_s, limits=KEEP_ALIVE)
        response = self.local.client.post(path, content=body, headers={"content-type": "application/json"})
        long = response.status_code != 200 and len(response.content) > ERROR_BYTES
        return f"{response.status_code}{'+long' if long else ''}", response

    def upload(self, path: str, body: bytes, chunked: bool) -> str:
        """POST ``body`` to ``path`` on a raw connection, ``CHUNK`` bytes a send (chunked or with
        its length declared), stopping once the server answers -> the outcome."""
        framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % len(body)
        head = (b"POST %s HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n"
                b"content-type: application/json\r\n%s\r\n\r\n" % (path.encode(), self.host.encode(), framing))
        with socket.create_connection((self.host, self.port), timeout=self.hang_s) as sock:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(head)
                for start in range(0, len(body), CHUNK):
                    if select.select([sock], [], [], 0)[0]:
                        break  # answered before the whole body was sent
                    part = body[start:start + CHUNK]
                    sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                else:
                    sock.sendall(b"0\r\n\r\n" if chunked else b"")
            return self.answer(sock)

    def answer(self, sock: socket.socket) -> str:
        """Read until the server closes ``sock`` -> its response's status, or how it ended."""
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            return "hang"
        except ConnectionResetError:
            pass  # closed, maybe after an answer
        if not data:
            return "closed"
        status = data.split(maxsplit=2)[1].decode()  # HTTP/1.1 413 ...
        return status + "+long" if len(data.partition(b"\r\n\r\n")[2]) > ERROR_BYTES else status

    def valid(self, kind: str, i: int) -> str:
        """A completion, chat or embeddings request; a 200 whose content is wrong is ``bad``."""
        word, tokens = f"w{5 + i % 40}", 1 + i % 8
        inputs = [f"w{5 + (i + k) % 40} w9" for k in range(tokens)]
        path, body, check = {
            "completion": (COMPLETIONS, {"model": self.model, "prompt": f"{word} w7", "max_tokens": tokens,
                                         "seed": i}, lambda r: isinstance(r["choices"][0]["text"], str)),
            "chat": (CHAT, {"model": self.model, "max_tokens": tokens, "messages": [{"role": "user", "content": word}]},
                     lambda r: isinstance(r["choices"][0]["message"]["content"], str)),
            "embeddings": (EMBEDDINGS, {"model": self.embed_model, "input": inputs},
                           lambda r: len(r["data"]) == len(inputs))}[kind]
        label, response = self.post(path, encode(body))
        return label if label != "200" or check(response.json()) else "bad"

    def stream(self, i: int, chat: bool = False, leave: bool = False) -> str:
        """A streamed completion (or chat) read to ``[DONE]``; ``leave``: left after its first event."""
        body = {"model": self.model, "max_tokens": 4 + i % 12, "stream": True, "ignore_eos": True}
        body.update({"messages": [{"role": "user", "content": "w6 w7"}]} if chat else {"prompt": "w6 w7"})
        with httpx.Client(base_url=self.url, timeout=self.hang_s) as client:  # closed: the connection goes
            with client.stream("POST", CHAT if chat else COMPLETIONS, json=body) as response:
                data = (line[5:].strip() for line in response.iter_lines() if line.startswith("data:"))
                events = [next(data, None)] if leave else list(data)
        ended = leave or response.status_code != 200 or (events.count("[DONE]") == 1 and events[-1] == "[DONE]")
        return str(response.status_code) if ended else "bad"

    def abuse(self, kind: str) -> str:
        """A slowloris head or a ``slow_body`` (a byte a ``DRIP_S``), or a ``silent`` connection:
        ``closed`` once the server closes it, ``hang`` if it has not within ``hang_s``."""
        drip = {"slowloris": b"POST /v1/completions HTTP/1.1\r\n" + b"x-a: b\r\n" * 1000,
                "slow_body": b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-length: 100000\r\n\r\n"
                             % self.host.encode() + b" " * 100_000, "silent": b""}[kind]
        deadline = time.monotonic() + self.hang_s
        with socket.create_connection((self.host, self.port), timeout=self.hang_s) as sock:
            sent = sock.send(drip[:drip.find(b"\r\n\r\n") + 4]) if kind == "slow_body" else 0
            while time.monotonic() < deadline:
                if select.select([sock], [], [], 0 if drip else deadline - time.monotonic())[0]:
                    return self.answer(sock)
                try:
                    time.sleep(DRIP_S)
                    sent += sock.send(drip[sent:sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    return "closed"
        return "hang"


def run(hostile: Hostile, requests: int, abusive: int, clients: int = 16, pid: int | None = None,
        rss_slack_mib: float = 300.0) -> dict:
    """Send ``requests`` of the mix and ``abusive`` connections while probing /health -> the
    results, ``failures`` listing what fails the run."""
    pid = pid or httpx.get(hostile.url + "/health", timeout=hostile.hang_s).json().get("pid")
    rss, latencies, probes, stop = {"before": rss_mib(pid)}, [], collections.Counter(), threading.Event()
    rss["peak"] = rss["before"]  # then the largest the probe reads

    def probe() -> None:
        with httpx.Client(timeout=hostile.hang_s) as client:
            while not stop.wait(0.1):
                start = time.monotonic()
                try:
                    probes[str(client.get(hostile.url + "/health").status_code)] += 1
                except httpx.HTTPError as err:
                    probes[type(err).__name__] += 1
                latencies.append(time.monotonic() - start)
                rss["peak"] = max(rss["peak"] or 0, rss_mib(pid) or 0)

    def one(kind: str, i: int) -> tuple[str, str]:
        try:
            return kind, hostile.request(kind, i)
        except httpx.TimeoutException:
            return kind, "hang"
        except Exception as err:  # noqa: BLE001 -- counted; one this client did not foresee, logged
            if not isinstance(err, (httpx.HTTPError, OSError)):
                logger.warning("%s %d: %r", kind, i, err)
            return kind, f"error:{type(err).__name__}"

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(abusive + 1) as pool, \
            concurrent.futures.ThreadPoolExecutor(clients) as senders:
        prober, rude = pool.submit(probe), [pool.submit(one, ABUSIVE[k % len(ABUSIVE)], k) for k in range(abusive)]
        try:
            done = list(senders.map(lambda i: one(MIX[i % len(MIX)], i // len(MIX)), range(requests)))
            done += [future.result() for future in rude]
            time.sleep(SETTLE_S)
            models = httpx.get(hostile.url + "/health", timeout=hostile.hang_s).json()["models"]
            gauges = {name: {k: m[k] for k in ("running", "waiting")} for name, m in models.items() if "running" in m}
            rss["after"] = rss_mib(pid)
        finally:
            stop.set()
        prober.result()
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind, outcome in done:
        outcomes[kind][outcome] += 1
    unexpected = {k: sum(n for o, n in c.items() if o not in EXPECTED[k]) for k, c in outcomes.items()}
    fivexx = sum(n for c in outcomes.values() for o, n in c.items() if o.startswith("5"))
    hangs, slowest = sum(c["hang"] for c in outcomes.values()), max(latencies, default=float("nan"))
    grown = None not in (rss["before"], rss["after"]) and rss["after"] - rss["before"] > rss_slack_mib
    failures = [what for what, bad in [
        (f"{fivexx} 5xx", fivexx), (f"{hangs} hangs", hangs),
        (f"{sum(unexpected.values())} unexpected outcomes", sum(unexpected.values())),
        (f"/health took {slowest:.2f} s", not slowest <= HEALTH_S),
        (f"/health answered {dict(probes)}", set(probes) != {"200"}),
        (f"gauges not 0: {gauges}", any(g["running"] or g["waiting"] for g in gauges.values())),
        (f"RSS {rss['before']} -> {rss['after']} MiB", grown)] if bad]
    return {"seconds": time.monotonic() - start, "requests": len(done), "outcomes": {k: dict(c) for k, c in outcomes.items()},
            "unexpected": unexpected, "5xx": fivexx, "hangs": hangs, "rss_mib": rss, "gauges": gauges,
            "health": {"probes": dict(probes), "max_s": slowest,
                       "p99_s": float(np.percentile(latencies, 99)) if latencies else slowest},
            "failures": failures}


def format_table(result: dict) -> str:
    """A Markdown table of the outcomes per kind, then the run's summary lines."""
    lines = ["| kind | sent | outcomes | unexpected |", "| --- | ---: | --- | ---: |"]
    for kind, counts in sorted(result["outcomes"].items()):
        shown = ", ".join(f"{o}: {n}" for o, n in sorted(counts.items()))
        lines.append(f"| {kind} | {sum(counts.values())} | {shown} | {result['unexpected'][kind]} |")
    health, rss = result["health"], result["rss_mib"]
    lines += ["", f"{result['requests']} requests and connections in {result['seconds']:.0f} s: "
              f"{result['5xx']} 5xx, {result['hangs']} hangs",
              f"/health: {health['probes']}, max {health['max_s']:.3f} s, p99 {health['p99_s']:.3f} s",
              f"server RSS (MiB): before {rss['before']}, peak {rss['peak']}, after {rss['after']}; "
              f"gauges at the end: {result['gauges']}",
              "PASS" if not result["failures"] else "FAIL: " + "; ".join(result["failures"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="a tfport serve on this machine: http://127.0.0.1:PORT")
    parser.add_argument("--model", required=True, help="a served decoder")
    parser.add_argument("--embed-model", help="a served encoder (default: no embeddings requests)")
    parser.add_argument("--requests", type=int, default=11_800)
    parser.add_argument("--abusive", type=int, default=63, help="slowloris, slow-body and silent connections")
    parser.add_argument("--clients", type=int, default=16, help="threads sending the requests")
    parser.add_argument("--hang-s", type=float, default=90.0, help="seconds without an answer: a hang")
    parser.add_argument("--pid", type=int, help="the server's pid, for its RSS (default: /health's)")
    parser.add_argument("--rss-slack-mib", type=float, default=300.0, help="RSS growth allowed after the run")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = run(Hostile(args.url, args.model, args.embed_model, args.hang_s), args.requests,
                 args.abusive, args.clients, args.pid, args.rss_slack_mib)
    print(format_table(result))
    if args.json:
        temporary = Path(args.json + ".tmp")
        temporary.write_text(json.dumps(result, indent=2))
        temporary.replace(args.json)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
