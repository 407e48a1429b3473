"""A cache layout added through the registries alone reaches export, parity, ``generate`` and the
server.

The throwaway layout ``test-mirror`` declares the same graph I/O as ``concat`` under its own name,
with a runtime side of its own whose pieces count their calls (so each test proves the layout's
own object ran, not ``concat``'s). Nothing outside this file knows its name; the registries are
restored after each test.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tfport.contract import CONCAT, LAYOUTS, CacheLayout
from tfport.export import ExportOptions, export_model
from tfport.export.parity import CASES, Runner
from tfport.export.targets import TARGETS, PortableTarget
from tfport.manifest import Manifest
from tfport.models import build_model
from tfport.models.generate import generate
from tfport.presets import PRESETS
from tfport.runtime import load_model
from tfport.runtime.decoding import DECODINGS, ConcatCache, ConcatRows, LayoutDecoding
from tfport.runtime.decoding.concat import ConcatRelayout, score

NAME = "test-mirror"
CALLS: dict[str, int] = {}


def counted(kind: str) -> None:
    CALLS[kind] = CALLS.get(kind, 0) + 1


class MirrorStrategy(ConcatCache):
    def start(self, *args, **kwargs):
        counted("strategy")
        return super().start(*args, **kwargs)


class MirrorRows(ConcatRows):
    def step(self, tokens):
        counted("rows")
        return super().step(tokens)


class MirrorRelayout(ConcatRelayout):
    def __call__(self, feeds, past, random_buffer):
        counted("relayout")
        return super().__call__(feeds, past, random_buffer)


class MirrorTarget(PortableTarget):
    name = "test-mirror-target"
    summary = "portable, declaring the throwaway cache layout 'test-mirror'"
    layout = NAME


@pytest.fixture
def mirror(monkeypatch):
    layout = CacheLayout(NAME, CONCAT.decoder_io, padding="left")
    monkeypatch.setitem(LAYOUTS, NAME, layout)
    monkeypatch.setitem(DECODINGS, NAME, LayoutDecoding(layout, MirrorStrategy(), MirrorRows,
                                                        MirrorRelayout(), score))
    target = MirrorTarget()
    monkeypatch.setitem(TARGETS, target.name, target)
    CALLS.clear()
    return target


@pytest.fixture
def exported(mirror, tmp_path):
    config = PRESETS["tiny-decoder"].replace(tie_embeddings=False, max_positions=64)
    model = build_model(config, seed=11)
    with torch.no_grad():  # every parameter away from its initial value, so a wrong mapping shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    out = tmp_path / "mirror"
    export_model(model, out, ExportOptions(target=mirror.name))  # validated against PyTorch on export
    return model, out


def test_a_registered_layout_reaches_export_and_parity(exported):
    model, out = exported
    manifest = Manifest.read(out)
    assert (manifest.target, manifest.layout) == ("test-mirror-target", NAME)
    assert CALLS.get("relayout", 0) > 0  # the export's validation ran the layout's relayout
    CALLS.clear()
    runner = Runner(model, out)
    for case in CASES:
        results = runner.run(case)
        assert all(r.ok for r in results), [r.describe() for r in results]
    assert CALLS.get("relayout", 0) > 0


def test_a_registered_layout_generates_and_serves(exported):
    from tests.runtime.serve.conftest import running_server

    model, out = exported
    prompts = [[5, 17, 33, 8, 61], [44, 9]]
    loaded = load_model(out)
    assert loaded.decoding is DECODINGS[NAME]
    tokens = loaded.generate(prompts, max_new_tokens=8, stop_token_ids=())
    assert CALLS.get("strategy", 0) == 1
    for row, prompt in zip(tokens, prompts):
        assert row.tolist() == generate(model, torch.tensor([prompt]), max_new_tokens=8)[0].tolist()

    with running_server([out]) as (url, _):
        for row, prompt in zip(tokens, prompts):
            response = httpx.post(url + "/v1/completions", json={
                "model": "mirror", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == row.tolist()
    assert CALLS.get("rows", 0) > 0  # the server's scheduler stepped the layout's own row batch
