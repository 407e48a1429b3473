"""Quantised matrices found again by their rows' exact values (``RowIndex``): how a quantisation
chosen ahead of time reaches the weight products the exporter emits."""

from __future__ import annotations

import hashlib

import numpy as np

from .blocks import BlockQuantized, concat_rows


def row_keys(values: np.ndarray) -> list[bytes]:
    """Each row's key: a 128-bit BLAKE2b digest of its float32 bytes (equal rows, equal keys; an
    index of a large model's rows holds 16 bytes per row instead of the row)."""
    return [hashlib.blake2b(row, digest_size=16).digest()
            for row in np.ascontiguousarray(values, dtype=np.float32)]


class RowIndex:
    """Quantised matrices found again by their rows' exact float32 values: how a quantisation
    chosen ahead of time (a GGUF file's blocks, ``export.quant.keep``; calibrated GPTQ,
    ``export.calibrate``) reaches the weights the exporter projects with, which may be several
    matrices' rows concatenated (QKV, gate + up) or a module's rows in another order."""

    def __init__(self):
        self.matrices: list[BlockQuantized] = []
        self.keys: list[list[bytes]] = []  # per matrix, its rows' keys (``row_keys``)
        self.rows: dict[bytes, list[tuple[int, int]]] = {}  # row key -> every (matrix, row)

    def add(self, values: np.ndarray, quantized: BlockQuantized) -> None:
        """Index ``quantized`` under ``values`` [N, K], the float values its rows stand for."""
        assert values.shape == quantized.shape, (values.shape, quantized.shape)
        self.add_keys(row_keys(values), quantized)

    def add_keys(self, keys: list[bytes], quantized: BlockQuantized) -> None:
        """Index ``quantized`` under its rows' ``keys`` (``row_keys``; another index's ``keys``)."""
        assert len(keys) == quantized.shape[0], (len(keys), quantized.shape)
        self.matrices.append(quantized)
        self.keys.append(keys)
        for row, key in enumerate(keys):
            self.rows.setdefault(key, []).append((len(self.matrices) - 1, row))

    def find(self, rows: np.ndarray) -> BlockQuantized | None:
        """The blocks of ``rows`` [N, K] if every row was indexed and all of them in one format
        (bits, block size, zero points, offsets); None otherwise."""
        parts = self.find_parts(rows)
        return parts[0] if parts is not None and len(parts) == 1 else None

    def find_parts(self, rows: np.ndarray, keys: list[bytes] | None = None) -> list[BlockQuantized] | None:
        """The blocks of ``rows`` [N, K] as consecutive groups of rows of one format each (one
        group when all share it), or None if a row was not indexed.

        A row stored in several places (a zero row in two matrices, a table's padding rows) is
        taken from the run of consecutive rows it continues, else from the indexed matrix whose
        rows match the longest stretch from here (on a tie, the previous row's matrix): a whole
        matrix, or one of several concatenated, is found as itself however many of its rows occur
        elsewhere. ``keys``: ``row_keys(rows)`` where the caller has them already."""
        keys = row_keys(rows) if keys is None else keys
        found: list[tuple[int, int]] = []
        for i, key in enumerate(keys):
            if found and self._continues(found[-1], key):
                found.append((found[-1][0], found[-1][1] + 1))
                continue
            candidates = self.rows.get(key)
            if candidates is None:
                return None
            previous = found[-1][0] if found else None
            found.append(candidates[0] if len(candidates) == 1 else  # longest run; then the matrix so far
                         max(candidates, key=lambda entry: (self._run(entry, keys, i), entry[0] == previous)))
        groups: list[list[tuple[int, int]]] = []
        for entry in found:
            if groups and self._format(groups[-1][-1]) == self._format(entry):
                groups[-1].append(entry)
            else:
                groups.append([entry])
        return [self._gather(group) for group in groups]

    def _continues(self, entry: tuple[int, int], key: bytes) -> bool:
        """Whether the row after ``entry`` in its matrix has the bytes ``key``."""
        matrix, row = entry
        return row + 1 < len(self.keys[matrix]) and self.keys[matrix][row + 1] == key

    def _run(self, entry: tuple[int, int], keys: list[bytes], start: int) -> int:
        """How many of ``keys[start:]`` match the rows of ``entry``'s matrix from ``entry`` on."""
        length = 1
        while start + length < len(keys) and self._continues((entry[0], entry[1] + length - 1), keys[start + length]):
            length += 1
        return length

    def _format(self, entry: tuple[int, int]) -> tuple:
        p = self.matrices[entry[0]]
        return p.bits, p.block_size, p.scales.dtype, p.zero_points is None, p.offsets is None

    def _gather(self, found: list[tuple[int, int]]) -> BlockQuantized:
        """Rows ``found`` ((matrix, row) pairs, all of one format) as one ``BlockQuantized``: each
        run of consecutive rows of one matrix taken whole (``BlockQuantized.rows``), the runs
        stacked."""
        runs: list[list[int]] = []  # [matrix, first row, stop]
        for matrix, row in found:
            if runs and runs[-1][0] == matrix and runs[-1][2] == row:
                runs[-1][2] += 1
            else:
                runs.append([matrix, row, row + 1])
        return concat_rows([self.matrices[m].rows(start, stop) for m, start, stop in runs])
