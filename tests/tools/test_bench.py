"""``tfport bench``: one quick run end to end (never a speed), and the figures it derives checked
against numbers worked out by hand from model dimensions and literal timings."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tfport.cli import main
from tfport.tools import bench
from tfport.tools.bench import (Bandwidth, BenchResult, BenchSettings, Growth, MemoryMark, Row,
                                 RunTiming, Skipped)
from tfport.models import build_model
from tfport.presets import PRESETS

MIB = 2**20

# Fields of every measured row; None allowed only where listed.
NUMBERS = ("prefill_ms", "step_ms", "tokens_per_s", "kv_cache_mb", "peak_rss_mb",
           "roofline_tokens_per_s", "roofline_pct")
LISTS = ("prefill_ms_repeats", "step_ms_repeats")
FIELDS = {"side", "target", "batch", "context", "new_tokens", "ratio_vs_torch",
          "greedy_agreement", *NUMBERS, *LISTS}

# tiny-decoder (E 32, H 4, Hkv 2, D 8, FFN 64 gated, V 96, 2 layers, RMSNorm, no biases, untied
# head), counted on paper:
#   per layer: attn_norm 32 + qkv (4 + 2 + 2 heads x 8) x 32 = 2048 + out 32 x 32 = 1024
#              + ffn_norm 32 + gate, up, down 3 x 64 x 32 = 6144              -> 9280
#   2 layers 18560 + final norm 32 + lm_head 96 x 32 = 3072                    -> 21664 read
#   + token table 96 x 32 = 3072 (gathered, not read in full)                  -> 24736 in all
TINY_DECODER_PARAMETERS = 24736
TINY_DECODER_WEIGHT_BYTES = 21664 * 4  # float32


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


# ------------------------------------------------------------------------- one quick run
@pytest.fixture(scope="module")
def quick_json(tmp_path_factory):
    """One quick run with PyTorch, the portable target and a target no exporter knows."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main(["bench", "--quick", "--targets", "portable,no-such-target",
                 "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_quick_rows_cover_every_cell(quick_json):
    settings = quick_json["settings"]
    assert (settings["preset"], settings["batches"], settings["contexts"]) == (
        "tiny-decoder", [1, 2], [8, 32])
    cells = {(row["side"], row["target"], row["batch"], row["context"])
             for row in quick_json["rows"]}
    expected = {(side, target, b, c) for side, target in (("tfport", "portable"), ("torch", None))
                for b in (1, 2) for c in (8, 32)}
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
        if row["side"] == "torch":
            assert row["ratio_vs_torch"] is None and row["greedy_agreement"] is None
        else:
            assert positive(row["ratio_vs_torch"]) and 0 <= row["greedy_agreement"] <= 1


def test_quick_model_and_cache_sizes_match_hand_counts(quick_json):
    model = quick_json["model"]
    assert model["parameters"] == TINY_DECODER_PARAMETERS
    assert model["weight_bytes_per_token"] == TINY_DECODER_WEIGHT_BYTES
    # K and V x 2 layers x B x Hkv 2 x C x D 8 x 4 bytes = 256 x B x C bytes.
    kv_bytes = {(1, 8): 2048, (1, 32): 8192, (2, 8): 4096, (2, 32): 16384}
    for row in quick_json["rows"]:
        assert row["kv_cache_mb"] * MIB == kv_bytes[(row["batch"], row["context"])], row


def test_quick_roofline_grows_with_the_batch(quick_json):
    """Batch B reads the weights once for B tokens: the roofline at batch 2 is twice batch 1's."""
    roofline = {(r["side"], r["context"], r["batch"]): r["roofline_tokens_per_s"]
                for r in quick_json["rows"]}
    for side in ("tfport", "torch"):
        for context in (8, 32):
            assert roofline[(side, context, 2)] == pytest.approx(2 * roofline[(side, context, 1)])


def test_quick_growth_skips_and_memory(quick_json):
    pairs = sorted((g["side"], g["batch"], g["from_context"], g["to_context"])
                   for g in quick_json["growth"])
    assert pairs == [("tfport", 1, 8, 32), ("tfport", 2, 8, 32),
                     ("torch", 1, 8, 32), ("torch", 2, 8, 32)]
    assert all(positive(g["ratio"]) for g in quick_json["growth"])
    [skipped] = quick_json["skipped"]
    assert skipped["target"] == "no-such-target" and "no-such-target" in skipped["reason"]
    assert [m["phase"] for m in quick_json["memory"]] == [
        "start", "model built", "exported", "sessions loaded", "decode runs", "bandwidth"]
    assert all(positive(m["peak_rss_mb"]) for m in quick_json["memory"])
    assert quick_json["plot"] is None


def test_module_entry_point_without_torch(tmp_path):
    """``python -m tfport.tools.bench`` runs the bench; --no-torch leaves ratios empty."""
    path = tmp_path / "out" / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tfport.tools.bench", "--quick", "--no-torch", "--batch", "1",
         "--contexts", "8", "--json", str(path), "--plot", str(tmp_path / "steps.png")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(path.read_text())
    assert [(r["side"], r["batch"], r["context"]) for r in data["rows"]] == [("tfport", 1, 8)]
    assert data["rows"][0]["ratio_vs_torch"] is None and data["growth"] == []
    assert data["plot"].startswith(("wrote", "skipped (matplotlib is not installed)"))
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temporary left
    assert "% roofline" in proc.stdout and f"wrote {path}" in proc.stdout


@pytest.mark.parametrize("argv,needle", [
    (["--contexts", "64"], "max_positions=64"),  # 64 + new tokens + 1 > tiny-decoder's 64
    (["--preset", "tiny-encoder"], "decoder-only"),
    (["--batch", "1", "--threads", "0"], "threads=0"),
])
def test_bad_settings_are_refused(argv, needle, capsys):
    assert main(["bench", "--quick", *argv]) == 2
    assert needle in capsys.readouterr().err


# ------------------------------------------------------------ bytes counted by hand
# tiny-decoder-gpt2 (E 32, H = Hkv = 4, D 8, FFN 64 ungated, V 96, 64 learned positions, 2
# layers, LayerNorm, biases, tied head), counted on paper:
#   per layer: attn_norm 2 x 32 = 64 + qkv 96 x 32 + 96 = 3168 + out 32 x 32 + 32 = 1056
#              + ffn_norm 64 + up 64 x 32 + 64 = 2112 + down 32 x 64 + 32 = 2080     -> 8544
#   2 layers 17088 + final norm 64 + the tied token table 96 x 32 = 3072, read in full as the
#   head                                                                              -> 20224
#   (the 64 x 32 position table is gathered: not counted)
@pytest.mark.parametrize("preset,weights", [
    ("tiny-decoder", TINY_DECODER_WEIGHT_BYTES),  # untied head: the token table is not read
    ("tiny-decoder-gpt2", 20224 * 4),
])
def test_weight_bytes_per_token_match_a_count_on_paper(preset, weights):
    assert bench.weight_bytes_per_token(build_model(PRESETS[preset], seed=0)) == weights


@pytest.mark.parametrize("preset,batch,length,expected", [
    # K and V x 2 layers x B 3 x Hkv 2 x T 10 x D 8 x 4 bytes
    ("tiny-decoder", 3, 10, 2 * 2 * 3 * 2 * 10 * 8 * 4),  # 7680
    # MHA: Hkv = H = 4; K and V x 2 layers x B 1 x 4 x T 64 x D 8 x 4 bytes
    ("tiny-decoder-gpt2", 1, 64, 2 * 2 * 1 * 4 * 64 * 8 * 4),  # 32768
])
def test_kv_cache_bytes_from_the_cache_shape(preset, batch, length, expected):
    assert bench.kv_cache_bytes(build_model(PRESETS[preset], seed=0), batch, length) == expected


# ------------------------------------------------------------------- figures by hand
def test_bandwidth_uses_the_larger_measurement():
    gemv = Bandwidth(numpy_read_gbps=44.2, ort_gemv_gbps=47.3, read_mib=1024, gemv_mib=256,
                     threads=2)
    assert (gemv.gbps, gemv.source) == (47.3, "ORT GEMV")
    assert gemv.to_dict() == {"numpy_read_gbps": 44.2, "ort_gemv_gbps": 47.3, "read_mib": 1024,
                              "gemv_mib": 256, "threads": 2, "used_gbps": 47.3,
                              "source": "ORT GEMV"}
    read = Bandwidth(40.0, 30.0, 16, 8, 1)
    assert (read.gbps, read.source) == (40.0, "numpy read")


def test_row_medians_and_roofline_from_literal_timings():
    last = np.array([[5, 6, 7, 8]] * 8)
    runs = [RunTiming(10.0, [4.0, 5.0, 9.0], last), RunTiming(12.0, [5.0, 5.5, 6.0], last),
            RunTiming(11.0, [4.5, 4.8, 5.0], last)]
    row = bench.make_row("tfport", "portable", 8, 64, runs, kv_bytes=2 * MIB)
    assert row.new_tokens == 3 and row.label == "tfport[portable]"
    assert row.prefill_ms_repeats == [10.0, 12.0, 11.0] and row.prefill_ms == 11.0
    assert row.step_ms_repeats == [5.0, 5.5, 4.8]  # each run's median step
    assert row.step_ms == 5.0  # their median
    assert row.tokens_per_s == pytest.approx(1600.0)  # 8 tokens every 5 ms
    assert row.kv_cache_mb == 2.0 and row.tokens is last and positive(row.peak_rss_mb)
    # 8 tokens per read of 100 MB of weights at 40 GB/s (the larger of 40 and 30):
    # 8 x 40e9 / 100e6 = 3200 tokens/s, of which 1600 is 50%.
    bench.fill_roofline([row], 100_000_000, Bandwidth(40.0, 30.0, 16, 8, 1))
    assert row.roofline_tokens_per_s == pytest.approx(3200.0)
    assert row.roofline_pct == pytest.approx(50.0)


def hand_row(side: str, context: int, step_ms: float, tokens_per_s: float, **fields) -> Row:
    return Row(side=side, target="portable" if side == "tfport" else None, batch=1,
               context=context, new_tokens=32, prefill_ms=12.5, step_ms=step_ms,
               tokens_per_s=tokens_per_s, prefill_ms_repeats=[12.5], step_ms_repeats=[step_ms],
               kv_cache_mb=0.5, peak_rss_mb=512.0, **fields)


def test_comparisons_and_growth_from_hand_rows():
    rows = [
        hand_row("tfport", 64, 5.0, 200.0, tokens=np.array([[5, 6], [7, 8]])),
        hand_row("torch", 64, 10.0, 100.0, tokens=np.array([[5, 6], [7, 9]])),
        hand_row("tfport", 256, 5.5, 181.8),
        hand_row("tfport", 1024, 6.5, 153.8),
    ]
    bench.fill_comparisons(rows)
    assert rows[0].ratio_vs_torch == pytest.approx(2.0)  # 200 / 100 tokens/s
    assert rows[0].greedy_agreement == 0.75  # 3 of the 4 tokens agree
    assert rows[1].ratio_vs_torch is None and rows[1].greedy_agreement is None  # the reference
    assert rows[2].ratio_vs_torch is None  # no PyTorch row at context 256
    # tfport: 6.5 ms at context 1024 over 5.0 ms at 64; torch ran one context: no growth.
    [growth] = bench.step_growth(rows)
    assert (growth.side, growth.target, growth.batch, growth.from_context,
            growth.to_context) == ("tfport", "portable", 1, 64, 1024)
    assert growth.ratio == pytest.approx(1.3)


@pytest.fixture
def hand_result() -> BenchResult:
    """A llama-55m result as docs/benchmarks.md's: 155.7 MB of weights per step, 47.3 GB/s (ORT GEMV)."""
    rows = [
        hand_row("tfport", 64, 4.0, 250.0, roofline_tokens_per_s=303.8, roofline_pct=82.3,
                 ratio_vs_torch=1.5, greedy_agreement=1.0, tokens=np.zeros((1, 33))),
        hand_row("torch", 64, 6.0, 166.7, roofline_tokens_per_s=303.8, roofline_pct=54.9,
                 tokens=np.zeros((1, 33))),
    ]
    return BenchResult(
        settings=BenchSettings(),
        machine={"load_average_before": [0.5, 0.4, 0.3], "load_average_after": [1.0, 0.6, 0.4],
                 "usable_cpus": 2},
        model={"preset": "llama-55m", "dtype": "float32", "parameters": 55_000_000,
               "weight_bytes_per_token": 155_700_000},
        bandwidth=Bandwidth(44.2, 47.3, 1024, 256, 2),
        rows=rows,
        growth=[Growth("tfport", "portable", 1, 64, 1024, 1.3),
                Growth("torch", None, 1, 64, 1024, 1.05)],
        memory=[MemoryMark("start", 358.4, 357.9), MemoryMark("bandwidth", None, 442.0)],
        skipped=[Skipped("ort", "export: head_dim=8: expected a multiple of 16\nmore detail")])


def test_table_from_a_hand_made_result(hand_result):
    lines = bench.format_table(hand_result).splitlines()
    assert "55,000,000 parameters, 155.7 MB of weights read per step" in lines[0]
    assert "2 thread(s), 32 timed steps, median of 5 repeat(s)" in lines[0]
    assert "the roofline uses ORT GEMV (47.3 GB/s)" in lines[1]
    assert lines[2].startswith("roofline: 304 tokens/s at batch 1")  # 47.3e9 / 155.7e6 = 303.8
    cells = [line.split() for line in lines]
    assert ["tfport[portable]", "1", "64", "12.5", "4.00", "250.0", "82.3%", "1.50x",
            "512"] in cells
    assert ["torch", "1", "64", "12.5", "6.00", "166.7", "54.9%", "-", "512"] in cells
    [skipped] = [line for line in lines if line.startswith("tfport[ort]")]
    assert skipped.split(None, 1)[1] == "skipped: export: head_dim=8: expected a multiple of 16"
    assert not any("more detail" in line for line in lines)  # a reason's first line only
    assert "step time at context 1024 / context 64 (the issue's target: <= 1.3):" in lines
    assert "  tfport[portable] batch 1: 1.30" in lines and "  torch batch 1: 1.05" in lines
    assert lines[-1] == ("process memory, MiB (current RSS / peak so far): start 358/358, "
                         "bandwidth -/442")
    assert not any(line.startswith("note:") for line in lines)


def test_table_notes_rows_over_the_roofline(hand_result):
    hand_result.rows[0].roofline_pct = 110.0
    notes = [line for line in bench.format_table(hand_result).splitlines()
             if line.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: 1 row(s) exceed 100% of the roofline")
    assert "read weights at up to 52.0 GB/s" in notes[0]  # 110% of 47.3 GB/s


def test_json_from_a_hand_made_result(hand_result, tmp_path):
    path = bench.write_json(hand_result, tmp_path / "out" / "bench.json")
    data = json.loads(path.read_text())
    assert data["format"] == "tfport-bench/1"
    assert data["settings"]["preset"] == "llama-55m" and data["settings"]["targets"] == [
        "portable"]
    assert data["model"]["weight_bytes_per_token"] == 155_700_000
    assert data["bandwidth"]["used_gbps"] == 47.3 and data["bandwidth"]["source"] == "ORT GEMV"
    assert data["rows"][0] == {
        "side": "tfport", "target": "portable", "batch": 1, "context": 64, "new_tokens": 32,
        "prefill_ms": 12.5, "step_ms": 4.0, "tokens_per_s": 250.0, "prefill_ms_repeats": [12.5],
        "step_ms_repeats": [4.0], "kv_cache_mb": 0.5, "peak_rss_mb": 512.0,
        "roofline_tokens_per_s": 303.8, "roofline_pct": 82.3, "ratio_vs_torch": 1.5,
        "greedy_agreement": 1.0}  # the greedy tokens stay out of the JSON
    assert data["rows"][1]["side"] == "torch" and data["rows"][1]["target"] is None
    assert data["growth"][0] == {"side": "tfport", "target": "portable", "batch": 1,
                                 "from_context": 64, "to_context": 1024, "ratio": 1.3}
    assert data["memory"][1] == {"phase": "bandwidth", "rss_mb": None, "peak_rss_mb": 442.0}
    assert data["skipped"][0]["target"] == "ort" and data["plot"] is None
    assert [p.name for p in path.parent.iterdir()] == ["bench.json"]  # no temporary left


def test_bench_dtype_is_checked_and_reaches_the_exports(tmp_path):
    with pytest.raises(ValueError, match="dtype='int8': expected one of"):
        BenchSettings(dtype="int8")
    out = tmp_path / "r.json"
    assert main(["bench", "--quick", "--dtype", "float16", "--targets", "portable", "--no-torch",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["dtype"] == "float16" and result["model"]["dtype"] == "float16"
