"""``tfport bench --pareto`` (export/bench/pareto.py): layout names, the front, the SVG, and a
seconds-long run on a tiny checkpoint with a tokenizer (its speeds mean nothing; its perplexities
are checked against the module's own, computed here)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from tests.export.text_models import perturbed, word_tokenizer
from tests.matrix import matrix_config
from tfport.tools.bench.pareto import Point, default_rule, layout_options, mark_front, write_svg


def test_layout_names():
    assert layout_options("default") == {"quantize": "int4"}
    assert layout_options("w8a8") == {"quantize": "w8a8", "calibration": "none"}
    assert layout_options("gptq64-zp-h8") == {"quantize": "int4", "block_size": 64, "symmetric": False,
                                              "calibration": "builtin", "head_bits": 8}
    assert layout_options("rtn32-sym") == {"quantize": "int4", "block_size": 32, "symmetric": True,
                                           "calibration": "none"}
    assert layout_options("gptq128-sym-h8-hb64") == {"quantize": "int4", "block_size": 128, "symmetric": True,
                                                     "calibration": "builtin", "head_bits": 8, "head_block_size": 64}
    assert layout_options("rtn128-sym-hb32")["head_block_size"] == 32
    assert layout_options("keep") == {"quantize": "keep"}
    assert layout_options("keep-float") == {"quantize": "keep", "activations": "float"}
    assert layout_options("default-mixed") == {"quantize": "int4", "activations": "mixed"}
    assert layout_options("gptq32-sym-float") == {**layout_options("gptq32-sym"), "activations": "float"}
    for bad in ("gptq33-sym", "gptq32", "awq32-sym", "int2", "gptq128-sym-hb48", "gptq128-sym-hb", "-float",
                "float", "keep-float-float", "keep-mixed-float", "-mixed"):
        with pytest.raises(ValueError, match=f"--layouts {bad!r}: expected"):
            layout_options(bad)


def point(label, engine, tps, increase, kl=None, answers=None):
    return Point(label, engine, tps, 10 * (1 + increase), increase, [1e3 / tps], kl, None, answers)


def test_the_front_and_the_peer_matches():
    points = [point("a", "tfport", 100, 0.10), point("b", "tfport", 80, 0.05), point("c", "tfport", 90, 0.20),
              point("p", "onnxruntime-genai", 95, 0.30), point("q", "llama.cpp", 120, 0.15),
              point("r", "llama.cpp", 85, 0.08)]
    mark_front(points, "perplexity")
    by = {p.label: p for p in points}
    # c: a is faster and more accurate; p: a again; q is the fastest, r more accurate than a
    assert {p.label for p in points if p.on_front} == {"a", "b", "q", "r"}
    assert by["p"].matched_by == "a"
    assert by["q"].matched_by is None  # nothing of tfport's is as fast
    assert by["r"].matched_by is None  # a is faster but less accurate, b more accurate but slower

def test_the_front_on_kl_and_the_default_rule():
    """The same points judged by KL instead: a point with more perplexity but less KL moves onto
    the front; the rule takes the lowest KL among tfport points at least as fast as the peer that
    keep 9 of 10 answers."""
    points = [point("fast", "tfport", 120, 0.13, kl=0.12, answers=0.0), point("h8", "tfport", 100, 0.09, kl=0.09,
                                                                              answers=0.9),
              point("b32", "tfport", 101, 0.08, kl=0.10, answers=1.0), point("slow", "tfport", 90, 0.05, kl=0.05,
                                                                             answers=1.0),
              point("peer", "onnxruntime-genai", 99, 0.30, kl=0.36, answers=0.0)]
    mark_front(points, "kl")
    by = {p.label: p for p in points}
    assert {p.label for p in points if p.on_front} == {"fast", "h8", "b32", "slow"}
    mark_front(points, "perplexity")
    assert not by["h8"].on_front  # b32 is faster with less perplexity
    assert by["peer"].matched_by == "fast"
    assert default_rule(points).label == "h8"  # fast changes the answers, slow is slower than the peer
    by["h8"].answers = 0.8
    assert default_rule(points).label == "b32"
    by["b32"].tokens_per_s = 98.0
    assert default_rule(points) is None
    with pytest.raises(ValueError, match="--metric 'nll': expected one of kl, perplexity, top1"):
        mark_front(points, "nll")


def test_a_run_on_a_tiny_checkpoint(tmp_path, capsys):
    from tfport.cli import main
    from tfport.tools.parity.accuracy import perplexity, reference_logits
    from tfport.models.checkpoint import save_checkpoint

    config = matrix_config("decoder", "rope", "gqa").replace(d_model=64, max_positions=512)
    model = perturbed(config)
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(model, checkpoint)
    tokenizer = word_tokenizer(config.vocab_size, checkpoint / "tokenizer.json")
    text = tmp_path / "text.txt"
    text.write_text("The model reads this text and the next word is predicted from the words before it. " * 4)
    assert main(["bench", "--pareto", "--source", str(checkpoint), "--layouts", "rtn32-sym,int8",
                 "--text", str(text), "--repeats", "1", "--new-tokens", "4", "--plot", str(tmp_path / "p.svg"),
                 "--json", str(tmp_path / "p.json"), "--targets", "portable"]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "p.json").read_text())
    ids = np.array(tokenizer.encode(text.read_text()).ids, dtype=np.int64)
    assert result["tokens"] == len(ids)
    assert result["float32_perplexity"] == pytest.approx(perplexity(reference_logits(model, ids), ids), rel=1e-9)
    labels = [p["label"] for p in result["points"]]
    assert labels == ["tfport float32", "tfport rtn32-sym", "tfport int8"]
    float32 = result["points"][0]
    assert float32["increase"] == pytest.approx(0, abs=1e-4)  # the float export computes what the module does
    assert all(p["tokens_per_s"] > 0 and np.isfinite(p["perplexity"]) for p in result["points"])
    assert float32["kl_mean"] == pytest.approx(0, abs=1e-6) and float32["top1"] == 1.0
    assert all(p["answers"] is None for p in result["points"])  # no chat template: not measured
    # rtn32-sym's KL and top-1 against an independent computation: the same export made here,
    # torch's KL on the module's and the export's logits
    import torch

    from tfport.export import ExportOptions, export_model
    from tfport.tools.parity.accuracy import export_logits

    export_model(model, tmp_path / "rtn", ExportOptions(target="portable", quantize="int4", block_size=32,
                                                        symmetric=True, calibration="none", validate=False))
    p = torch.log_softmax(torch.from_numpy(reference_logits(model, ids)[:-1]).double(), -1)
    q = torch.log_softmax(torch.from_numpy(export_logits(tmp_path / "rtn", ids)[:-1]).double(), -1)
    kl = torch.nn.functional.kl_div(q, p, log_target=True, reduction="batchmean").item()
    rtn = result["points"][1]
    assert rtn["kl_mean"] == pytest.approx(kl, rel=1e-6) and rtn["kl_mean"] > 0
    assert rtn["top1"] == pytest.approx(float((p.argmax(-1) == q.argmax(-1)).double().mean()))
    assert "tfport rtn32-sym" in out and "front" in out
    svg = ET.parse(tmp_path / "p.svg").getroot()
    assert len(svg.findall("{http://www.w3.org/2000/svg}circle")) == 3


def test_refusals(tmp_path):
    from tfport.cli import main

    assert main(["bench", "--layouts", "int8"]) == 2  # --layouts applies with --pareto
    assert main(["bench", "--pareto"]) == 2  # --pareto needs --source
    assert main(["bench", "--pareto", "--source", "tiny-decoder", "--layouts", "gptq7-sym"]) == 2
    assert not list(tmp_path.iterdir())


def test_svg_is_written_atomically_and_escapes_labels(tmp_path):
    result = {"text": "a<b>.txt", "points": [point("tfport <x>", "tfport", 10, 0.1).__dict__,
                                             point("peer & co", "llama.cpp", 12, 0.2).__dict__]}
    mark_front([Point(**p) for p in result["points"]], "perplexity")
    path = write_svg(result, tmp_path / "plot.svg")  # a result without "metric" (before KL): perplexity
    root = ET.parse(path).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "tfport <x>" in texts and "peer & co" in texts
    assert [p.name for p in tmp_path.iterdir()] == ["plot.svg"]
