"""Round-to-nearest blockwise quantisation of weight rows (``quantize_rows``), with the per-block
clipping search that calibrated quantisation reuses with importance weights (``best_rtn``)."""

from __future__ import annotations

import numpy as np

from tfport.dtypes import NUMPY_DTYPES

from .blocks import BlockQuantized

# Range factors tried per block by ``quantize_rows(search=True)``: 1 is plain min/max
# round-to-nearest; smaller ones clip the extremes of the block to shrink the step for the rest.
SEARCH_FACTORS = tuple(np.round(np.arange(1.0, 0.695, -0.05), 3))  # 1.0, 0.95, ..., 0.7
SEARCH_CHUNK = 4096  # rows quantised at a time (bounds the search's temporary arrays)


def quantize_rows(rows: np.ndarray, bits: int, block_size: int, symmetric: bool,
                  scale_dtype: str = "float32", search: bool = True) -> BlockQuantized:
    """Round-to-nearest blockwise quantisation of ``rows`` [N, K] along K.

    Symmetric: 4 bits take GGUF Q4_0's scale (the block's value of largest magnitude maps to code
    -8, so all 16 levels are used), 8 bits ``max|w| / 127``. Asymmetric: the block's range, widened
    to include 0, over 2^bits - 1 levels, with the zero point that puts 0 on a code. With
    ``search``, each block's range is also tried scaled by ``SEARCH_FACTORS`` (clipping its
    extremes) and the scale with the least squared error is kept; the codes are always the nearest
    ones for the chosen scale. Scales are rounded to ``scale_dtype`` *before* the codes are chosen,
    so the dequantised values are those the graph computes.
    """
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"rows: expected a matrix [N, K], got shape {rows.shape}")
    n, k = rows.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), np.float32)
    padded[:, :k] = rows
    blocks = padded.reshape(n, n_blocks, block_size)
    dtype = NUMPY_DTYPES[scale_dtype]
    factors = SEARCH_FACTORS if search and bits == 4 else (1.0,)  # 8 bits: nothing to gain
    parts = [best_rtn(blocks[i:i + SEARCH_CHUNK], bits, symmetric, dtype, factors)
             for i in range(0, n, SEARCH_CHUNK)]
    scale = np.concatenate([p[0] for p in parts])
    zero_points = None if symmetric else np.concatenate([p[1] for p in parts])
    codes = np.concatenate([p[2] for p in parts]).reshape(n, -1)[:, :k]
    return BlockQuantized(np.ascontiguousarray(codes), scale, zero_points, bits, block_size)


def _rtn(blocks: np.ndarray, bits: int, symmetric: bool, dtype, factor: float):
    """Scales [n, Kb] (``dtype``), zero points uint8 [n, Kb] (None when symmetric) and codes uint8
    [n, Kb, bs] for the block range scaled by ``factor``."""
    levels = (1 << bits) - 1
    half = 1 << (bits - 1)
    if symmetric:
        if bits == 4:
            index = np.abs(blocks).argmax(axis=-1)[..., None]
            peak = np.take_along_axis(blocks, index, axis=-1)[..., 0]  # signed, largest magnitude
            scale = peak * factor / -half
        else:
            scale = np.abs(blocks).max(axis=-1) * factor / (half - 1)
        scale = _nonzero(scale.astype(dtype))
        return scale, None, nearest_codes(blocks, scale.astype(np.float32)[..., None], None, bits)
    low = np.minimum(blocks.min(axis=-1), 0.0) * factor
    high = np.maximum(blocks.max(axis=-1), 0.0) * factor
    scale = _nonzero(((high - low) / levels).astype(dtype))
    scale32 = scale.astype(np.float32)
    zero_points = np.clip(np.rint(-low / scale32), 0, levels).astype(np.uint8)
    return scale, zero_points, nearest_codes(blocks, scale32[..., None], zero_points[..., None], bits)


def nearest_codes(values: np.ndarray, scale: np.ndarray, zero_points: np.ndarray | None,
                  bits: int) -> np.ndarray:
    """uint8 codes nearest ``values`` for float32 ``scale`` and uint8 ``zero_points`` (None:
    symmetric, signed codes -2^(bits-1) .. 2^(bits-1) - 1 stored plus 2^(bits-1)), broadcast."""
    half, levels = 1 << (bits - 1), (1 << bits) - 1
    if zero_points is None:
        return (np.clip(np.rint(values / scale), -half, half - 1) + half).astype(np.uint8)
    return np.clip(np.rint(values / scale) + zero_points, 0, levels).astype(np.uint8)


def best_rtn(blocks: np.ndarray, bits: int, symmetric: bool, dtype, factors,
              importance: np.ndarray | None = None) -> tuple:
    """``_rtn`` at each factor, keeping per block the one with the least squared error (each
    value's error times ``importance``, broadcast against the blocks [n, Kb, bs], when given:
    calibrated quantisation weights it by the input's mean square, ``export.calibrate``)."""
    best = None
    for factor in factors:
        scale, zero_points, codes = _rtn(blocks, bits, symmetric, dtype, factor)
        zp = (1 << (bits - 1)) if zero_points is None else zero_points[..., None].astype(np.float32)
        error = np.square((codes.astype(np.float32) - zp) * scale.astype(np.float32)[..., None] - blocks)
        error = (error if importance is None else error * importance).sum(-1)
        if best is None:
            best = [scale, zero_points, codes, error]
            continue
        better = error < best[3]
        best[0] = np.where(better, scale, best[0])
        if zero_points is not None:
            best[1] = np.where(better, zero_points, best[1])
        best[2] = np.where(better[..., None], codes, best[2])
        best[3] = np.minimum(error, best[3])
    return best[0], best[1], best[2]


def _nonzero(scale: np.ndarray) -> np.ndarray:
    """All-zero blocks get scale 1 (their codes are the zero point either way)."""
    return np.where(scale == 0, np.ones_like(scale), scale)
