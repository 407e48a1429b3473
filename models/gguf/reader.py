"""Read a GGUF file (llama.cpp's format) with the ``gguf`` package: metadata and float32 tensors.

A GGUF file holds key/value metadata (architecture, hyper-parameters, tokenizer, chat template)
and tensors named in llama.cpp's scheme (``blk.{i}.attn_q.weight``), each stored in one of ggml's
types: plain floats or block quantisations (32 values per block for the legacy types, 256 for
the K-quants). Tensors are dequantised with ``gguf.quants.dequantize``, ``gguf``'s own routines.

GGUF lists a tensor's dimensions fastest-varying first (ggml's ``ne``); ``shape`` here is the
numpy / PyTorch order, the reverse, so a linear weight is [out_features, in_features] as in
Hugging Face checkpoints.
"""

from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np

Shape = tuple[int, ...]

GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"

# ggml tensor types tfport dequantises: plain floats, the legacy block types (32 values per
# block) and the K-quants (256 values per block, "super-blocks").
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a .gguf file needs the 'gguf' package (llama.cpp's gguf-py): "
                          "pip install gguf") from None
    return gguf


# Resolved file path -> functions called with a tensor's name each time one is dequantised from
# it, by any GGUFFile of that path (``on_tensor_read``).
_READ_LISTENERS: dict[Path, list[Callable[[str, np.ndarray | None], None]]] = {}


def on_tensor_read(path: str | os.PathLike,
                   listener: Callable[[str, np.ndarray | None], None]) -> Callable[[], None]:
    """Call ``listener(name, values)`` whenever a tensor of the GGUF file ``path`` is dequantised (an
    export keeping the file's own blocks looks up just the tensors a weight was read from);
    returns the function that stops it."""
    key = Path(path).resolve()
    _READ_LISTENERS.setdefault(key, []).append(listener)

    def stop() -> None:
        listeners = _READ_LISTENERS.get(key, [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:
            _READ_LISTENERS.pop(key, None)

    return stop


def own_float32(values: np.ndarray) -> np.ndarray:
    """``values`` as a float32 C-order array of this process's own: gguf-py's dequantisation as
    it is (a new array) or, for an F32 / F16 tensor (a view of the memory-mapped file, read-only),
    a copy. A 1B model's token table is 1 GiB of float32: copying it again would double the peak."""
    base, mapped = values, False
    while base is not None and not mapped:
        mapped = isinstance(base, (np.memmap, mmap.mmap))
        base = getattr(base, "base", None)
    if values.dtype == np.float32 and values.flags.c_contiguous and values.flags.writeable and not mapped:
        return values
    return np.array(values, dtype=np.float32, order="C")


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def open_gguf(path: str | os.PathLike) -> "GGUFFile":
    """``GGUFFile(path)``, shared: gguf-py parses a header in Python (2.5 s for SmolLM2-135M's,
    whose vocabulary and merges are ~100K strings; 4.7 s for Llama 3's), and an export reads it
    where it imports the file, plans its quantisation and keeps its blocks. The last few files
    opened are kept, each under its path, size, inode and modification time (a rewritten file
    is opened again)."""
    try:
        stat = Path(path).stat()
    except OSError:
        return GGUFFile(path)  # its own error names the argument
    return _open_gguf(str(Path(path).resolve()), stat.st_size, stat.st_ino, stat.st_mtime_ns, str(path))


@functools.lru_cache(maxsize=4)
def _open_gguf(resolved: str, size: int, inode: int, modified: int, given: str) -> "GGUFFile":
    return GGUFFile(given)


class GGUFFile:
    """One GGUF file: ``metadata`` (key -> Python value) and its tensors by GGUF name (read
    only: ``open_gguf`` shares one object among its readers)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not is_gguf_file(self.path):
            raise ValueError(f"gguf={str(path)!r}: not a GGUF file (expected a file starting "
                             f"with the bytes {GGUF_MAGIC!r}, as llama.cpp writes them)")
        gguf = _gguf()
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except Exception as err:  # gguf raises ValueError, struct.error, IndexError...
            raise ValueError(f"gguf={str(path)!r}: not a readable GGUF file ({err})") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):  # the header (version, counts), not metadata
                continue
            value = field.contents()
            self.metadata[key] = value.tolist() if isinstance(value, np.ndarray) else value
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, architecture={self.architecture!r})"

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    def require(self, key: str) -> Any:
        """Metadata ``key``; a clear error when the file lacks it."""
        if key not in self.metadata:
            raise ValueError(f"{self.path.name}: no metadata key {key!r}")
        return self.metadata[key]

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """ggml type name of tensor ``name`` (``"Q4_1"``, ``"F32"``, ...)."""
        return self._tensors[name].tensor_type.name

    def shape(self, name: str) -> Shape:
        """Numpy-order shape of tensor ``name`` (GGUF's dimension list reversed)."""
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def check_types(self) -> None:
        """Refuse, naming them, the tensors stored in a type tfport does not dequantise."""
        odd = {name: self.tensor_type(name) for name in self._tensors
               if self.tensor_type(name) not in SUPPORTED_TYPES}
        if odd:
            listed = ", ".join(f"{n} ({t})" for n, t in list(odd.items())[:8])
            more = f" and {len(odd) - 8} more" if len(odd) > 8 else ""
            raise ValueError(f"{self.path.name}: tensor type(s) {sorted(set(odd.values()))} are not "
                             f"supported (tensors {listed}{more}); tfport dequantises "
                             f"{list(SUPPORTED_TYPES)}")

    def blocks(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored bytes, uint8 [rows, bytes per row] (ggml blocks as written;
        see ``tfport.export.gguf_keep`` for the layouts it keeps)."""
        data = np.asarray(self._tensors[name].data)
        return data.view(np.uint8).reshape(data.shape[0], -1)

    def release(self, name: str) -> None:
        """Drop tensor ``name``'s pages of the memory-mapped file from this process's resident
        memory (they stay in the page cache and are read again if touched: views stay valid).
        Streaming a large file tensor by tensor, this keeps resident memory at what is in use."""
        tensor = self._tensors[name]
        mapping = getattr(self._reader.data, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        start = tensor.data_offset // page * page
        end = tensor.data_offset + tensor.n_bytes
        mapping.madvise(mmap.MADV_DONTNEED, start, min(end, len(mapping)) - start)

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, numpy-order shape (its pages released, ``release``)."""
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ValueError(f"{self.path.name}: tensor {name!r} has type {kind}, which tfport does "
                             f"not dequantise; supported: {list(SUPPORTED_TYPES)}")
        values = own_float32(_gguf().quants.dequantize(tensor.data, tensor.tensor_type)).reshape(self.shape(name))
        self.release(name)
        self.notify(name, values)
        return values

    def notify(self, name: str, values: np.ndarray | None = None) -> None:
        """Tell the ``on_tensor_read`` listeners of this file that tensor ``name`` was read (as
        ``values``, float32 in numpy order; None: only part of it)."""
        for listener in list(_READ_LISTENERS.get(self.path.resolve(), ())):
            listener(name, values)
