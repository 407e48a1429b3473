"""``--quantize keep``: a GGUF file's own Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks, and the Q4_K / Q5_K / Q6_K
super-blocks of llama.cpp's "K-quants" (Q4_K_M, Q5_K_M ...), as the export's quantised weights,
without re-quantising.

ggml's legacy block types are blockwise quantisations along each row, 32 values per block, with
an fp16 scale ``d`` -- exactly ``export.blocks.BlockQuantized``:

* Q4_0: 16 bytes of nibbles, ``w = (q - 8) d``: 4 bits, symmetric (implicit zero point 8);
* Q8_0: 32 int8 ``q``, ``w = q d``: 8 bits, symmetric (codes q + 128, implicit zero point 128);
* Q4_1: an fp16 minimum ``m`` too, ``w = q d + m = (q - z) d + (m + z d)``: 4 bits, the integer
  zero point z nearest -m / d, and the small remainder ``m + z d`` as the block *offset*, which
  the targets add as (x summed per block) @ offset (``quantized_graph.offset_product``);
* Q5_0 / Q5_1: as Q4_0 / Q4_1 with a fifth bit per value (``qh``), ``w = (q - 16) d`` and
  ``q d + m``: int8 blocks (zero point 16; offsets), the 5-bit codes stored in 8 bits. llama.cpp
  writes them where a row's length is not a multiple of 256 (K-quant files of models with 576-wide
  rows, as SmolLM2's Q4_K_M).

Nibble order in a 4-bit block: byte j holds value j (low nibble) and value j + 16 (high).

A K-quant super-block holds 256 values of a row in sub-blocks, each with its own scale (and
minimum) made of a 6- or 8-bit integer times the super-block's fp16 ``d`` (``dmin``): one
sub-block is one block of the export's layout, with scale ``d sc`` (exact in float32):

* Q4_K: 8 sub-blocks of 32, ``w = q (d sc) - dmin m``, q 4 bits: int4 blocks of 32 with offsets,
  as Q4_1 (the minimum is ``-dmin m``);
* Q5_K: the same with 5-bit q: int8 blocks of 32 with offsets (no 5-bit product; the codes stay
  q, so nothing is re-quantised, only stored in 8 bits);
* Q6_K: 16 sub-blocks of 16, ``w = (q - 32) (d sc)``, q 6 bits, sc a signed byte: int8 blocks of
  16 with zero point 32 (a negative ``sc`` is a negative scale).

Q2_K and Q3_K are not kept (they fall back like F32).

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

from .blocks import BlockQuantized, RowParts
from .quantize import QuantScheme
from .row_index import RowIndex, row_keys

log = logging.getLogger(__name__)

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}  # ggml type -> bytes per block of 32
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # K-quant type -> bytes per 256 values
KEPT_TYPES = (*BLOCK_BYTES, *SUPER_BYTES)
KEY_ROWS = 4096  # rows whose values are computed at a time to index them
KEPT_BLOCK_SIZES = {"Q6_K": 16}  # the export's block size where it is not 32


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


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] -> codes [..., 32]: low nibbles are values 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_blocks(kind: str, raw: np.ndarray) -> BlockQuantized:
    """A tensor's ggml blocks, uint8 [rows, bytes per row], as a ``BlockQuantized`` [rows, K]."""
    if kind in SUPER_BYTES:
        return _decode_super_blocks(kind, raw)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[kind])  # [rows, Kb, bytes]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, Kb]
    if kind == "Q8_0":
        signed = blocks[..., 2:34].copy().view(np.int8).astype(np.int16)
        return BlockQuantized((signed + 128).astype(np.uint8).reshape(rows, -1), scale, None, 8, BLOCK)
    if kind == "Q4_0":
        return BlockQuantized(_nibbles(blocks[..., 2:18]).reshape(rows, -1), scale, None, 4, BLOCK)
    if kind == "Q5_0":  # [d, qh, qs]: w = (q - 16) d, int8 blocks with zero point 16
        return BlockQuantized(_five_bit_codes(blocks, 2), scale, np.full(scale.shape, 16, np.uint8), 8, BLOCK)
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # Q4_1, Q5_1: [d, m, ...]
    if kind == "Q5_1":
        return _with_minimum(_five_bit_codes(blocks, 4), scale, minimum, 8, BLOCK)
    return _with_minimum(_nibbles(blocks[..., 4:20]).reshape(blocks.shape[0], -1), scale, minimum, 4, BLOCK)


def _five_bit_codes(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0 / Q5_1 codes [rows, K] from blocks [rows, Kb, bytes] whose ``qh`` (bit i: value i's
    fifth bit, little-endian) starts at byte ``start``, followed by nibbles as in Q4_0."""
    high = blocks[..., start:start + 4].copy().view("<u4")  # [rows, Kb, 1]
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, Kb, 32]
    return (_nibbles(blocks[..., start + 4:start + 20]) | (fifth << 4)).reshape(blocks.shape[0], -1)


def _with_minimum(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, bits: int,
                  block: int) -> BlockQuantized:
    """Blocks ``w = q d + m`` (codes [rows, K], d and m [rows, Kb]) as zero points and offsets."""
    # q d + m = (q - z) d + (m + z d) with the integer zero point z nearest -m / d: the offset
    # left over is at most d / 2, so x @ ((q - z) d) + (x summed per block) @ offset does not
    # cancel two large terms (m is about -8 d) in float32. z d and m + z d are exact in float32.
    ratio = np.divide(-minimum, scale, out=np.zeros_like(scale), where=scale != 0)
    zero_points = np.clip(np.rint(ratio), 0, (1 << bits) - 1).astype(np.uint8)
    offsets = minimum + zero_points.astype(np.float32) * scale
    return BlockQuantized(codes, scale, zero_points, bits, block, offsets)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and minima, uint8 [..., 12] -> two [..., 8]: bytes
    0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for
    the minima, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and minima 4-7 (high)."""
    low, mins, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    minima = np.concatenate([mins & 0x3F, (rest >> 4) | ((mins >> 2) & 0x30)], axis=-1)
    return scales, minima


def _decode_super_blocks(kind: str, raw: np.ndarray) -> BlockQuantized:
    """Q4_K / Q5_K / Q6_K super-blocks, uint8 [rows, bytes per row], as a ``BlockQuantized``."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, SUPER_BYTES[kind])  # [rows, Ks, bytes]
    n = blocks.shape[1]

    def half(at: int) -> np.ndarray:  # an fp16 per super-block -> float32 [rows, Ks, 1]
        return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)

    if kind == "Q6_K":  # ql [128], qh [64], scales int8 [16], d
        # value 128 h + 64 s + b: nibble s of ql byte 64 h + b; its top 2 bits are bits 2 t, 2 t + 1
        # of qh byte 32 h + c, for the same value written 128 h + 32 t + c
        ql, qh = blocks[..., 0:128].reshape(rows, n, 2, 64), blocks[..., 128:192].reshape(rows, n, 2, 32)
        low = np.stack([ql & 0x0F, ql >> 4], axis=-2).reshape(rows, n, 256)
        high = np.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-2).reshape(rows, n, 256)
        codes = low | (high << 4)
        scale = half(208) * blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, Ks, 16]
        zero = np.full((rows, n * 16), 32, np.uint8)
        return BlockQuantized(codes.reshape(rows, -1).astype(np.uint8), scale.reshape(rows, -1), zero, 8, 16)
    sc, m = _k_scales(blocks[..., 4:16])
    scale = (half(0) * sc.astype(np.float32)).reshape(rows, -1)  # [rows, Ks * 8]
    minimum = -(half(2) * m.astype(np.float32)).reshape(rows, -1)
    # qs [128]: 32 bytes per pair of sub-blocks, low nibbles first (Q5_K: after qh [32], whose
    # byte i holds value i's fifth bit for sub-block j in bit j)
    start = 16 if kind == "Q4_K" else 48
    qs = blocks[..., start:start + 128].reshape(rows, n, 4, 32)
    codes = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(rows, n, 8, 32)
    if kind == "Q4_K":
        return _with_minimum(codes.reshape(rows, -1), scale, minimum, 4, BLOCK)
    qh = blocks[..., 16:48]
    fifth = np.stack([(qh >> j) & 0x01 for j in range(8)], axis=-2)  # [rows, Ks, 8, 32]
    return _with_minimum((codes | (fifth << 4)).reshape(rows, -1), scale, minimum, 8, BLOCK)


def gguf_values(blocks: BlockQuantized) -> np.ndarray:
    """float32 [rows, K] exactly as ggml (and gguf-py) dequantise the blocks: ``q d + m`` for
    Q4_1 (m = offset - zero point * scale), ``(q - z) d`` otherwise."""
    if blocks.offsets is None:
        return blocks.dequantize()
    minimum = blocks.offsets - blocks.zero_points.astype(np.float32) * blocks.scales
    n, k = blocks.shape
    if k == blocks.n_blocks * blocks.block_size:  # whole blocks: broadcast per block
        shape = (n, blocks.n_blocks, blocks.block_size)
        return (blocks.codes.reshape(shape).astype(np.float32) * blocks.scales[..., None]
                + minimum[..., None]).reshape(n, k)
    return blocks.codes.astype(np.float32) * blocks.block_values(blocks.scales) + blocks.block_values(minimum)


def _key(rows: np.ndarray) -> str:
    """A weight product's identity: the sha1 of its float32 bytes."""
    return hashlib.sha1(np.ascontiguousarray(rows, dtype=np.float32).tobytes()).hexdigest()


class KeptQuantization:
    """The quantisation a GGUF file already has, looked up row by row (see the module doc); a
    drop-in for ``QuantScheme`` in the exporter (``quantize``, ``embeddings``, ``name``,
    ``to_dict``).

    Only the file's tensors that weights were just read from are indexed: each dequantised
    tensor of the file (``reader.on_tensor_read``) joins the index, which starts again when a
    read moves on to another layer (``blk.N``; the tensors outside the layers are one group), so
    a streamed export indexes one layer at a time. A weight found in none of them (a module
    loaded before this object existed) indexes the whole file once, and is found there.
    """

    name = "keep"
    embeddings = True

    def __init__(self, path: str | Path, fallback: QuantScheme | None = None):
        from tfport.models.gguf.reader import GGUFFile, on_tensor_read

        self.path = Path(path)
        self.fallback = fallback or QuantScheme(8, BLOCK, symmetric=True)
        self.file = GGUFFile(self.path)
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

    def _read(self, name: str) -> None:
        """A tensor of the file was dequantised: index it, in a new index if its group is new."""
        if name not in self.kinds or self._whole:
            return
        group = ".".join(name.split(".")[:2]) if name.startswith("blk.") else ""
        if group != self._group:
            self.index, self._indexed, self._group = RowIndex(), set(), group
        self._add(name)

    def _add(self, name: str) -> None:
        if name in self._indexed:
            return
        rows = int(np.prod(self.file.shape(name)[:-1]))
        blocks = decode_blocks(self.kinds[name], self.file.blocks(name).reshape(rows, -1))
        self.file.release(name)
        keys = []  # in chunks of rows: a large table's float values are never all held
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
        parts = None
        if scale_dtype == "float32":
            parts = self.index.find_parts(rows)
            if parts is None and not self._whole:
                self._index_whole_file()
                parts = self.index.find_parts(rows)
        found = None if parts is None else parts[0] if len(parts) == 1 else RowParts(parts)
        key = _key(rows)
        if found is None:
            if key not in self._seen:
                log.info("keep: a [%d, %d] weight is not stored in one of %s: re-quantised as %s",
                         *rows.shape, list(KEPT_TYPES), self.fallback.name)
            self._seen[key] = False
            return self.fallback.quantize(rows, scale_dtype)
        self._seen[key] = True
        return found

    def holds(self, rows: np.ndarray) -> bool:
        """Whether ``quantize(rows)`` gave the file's own blocks, whose dequantised values are
        ``rows`` exactly (their keys are those values): a reference needs no dequantised copy."""
        return self._seen.get(_key(rows), False)

    def to_dict(self) -> dict:
        types = sorted(set(self.kinds.values()))
        sizes = {kind: KEPT_BLOCK_SIZES.get(kind, BLOCK) for kind in types}
        return {"format": "keep", "source": self.path.name, "types": types,
                "block_size": min(sizes.values(), default=BLOCK), "block_sizes": sizes,
                "embeddings": True, "fallback": self.fallback.to_dict(),
                "kept": self.kept, "requantized": self.requantized}
