"""``load_model(DIR, batch_export=OTHER, batch_rows=N)``: runs of at least N rows (batch x new
tokens) go to another export of the same model (int4 beside w8a8 here), the others to DIR's own.

Which session ran is told apart by the logits: the two quantisations of one tiny model differ
everywhere, so a run's logits are bitwise those of one export alone or of the other.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.matrix import matrix_config, ort_config
from tfport.export import ExportOptions, export_model
from tfport.models import build_model
from tfport.runtime import load_model
from tfport.runtime.sampling import Logprobs

TARGETS = {"ort": ort_config("gqa"), "portable": matrix_config("decoder", "rope", "gqa")}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """target -> (int4 export, w8a8 export) of one tiny decoder."""
    made = {}
    for target, config in TARGETS.items():
        model = build_model(config, seed=0)
        root = tmp_path_factory.mktemp(f"batch-{target}")
        for quantize in ("int4", "w8a8"):
            export_model(model, root / quantize, ExportOptions(target=target, quantize=quantize, block_size=16)
                         if quantize == "int4" else ExportOptions(target=target, quantize=quantize))
        made[target] = (root / "int4", root / "w8a8")
    return made


def _prompts(config, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, config.vocab_size, size=n).tolist() for n in lengths]


@pytest.mark.parametrize("target", list(TARGETS))
def test_generate_runs_many_rows_on_the_batch_export(target, exports):
    """A batch of 3 (every run >= 3 rows) decodes as the w8a8 export alone; one 2-token prompt
    (a 2-row prefill, then 1-row steps) as the int4 export alone."""
    int4, w8a8 = exports[target]
    mixed = load_model(int4, batch_export=w8a8, batch_rows=3)
    alone = {"int4": load_model(int4), "w8a8": load_model(w8a8)}
    assert mixed.batch_manifest.quantization["format"] == "w8a8"
    config = TARGETS[target]
    for prompts, expected in ((_prompts(config, (4, 6, 5)), "w8a8"), (_prompts(config, (2,)), "int4")):
        got = {}
        for name, model in (("mixed", mixed), *alone.items()):
            logprobs = Logprobs()
            tokens = model.generate(prompts, max_new_tokens=8, stop_token_ids=(), logprobs=logprobs)
            got[name] = (tokens, logprobs.arrays()[0])
        assert np.array_equal(got["mixed"][0], got[expected][0]), (expected, got)
        assert np.array_equal(got["mixed"][1], got[expected][1])  # the chosen tokens' log-probabilities
        assert not np.array_equal(got["int4"][1], got["w8a8"][1])  # or the check above proves nothing


@pytest.mark.parametrize("target", list(TARGETS))
def test_the_row_batch_picks_a_session_per_run(target, exports):
    """The served engine's row batch: a 2-token prompt's prefill and its 1-row steps on int4, a
    5-token prompt's prefill on w8a8, bitwise the logits of each export alone."""
    int4, w8a8 = exports[target]
    mixed = load_model(int4, batch_export=w8a8, batch_rows=3)
    short, long = _prompts(TARGETS[target], (2, 5), seed=1)

    def logits(model, prompt, steps=0):
        rows = model.decoding.rows(model.runners["decoder"], 2, 32, 0)
        _, first = rows.add(np.array(prompt))
        out = [first.copy()]
        for _ in range(steps):
            out.append(np.array(rows.step(np.array([int(out[-1].argmax())]))[0]))
        return out

    alone_int4, alone_w8a8 = load_model(int4), load_model(w8a8)
    for got, want in zip(logits(mixed, short, 3), logits(alone_int4, short, 3)):
        assert np.array_equal(got, want)
    assert np.array_equal(logits(mixed, long)[0], logits(alone_w8a8, long)[0])
    assert not np.array_equal(logits(alone_int4, long)[0], logits(alone_w8a8, long)[0])


def test_runs_are_counted_by_export_and_reported_in_metrics(exports):
    """``GraphRunner.runs`` counts where each run went; ``/metrics`` reports it per model."""
    pytest.importorskip("prometheus_client", reason="the 'serve' extra")
    from types import SimpleNamespace

    from tfport.runtime.serve.metrics import ServeMetrics

    int4, w8a8 = exports["ort"]
    mixed = load_model(int4, batch_export=w8a8, batch_rows=3)
    runner = mixed.runners["decoder"]
    rows = mixed.decoding.rows(runner, 3, 32, 0)
    for prompt in _prompts(TARGETS["ort"], (2, 5)):  # prefills: 2 rows (own), 5 rows (batch)
        rows.add(np.array(prompt))
    rows.step(np.array([5, 6]))  # 2 rows: own
    assert runner.runs == {"own": 2, "batch": 1}
    metrics = ServeMetrics()
    metrics.watch("m", SimpleNamespace(waiting=0, running=0, prefix=None, runner=runner))
    text = metrics.render().decode()
    assert 'tfport_batch_export_runs_total{export="own",model="m"} 2.0' in text
    assert 'tfport_batch_export_runs_total{export="batch",model="m"} 1.0' in text


def test_the_crossover_is_the_fewest_rows_from_which_the_batch_side_stays_faster():
    """Times made up: (own, batch) seconds per row count."""
    from tfport.runtime.batch_export import crossover

    assert crossover({1: (5, 7), 2: (8, 10), 4: (10, 11), 8: (17, 14), 16: (31, 22), 32: (76, 49)}) == 8
    assert crossover({1: (5, 7), 4: (10, 9), 8: (17, 18), 16: (31, 22)}) == 16  # faster at 4, not at 8
    assert crossover({1: (5, 4), 2: (8, 7)}) == 1
    assert crossover({1: (5, 7), 16: (31, 31)}) is None  # a tie is not faster


@pytest.mark.parametrize("target", list(TARGETS))
def test_auto_measures_the_rows_or_detaches_the_batch_export(target, exports):
    """The default, "auto", times both sessions on this machine: a probe size, or no batch export
    where it is never faster (both are possible on a tiny model; either way the runs go to one
    session consistently: a batch of 3 decodes as one of the two exports alone)."""
    from tfport.runtime.batch_export import PROBE_ROWS

    int4, w8a8 = exports[target]
    mixed = load_model(int4, batch_export=w8a8)
    runner = mixed.runners["decoder"]
    assert runner.batch_session is None or runner.batch_rows in PROBE_ROWS
    if runner.batch_session is None:  # never faster: every run on int4
        expected = int4
    elif runner.batch_rows <= 3:  # every run of a batch of 3 on w8a8
        expected = w8a8
    else:  # the prefill on one, the steps on the other: tested with a given batch_rows above
        return
    prompts = _prompts(TARGETS[target], (4, 6, 5))
    np.testing.assert_array_equal(mixed.generate(prompts, max_new_tokens=6, stop_token_ids=()),
                                  load_model(expected).generate(prompts, max_new_tokens=6, stop_token_ids=()))


@pytest.mark.parametrize("measured", [None, 2])
def test_auto_applies_the_measured_rows_or_detaches(measured, exports, monkeypatch, caplog):
    """The measurement replaced (its timing is this machine's): its rows go to every runner, or
    None detaches the batch export with a warning, keeping ``batch_manifest`` (speculation's
    refusal then does not depend on a timing)."""
    import logging

    import tfport.runtime.batch_export as batch_module

    monkeypatch.setattr(batch_module, "measure_batch_rows", lambda *args: (measured, {1: (1.0, 2.0)}))
    int4, w8a8 = exports["ort"]
    with caplog.at_level(logging.INFO, logger="tfport.runtime.batch_export"):
        mixed = load_model(int4, batch_export=w8a8)
    runner = mixed.runners["decoder"]
    assert mixed.batch_manifest is not None
    if measured is None:
        assert runner.batch_session is None
        assert "not faster than the model's own export at any row count" in caplog.text
    else:
        assert runner.batch_session is not None and runner.batch_rows == 2
        assert "runs of 2 rows or more, measured" in caplog.text
    with pytest.raises(ValueError, match=r"batch export \(batch_export\)"):
        mixed.generate([[5, 6, 7]], max_new_tokens=4, speculative="lookup")


def test_only_an_export_of_the_same_model_and_contract_is_taken(exports, tmp_path):
    int4, w8a8 = exports["ort"]
    other = tmp_path / "other"
    export_model(build_model(ort_config("gqa").replace(n_decoder_layers=3), seed=0), other,
                 ExportOptions(target="ort", quantize="w8a8"))
    with pytest.raises(ValueError, match=r"batch_export=.*other.*: its config's n_decoder_layers differs from the model's"):
        load_model(int4, batch_export=other)
    export_model(build_model(ort_config("gqa"), seed=0), tmp_path / "portable",
                 ExportOptions(target="portable", quantize="w8a8"))
    with pytest.raises(ValueError, match=r"batch_export=.*portable.*: its layout differs"):
        load_model(int4, batch_export=tmp_path / "portable")
    with pytest.raises(ValueError, match=r"batch_export='.*nowhere': model_dir=.*expected a directory made by"):
        load_model(int4, batch_export=tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"batch_rows=4: applies with batch_export \(none given\)"):
        load_model(int4, batch_rows=4)
    with pytest.raises(TypeError, match=r"batch_export=123: model_dir: expected a path"):
        load_model(int4, batch_export=123)
    for bad in (0, "soon", True):
        with pytest.raises(ValueError, match=rf"batch_rows={bad!r}: expected 'auto' or a positive integer"):
            load_model(int4, batch_export=w8a8, batch_rows=bad)


def test_the_server_takes_a_batch_export_for_one_model(exports):
    """In a child process: the server opens both exports on ONNX Runtime's process-wide thread
    pool (which, once made, every later session of a process must use)."""
    pytest.importorskip("fastapi", reason="the 'serve' extra")
    int4, w8a8 = exports["ort"]
    code = f"""
import onnxruntime as ort
from tfport.runtime.serve.app import ServerState
from tfport.runtime.serve.options import ServeOptions
from tfport.runtime.threads import shared_pool
options = ServeOptions(batch_export={str(w8a8)!r}, batch_rows=4, threads=1)
runner = next(iter(ServerState.load([{str(int4)!r}], options).models.values())).model.runners["decoder"]
assert runner.batch_session is not None and runner.batch_rows == 4 and shared_pool() == 1
try:
    ServerState.load([{str(int4)!r}, {str(w8a8)!r}], options, names=["a", "b"])
except ValueError as err:
    print(err)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is another export of the one model served; got 2 model directories" in done.stdout
