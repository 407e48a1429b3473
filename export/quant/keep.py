"""``--quantize keep``: a GGUF file's own blocks (``export.gguf_keep`` reads them) as the
export's quantised weights, without re-quantising. ``KeptQuantization`` is the scheme,
``FORMAT`` the registry entry (which binds the scheme to the source file: ``for_source``).

A mixture's experts, stacked [N, rows, K] per layer and projection (``ffn_*_exps``), are indexed
as N * rows rows, so each expert's products keep their blocks; its router (``ffn_gate_inp``),
which llama.cpp's files hold in F32, is re-quantised with the fallback like any F32 matrix.

The importer (``tfport.models.gguf``) dequantises these blocks to float32 for the reference
module; ``KeptQuantization`` finds each weight row of that module among the file's rows (by its
exact float32 bytes, which survives the importer's row concatenations and Q/K un-permutation) and
hands back the file's codes and scales, so ``dequantize()`` reproduces the module's weights
bit for bit. A product whose rows come from tensors of different types (a Q4_K_M file's Q4_K
query and key with its Q6_K value, fused into one QKV product) keeps each part's blocks as its
own product, concatenated (``RowParts``). Rows stored in another type (F32, F16, Q2_K, Q3_K ...)
are re-quantised with ``fallback`` (round-to-nearest), with a warning, and counted in the
manifest (``kept`` and ``requantized`` weight products: a fused QKV or gate|up is one).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from ..blocks import BlockQuantized, RowParts
from ..gguf_keep import BLOCK, KEPT_BLOCK_SIZES, KEPT_TYPES, decode_blocks, gguf_values
from ..row_index import RowIndex, row_keys
from .base import QuantFormat
from .blockwise import Blockwise, QuantScheme

log = logging.getLogger(__name__)

NAME = "keep"
KEY_ROWS = 4096  # rows whose values are computed at a time to index them


def check_keep(source: str, dtype: str = "float32") -> None:
    """``ValueError`` unless ``quantize="keep"`` applies: ``source`` a GGUF file, exported in ``dtype``
    float32 (``check_keep_dtype``)."""
    from tfport.models.gguf.reader import is_gguf_file

    if not is_gguf_file(source):
        raise ValueError(f"quantize='keep': source={source!r} is not a GGUF file; 'keep' keeps a GGUF "
                         "file's own Q4_0 / Q4_1 / Q8_0 blocks (use int4 or int8 otherwise)")
    check_keep_dtype(dtype)


def check_keep_dtype(dtype: str) -> None:
    """``ValueError`` for a ``quantize="keep"`` export in a ``dtype`` other than float32."""
    if dtype != "float32":
        raise ValueError(f"quantize='keep' with dtype={dtype!r}: a GGUF file's blocks are kept with "
                         "their float32 scales (a K-quant's d x sc is not a float16 number); export "
                         "with dtype='float32', or re-quantise with quantize='int4' or 'int8'")


FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGUF block types of 4-bit codes
# ``--quantize int4`` alone keeps a GGUF file's own blocks when at least this share of its layer
# weights is in 4-bit blocks (a Q4_K_M file's, ~0.8, is; a Q5_K_M or Q8_0 file's is not)
FOUR_BIT_SHARE = 0.75


def four_bit_share(source: str | Path) -> float:
    """The share of a GGUF file's layer weights (the values of its ``blk.*`` matrices) stored in
    4-bit blocks (``FOUR_BIT_TYPES``): 1.0 for a Q4_0 or Q4_1 file, about 0.8 for a Q4_K_M one
    (some value and down projections in Q6_K), 0 for Q8_0 or F16. Reads the header only."""
    from tfport.models.gguf.reader import open_gguf

    file = open_gguf(source)
    sizes = {name: int(np.prod(file.shape(name))) for name in file.tensor_names()
             if name.startswith("blk.") and len(file.shape(name)) >= 2}
    total = sum(sizes.values())
    return sum(n for name, n in sizes.items() if file.tensor_type(name) in FOUR_BIT_TYPES) / total if total else 0.0


def _key(keys: list[bytes]) -> str:
    """A weight product's identity from its rows' keys (``row_keys``): equal rows, equal keys."""
    return hashlib.sha1(b"".join(keys)).hexdigest()


class KeptQuantization(Blockwise):
    """The quantisation a GGUF file already has, looked up row by row (see the module doc).

    Only the file's tensors that weights were just read from are indexed: each dequantised
    tensor of the file (``reader.on_tensor_read``) joins the index, which starts again when a
    read moves on to another layer (``blk.N``; the tensors outside the layers are one group), so
    a streamed export indexes one layer at a time. A weight found in none of them (a module
    loaded before this object existed) indexes the whole file once, and is found there.
    """

    name = NAME
    embeddings = True

    def __init__(self, path: str | Path, fallback: QuantScheme | None = None):
        from tfport.models.gguf.reader import on_tensor_read, open_gguf

        self.path = Path(path)
        self.fallback = fallback or QuantScheme(8, BLOCK, symmetric=True)
        self.file = open_gguf(self.path)
        # kept tensors: name -> ggml type (a stack of experts [N, rows, K] holds N * rows rows of K)
        self.kinds = {name: self.file.tensor_type(name) for name in self.file.tensor_names()
                      if self.file.tensor_type(name) in KEPT_TYPES and len(self.file.shape(name)) in (2, 3)}
        self.index = RowIndex()
        self._indexed: set[str] = set()
        self._group: str | None = None
        self._whole = False  # the whole file indexed (a miss among the recent tensors)
        self._stop_listening = on_tensor_read(self.path, self._read)
        # distinct weight products seen so far (sha1 of their float32 bytes) -> kept or not: a
        # matrix lowered in several graphs (or again for validation) counts once
        self._seen: dict[str, bool] = {}

    def __del__(self):
        stop = getattr(self, "_stop_listening", None)
        if stop is not None:
            stop()

    def _read(self, name: str, values: np.ndarray | None) -> None:
        """A tensor of the file was dequantised (to ``values``, or None when only part of it
        was): index it, in a new index if its group is new."""
        if name not in self.kinds or self._whole:
            return
        group = ".".join(name.split(".")[:2]) if name.startswith("blk.") else ""
        if group != self._group:
            self.index, self._indexed, self._group = RowIndex(), set(), group
        self._add(name, values)

    def _add(self, name: str, values: np.ndarray | None = None) -> None:
        """Index tensor ``name``'s blocks under its rows' float32 values: ``values`` (the whole
        tensor, as just read) or computed from the blocks."""
        if name in self._indexed:
            return
        rows = int(np.prod(self.file.shape(name)[:-1]))
        blocks = decode_blocks(self.kinds[name], self.file.blocks(name).reshape(rows, -1))
        self.file.release(name)
        if values is not None:
            keys = row_keys(values.reshape(rows, -1))
        else:  # in chunks of rows: a large table's float values are never all held
            keys = []
            for start in range(0, rows, KEY_ROWS):
                keys += row_keys(gguf_values(blocks.rows(start, start + KEY_ROWS)))
        self.index.add_keys(keys, blocks)
        self._indexed.add(name)

    def _index_whole_file(self) -> None:
        log.info("keep: indexing every tensor of %s (a weight read before the export started)", self.path.name)
        self._whole = True
        for name in self.kinds:
            self._add(name)

    @property
    def bits(self) -> int:
        """The widest codes the kept blocks store (4 for Q4_0 / Q4_1 / Q4_K, else 8): what a
        memory estimate takes the export's weights to need."""
        return 4 if all(kind.startswith("Q4") for kind in self.kinds.values()) else 8

    block_size = BLOCK

    @property
    def kept(self) -> int:
        """Weight products (and token tables) lowered with the file's own blocks so far."""
        return sum(self._seen.values())

    @property
    def requantized(self) -> int:
        """Weight products (and token tables) re-quantised with ``fallback`` so far (stored in no kept type)."""
        return len(self._seen) - self.kept

    def quantize(self, rows: np.ndarray, scale_dtype: str = "float32") -> BlockQuantized | RowParts:
        """The file's blocks of ``rows`` [N, K] if every row is one of its rows: one
        ``BlockQuantized``, or ``RowParts`` where consecutive rows come from tensors of different
        types (each part lowered as its own product); otherwise ``rows`` re-quantised with
        ``fallback``."""
        parts, keys = None, row_keys(rows)
        if scale_dtype == "float32":
            parts = self.index.find_parts(rows, keys)
            if parts is None and not self._whole:
                self._index_whole_file()
                parts = self.index.find_parts(rows, keys)
        found = None if parts is None else parts[0] if len(parts) == 1 else RowParts(parts)
        key = _key(keys)
        if found is None:
            if key not in self._seen:
                log.info("keep: a [%d, %d] weight is not stored in one of %s: re-quantised as %s",
                         *rows.shape, list(KEPT_TYPES), self.fallback.name)
            self._seen[key] = False
            return self.fallback.quantize(rows, scale_dtype)
        self._seen[key] = True
        return found

    def bytes_per_value(self) -> float:
        """The widest kept codes (``bits``) and a float32 scale per block of 32."""
        return self.bits / 8 + 4 / self.block_size

    def check_dtype(self, dtype: str) -> None:
        super().check_dtype(dtype)
        check_keep_dtype(dtype)

    def reference(self, model, dtype: str = "float32"):
        """``model`` itself once every weight product the export lowered kept the file's own
        blocks: each was found by its rows' exact float32 values, so the graphs compute with the
        values the module reads (checking each weight again as the reference reads it would hash
        every weight once per forward). Otherwise, or before an export, the blockwise reference
        (kept weights as read, re-quantised ones dequantised)."""
        if self.kept and not self.requantized and dtype == "float32":
            return model
        return super().reference(model, dtype)

    def holds(self, rows: np.ndarray) -> bool:
        """Whether ``quantize(rows)`` gave the file's own blocks, whose dequantised values are
        ``rows`` exactly (their keys are those values): a reference needs no dequantised copy."""
        return self._seen.get(_key(row_keys(rows)), False)

    def to_dict(self) -> dict:
        types = sorted(set(self.kinds.values()))
        sizes = {kind: KEPT_BLOCK_SIZES.get(kind, BLOCK) for kind in types}
        return {"format": NAME, "source": self.path.name, "types": types,
                "block_size": min(sizes.values(), default=BLOCK), "block_sizes": sizes,
                "embeddings": True, "fallback": self.fallback.to_dict(),
                "kept": self.kept, "requantized": self.requantized}

    def report(self) -> None:
        """A warning when not every weight matrix's own blocks could be kept."""
        if self.requantized:
            log.warning("quantize='keep': %d of %d weight products are not stored in a kept GGUF type and "
                        "were re-quantised as %s, blocks of %d (round-to-nearest)", self.requantized,
                        self.requantized + self.kept, self.fallback.name, self.fallback.block_size)



# ---------------------------------------------------------------------------------- registry
class KeepFormat(QuantFormat):
    """``--quantize keep``: needs a GGUF source (``for_source``); no options."""

    name = NAME
    summary = "a .gguf source's own Q4_0/Q4_1/Q8_0 blocks, not re-quantised"

    def parse(self, block_size: int | None = None, symmetric: bool | None = None,
              generates: bool = False) -> KeptQuantization:
        raise ValueError("quantize='keep': keeps a GGUF file's own blocks, so the source must be a "
                         ".gguf file (tfport export FILE.gguf --quantize keep, or "
                         "export.quant.keep.KeptQuantization)")

    def check_source(self, source: str, dtype: str) -> None:
        check_keep(source, dtype)

    def for_source(self, source: str, dtype: str) -> KeptQuantization:
        self.check_source(source, dtype)
        return KeptQuantization(source)

    def from_manifest(self, entry: dict, source: str) -> KeptQuantization:
        fallback = entry["fallback"]
        return KeptQuantization(source, QuantScheme(fallback["bits"], fallback["block_size"], fallback["symmetric"],
                                                    fallback["embeddings"]))

    def describe(self, entry: dict) -> str:
        """E.g. "keep Q4_K, Q6_K: 120 weight products kept, 1 re-quantised as int8" (a fused QKV
        or gate|up product counts once)."""
        text = f"keep {', '.join(entry['types']) or 'no kept type'}: {entry['kept']} weight products kept"
        if entry["requantized"]:
            text += f", {entry['requantized']} re-quantised as {entry['fallback']['format']}"
        return text


FORMAT = KeepFormat()
