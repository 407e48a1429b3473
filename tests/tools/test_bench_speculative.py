"""``tfport bench --speculative`` (export/bench/speculative.py) on tiny models: every engine's row,
warm and cold, the tokens checked against plain decoding (a float target: identical), the
chunk-vs-steps logit difference, and the prefix caches the cold runs turn off restored."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tests.export.text_models import perturbed, word_tokenizer
from tests.matrix import matrix_config
from tfport.export import ExportOptions, export_model
from tfport.tools.bench.speculative import _cold, chunk_deviation, format_speculative, run_speculative
from tfport.runtime import load_model

TEMPLATE = ("{% for m in messages %}[BOS] {{ m['content'] }} [EOS] {% endfor %}"
            "{% if add_generation_prompt %}[BOS]{% endif %}")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-speculative")
    config = matrix_config("decoder", "rope", "gqa").replace(vocab_size=256, max_positions=512)
    word_tokenizer(config.vocab_size, root / "tokenizer.json")
    for name, seed in (("target", 0), ("draft", 1)):
        model = perturbed(config) if seed == 0 else perturbed(config.replace(n_decoder_layers=1))
        export_model(model, root / name, ExportOptions(tokenizer=root / "tokenizer.json", chat_template=TEMPLATE))
    return root


def _check(rows, engines):
    assert [(r["workload"], r["engine"]) for r in rows] == [
        (w, e) for w in ("grounded", "free") for e in ("tfport plain", *engines)]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["cold_tokens_per_s"] > 0
        if row["engine"] == "tfport plain":
            assert 0 <= row["chunk_deviation"] < 1e-4  # float32: rounding only
        if row["engine"] != "tfport plain":
            assert row["identical"] is True  # a float target: the same tokens as plain decoding
            assert 0 <= row["acceptance_rate"] <= 1 and row["tokens_per_forward"] >= 1


def test_every_engine_is_timed_warm_and_cold_with_the_plain_tokens(exports):
    result = run_speculative(exports / "target", ("lookup",), threads=1, repeats=1, max_new_tokens=12)
    _check(result["rows"], ["tfport lookup"])
    table = format_speculative(result)
    assert "cold" in table.splitlines()[0] and "cold: caches off, every run prefills it" in table


def test_a_draft_model_through_the_cli(exports, tmp_path):
    """In a child process: a draft model puts the process on ONNX Runtime's process-wide thread
    pool, which every later session of that process must use."""
    out = tmp_path / "spec.json"
    done = subprocess.run([sys.executable, "-m", "tfport.cli", "bench", "--speculative",
                           f"lookup,{exports / 'draft'}", "--export", str(exports / "target"), "--threads", "1",
                           "--repeats", "1", "--new-tokens", "12", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _check(json.loads(out.read_text())["rows"], ["tfport lookup", "tfport draft"])


class Shifted:
    """A row batch whose chunks' logits at one position are off by ``shift``."""

    def __init__(self, batch, position: int, shift: float):
        self.batch, self.position, self.shift = batch, position, shift

    def __getattr__(self, name):
        return getattr(self.batch, name)

    def extend(self, chunks):
        out = [np.array(logits) for logits in self.batch.extend(chunks)]
        out[0][self.position] += self.shift
        return out


def test_chunk_deviation_compares_each_position_of_a_chunk_with_its_step(exports):
    """The same tokens as a chunk and as steps differ by rounding only on a float export; a chunk
    whose third position is shifted by 0.5 reads as 0.5 apart."""
    model = load_model(exports / "target", intra_op_threads=1)
    ids, tokens = np.arange(5, 25), np.arange(30, 36)
    assert 0 <= chunk_deviation(model, ids, tokens) < 1e-4
    shifted = SimpleNamespace(config=model.config, runner=model.runner, decoding=SimpleNamespace(
        rows=lambda *args, **kwargs: Shifted(model.decoding.rows(*args, **kwargs), 2, 0.5)))
    assert chunk_deviation(shifted, ids, tokens) == pytest.approx(0.5, abs=1e-4)


def test_cold_turns_the_prefix_caches_off_and_restores_them():
    models = [SimpleNamespace(prefix_cache="a"), SimpleNamespace(prefix_cache="b")]
    with _cold(models):
        assert [m.prefix_cache for m in models] == [None, None]
    assert [m.prefix_cache for m in models] == ["a", "b"]
    with pytest.raises(KeyError), _cold(models):
        raise KeyError("restored on the way out too")
    assert [m.prefix_cache for m in models] == ["a", "b"]
