"""Lazy modules (``tfport.models.lazy``): weights on the meta device, read from their file when used."""

from __future__ import annotations

import pytest
import torch

from tfport import get_preset
from tfport.models import build_model
from tfport.models.checkpoint import load_checkpoint, save_checkpoint
from tfport.models import lazy as lazy_weights
from tfport.models.lazy import (is_lazy, lazy_module, materialize_all, materialized, parameter_names, read_weight,
                                streamed)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = build_model(get_preset("tiny-decoder").replace(tie_embeddings=True), seed=7)  # one table, two names
    return model, save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "dec")


def test_a_lazy_module_holds_no_weights_and_reads_each_as_the_file_has_it(checkpoint):
    model, directory = checkpoint
    lazy = load_checkpoint(directory, lazy=True)
    assert all(p.is_meta for p in lazy.parameters()) and is_lazy(lazy)
    for (name, original), (_, param) in zip(parameter_names(model).items(), parameter_names(lazy).items()):
        assert torch.equal(torch.from_numpy(read_weight(param)), original.detach()), name
    assert lazy.lm_head.weight is lazy.decoder.embed.tokens.weight  # still tied


@pytest.mark.parametrize("small_bytes", [0, lazy_weights.SMALL_PARAMETER_BYTES])
def test_streamed_forward_equals_the_loaded_module_and_leaves_it_lazy(checkpoint, monkeypatch, small_bytes):
    """Layer by layer, the modules outside the layers on their own (every parameter counted
    large) or read up front (small)."""
    monkeypatch.setattr(lazy_weights, "SMALL_PARAMETER_BYTES", small_bytes)
    model, directory = checkpoint
    lazy = load_checkpoint(directory, lazy=True)
    ids = torch.tensor([[1, 5, 9, 2], [3, 3, 8, 1]])
    mask = torch.ones_like(ids)
    expected = model(ids, mask)[0]
    reads = []
    with torch.no_grad(), streamed(lazy, reads.append):
        actual = lazy(ids, mask)[0]
    assert torch.equal(actual, expected)
    layers = len(lazy.decoder.layers)  # each layer read whole while it runs; the table and head
    assert len(reads) > layers + 1 if small_bytes == 0 else len(reads) == layers  # table, head, norm: alone or up front
    assert all(p.is_meta for p in lazy.parameters())  # nothing kept after the forward


def test_materialized_holds_real_values_inside_only(checkpoint):
    model, directory = checkpoint
    lazy = load_checkpoint(directory, lazy=True)
    layer = lazy.decoder.layers[1]
    with materialized(layer):
        assert not any(p.is_meta for p in layer.parameters())
        assert torch.equal(layer.ffn.down.weight, model.decoder.layers[1].ffn.down.weight)
    assert all(p.is_meta for p in layer.parameters())
    eager = materialize_all(load_checkpoint(directory, lazy=True))
    assert not is_lazy(eager) and eager.lm_head.weight is eager.decoder.embed.tokens.weight


def test_a_meta_weight_without_loader_is_an_error_not_garbage():
    lazy = lazy_module(get_preset("tiny-decoder"))
    with pytest.raises(RuntimeError, match="meta device without a loader"):
        read_weight(lazy.decoder.layers[0].ffn.down.weight)
    with pytest.raises(RuntimeError, match="without a loader"), streamed(lazy):
        lazy(torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.long))
