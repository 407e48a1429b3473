"""``tfport bench``: the quick mode's JSON is complete and self-consistent (never a speed)."""

from __future__ import annotations

import json
import math

import pytest

from tfport.cli import main
from tfport.export import bench
from tfport.models import build_model
from tfport.presets import PRESETS

# Fields of every measured row; None allowed only where listed.
NUMBERS = ("prefill_ms", "step_ms", "tokens_per_s", "kv_cache_mb", "peak_rss_mb",
           "roofline_tokens_per_s", "roofline_pct")
LISTS = ("prefill_ms_repeats", "step_ms_repeats")
FIELDS = {"side", "target", "batch", "context", "new_tokens", "ratio_vs_torch",
          "greedy_agreement", *NUMBERS, *LISTS}


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
    """One quick run with PyTorch, the portable target and a target no exporter knows."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main(["bench", "--quick", "--targets", "portable,no-such-target",
                 "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_quick_rows_cover_every_cell(quick_json):
    settings = quick_json["settings"]
    cells = {(row["side"], row["target"], row["batch"], row["context"])
             for row in quick_json["rows"]}
    expected = {(side, target, b, c) for side, target in (("tfport", "portable"), ("torch", None))
                for b in settings["batches"] for c in settings["contexts"]}
    assert cells == expected and len(quick_json["rows"]) == len(expected)


def test_quick_rows_have_every_field(quick_json):
    for row in quick_json["rows"]:
        assert set(row) == FIELDS, row
        for name in NUMBERS:
            assert positive(row[name]), (name, row)
        for name in LISTS:
            assert len(row[name]) == quick_json["settings"]["repeats"]
            assert all(positive(v) for v in row[name]), (name, row)
        assert row["new_tokens"] == quick_json["settings"]["new_tokens"]


def test_quick_figures_are_consistent(quick_json):
    bandwidth = quick_json["bandwidth"]
    assert positive(bandwidth["numpy_read_gbps"]) and positive(bandwidth["ort_gemv_gbps"])
    assert bandwidth["used_gbps"] == max(bandwidth["numpy_read_gbps"], bandwidth["ort_gemv_gbps"])
    larger = "ORT GEMV" if bandwidth["ort_gemv_gbps"] > bandwidth["numpy_read_gbps"] else "numpy read"
    assert bandwidth["source"] == larger
    weight_bytes = quick_json["model"]["weight_bytes_per_token"]
    torch_rows = {(r["batch"], r["context"]): r for r in quick_json["rows"] if r["side"] == "torch"}
    for row in quick_json["rows"]:
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1e3 / row["step_ms"])
        roofline = row["batch"] * bandwidth["used_gbps"] * 1e9 / weight_bytes
        assert row["roofline_tokens_per_s"] == pytest.approx(roofline)
        assert row["roofline_pct"] == pytest.approx(100 * row["tokens_per_s"] / roofline)
        if row["side"] == "torch":
            assert row["ratio_vs_torch"] is None and row["greedy_agreement"] is None
        else:
            reference = torch_rows[(row["batch"], row["context"])]
            assert row["ratio_vs_torch"] == pytest.approx(
                row["tokens_per_s"] / reference["tokens_per_s"])
            assert 0 <= row["greedy_agreement"] <= 1


def test_quick_growth_skips_and_memory(quick_json):
    settings = quick_json["settings"]
    rows = {(r["side"], r["target"], r["batch"], r["context"]): r for r in quick_json["rows"]}
    short, long = min(settings["contexts"]), max(settings["contexts"])
    assert len(quick_json["growth"]) == 2 * len(settings["batches"])
    for g in quick_json["growth"]:
        assert (g["from_context"], g["to_context"]) == (short, long)
        expected = (rows[(g["side"], g["target"], g["batch"], long)]["step_ms"]
                    / rows[(g["side"], g["target"], g["batch"], short)]["step_ms"])
        assert g["ratio"] == pytest.approx(expected)
    [skipped] = quick_json["skipped"]
    assert skipped["target"] == "no-such-target" and "no-such-target" in skipped["reason"]
    assert [m["phase"] for m in quick_json["memory"]][-1] == "bandwidth"
    assert all(positive(m["peak_rss_mb"]) for m in quick_json["memory"])
    assert quick_json["plot"] is None


def test_module_entry_point_without_torch(tmp_path, capsys):
    """``python -m tfport.export.bench`` is ``bench.main``; --no-torch leaves ratios empty."""
    path = tmp_path / "out" / "bench.json"
    assert bench.main(["--quick", "--no-torch", "--batch", "1", "--contexts", "8",
                       "--json", str(path), "--plot", str(tmp_path / "steps.png")]) == 0
    data = json.loads(path.read_text())
    assert [(r["side"], r["batch"], r["context"]) for r in data["rows"]] == [("tfport", 1, 8)]
    assert data["rows"][0]["ratio_vs_torch"] is None and data["growth"] == []
    assert data["plot"].startswith(("wrote", "skipped (matplotlib is not installed)"))
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temporary left
    assert "% roofline" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["--contexts", "64"], "max_positions=64"),  # 64 + new tokens + 1 > tiny-decoder's 64
    (["--preset", "tiny-encoder"], "decoder-only"),
    (["--batch", "1", "--threads", "0"], "threads=0"),
])
def test_bad_settings_are_refused(argv, needle, capsys):
    assert main(["bench", "--quick", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("preset,excluded", [
    ("tiny-decoder", ("decoder.embed.tokens.weight",)),  # untied head: read in full
    ("tiny-decoder-gpt2", ("decoder.embed.positions.weight",)),  # tied: the table is the head
])
def test_weight_bytes_exclude_gathered_tables_only(preset, excluded):
    model = build_model(PRESETS[preset], seed=0)
    params = dict(model.named_parameters())  # shared (tied) tensors listed once
    expected = sum(p.numel() * 4 for name, p in params.items() if name not in excluded)
    assert bench.weight_bytes_per_token(model) == expected
