"""The streamed export: a checkpoint's or GGUF file's weights are read one tensor at a time as
they are emitted (``tfport.models.lazy``), written to the external data file as they come
(``graph.Initializers``), and validated with the reference run one module at a time.

Proved here on small models: the streamed export is byte for byte the export of the same module
loaded whole; its external data file is what onnx's own writer makes of the same graph; peak
memory (a child process, a model of ~300 MB of float32) stays far below the model's size; the
validation catches one mis-mapped weight in a middle layer; and an export that cannot fit is
refused before it starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("gguf")

from tfport.export import ExportOptions, export_checkpoint_or_preset, export_model  # noqa: E402
from tfport.export import emit  # noqa: E402
from tfport.tools.bench.scale_models import Shape, write_gguf, write_safetensors  # noqa: E402
from tfport.export.quant import KeptQuantization  # noqa: E402
from tfport.models.gguf import load_gguf  # noqa: E402
from tfport.models.hf import load_hf_model  # noqa: E402
from tfport.models import lazy as lazy_weights  # noqa: E402
from tfport.models.lazy import is_lazy, read_weight  # noqa: E402

# Six layers so that "a middle layer" has neighbours; rows of 128 (whole blocks of 32).
SMALL = Shape("small", "llama", 128, 6, 4, 2, 256, 384, tied=False)
SMALL_TIED = Shape("small-tied", "llama", 128, 4, 4, 2, 256, 384, tied=True)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory) -> Path:
    return write_gguf(SMALL, "Q4_0", tmp_path_factory.mktemp("gguf") / "small.Q4_0.gguf", seed=3)


@pytest.mark.parametrize("quantize,threshold", [(None, 2**31), ("int8", 0), ("keep", 0), ("keep", 2**31)])
def test_streamed_export_equals_the_export_of_the_whole_module(q4_file, tmp_path, quantize, threshold):
    options = ExportOptions(quantize=quantize, validate=False, external_data_threshold=threshold)
    streamed = tmp_path / "streamed"
    export_checkpoint_or_preset(str(q4_file), streamed, options)
    loaded = load_gguf(q4_file)
    assert not is_lazy(loaded.model)
    whole = tmp_path / "whole"
    eager = options.replace(quantize=KeptQuantization(q4_file) if quantize == "keep" else quantize)
    export_model(loaded.model, whole, eager.replace(tokenizer=None))
    ours, theirs = _files(streamed), _files(whole)
    for name in ("decoder.onnx", "decoder.onnx.data", "config.json"):
        if name in theirs:
            assert ours[name] == theirs[name], name
    assert ("decoder.onnx.data" in ours) == (threshold == 0)


def test_external_data_is_what_onnx_writes(q4_file, tmp_path):
    """The streamed graph, loaded whole and saved by onnx's own external-data writer with the
    settings the exporter always used, gives the same two files byte for byte."""
    out = tmp_path / "streamed"
    export_checkpoint_or_preset(str(q4_file), out, ExportOptions(quantize="int4", calibration="none",
                                                                validate=False, external_data_threshold=0))
    model = onnx.load(str(out / "decoder.onnx"))  # external data read back into the protos
    again = tmp_path / "onnx"
    again.mkdir()
    onnx.save_model(model, str(again / "decoder.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="decoder.onnx.data", size_threshold=1024)
    assert (again / "decoder.onnx").read_bytes() == (out / "decoder.onnx").read_bytes()
    assert (again / "decoder.onnx.data").read_bytes() == (out / "decoder.onnx.data").read_bytes()


def test_bf16_safetensors_stream_as_loaded(tmp_path):
    directory = write_safetensors(SMALL_TIED, tmp_path / "hf", seed=4)
    lazy = load_hf_model(directory, lazy=True)
    eager = load_hf_model(directory)
    assert is_lazy(lazy) and not is_lazy(eager)
    for (name, a), (_, b) in zip(lazy.named_parameters(), eager.named_parameters()):
        assert np.array_equal(read_weight(a), b.detach().numpy()), name
    options = ExportOptions(quantize="int4", calibration="none", validate=True, external_data_threshold=0)
    export_checkpoint_or_preset(str(directory), tmp_path / "streamed", options)
    export_model(eager, tmp_path / "whole", options)
    assert _files(tmp_path / "streamed")["decoder.onnx.data"] == _files(tmp_path / "whole")["decoder.onnx.data"]


FAULTS = {"transposed": lambda w: w.T, "swapped": lambda w: w[::-1],
          # outputs permuted: every output's row is still one of the file's, so keep finds them all
          # and validates against the module itself (``KeptQuantization.reference``)
          "outputs permuted": lambda w: w[:, ::-1]}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_validation_catches_one_broken_middle_layer(q4_file, tmp_path, monkeypatch, fault):
    """A weight mis-placed in the graph of one middle layer (layer 3 of 6) while the reference
    reads it right: the streamed validation (reference run module by module, every parameter
    counted large) refuses the export, and nothing is left behind."""
    monkeypatch.setattr(lazy_weights, "SMALL_PARAMETER_BYTES", 0)
    project = emit.project
    references = []  # per validation: whether the reference was the module itself
    reference = KeptQuantization.reference

    def recorded(self, model, dtype="float32"):
        module = reference(self, model, dtype)
        references.append(module is model)
        return module

    monkeypatch.setattr(KeptQuantization, "reference", recorded)

    def broken(g, x, weight, name, **kwargs):
        if isinstance(weight, np.ndarray) and name == "decoder.layers.3.attn.out":
            weight = FAULTS[fault](weight)  # square [E, E] ([in, out] here): same shape
        return project(g, x, weight, name, **kwargs)

    monkeypatch.setattr(emit, "project", broken)
    out = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="export validation failed"):
        export_checkpoint_or_preset(str(q4_file), out, ExportOptions(quantize="keep"))
    assert not out.exists()
    # every weight kept: the reference is the module itself (only the permuted outputs were found
    # in the file; the other faults' rows were not, so they were re-quantised and dequantised)
    assert references == [fault == "outputs permuted"]
    monkeypatch.setattr(emit, "project", project)
    export_checkpoint_or_preset(str(q4_file), out, ExportOptions(quantize="keep"))  # unbroken: passes
    assert references[-1] is True


def test_validation_reads_the_reference_before_opening_the_session(q4_file, tmp_path, monkeypatch):
    """A streamed validation computes every reference output before ONNX Runtime opens the export,
    so a model larger than memory never holds the session and the reference's reads at once."""
    from tfport.export.parity.runner import Runner

    events = []
    load, session = lazy_weights._load, Runner._session
    monkeypatch.setattr(lazy_weights, "_load", lambda param: events.append("read") or load(param))
    monkeypatch.setattr(Runner, "_session", lambda self, path: events.append("session") or session(self, path))
    export_checkpoint_or_preset(str(q4_file), tmp_path / "out", ExportOptions(quantize="keep"))
    first_session = events.index("session")
    assert "read" in events[first_session - 5:first_session]  # the references were read just before
    assert "read" not in events[first_session:]


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    from tfport.export import ExportOptions, export_checkpoint_or_preset
    from tfport.heap import peak_resident
    options = ExportOptions(validate=False, external_data_threshold=0)
    export_checkpoint_or_preset(sys.argv[1], sys.argv[2] + "-warm", options)  # every library loaded
    base = peak_resident()
    export_checkpoint_or_preset(sys.argv[3], sys.argv[2], options)
    print(json.dumps({"base": base, "peak": peak_resident()}))
""")
# 24 layers of [512 x 1536] products: ~75M parameters, 300 MB of float32 written out; its
# largest tensor (an FFN matrix, 3 MB) is 1% of it.
MEDIUM = Shape("medium", "llama", 512, 24, 8, 2, 1536, 2000, tied=False)


def test_streamed_export_peak_memory_is_a_few_tensors(tmp_path):
    """Exporting a float32 model of ~300 MB from an F16 GGUF file grows the process by far less
    than the model (eager loading alone would hold all 300 MB, and its graph protos as much again):
    tensors in flight and the graph's structure, the C heap handed back as large ones are written."""
    path = write_gguf(MEDIUM, "F16", tmp_path / "medium.F16.gguf", seed=5)
    warm = write_gguf(SMALL, "F16", tmp_path / "small.F16.gguf", seed=6)
    model_bytes = 4 * MEDIUM.parameters()
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(warm), str(out), str(path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    written = (out / "decoder.onnx.data").stat().st_size
    assert written > 0.95 * model_bytes  # the weights really were written, in float32
    grown = figures["peak"] - figures["base"]
    # Measured 50-62 MB for this 298 MB model (the child's own VmHWM: ru_maxrss, used before,
    # reported the pytest parent's peak and hid any growth); eager loading holds >= 298 MB more.
    assert grown < model_bytes / 3, (grown, model_bytes)


def test_an_export_that_cannot_fit_is_refused_before_it_starts(q4_file, tmp_path, monkeypatch):
    from tfport.export import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 2**20)
    out = tmp_path / "out"
    with pytest.raises(MemoryError, match=r"needs about .* GiB at its peak .* GiB is available: ") as refused:
        export_checkpoint_or_preset(str(q4_file), out, ExportOptions(quantize="keep"))
    assert not out.exists()
    # this small model's session is its largest phase: skipping validation is advised, with its estimate
    assert "validate=False (--no-validate) needs about" in str(refused.value)


def test_the_estimate_adds_only_the_larger_phase():
    """Writing and validating follow one another: the peak is what both hold (the libraries) plus
    the larger phase, and --no-validate is advised only when validating is that phase."""
    from tfport.export.memory import GiB, MemoryEstimate

    writing, validating = {"largest tensor in flight": 6 * GiB}, {"validation session": 4 * GiB}
    estimate = MemoryEstimate({"libraries": GiB}, {"writing": writing, "validating": validating})
    assert estimate.total == 7 * GiB
    assert estimate.part("validation session") == 4 * GiB and estimate.part("none") is None
    assert "then the larger of writing (largest tensor in flight 6.0 GiB) and validating" in estimate.describe()
    assert MemoryEstimate({"libraries": GiB}, {"writing": writing}).total == 7 * GiB
