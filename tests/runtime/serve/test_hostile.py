"""The hostile client (``tfport.tools.hostile``, issue 27's proof), bounded: every kind of
its mix against the session's server on 127.0.0.1 with nothing failing; its abusive connections
closed by a ``tfport serve`` with short read deadlines; and the script failing where it should
(a server without read deadlines keeps a silent connection: a hang), refusing a non-loopback URL.

The payloads that make the server work hardest are cut down (a long prompt of 300k characters
rather than 3M, 3,000 embedding inputs rather than 800,000), to keep the file under 20 s; the
oversize bodies are the script's own, refused at the body limit whatever their size."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.timing  # latency bounds: make test runs these alone, after the rest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from tfport.tools import hostile  # noqa: E402

from .conftest import running_server  # noqa: E402
from .processes import serve_process  # noqa: E402

linux = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                           reason="reads the server's RSS from Linux's /proc")


@pytest.fixture(autouse=True)
def settle_quickly(monkeypatch):
    monkeypatch.setattr(hostile, "SETTLE_S", 0.5)  # a tiny model's rows are freed within it


def cut_down(client: hostile.Hostile) -> hostile.Hostile:
    """``client`` with its tokeniser- and parser-heavy payloads made smaller (same outcomes)."""
    client.variants["long_prompt"] = [  # over --max-prompt-chars; over the context
        ("post", hostile.COMPLETIONS, hostile.encode({"model": client.model, "prompt": "w5 " * n}))
        for n in (400_000, 30_000)]
    inputs = hostile.encode({"model": client.embed_model, "input": ["w5"] * 3000})
    client.variants["many_inputs"][1] = ("post", hostile.EMBEDDINGS, inputs)  # 1M inputs (413); 3,000 (400)
    return client


@linux
def test_every_kind_of_the_mix_gets_the_answer_it_expects(server):
    url, _ = server
    requests = 4 * len(hostile.MIX)  # each kind 4 to 12 times, every variant of the two-variant kinds
    result = hostile.run(cut_down(hostile.Hostile(url, "dec-ort", "enc", hang_s=30)), requests,
                         abusive=0, clients=8)
    assert result["failures"] == [], hostile.format_table(result)
    assert set(result["outcomes"]) == set(hostile.MIX)
    assert sum(sum(c.values()) for c in result["outcomes"].values()) == requests
    assert result["outcomes"]["huge_stop"] == {"200": 2, "400": 2}  # one 3 MB stop runs; 5 are refused
    assert set(result["outcomes"]["many_inputs"]) == {"400", "413"}
    assert result["health"]["probes"]["200"] > 0 and "PASS" in hostile.format_table(result)


@linux
def test_abusive_connections_are_closed_by_the_read_deadlines(serve_exports, monkeypatch):
    monkeypatch.setattr(hostile, "DRIP_S", 0.2)
    with serve_process(serve_exports["dec-portable"], "--header-timeout", "1", "--body-timeout", "1") as served:
        client = hostile.Hostile(served.url, "dec-portable", hang_s=15)
        result = hostile.run(client, requests=len(hostile.MIX), abusive=len(hostile.ABUSIVE), clients=4)
    assert result["failures"] == [], hostile.format_table(result)
    assert {kind: result["outcomes"][kind] for kind in ("slowloris", "silent", "slow_body")} == {
        "slowloris": {"closed": 6}, "silent": {"closed": 1}, "slow_body": {"closed": 1}}


@linux
def test_a_connection_left_open_is_a_hang_and_fails_the_run(serve_exports, monkeypatch):
    """The in-process server runs uvicorn without read deadlines: a silent connection stays."""
    monkeypatch.setattr(hostile, "ABUSIVE", ["silent"])
    with running_server([serve_exports["dec-portable"]]) as (url, _):
        result = hostile.run(hostile.Hostile(url, "dec-portable", hang_s=1.5), requests=0, abusive=1)
    assert result["outcomes"] == {"silent": {"hang": 1}} and result["hangs"] == 1
    assert result["failures"] == ["1 hangs", "1 unexpected outcomes"]
    assert "FAIL: 1 hangs" in hostile.format_table(result)


@pytest.mark.parametrize("url", ["http://example.com:8000", "http://10.0.0.1:8000"])
def test_only_this_machine_is_a_target(url):
    with pytest.raises(ValueError, match="127.0.0.1"):
        hostile.Hostile(url, "dec")
