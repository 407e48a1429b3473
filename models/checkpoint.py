"""Model directories: ``config.json`` + ``model.safetensors``; never unpickled.

Tied weights (one tensor under several names) are stored once, under their first name. Loading
checks every key and shape and says which are missing, unexpected or mismatched.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tfport.config import ModelConfig
from tfport.contract import CONFIG_FILE
from tfport.files import atomic_directory, check_output_dir

from .lazy import attach
from .tensor_files import SafetensorsFile

WEIGHTS_FILE = "model.safetensors"


def _aliases(model: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, str]]:
    """(canonical name -> parameter, alias name -> canonical name) over the state dict."""
    canonical: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
            canonical[name] = tensor
    return canonical, aliases


def save_checkpoint(model: nn.Module, directory: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``model`` (with a ``.config``) to ``directory`` atomically; returns the directory.

    A non-empty ``directory`` is refused unless ``overwrite`` (its whole content is replaced).
    """
    directory = check_output_dir(directory, "directory", overwrite)
    canonical, _ = _aliases(model)
    tensors = {name: t.detach().contiguous().cpu() for name, t in canonical.items()}
    with atomic_directory(directory) as tmp:
        (tmp / CONFIG_FILE).write_text(model.config.to_json() + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "producer": "tfport"})
    return directory


def load_config(directory: str | os.PathLike) -> ModelConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"checkpoint={str(directory)!r}: no {CONFIG_FILE}; expected a directory "
                         f"with {CONFIG_FILE} and {WEIGHTS_FILE}")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def load_checkpoint(directory: str | os.PathLike, lazy: bool = False) -> nn.Module:
    """Build the model in ``directory/config.json`` and load ``model.safetensors`` strictly; with
    ``lazy``, each weight stays in the file until it is read (``tfport.models.lazy``)."""
    from .lazy import lazy_module, materialize_all

    directory = Path(directory)
    config = load_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"checkpoint={str(directory)!r}: no {WEIGHTS_FILE}")
    tensors = SafetensorsFile(weights)
    model = lazy_module(config)
    canonical, _ = _aliases(model)
    missing = sorted(set(canonical) - set(tensors.keys()))
    unexpected = sorted(set(tensors.keys()) - set(canonical))
    mismatched = [f"{name}: file {tensors.shape(name)}, model {tuple(t.shape)}"
                  for name, t in canonical.items()
                  if name in tensors.header and tensors.shape(name) != tuple(t.shape)]
    if missing or unexpected or mismatched:
        raise ValueError(f"checkpoint={str(directory)!r} does not fit its config: missing keys "
                         f"{missing}, unexpected keys {unexpected}, shape mismatches {mismatched}")
    attach(model, {name: functools.partial(tensors.get, name) for name in canonical})
    return model.eval() if lazy else materialize_all(model).eval()
