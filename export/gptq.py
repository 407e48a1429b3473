"""GPTQ (Frantar et al. 2022) in the export's block layout.

Round-to-nearest picks each weight's code on its own; GPTQ picks them to keep a product's
*output* close on real activations. For a weight W [N, K] whose inputs x [K] are seen on a
calibration text, the output error of a change dW is ``sum over tokens |dW x|^2 = tr(dW H dW^T)``
with ``H = E[x x^T]`` [K, K] (``hessians.collect_hessians``). GPTQ quantises W one column at a
time; after rounding a column it spreads that column's error over the columns not yet quantised,
the update that minimises the output error given H (the optimal brain surgeon step; with the
inverse of H's Cholesky factor every step is one row of a triangular matrix). With the columns
taken in order k = 0 .. K-1:

    err = (W[:, k] - Q[:, k]) / U[k, k]        W[:, k+1:] -= err U[k, k+1:]      (H^-1 = U^T U)

Here the columns go in order of decreasing H diagonal ("act-order", GPTQ's option for small
models) with "static groups": each block of ``block_size`` columns gets its scale (and zero
point) up front from the original weights, by the clipping search of round-to-nearest
(``rounding.search_scales``) with each column's error weighted by H's diagonal, and every column is
rounded with its own block's scale wherever the order reaches it. So the result is an ordinary
``BlockQuantized``: the same codes, scales and zero points in the same layout, which every
export target lowers unchanged; only which codes (and scales) are chosen differs. On SmolLM2
act-order lowered perplexity over in-order GPTQ with scales chosen as each block is reached
(24.68 vs 24.97 asymmetric, 25.46 vs 26.74 symmetric, PyTorch with the fake-quantised weights, on
the first 320 tokens of the perplexity text).
"""

from __future__ import annotations

import numpy as np
import torch

from tfport.dtypes import NUMPY_DTYPES

from .blocks import BlockQuantized
from .rounding import SEARCH_FACTORS, nearest_codes, search_scales

LAZY_COLUMNS = 128  # columns whose errors are applied to the rest at once
CHUNK_ROWS = 2048  # rows whose lazy batch of columns is updated at once (1 MB: kept in cache)
DAMP = 0.1  # H += DAMP * mean(diag H) * I: well conditioned, and less fitted to a short text


def gptq_rows(rows: np.ndarray, hessian: torch.Tensor, bits: int, block_size: int, symmetric: bool,
              scale_dtype: str = "float32", damp: float = DAMP) -> BlockQuantized:
    """GPTQ quantisation of ``rows`` [N, K] (an ``nn.Linear`` weight) for inputs with second
    moment ``hessian`` [K, K] (see the module doc), in blocks of ``block_size`` along K with
    scales rounded to ``scale_dtype`` before the codes are chosen, as ``quantize_rows`` does.

    Scales (and zero points) are chosen first, per block, from the original weights (the clipping
    search of ``quantize_rows`` with each column's error weighted by H's diagonal); then the
    columns are quantised in order of decreasing H diagonal ("act-order": the inputs with the
    largest energy first, while the most columns are left to absorb their error), each with its
    own block's scale, so the blocks stay those of the layout.
    """
    rows = np.asarray(rows, dtype=np.float32)
    n, k = rows.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian: expected shape {(k, k)} for rows {rows.shape}, got {tuple(hessian.shape)}")
    h = hessian.double().clone()
    dead = torch.diagonal(h) <= 0  # inputs that are always 0: nothing to compensate into them
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    scales, zero_points = _block_scales(rows, torch.diagonal(h).float().numpy(), bits, block_size, symmetric,
                                        NUMPY_DTYPES[scale_dtype])
    order = torch.argsort(torch.diagonal(h), descending=True)  # [K]: column quantised at step i
    h = h[order][:, order]
    inverse_factor = torch.linalg.solve_triangular(torch.linalg.cholesky(h), torch.eye(k, dtype=h.dtype), upper=False)
    u = torch.linalg.cholesky(inverse_factor.T @ inverse_factor, upper=True).float()  # H^-1 = U^T U
    order = order.numpy()
    w = torch.from_numpy(rows[:, order])  # [N, K] in quantisation order, updated as columns are done
    block_of = order // block_size  # [K]: the block of the column quantised at step i
    steps = np.ascontiguousarray(scales.T, np.float32)  # [Kb, N]
    zeros = (np.full(steps.shape, 1 << (bits - 1), np.float32) if zero_points is None
             else np.ascontiguousarray(zero_points.T, np.float32))
    codes = np.zeros((k, n), np.uint8)  # [K, N] in quantisation order
    u_numpy = u.numpy()
    for c0 in range(0, k, LAZY_COLUMNS):  # errors reach later columns in lazy batches (GPTQ's trick)
        c1 = min(k, c0 + LAZY_COLUMNS)
        errors = np.empty((c1 - c0, n), np.float32)  # [C, N]
        for r0 in range(0, n, CHUNK_ROWS):  # rows are independent: a chunk's columns stay in cache
            r1 = min(n, r0 + CHUNK_ROWS)
            columns = np.ascontiguousarray(w[r0:r1, c0:c1].numpy().T)  # [C, R]
            _quantise_columns(columns, u_numpy[c0:c1, c0:c1], steps[block_of[c0:c1], r0:r1],
                              zeros[block_of[c0:c1], r0:r1], zero_points is not None, bits,
                              codes[c0:c1, r0:r1], errors[:, r0:r1])
        w[:, c1:] -= torch.from_numpy(np.ascontiguousarray(errors.T)) @ u[c0:c1, c1:]
    codes = np.ascontiguousarray(codes[np.argsort(order)].T)  # [N, K] in column order
    return BlockQuantized(codes, scales, zero_points, bits, block_size)


def _quantise_columns(columns: np.ndarray, u: np.ndarray, steps: np.ndarray, zeros: np.ndarray,
                      asymmetric: bool, bits: int, codes: np.ndarray, errors: np.ndarray) -> None:
    """GPTQ's inner loop over one lazy batch of C columns for R rows: ``columns`` [C, R] (the
    weights, transposed; updated in place), ``u`` [C, C] (that batch's block of U), ``steps`` and
    ``zeros`` [C, R] (each column's block scale and zero point, float32); writes ``codes`` [C, R]
    and the scaled errors ``errors`` [C, R] the later columns are updated with."""
    product = np.empty_like(columns)
    for i in range(len(columns)):
        code = nearest_codes(columns[i], steps[i], zeros[i] if asymmetric else None, bits)
        codes[i] = code
        err = (columns[i] - (code - zeros[i]) * steps[i]) / u[i, i]  # [R]
        rest = product[i + 1:]
        np.multiply(u[i, i + 1:, None], err, out=rest)
        columns[i + 1:] -= rest
        errors[i] = err


def _block_scales(rows: np.ndarray, importance: np.ndarray, bits: int, block_size: int, symmetric: bool,
                  dtype) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales [N, Kb] (``dtype``) and zero points (uint8 [N, Kb] or None) of ``rows`` [N, K] by the
    importance-weighted clipping search (``rounding.search_scales``); a short last block is padded
    with zeros of no importance."""
    n, k = rows.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), np.float32)
    padded[:, :k] = rows
    weights = np.zeros(n_blocks * block_size, np.float32)
    weights[:k] = importance
    factors = SEARCH_FACTORS if bits == 4 else (1.0,)
    return search_scales(padded.reshape(n, n_blocks, block_size), bits, symmetric, dtype, factors,
                         weights.reshape(n_blocks, block_size))


def gptq_bytes(n: int, k: int) -> int:
    """Working memory of ``gptq_rows`` for rows [N, K] (measured: about five float64 [K, K]
    matrices at once, and three float32 copies of the rows)."""
    return 5 * 8 * k * k + 3 * 4 * n * k
