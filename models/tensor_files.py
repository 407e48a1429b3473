"""Tensors read one at a time from a safetensors file, without a memory map.

A memory map would keep every page a read touched resident in the process (an 8B checkpoint read
through one shows 16 GB resident by the end); ``os.preadv`` into a buffer of the tensor's own
leaves nothing behind once its values are dropped. The format is a little-endian u64 header
length, a JSON table (name -> dtype, shape, byte range) and the data.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

# safetensors dtype -> (torch dtype, bytes per value)
SAFETENSORS_DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
                      "F64": (torch.float64, 8), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
                      "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
                      "BOOL": (torch.bool, 1)}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header


def read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """``path``'s tensor table (name -> {"dtype", "shape", "data_offsets"}) and where the data
    starts; ``ValueError`` naming the file for anything that is not a safetensors file."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if not 2 <= length <= MAX_HEADER_BYTES:
                raise ValueError(f"header length {length}")
            header = json.loads(handle.read(length))
        size = path.stat().st_size
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    header.pop("__metadata__", None)
    start = 8 + length
    for name, entry in header.items():
        ok = (isinstance(entry, dict) and entry.get("dtype") in SAFETENSORS_DTYPES
              and isinstance(entry.get("shape"), list) and isinstance(entry.get("data_offsets"), list)
              and len(entry["data_offsets"]) == 2)
        if ok:
            begin, end = entry["data_offsets"]
            n = int(np.prod(entry["shape"], dtype=np.int64))
            ok = 0 <= begin <= end and start + end <= size and end - begin == n * SAFETENSORS_DTYPES[entry["dtype"]][1]
        if not ok:
            raise ValueError(f"{path}: not a readable safetensors file (tensor {name!r}: {entry!r} "
                             f"does not fit the file's {size} bytes)")
    return header, start


def read_range(path: Path, offset: int, length: int, what: str) -> bytearray:
    """``length`` bytes of ``path`` from ``offset`` (``what`` names them in the error)."""
    buffer = bytearray(length)
    view, done = memoryview(buffer), 0
    with path.open("rb", buffering=0) as handle:
        while done < length:
            read = os.preadv(handle.fileno(), [view[done:]], offset + done)
            if read <= 0:
                raise ValueError(f"{path}: {what} is cut short ({done} of {length} bytes)")
            done += read
    return buffer


class SafetensorsFile:
    """One safetensors file: ``keys()``, ``shape(name)``, ``get(name)`` (a torch tensor as
    stored, read now)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header, self.start = read_safetensors_header(self.path)

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        begin, end = entry["data_offsets"]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]][0]
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        buffer = read_range(self.path, self.start + begin, end - begin, f"tensor {name!r}")
        return torch.frombuffer(buffer, dtype=dtype).reshape(entry["shape"])
