"""``runtime/residency.py``: once a session has opened, this process's resident pages of the
export's external weights are given back; a page a kernel reads again comes back from the file,
so the logits do not change, and a mapping with written pages is left alone."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest
import torch

from tfport.export import ExportOptions, export_model
from tfport.models import build_model
from tfport.presets import get_preset
from tfport.runtime import load_model, session
from tfport.runtime.residency import release_weight_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _resident_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) > 5 and " ".join(fields[5:]) == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A small decoder in int4 with its weights in ``decoder.onnx.data``."""
    config = get_preset("tiny-decoder").replace(d_model=128, max_positions=64)
    model = build_model(config, seed=3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    out = tmp_path_factory.mktemp("residency") / "int4"
    export_model(model, out, ExportOptions(target="ort", quantize="int4", calibration="none", validate=False,
                                           external_data_threshold=0))
    assert (out / "decoder.onnx.data").is_file()
    return out


def test_weight_pages_are_given_back_and_the_logits_stay(export, monkeypatch):
    data = (export / "decoder.onnx.data").resolve()
    ids = np.random.default_rng(0).integers(0, 100, size=(1, 12))
    released = load_model(export, intra_op_threads=1)
    assert _resident_kib(data) == 0  # right after opening: none of its mappings' pages
    logits = released.decoding.logits(released.runners["decoder"], ids)
    monkeypatch.setattr(session, "release_weight_pages", lambda path: 0)
    kept = load_model(export, intra_op_threads=1)
    assert _resident_kib(data) > 0  # without it, what packing read stays resident
    np.testing.assert_array_equal(logits, kept.decoding.logits(kept.runners["decoder"], ids))


def test_a_written_mapping_is_left_alone(tmp_path):
    path = tmp_path / "weights.bin"
    content = bytes(range(256)) * 64  # 16 KiB: four pages
    path.write_bytes(content)
    with open(path, "r+b") as file:
        clean = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE)
        written = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE)
    assert clean[:] == content  # read: resident, unwritten
    written[5] = 7  # a private copy of one page
    assert _resident_kib(path) > 0
    assert release_weight_pages(path) == len(content)  # the clean mapping only
    assert written[5] == 7 and written[:5] == content[:5]
    assert clean[:] == content  # read back from the file
    clean.close(), written.close()
