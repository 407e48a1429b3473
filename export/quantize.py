"""Blockwise weight-only quantisation: formats, round-to-nearest, the fake-quantised reference.

A weight matrix is quantised in *rows* ``[N, K]`` (an ``nn.Linear`` weight: N outputs, K inputs;
an embedding table: N = V rows of K = E values), each row in blocks of ``block_size`` consecutive
values along K with one scale (and with ``symmetric=False`` one integer zero point) per block:

    w[n, k] ~= (code[n, k] - zero_point[n, k // bs]) * scale[n, k // bs]

Codes are unsigned (0 .. 2^bits - 1); a symmetric block has the implicit zero point 2^(bits-1),
which is the same as signed codes with no zero point. A row whose K is not a multiple of the block
size ends in a short block (padded with the zero point where a kernel needs whole blocks).

This is the layout ONNX Runtime's ``com.microsoft.MatMulNBits`` and ``GatherBlockQuantized`` read,
the one ONNX ``DequantizeLinear`` (opset 21, blocked) reads along K of ``[K, N]``, and the one
GGUF's legacy block types store (Q4_0: 32 values, symmetric; Q8_0: 32 values, symmetric; Q4_1: 32
values with a float minimum). Everything here is numpy; the export target decides how a quantised
product is lowered (``targets.base.PortableTarget.project_quantized``).

``fake_quantize`` returns a copy of a reference module whose weights are replaced by the
dequantised values the graph uses, so that parity against it holds with float32 tolerances.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from tfport.dtypes import NUMPY_DTYPES

BLOCK_SIZES = (16, 32, 64, 128, 256)  # powers of two >= 16: what MatMulNBits and ONNX's blocks take
BITS = {"int4": 4, "int8": 8}  # --quantize FORMAT -> bits


@dataclass(frozen=True)
class QuantScheme:
    """How weights are quantised: ``bits`` 4 or 8, ``block_size`` values per scale along K,
    ``symmetric`` (no zero points) or not; ``embeddings`` also quantises the token table (gathered
    from its quantised rows where the target can) and with it a tied output head."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = False
    embeddings: bool = True

    def __post_init__(self) -> None:
        if self.bits not in BITS.values():
            raise ValueError(f"bits={self.bits!r}: expected one of {sorted(BITS.values())}")
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size!r}: expected one of {list(BLOCK_SIZES)}")
        for option in ("symmetric", "embeddings"):
            if not isinstance(getattr(self, option), bool):
                raise TypeError(f"{option}={getattr(self, option)!r}: expected True or False")

    @classmethod
    def parse(cls, quantize: str, block_size: int = 32, symmetric: bool = False) -> "QuantScheme":
        """``--quantize int4|int8`` with ``--block-size`` and ``--symmetric``."""
        if quantize not in BITS:
            raise ValueError(f"quantize={quantize!r}: expected one of {list(BITS)}")
        return cls(BITS[quantize], block_size, symmetric)

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def to_dict(self) -> dict:
        return {"format": self.name, "bits": self.bits, "block_size": self.block_size,
                "symmetric": self.symmetric, "embeddings": self.embeddings,
                "scale_search": self.bits == 4}  # quantize_rows(search=True) searches 4-bit scales

    def quantize(self, rows: np.ndarray, scale_dtype: str = "float32") -> "BlockQuantized":
        return quantize_rows(rows, self.bits, self.block_size, self.symmetric, scale_dtype)


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

    def dequantize(self) -> np.ndarray:
        """[N, K] in the scales' dtype: (code - zero point) * scale (+ offset), as the graph
        computes it (one rounding, in the scales' dtype)."""
        dtype = self.scales.dtype
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


class RowIndex:
    """Quantised matrices found again by their rows' exact float32 values: how a quantisation
    chosen ahead of time (a GGUF file's blocks, ``export.gguf_keep``; calibrated GPTQ,
    ``export.calibrate``) reaches the weights the exporter projects with, which may be several
    matrices' rows concatenated (QKV, gate + up) or a module's rows in another order."""

    def __init__(self):
        self.matrices: list[BlockQuantized] = []
        self.keys: list[list[bytes]] = []  # per matrix, its rows' float32 bytes
        self.rows: dict[bytes, list[tuple[int, int]]] = {}  # float32 row bytes -> every (matrix, row)

    def add(self, values: np.ndarray, quantized: BlockQuantized) -> None:
        """Index ``quantized`` under ``values`` [N, K], the float values its rows stand for."""
        assert values.shape == quantized.shape, (values.shape, quantized.shape)
        self.matrices.append(quantized)
        keys = [value.tobytes() for value in np.ascontiguousarray(values, dtype=np.float32)]
        self.keys.append(keys)
        for row, key in enumerate(keys):
            self.rows.setdefault(key, []).append((len(self.matrices) - 1, row))

    def find(self, rows: np.ndarray) -> BlockQuantized | None:
        """The blocks of ``rows`` [N, K] if every row was indexed and all of them in one format
        (bits, block size, zero points, offsets); None otherwise."""
        parts = self.find_parts(rows)
        return parts[0] if parts is not None and len(parts) == 1 else None

    def find_parts(self, rows: np.ndarray) -> list[BlockQuantized] | None:
        """The blocks of ``rows`` [N, K] as consecutive groups of rows of one format each (one
        group when all share it), or None if a row was not indexed.

        A row stored in several places (a zero row in two matrices, a table's padding rows) is
        taken from the run of consecutive rows it continues, else from the indexed matrix whose
        rows match the longest stretch from here (on a tie, the previous row's matrix): a whole
        matrix, or one of several concatenated, is found as itself however many of its rows occur
        elsewhere."""
        keys = [row.tobytes() for row in np.ascontiguousarray(rows, dtype=np.float32)]
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
        """Rows ``found`` ((matrix, row) pairs, all of one format) as one ``BlockQuantized``."""
        parts = [self.matrices[m] for m, _ in found]
        first = parts[0]

        def gather(attr: str):
            if getattr(first, attr) is None:
                return None
            return np.stack([getattr(part, attr)[i] for part, (_, i) in zip(parts, found)])

        return BlockQuantized(gather("codes"), gather("scales"), gather("zero_points"), first.bits,
                              first.block_size, gather("offsets"))


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """uint8 [..., 2M] with values < 16 -> uint8 [..., M], the first of each pair in the low nibble
    (ONNX int4/uint4 and MatMulNBits' order). An odd last axis is padded with 0."""
    values = np.asarray(values, dtype=np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


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
    parts = [_best_rtn(blocks[i:i + SEARCH_CHUNK], bits, symmetric, dtype, factors)
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


def _best_rtn(blocks: np.ndarray, bits: int, symmetric: bool, dtype, factors,
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


# ------------------------------------------------------------------------------ the reference
def quantized_weights(model, scheme: QuantScheme, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Parameter name -> the dequantised value [out, in] (float32) the export of ``model`` with
    ``scheme`` computes with: every ``nn.Linear`` weight, and with ``scheme.embeddings`` the token
    tables (and so a tied head). Scales are rounded to ``dtype`` as the graph stores them."""
    from torch import nn

    values = {}
    tables = token_table_paths(model)
    table_ids = {id(model.get_parameter(path)) for path in tables}
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if id(module.weight) in table_ids and not scheme.embeddings:
                continue  # a tied head reads the table, which stays unquantised
            rows = module.weight.detach().float().cpu().numpy()
            values[f"{path}.weight"] = scheme.quantize(rows, dtype).dequantize().astype(np.float32)
    if scheme.embeddings:
        for path in tables:
            table = scheme.quantize(model.get_parameter(path).detach().float().cpu().numpy(), dtype)
            if gatherable(table):  # as WeightQuantizer.table: other tables stay float
                values[path] = table.dequantize().astype(np.float32)
    return values


def gatherable(table) -> bool:
    """Whether a quantised token table can be gathered from: one format (not ``RowParts``)."""
    return isinstance(table, BlockQuantized)


def token_table_paths(model) -> list[str]:
    """Parameter names of the token embedding tables the exporter gathers from."""
    paths = []
    for side in ("encoder", "decoder"):
        stack = getattr(model, side, None)
        if stack is not None and hasattr(stack, "embed"):
            name = f"{side}.embed.tokens.weight"
            if name not in paths and dict(model.named_parameters(remove_duplicate=False)).get(name) is not None:
                paths.append(name)
    return paths


def fake_quantize(model, scheme: QuantScheme, dtype: str = "float32"):
    """A copy of ``model`` whose weights are replaced by their dequantised values (see
    ``quantized_weights``): the PyTorch reference a quantised export is compared against."""
    import torch

    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        for name, value in quantized_weights(reference, scheme, dtype).items():
            parameter = reference.get_parameter(name)
            parameter.copy_(torch.from_numpy(value).to(parameter.dtype))
    return reference


def resolve_scheme(quantize, block_size: int | None = None, symmetric: bool | None = None) -> QuantScheme | None:
    """``export_model``'s ``quantize`` argument: None, "int4" / "int8" (with ``block_size``, default
    32, and ``symmetric``, default False) or a ``QuantScheme`` (taken as is: ``block_size`` and
    ``symmetric`` are refused with it, as without quantisation)."""
    if quantize is None or isinstance(quantize, QuantScheme) or hasattr(quantize, "quantize"):
        for option, value in (("block_size", block_size), ("symmetric", symmetric)):
            if value is not None:
                got = ("no quantisation" if quantize is None else
                       f"quantize={getattr(quantize, 'name', type(quantize).__name__)!r}, whose layout is its own")
                raise ValueError(f"{option}={value!r}: applies to quantize='int4' or 'int8', got {got}")
        return quantize  # a QuantScheme, or export.gguf_keep.KeptQuantization
    if quantize == "keep":
        raise ValueError("quantize='keep': keeps a GGUF file's own blocks, so the source must be a "
                         ".gguf file (tfport export FILE.gguf --quantize keep, or "
                         "export.gguf_keep.KeptQuantization)")
    if not isinstance(quantize, str):
        raise TypeError(f"quantize={quantize!r}: expected None, one of {list(BITS)} or a QuantScheme")
    return QuantScheme.parse(quantize, 32 if block_size is None else block_size, False if symmetric is None else symmetric)
