"""``tfport bench-serve``: a short run against a server it starts on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from tfport.cli import main  # noqa: E402
from tfport.tools.serve_bench import check_loopback  # noqa: E402


def test_bench_serve_checks_every_response(serve_exports, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench-serve", str(serve_exports["dec-ort"]), "--concurrency", "1,4",
                 "--requests", "6", "--max-new", "8", "--prompt-len", "5", "--threads", "1",
                 "--time-limit", "60", "--json", str(out)])
    assert code == 0, capsys.readouterr()
    results = json.loads(out.read_text())
    assert [r["concurrency"] for r in results] == [1, 4]
    for r in results:
        assert (r["sent"], r["ok"], r["failed"], r["tokens"]) == (6, 6, 0, 48), r
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50"] <= r["latency_p50"]
    assert "| 4 | 6/6 |" in capsys.readouterr().out


def test_bench_serve_refuses_other_hosts():
    with pytest.raises(ValueError, match="this machine only"):
        check_loopback("http://10.0.0.1:8000")
    assert check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


def test_serve_reports_a_bad_export_or_port_before_starting(tmp_path, capsys):
    """An export that cannot be loaded is a one-line error (exit 2), not uvicorn's startup traceback."""
    assert main(["serve", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "model_dir=" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path), "--port", "99999"])
    assert "port='99999': expected an integer in [0, 65535]" in capsys.readouterr().err


def test_prompt_lengths_are_drawn_from_the_range_and_seeded():
    from tfport.tools.serve_bench import BenchConfig, parse_prompt_len, random_prompts

    assert parse_prompt_len("16") == (16, 16) and parse_prompt_len("16-1024") == (16, 1024)
    for bad in ("0", "1024-16", "16-", "a-b", "1-2-3", "-5"):
        with pytest.raises(ValueError, match="--prompt-len="):
            parse_prompt_len(bad)
    config = BenchConfig(requests=200, prompt_len=(16, 1024))
    lengths = [len(p) for p in random_prompts(config, vocab=100)]
    assert min(lengths) >= 16 and max(lengths) <= 1024
    # log-uniform: as many prompts under the geometric mean (128) as over it, give or take
    assert 70 < sum(n < 128 for n in lengths) < 130, lengths
    assert random_prompts(config, vocab=100) == random_prompts(config, vocab=100)
    assert all(3 <= i < 100 for p in random_prompts(config, vocab=100) for i in p)
    assert {len(p) for p in random_prompts(BenchConfig(requests=5, prompt_len=(7, 7)), 100)} == {7}


def test_a_started_server_gets_the_options(monkeypatch):
    """The server ``start_server`` runs is given bench-serve's options: its command line, parsed
    by ``tfport serve``'s own parser, gives the same options (tests/runtime/serve/test_options.py
    checks every option)."""
    from tfport.cli import build_parser
    from tfport.tools import serve_bench as bench
    from tfport.runtime.serve.cli import serve_options
    from tfport.runtime.serve.options import ServeOptions

    class Started(Exception):
        pass

    def popen(command, **_):
        raise Started(command)

    wanted = ServeOptions(max_rows=4, threads=2, max_length=300, prefix_cache_mb=0, prefill_chunk=None,
                          speculative="lookup", draft_tokens=3, speculative_inexact=True, timeout=30.0,
                          batch_export="another-export", batch_rows=5, max_prompt_chars=100,
                          embedding_batch_ms=0.0)
    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    with pytest.raises(Started) as started:
        bench.start_server("some-export", wanted, name="m")
    command = started.value.args[0]
    assert command[1:5] == ["-m", "tfport.cli", "serve", "some-export"], command
    args = build_parser("serve").parse_args(command[3:])
    assert serve_options(args) == wanted and (args.host, args.names) == ("127.0.0.1", ["m"])


@pytest.mark.parametrize("exact", [True, False])
def test_tokens_that_differ_between_levels_fail_only_an_exact_run(monkeypatch, exact):
    """A float export's tokens must not depend on the level; a quantised export's (or another
    server's) may, and are counted instead (``differ``)."""
    import asyncio

    from tfport.tools import serve_bench as bench

    answers = {1: [5, 6], 4: [5, 7]}  # prompt 0 continues differently at 4 clients

    async def one(client, url, model, prompt, config, deadline, avoid=()):
        return 0.1, 0.2, answers[current], None

    monkeypatch.setattr(bench, "_one", one)
    reference, config = {}, bench.BenchConfig(requests=2, new_tokens=2)
    results = []
    for current in (1, 4):
        results.append(asyncio.run(bench._level("http://127.0.0.1:1", "m", [[3], [4]], current, config,
                                                float("inf"), reference, exact)))
    first, second = results
    assert (first.ok, first.failed, first.differ) == (2, 0, 0)
    if exact:
        assert (second.ok, second.failed, second.differ) == (0, 2, 0)
        assert "tokens differ" in second.errors[0]
    else:
        assert (second.ok, second.failed, second.differ) == (2, 0, 2)
        assert "2 of 2 responses' tokens differ" in bench.format_table(results)


def test_another_server_is_driven_with_plain_openai_fields(serve_exports):
    """``--url``: text prompts, the end ids biased away instead of tfport's ``ignore_eos``, tokens
    counted from a "length" finish; run here against tfport's own server on 127.0.0.1, which
    would refuse an unknown field."""
    from tfport.tools.serve_bench import BenchConfig, run_bench_serve
    from tfport.runtime.serve.options import ServeOptions

    from .conftest import running_server

    config = BenchConfig(concurrency=[1, 2], requests=3, new_tokens=6, prompt_len=(4, 12))
    with running_server([serve_exports["dec-ort"]]) as (url, _):
        results = run_bench_serve(serve_exports["dec-ort"], config, ServeOptions(), url=url)
    for r in results:
        assert (r.sent, r.ok, r.failed, r.tokens) == (3, 3, 0, 18), r
        assert 0 < r.ttft_p50 <= r.latency_p50
