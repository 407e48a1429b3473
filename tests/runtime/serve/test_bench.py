"""``tfport bench-serve``: a short run against a server it starts on 127.0.0.1."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="needs the 'serve' extra: pip install -e '.[serve]'")
pytest.importorskip("httpx", reason="needs the 'serve' extra (httpx)")

from tfport.cli import main  # noqa: E402
from tfport.runtime.serve.bench import check_loopback  # noqa: E402


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
