"""``tfport parity DIR --against SOURCE``: the table, the JSON, failures with localisation."""

from __future__ import annotations

import json

import onnx
from onnx import numpy_helper

from tests.matrix import ort_config
from tfport.cli import main
from tfport.export import ExportOptions, export_model
from tfport.export.parity import CASES
from tfport.models import build_model
from tfport.models.checkpoint import save_checkpoint
from tfport.presets import PRESETS


def run(args, capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().out


def test_matching_export_passes_and_writes_json(tmp_path, capsys):
    model = build_model(PRESETS["tiny-encoder-decoder"], seed=3)
    export_model(model, tmp_path / "out")
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    code, out = run(["parity", str(tmp_path / "out"), "--against", str(ckpt), "--providers", "cpu,cuda",
                     "--json", str(tmp_path / "p.json")], capsys)
    assert code == 0, out
    report = json.loads((tmp_path / "p.json").read_text())
    rows = [r for r in report["rows"] if "skipped" not in r]
    assert len(rows) == 2 * len(CASES) and all(r["ok"] for r in rows)  # encoder + decoder per case
    assert {r["graph"] for r in rows} == {"encoder", "decoder"}
    cuda = [r for r in report["rows"] if r["provider"] == "cuda"]
    assert cuda and ("skipped" in cuda[0] or cuda[0].get("ok") is not None)


def test_mismatch_fails_and_names_the_diverging_piece(tmp_path, capsys):
    model = build_model(PRESETS["tiny-decoder"], seed=4)
    export_model(model, tmp_path / "out")
    path = tmp_path / "out" / "decoder.onnx"
    proto = onnx.load(str(path))
    for tensor in proto.graph.initializer:
        if tensor.name == "decoder.layers.1.ffn.down.weight_t":
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * 1.5, tensor.name))
    onnx.save(proto, str(path))
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    code, out = run(["parity", str(tmp_path / "out"), "--against", str(ckpt),
                     "--json", str(tmp_path / "p.json")], capsys)
    assert code == 1
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert all(not r["ok"] for r in rows)
    assert all(r["first_divergence"].startswith("layer 1 of decoder, FFN") for r in rows)
    assert "MISMATCH: layer 1 of decoder, FFN" in out


def test_rows_name_the_case_that_ran(tmp_path, capsys):
    """Target "ort" runs a chunk on top of a past with batch 1 (the kernel's limit): say so."""
    model = build_model(ort_config("gqa"), seed=5)
    export_model(model, tmp_path / "out", ExportOptions(target="ort"))
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    code, _ = run(["parity", str(tmp_path / "out"), "--against", str(ckpt),
                   "--json", str(tmp_path / "p.json")], capsys)
    assert code == 0
    labels = [r["case"] for r in json.loads((tmp_path / "p.json").read_text())["rows"]]
    chunks = [c.label for c in CASES if c.past and c.new > 1]
    assert all(label.replace("B3", "B1") in labels for label in chunks)
    assert not any(label in labels for label in chunks)


def test_config_mismatch_is_refused(tmp_path, capsys):
    export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "out")
    code = main(["parity", str(tmp_path / "out"), "--against", "tiny-decoder-mqa"])
    assert code == 2
    assert "config differs" in capsys.readouterr().err


def test_first_divergence_names_the_piece():
    from tfport.export.parity.cases import Diff
    from tfport.export.parity.localize import first_divergence

    ok = Diff("encoder.layers.0.attn.content_term", 0.0, 0.0, True)
    bad = Diff("encoder.layers.2.attn.content_term", 0.5, 0.1, False)
    assert first_divergence([ok]) is None
    assert first_divergence([ok, bad]).startswith("layer 2 of encoder, disentangled position bias")
    assert first_divergence([Diff("decoder.layers.1.ffn_norm", 1.0, 1.0, False)]).startswith("layer 1 of decoder, norm")


def test_nothing_checked_is_an_error_and_options_that_would_be_ignored_are_refused(tmp_path, capsys):
    """No provider given, or none that can run (CUDA on a machine without it), checks nothing:
    exit 2, not a pass; --calibration for an export that was not calibrated is refused."""
    from tfport.export.validate import cuda_available

    export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "out")
    args = ["parity", str(tmp_path / "out"), "--against", "tiny-decoder"]
    assert main([*args, "--providers", " , "]) == 2
    assert "--providers=' , ': expected one or more of cpu, cuda" in capsys.readouterr().err
    if not cuda_available()[0]:
        assert main([*args, "--providers", "cuda"]) == 2
        assert "nothing was checked" in capsys.readouterr().err
    assert main([*args, "--calibration", str(tmp_path / "text.txt")]) == 2
    assert "was not calibrated" in capsys.readouterr().err


def test_accuracy_greedy_agreement_is_greedy_whatever_the_generation_config_says(tmp_path, capsys):
    """An export whose generation_config.json samples with a repetition penalty: --accuracy's
    greedy column still decodes greedily and unpenalised, so a float32 export agrees with its
    reference on every token (sampling: ~0%)."""
    from tests.runtime.runtime_cases import write_tokenizer
    from tfport.generation import GenerationDefaults

    config = PRESETS["tiny-decoder"]
    export_model(build_model(config, seed=0), tmp_path / "out", ExportOptions(
        tokenizer=write_tokenizer(tmp_path / "t.json", config),
        generation=GenerationDefaults(do_sample=True, temperature=1.5, top_k=0, repetition_penalty=1.8)))
    code, out = run(["parity", str(tmp_path / "out"), "--against", "tiny-decoder", "--accuracy"], capsys)
    assert code == 0, out
    row = next(line for line in out.splitlines() if line.startswith("export ("))
    perplexity_ratio, kl, top1, agreement, answers = row.split()[-5:]
    assert (perplexity_ratio, agreement) == ("1.000", "100%"), row
    assert (float(kl), top1, answers) == (0.0, "100.0%", "-"), row  # no chat template: answers not measured
