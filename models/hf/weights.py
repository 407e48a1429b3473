"""A checkpoint directory's weights: ``model.safetensors``, or ``model.safetensors.index.json`` and
the shards it lists, read lazily as a tensor source (``loader.TensorSource``).

Pickled weights (``pytorch_model.bin`` and the like) are never loaded -- unpickling runs code --
and a directory that has only those is refused with what to convert them to.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..tensor_files import SafetensorsFile
from .configs import read_json

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_LISTED = 12  # problems listed per kind in one error message


def weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of ``directory`` -- one file, or the shards its index lists -- and
    the index's tensor name -> shard map (None for one file)."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single], None
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' of tensor name -> shard file")
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in shards if not p.is_file()]
        if absent:
            raise ValueError(f"{index} lists shard(s) {absent} that are not in {directory}")
        return shards, weight_map
    present = sorted(p.name for p in directory.iterdir() if p.is_file())
    pickled = [name for name in present if name.endswith(PICKLED_SUFFIXES) or name.endswith(".bin.index.json")]
    shards = [name for name in present if name.endswith(".safetensors")]
    found = (f"it has {pickled}, pickled weights that tfport never loads (unpickling runs code); "
             "convert them to safetensors (e.g. save_pretrained(..., safe_serialization=True))"
             if pickled else f"it has {present}")
    if shards:
        found = f"it has safetensors shards {shards} but no {INDEX_FILE}"
    raise ValueError(f"checkpoint={str(directory)!r}: no {WEIGHTS_FILE} or {INDEX_FILE}; {found}")


class SafetensorsTensors:
    """The tensors of ``directory``'s safetensors file(s) by name as stored, read lazily, one
    tensor per ``get`` (``tensor_files.SafetensorsFile``).

    A key stored in two shards, or not in the shard the index names, is refused on opening.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self.shards: dict[Path, SafetensorsFile] = {}
        self.file: dict[str, Path] = {}  # key -> file
        files, weight_map = weight_files(directory)
        for path in files:
            self.shards[path] = SafetensorsFile(path)
            for key in self.shards[path].keys():
                if key in self.file:
                    raise ValueError(f"{path}: tensor {key!r} is also in {self.file[key].name}")
                self.file[key] = path
        if weight_map is not None:
            stray = sorted(f"{key} (in {shard} says {INDEX_FILE})" for key, shard in weight_map.items()
                           if self.file.get(key, Path()).name != shard)
            if stray:
                raise ValueError(f"{directory}: tensors not where the index puts them: "
                                 f"{stray[:MAX_LISTED]}")

    def keys(self) -> frozenset[str]:
        return frozenset(self.file)

    def where(self, name: str) -> str:
        """``file: key`` for messages."""
        return f"{self.file[name].name}: {name}"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shards[self.file[name]].shape(name)

    def get(self, name: str) -> torch.Tensor:
        """As stored (any dtype); the loader converts to float32."""
        return self.shards[self.file[name]].get(name)
