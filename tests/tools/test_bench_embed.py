"""``tfport bench --embed``: encoder exports' sentences per second by batch size (its speeds
mean nothing at --quick; what is tested is what it runs and reports)."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from tfport.export import ExportOptions, export_model
from tfport.tools.bench.embed import EmbedSettings, _embed_all
from tfport.models import build_model
from tfport.presets import PRESETS


def test_every_sentence_is_embedded_in_batches_of_the_size():
    class Recorder:
        def __init__(self):
            self.shapes = []

        def embed(self, ids):
            self.shapes.append(ids.shape)

    ids = np.arange(14).reshape(7, 2)
    model = Recorder()
    assert _embed_all(model, ids, 3) >= 0
    assert model.shapes == [(3, 2), (3, 2), (1, 2)]


def test_the_cli_times_each_export_at_each_batch(tmp_path, capsys):
    from tfport.cli import main

    encoder, decoder = tmp_path / "encoder", tmp_path / "decoder"
    export_model(build_model(PRESETS["tiny-encoder"], seed=0), encoder, ExportOptions(validate=False))
    export_model(build_model(PRESETS["tiny-encoder"], seed=1), tmp_path / "int8",
                 ExportOptions(quantize="int8", validate=False))
    out = tmp_path / "embed.json"
    assert main(["bench", "--embed", f"{encoder},{tmp_path / 'int8'}", "--quick", "--batch", "1,3",
                 "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["format"] == "tfport-bench-embed/1"
    assert [(r["export"], r["quantization"], r["batch"]) for r in result["rows"]] == [
        (str(encoder), "float32", 1), (str(tmp_path / "int8"), "int8", 1),
        (str(encoder), "float32", 3), (str(tmp_path / "int8"), "int8", 3)]
    for row in result["rows"]:
        assert len(row["seconds_repeats"]) == 2 and min(row["seconds_repeats"]) > 0
        assert row["sentences_per_s"] == pytest.approx(4 / statistics.median(row["seconds_repeats"]))
    assert "sentences/s" in capsys.readouterr().out

    export_model(build_model(PRESETS["tiny-decoder"], seed=0), decoder, ExportOptions(validate=False))
    assert main(["bench", "--embed", str(decoder), "--quick"]) == 2
    assert f"--embed {str(decoder)!r}: a decoder export; expected encoder exports" in capsys.readouterr().err


@pytest.mark.parametrize("field,value", [("batches", ()), ("batches", (0,)), ("length", 0), ("repeats", True),
                                         ("settle_ms", -1)])
def test_settings_refuse_bad_values(field, value):
    with pytest.raises(ValueError, match=f"{field}="):
        EmbedSettings(**{field: value})
