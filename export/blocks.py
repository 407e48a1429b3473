"""Quantised weight matrices in blocks: the layout every quantisation of an export produces and
every target lowers.

A matrix [N, K] (an ``nn.Linear`` weight: N outputs, K inputs; an embedding table: N = V rows of
K = E values) is stored row by row in blocks of ``block_size`` consecutive values along K, with
one scale (and, unless symmetric, one integer zero point) per block:

    w[n, k] ~= (code[n, k] - zero_point[n, k // bs]) * scale[n, k // bs]

Codes are unsigned (0 .. 2^bits - 1); a symmetric block has the implicit zero point 2^(bits-1),
which is the same as signed codes with no zero point. A row whose K is not a multiple of the block
size ends in a short block (padded with the zero point where a kernel needs whole blocks). This
is the layout ONNX Runtime's ``MatMulNBits`` / ``GatherBlockQuantized`` read, the one ONNX's
blocked ``DequantizeLinear`` reads along K of [K, N], and the one GGUF's legacy block types store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


DEQUANTIZE_ROWS = 4096  # rows dequantised at a time (a large token table in chunks)


@dataclass
class BlockQuantized:
    """A matrix [N, K] in blocks along K: ``codes`` uint8 [N, K] (one code per byte, 0..2^bits-1),
    ``scales`` [N, Kb] (the graph's float dtype), ``zero_points`` uint8 [N, Kb] or None
    (symmetric: 2^(bits-1)); ``offsets`` [N, Kb] float, GGUF Q4_1's block minimum, added after
    scaling (None for round-to-nearest)."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    bits: int
    block_size: int
    offsets: np.ndarray | None = None
    # Initializer names per storage layout, filled by the target's lowering, so a tied table is
    # stored once per layout however many products and gathers read it.
    stored: dict[str, tuple] = field(default_factory=dict, repr=False)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def n_blocks(self) -> int:
        return self.scales.shape[1]

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None

    def block_values(self, values: np.ndarray) -> np.ndarray:
        """A per-block array [N, Kb] spread to [N, K]."""
        return np.repeat(values, self.block_size, axis=1)[:, :self.shape[1]]

    def zero_point_values(self) -> np.ndarray:
        """uint8 [N, Kb]: the zero points, the implicit 2^(bits-1) when symmetric."""
        if self.zero_points is not None:
            return self.zero_points
        return np.full(self.scales.shape, 1 << (self.bits - 1), dtype=np.uint8)

    def rows(self, start: int, stop: int) -> "BlockQuantized":
        """Rows ``start:stop`` (views of the codes, scales, zero points and offsets)."""
        def part(values):
            return None if values is None else values[start:stop]

        return BlockQuantized(self.row_codes(start, stop), self.scales[start:stop], part(self.zero_points),
                              self.bits, self.block_size, part(self.offsets))

    def row_codes(self, start: int, stop: int) -> np.ndarray:
        """uint8 [stop - start, K]: the codes of rows ``start:stop``."""
        return self.codes[start:stop]

    def dequantize(self) -> np.ndarray:
        """[N, K] in the scales' dtype: (code - zero point) * scale (+ offset), as the graph
        computes it (one rounding, in the scales' dtype); computed in chunks of rows, so a large
        table needs little more than its result."""
        n, k = self.shape
        if n > DEQUANTIZE_ROWS:
            out = np.empty((n, k), dtype=self.scales.dtype)
            for start in range(0, n, DEQUANTIZE_ROWS):
                out[start:start + DEQUANTIZE_ROWS] = self.rows(start, start + DEQUANTIZE_ROWS).dequantize()
            return out
        dtype = self.scales.dtype
        if k == self.n_blocks * self.block_size:  # whole blocks: broadcast per block, no spread copies
            blocks = (n, self.n_blocks, self.block_size)
            centred = self.codes.reshape(blocks).astype(np.int16) - self.zero_point_values()[..., None].astype(np.int16)
            values = centred.astype(dtype) * self.scales[..., None]
            if self.offsets is not None:
                values = values + self.offsets[..., None]
            return values.astype(dtype).reshape(n, k)
        centred = self.codes.astype(np.int16) - self.block_values(self.zero_point_values()).astype(np.int16)
        values = centred.astype(dtype) * self.block_values(self.scales)
        if self.offsets is not None:
            values = values + self.block_values(self.offsets)
        return values.astype(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: packed codes, scales, zero points (packed like the codes)."""
        n, k = self.shape
        packed = n * self.n_blocks * self.block_size * self.bits // 8
        extra = 0 if self.zero_points is None else self.zero_points.size * self.bits // 8
        offsets = 0 if self.offsets is None else self.offsets.nbytes
        return packed + self.scales.nbytes + extra + offsets

    # ------------------------------------------------------------------------- storage layouts
    def padded_codes(self) -> np.ndarray:
        """uint8 [N, Kb, block_size]: the codes in whole blocks, a short last block padded with
        its zero point (dequantises to 0)."""
        n, k = self.shape
        full = self.n_blocks * self.block_size
        if full == k:
            return self.codes.reshape(n, self.n_blocks, self.block_size)
        pad = np.repeat(self.zero_point_values()[:, -1:], full - k, axis=1)
        return np.concatenate([self.codes, pad], axis=1).reshape(n, self.n_blocks, self.block_size)

    def signed_codes(self) -> np.ndarray:
        """int8 [N, K]: code - 2^(bits-1) (the signed codes of a symmetric block)."""
        return (self.codes.astype(np.int16) - (1 << (self.bits - 1))).astype(np.int8)


class NibbleBlocks(BlockQuantized):
    """A 4-bit ``BlockQuantized`` that holds its codes two per byte: what GPTQ keeps of every
    matrix from calibration until the graphs are written (half the bytes of a code per byte: 3.7
    GB less at 8B). ``codes`` unpacks them on each read, a fresh uint8 [N, K]; ``shape`` does not."""

    @property
    def codes(self) -> np.ndarray:
        return unpack_nibbles(self._packed, self._width)

    @codes.setter
    def codes(self, values: np.ndarray) -> None:
        values = np.asarray(values)
        assert values.ndim == 2 and (values.size == 0 or values.max() < 16), "4-bit codes [N, K]"
        self._width = values.shape[1]
        self._packed = pack_nibbles(values)

    @property
    def shape(self) -> tuple[int, int]:
        return self._packed.shape[0], self._width

    def row_codes(self, start: int, stop: int) -> np.ndarray:
        """Only these rows unpacked (a view of all of them would keep every code unpacked for as
        long as the rows live)."""
        return unpack_nibbles(self._packed[start:stop], self._width)


def compact(quantized: BlockQuantized) -> BlockQuantized:
    """``quantized`` holding its codes in as few bytes as they need (``NibbleBlocks`` for 4 bits)."""
    if quantized.bits != 4 or isinstance(quantized, NibbleBlocks):
        return quantized
    return NibbleBlocks(quantized.codes, quantized.scales, quantized.zero_points, quantized.bits,
                        quantized.block_size, quantized.offsets)


def concat_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """Matrices [N_i, K] of one format stacked along N -> [sum N_i, K]."""
    first = parts[0]

    def stack(attr: str):
        return None if getattr(first, attr) is None else np.concatenate([getattr(p, attr) for p in parts])

    return BlockQuantized(stack("codes"), stack("scales"), stack("zero_points"), first.bits, first.block_size,
                          stack("offsets"))


@dataclass
class RowParts:
    """A weight [N, K] whose consecutive row groups are quantised in different formats (a GGUF
    Q4_K_M file's Q4_K query and key rows with its Q6_K value rows, fused into one QKV product):
    the parts [N_i, K] in order. ``WeightQuantizer.project`` lowers each part and concatenates."""

    parts: list[BlockQuantized]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts])


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """uint8 [..., 2M] with values < 16 -> uint8 [..., M], the first of each pair in the low nibble
    (ONNX int4/uint4 and MatMulNBits' order). An odd last axis is padded with 0."""
    values = np.asarray(values, dtype=np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: np.ndarray, width: int) -> np.ndarray:
    """``pack_nibbles``' inverse: uint8 [..., M] -> uint8 [..., width] (width <= 2M), contiguous."""
    values = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=np.uint8)
    values[..., 0::2] = packed & 0x0F
    values[..., 1::2] = packed >> 4
    return values if width == values.shape[-1] else np.ascontiguousarray(values[..., :width])

