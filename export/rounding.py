"""Round-to-nearest blockwise quantisation of weight rows (``quantize_rows``), with the per-block
clipping search that calibrated quantisation reuses with importance weights (``search_scales``)."""

from __future__ import annotations

import numpy as np

from tfport.dtypes import NUMPY_DTYPES

from .blocks import BlockQuantized

# Range factors tried per block by ``quantize_rows(search=True)``: 1 is plain min/max
# round-to-nearest; smaller ones clip the extremes of the block to shrink the step for the rest.
SEARCH_FACTORS = tuple(np.round(np.arange(1.0, 0.695, -0.05), 3))  # 1.0, 0.95, ..., 0.7
SEARCH_CHUNK = 512  # rows searched at a time (their temporary arrays stay in cache)


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
    factors = SEARCH_FACTORS if search and bits == 4 else (1.0,)  # 8 bits: nothing to gain
    scale, zero_points = search_scales(blocks, bits, symmetric, NUMPY_DTYPES[scale_dtype], factors)
    codes = np.empty(blocks.shape, np.uint8)  # [N, Kb, bs]
    for chunk in (slice(i, i + SEARCH_CHUNK) for i in range(0, n, SEARCH_CHUNK)):  # bounded temporaries
        codes[chunk] = nearest_codes(blocks[chunk], scale[chunk, :, None].astype(np.float32),
                                     None if zero_points is None else zero_points[chunk, :, None], bits)
    return BlockQuantized(np.ascontiguousarray(codes.reshape(n, -1)[:, :k]), scale, zero_points, bits, block_size)


def search_scales(blocks: np.ndarray, bits: int, symmetric: bool, dtype, factors,
                  importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales [n, Kb] (``dtype``) and zero points (uint8 [n, Kb]; None when symmetric) of
    ``blocks`` [n, Kb, bs]: per block, the scale (see ``quantize_rows``) of the block's range times
    each of ``factors`` whose nearest codes have the least squared error, each value's error times
    ``importance`` (broadcast against the blocks) when given (calibrated quantisation weights it
    by the input's mean square, ``export.gptq``). ``SEARCH_CHUNK`` rows at a time."""
    parts = [_search(blocks[i:i + SEARCH_CHUNK], bits, symmetric, dtype, factors, importance)
             for i in range(0, len(blocks), SEARCH_CHUNK)]
    scales = np.concatenate([p[0] for p in parts])
    return scales, None if symmetric else np.concatenate([p[1] for p in parts])


def _search(blocks: np.ndarray, bits: int, symmetric: bool, dtype, factors, importance: np.ndarray | None):
    """``search_scales`` on blocks [n, Kb, bs]: scales [n, Kb] and zero points [n, Kb] (None)."""
    half, levels = 1 << (bits - 1), (1 << bits) - 1
    if symmetric and bits == 4:  # the signed value of largest magnitude maps to code -half
        index = np.abs(blocks).argmax(axis=-1)[..., None]
        peak, divisor = np.take_along_axis(blocks, index, axis=-1)[..., 0], -half
    elif symmetric:
        peak, divisor = np.abs(blocks).max(axis=-1), half - 1
    else:
        low, high = np.minimum(blocks.min(axis=-1), 0.0), np.maximum(blocks.max(axis=-1), 0.0)
    best = None
    for factor in factors:
        if symmetric:
            scale, zero_points = _nonzero((peak * factor / divisor).astype(dtype)), None
        else:
            low_f, high_f = low * factor, high * factor
            scale = _nonzero(((high_f - low_f) / levels).astype(dtype))
            zero_points = np.clip(np.rint(-low_f / scale.astype(np.float32)), 0, levels).astype(np.uint8)
        scale32 = scale.astype(np.float32)[..., None]
        zero = None if zero_points is None else zero_points[..., None].astype(np.float32)
        error = _rounded(blocks, scale32, zero, bits)  # [n, Kb, bs]: codes, then the error
        if zero is not None:
            error -= zero
        error *= scale32
        error -= blocks
        np.square(error, out=error)
        if importance is not None:
            error *= importance
        error = error.sum(-1)  # [n, Kb]
        if best is None:
            best = [scale, zero_points, error]
            continue
        better = error < best[2]
        best[0] = np.where(better, scale, best[0])
        if zero_points is not None:
            best[1] = np.where(better, zero_points, best[1])
        best[2] = np.minimum(error, best[2])
    return best[0], best[1]


def _rounded(values: np.ndarray, scale: np.ndarray, zero_points: np.ndarray | None, bits: int) -> np.ndarray:
    """The nearest codes as float32, signed (-2^(bits-1) .. 2^(bits-1) - 1) when ``zero_points`` is None."""
    half, levels = 1 << (bits - 1), (1 << bits) - 1
    if zero_points is None:
        return np.clip(np.rint(values / scale), -half, half - 1)
    return np.clip(np.rint(values / scale) + zero_points, 0, levels)


def nearest_codes(values: np.ndarray, scale: np.ndarray, zero_points: np.ndarray | None,
                  bits: int) -> np.ndarray:
    """uint8 codes nearest ``values`` for float32 ``scale`` and ``zero_points`` (uint8 or float32;
    None: symmetric, signed codes -2^(bits-1) .. 2^(bits-1) - 1 stored plus 2^(bits-1)), broadcast."""
    codes = _rounded(values, scale, zero_points, bits)
    return (codes if zero_points is not None else codes + (1 << (bits - 1))).astype(np.uint8)


def _nonzero(scale: np.ndarray) -> np.ndarray:
    """All-zero blocks get scale 1 (their codes are the zero point either way)."""
    return np.where(scale == 0, np.ones_like(scale), scale)
