"""A GGUF file's own Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks, and the Q4_K / Q5_K / Q6_K
super-blocks of llama.cpp's "K-quants" (Q4_K_M, Q5_K_M ...), read as the export's quantised
blocks without re-quantising: what ``--quantize keep`` keeps (``export.quant.keep``).

ggml's legacy block types are blockwise quantisations along each row, 32 values per block, with
an fp16 scale ``d`` -- exactly ``export.blocks.BlockQuantized``:

* Q4_0: 16 bytes of nibbles, ``w = (q - 8) d``: 4 bits, symmetric (implicit zero point 8);
* Q8_0: 32 int8 ``q``, ``w = q d``: 8 bits, symmetric (codes q + 128, implicit zero point 128);
* Q4_1: an fp16 minimum ``m`` too, ``w = q d + m = (q - z) d + (m + z d)``: 4 bits, the integer
  zero point z nearest -m / d, and the small remainder ``m + z d`` as the block *offset*, which
  the targets add as (x summed per block) @ offset (``quant.graph.offset_product``);
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

``export.quant.keep`` (``--quantize keep``) finds a weight's rows among these blocks and keeps them.
"""

from __future__ import annotations

import numpy as np

from .blocks import BlockQuantized

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}  # ggml type -> bytes per block of 32
SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # K-quant type -> bytes per 256 values
KEPT_TYPES = (*BLOCK_BYTES, *SUPER_BYTES)
KEPT_BLOCK_SIZES = {"Q6_K": 16}  # the export's block size where it is not 32


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
