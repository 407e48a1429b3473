"""models/checkpoint.py: safetensors round trip for every family, strict loading, no pickle."""

from __future__ import annotations

import json
import pickle
import re
import struct
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from tfport.models import build_model
from tfport.models.checkpoint import WEIGHTS_FILE, load_checkpoint, save_checkpoint

from .torch_reference import random_ids, tiny


@dataclass(frozen=True)
class RoundTripCase:
    preset: str
    tie: bool

    @property
    def name(self) -> str:
        return f"{self.preset}-{'tied' if self.tie else 'untied'}"


CASES = [RoundTripCase(p, tie) for p in ("tiny-encoder", "tiny-decoder", "tiny-encoder-decoder")
         for tie in (True, False)] + [RoundTripCase("tiny-encoder-decoder-t5", True)]


def outputs(model) -> list[torch.Tensor]:
    """Every output of the model on a small padded batch."""
    config = model.config
    ids = random_ids((2, 5), config.vocab_size)
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]] if config.family == "decoder" else [[1] * 5, [1, 1, 1, 0, 0]])
    if config.family == "encoder":
        out = model(ids, mask)
        return [t for t in (out.last_hidden_state, out.pooler_output, out.logits) if t is not None]
    if config.family == "decoder":
        logits, cache = model(ids, mask)
        return [logits] + [t for kv in cache.layers for t in kv]
    return [model(ids, random_ids((2, 3), config.vocab_size, seed=1), mask)]


def head_and_embedding(model):
    if model.config.family == "encoder":
        return model.mlm.decoder.weight, model.encoder.embed.tokens.weight
    stack = model.decoder
    return model.lm_head.weight, stack.embed.tokens.weight


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_round_trip_outputs_equal(case: RoundTripCase, tmp_path):
    config = tiny(case.preset, tie_embeddings=case.tie)
    model = build_model(config, seed=0)
    directory = save_checkpoint(model, tmp_path / "ckpt")
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", WEIGHTS_FILE]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no temporary directory left behind"

    loaded = load_checkpoint(directory)
    assert loaded.config == config
    assert not loaded.training
    for got, expected in zip(outputs(loaded), outputs(model), strict=True):
        assert torch.equal(got, expected), "a reload must reproduce outputs bit for bit"

    head, embedding = head_and_embedding(loaded)
    assert (head is embedding) == case.tie, "tying must survive the reload"
    stored = load_file(str(directory / WEIGHTS_FILE))
    distinct = {id(t) for t in model.state_dict(keep_vars=True).values()}
    assert len(stored) == len(distinct), "a tied tensor is stored once"


def test_save_overwrites_an_existing_checkpoint(tmp_path):
    first = build_model(tiny("tiny-decoder"), seed=0)
    second = build_model(tiny("tiny-decoder"), seed=1)
    save_checkpoint(first, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="directory=.*exists and is not empty"):
        save_checkpoint(second, tmp_path / "ckpt")
    assert torch.equal(outputs(load_checkpoint(tmp_path / "ckpt"))[0], outputs(first)[0])
    save_checkpoint(second, tmp_path / "ckpt", overwrite=True)
    assert torch.equal(outputs(load_checkpoint(tmp_path / "ckpt"))[0], outputs(second)[0])


# --------------------------------------------------------------------------------- strict loading
def tamper(directory, edit) -> None:
    path = str(directory / WEIGHTS_FILE)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


KEY = "decoder.layers.0.attn.qkv.weight"
TAMPERING = {
    "missing": (lambda t: t.pop(KEY), KEY),
    "unexpected": (lambda t: t.update({"decoder.layers.9.extra.weight": torch.zeros(2)}),
                   "decoder.layers.9.extra.weight"),
    "shape-mismatch": (lambda t: t.update({KEY: t[KEY][:-1]}), KEY),
}


@pytest.mark.parametrize("kind", TAMPERING)
def test_load_errors_name_the_key(kind: str, tmp_path):
    directory = save_checkpoint(build_model(tiny("tiny-decoder"), seed=0), tmp_path / "ckpt")
    edit, key = TAMPERING[kind]
    tamper(directory, edit)
    with pytest.raises(ValueError, match=re.escape(key)) as info:
        load_checkpoint(directory)
    message = str(info.value)
    assert {"missing": "missing keys ['", "unexpected": "unexpected keys ['",
            "shape-mismatch": "shape mismatches ['"}[kind] + key in message, message
    if kind == "shape-mismatch":
        assert "file (63, 32), model (64, 32)" in message, "both shapes are shown"


def test_load_without_files_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(tiny("tiny-decoder").to_json())
    with pytest.raises(ValueError, match=re.escape(WEIGHTS_FILE)):
        load_checkpoint(tmp_path)


def test_loader_never_unpickles(tmp_path, monkeypatch):
    directory = save_checkpoint(build_model(tiny("tiny-encoder-decoder"), seed=0), tmp_path / "ckpt")
    # The weights file is safetensors: an 8-byte little-endian header size, then a JSON header.
    raw = (directory / WEIGHTS_FILE).read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    assert header["__metadata__"]["format"] == "pt"

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint loader must never unpickle")

    class RefusingUnpickler:
        def __init__(self, *args, **kwargs):
            refuse()

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    loaded = load_checkpoint(directory)
    assert loaded.config.family == "encoder-decoder"
