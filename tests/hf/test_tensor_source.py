"""``load_from_tensors``: any TensorSource presenting Hugging Face names loads like the directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tfport.models.hf import load_from_tensors

pytest.importorskip("transformers", reason="the tiny checkpoints are built with transformers, which "
                    "the 'dev' extra installs")


class DictTensors:
    """The smallest TensorSource: a dict of tensors held in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self) -> frozenset[str]:
        return frozenset(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def where(self, name: str) -> str:
        return f"memory: {name}"


def checkpoint(it) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((it.directory / "config.json").read_text())
    return config, load_file(str(it.directory / "model.safetensors"))


def test_same_module_as_the_directory(imported):
    it = imported("llama")
    config, tensors = checkpoint(it)
    model = load_from_tensors(config, DictTensors(tensors), "memory")
    assert model.config == it.model.config
    expected = it.model.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


def test_base_model_names_and_half_precision(imported):
    """Names without the task model's prefix (as LlamaModel saves them); float16 becomes float32."""
    it = imported("llama")
    config, tensors = checkpoint(it)
    base = {name.removeprefix("model."): t.half() for name, t in tensors.items()}  # lm_head.* stays
    model = load_from_tensors(config, DictTensors(base), "memory")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    torch.testing.assert_close(model.decoder.norm.weight, tensors["model.norm.weight"].half().float(),
                               rtol=0, atol=0)


def test_errors_start_with_origin(imported):
    config, tensors = checkpoint(imported("llama"))
    tensors.pop("model.norm.weight")
    with pytest.raises(ValueError, match=r"^gguf='x\.gguf' \(llama\) does not map onto tfport's modules: "
                                         r"missing key\(s\): model\.norm\.weight \(for decoder\.norm\.weight\)"):
        load_from_tensors(config, DictTensors(tensors), "gguf='x.gguf'")


def test_prefixed_and_unprefixed_name_of_one_tensor(imported):
    config, tensors = checkpoint(imported("llama"))
    tensors["norm.weight"] = tensors["model.norm.weight"]
    with pytest.raises(ValueError, match=r"memory: model\.norm\.weight and memory: norm\.weight are both "
                                         r"'model\.norm\.weight'"):
        load_from_tensors(config, DictTensors(tensors), "memory")
