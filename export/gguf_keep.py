"""``--quantize keep``: a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks as the export's quantised
weights, without re-quantising.

ggml's legacy block types are blockwise quantisations along each row, 32 values per block, with
an fp16 scale ``d`` -- exactly ``export.quantize.BlockQuantized``:

* Q4_0: 16 bytes of nibbles, ``w = (q - 8) d``: 4 bits, symmetric (implicit zero point 8);
* Q8_0: 32 int8 ``q``, ``w = q d``: 8 bits, symmetric (codes q + 128, implicit zero point 128);
* Q4_1: an fp16 minimum ``m`` too, ``w = q d + m = (q - z) d + (m + z d)``: 4 bits, the integer
  zero point z nearest -m / d, and the small remainder ``m + z d`` as the block *offset*, which
  the targets add as (x summed per block) @ offset (``quantize.offset_product``).

Nibble order in a 4-bit block: byte j holds value j (low nibble) and value j + 16 (high).

The importer (``tfport.models.gguf``) dequantises these blocks to float32 for the reference
module; ``KeptQuantization`` finds each weight row of that module among the file's rows (by its
exact float32 bytes, which survives the importer's row concatenations and Q/K un-permutation) and
hands back the file's codes and scales, so ``dequantize()`` reproduces the module's weights
bit for bit. Rows stored in another type (F32, K-quants) are re-quantised with ``fallback``
(round-to-nearest) and counted in ``to_dict``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .quantize import BlockQuantized, QuantScheme, RowIndex

log = logging.getLogger(__name__)

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # ggml type -> bytes per block of 32


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] -> codes [..., 32]: low nibbles are values 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_blocks(kind: str, raw: np.ndarray) -> BlockQuantized:
    """A tensor's ggml blocks, uint8 [rows, bytes per row], as a ``BlockQuantized`` [rows, K]."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[kind])  # [rows, Kb, bytes]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, Kb]
    if kind == "Q8_0":
        signed = blocks[..., 2:34].copy().view(np.int8).astype(np.int16)
        return BlockQuantized((signed + 128).astype(np.uint8).reshape(rows, -1), scale, None, 8, BLOCK)
    if kind == "Q4_0":
        return BlockQuantized(_nibbles(blocks[..., 2:18]).reshape(rows, -1), scale, None, 4, BLOCK)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = _nibbles(blocks[..., 4:20]).reshape(rows, -1)
    # q d + m = (q - z) d + (m + z d) with the integer zero point z nearest -m / d: the offset
    # left over is at most d / 2, so x @ ((q - z) d) + (x summed per block) @ offset does not
    # cancel two large terms (m is about -8 d) in float32. z d and m + z d are exact in float32.
    ratio = np.divide(-minimum, scale, out=np.zeros_like(scale), where=scale != 0)
    zero_points = np.clip(np.rint(ratio), 0, 15).astype(np.uint8)
    offsets = minimum + zero_points.astype(np.float32) * scale
    return BlockQuantized(codes, scale, zero_points, 4, BLOCK, offsets)


def gguf_values(blocks: BlockQuantized) -> np.ndarray:
    """float32 [rows, K] exactly as ggml (and gguf-py) dequantise the blocks: ``q d + m`` for
    Q4_1 (m = offset - zero point * scale), ``(q - z) d`` otherwise."""
    if blocks.offsets is None:
        return blocks.dequantize()
    minimum = blocks.offsets - blocks.zero_points.astype(np.float32) * blocks.scales
    return blocks.codes.astype(np.float32) * blocks.block_values(blocks.scales) + blocks.block_values(minimum)


class KeptQuantization:
    """The quantisation a GGUF file already has, looked up row by row (see the module doc); a
    drop-in for ``QuantScheme`` in the exporter (``quantize``, ``embeddings``, ``name``,
    ``to_dict``)."""

    name = "keep"
    embeddings = True

    def __init__(self, path: str | Path, fallback: QuantScheme | None = None):
        from tfport.models.gguf.reader import GGUFFile

        self.path = Path(path)
        self.fallback = fallback or QuantScheme(8, BLOCK, symmetric=True)
        file = GGUFFile(self.path)
        self.index = RowIndex()  # the file's rows by their float32 values
        self.kinds: dict[str, str] = {}
        for name in file.tensor_names():
            kind = file.tensor_type(name)
            if kind not in BLOCK_BYTES or len(file.shape(name)) != 2:
                continue
            blocks = decode_blocks(kind, file.blocks(name))
            self.index.add(gguf_values(blocks), blocks)
            self.kinds[name] = kind
        self.kept = self.requantized = 0  # weight matrices so far

    def quantize(self, rows: np.ndarray, scale_dtype: str = "float32") -> BlockQuantized:
        """The file's blocks of ``rows`` [N, K] if every row is one of its rows, all of one ggml
        type (one block format); otherwise ``rows`` re-quantised with ``fallback``."""
        found = self.index.find(rows) if scale_dtype == "float32" else None
        if found is None:
            self.requantized += 1
            log.info("keep: a [%d, %d] weight is not stored in one of %s: re-quantised as %s",
                     *rows.shape, sorted(BLOCK_BYTES), self.fallback.name)
            return self.fallback.quantize(rows, scale_dtype)
        self.kept += 1
        return found

    def to_dict(self) -> dict:
        return {"format": "keep", "source": self.path.name, "types": sorted(set(self.kinds.values())),
                "block_size": BLOCK, "embeddings": True, "fallback": self.fallback.to_dict()}
