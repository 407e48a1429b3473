"""The graph side of quantised weights: how ``export.blocks`` are stored as ONNX
initializers (int4 / uint4 / int8 / uint8, packed bytes for the contrib operators), the
``WeightQuantizer`` a ``GraphBuilder`` holds for a blockwise scheme (every weight product and
token gather of one graph, lowered by the export target: ``project_quantized``,
``gather_quantized``) and the block offsets of GGUF's Q4_1 / Q4_K / Q5_1 / Q5_K.
"""

from __future__ import annotations

import logging

import numpy as np

from ..blocks import BlockQuantized, RowParts, pack_nibbles
from .base import Quantization

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ graph storage
ONNX_INT_TYPES = {(4, True): 22, (4, False): 21, (8, True): 3, (8, False): 2}  # (bits, signed) -> INT4, UINT4, INT8, UINT8


def int_initializer(g, name: str, values: np.ndarray, bits: int, signed: bool) -> str:
    """An integer initializer of ONNX type int4/uint4 (``values`` packed two per byte, as ONNX
    stores them) or int8/uint8; returns its (fresh) name."""
    from onnx import helper

    name = g.fresh(name)
    values = np.ascontiguousarray(values)
    if bits == 4:
        raw = pack_nibbles(values.astype(np.int8).view(np.uint8).reshape(-1)).tobytes()
        tensor = helper.make_tensor(name, ONNX_INT_TYPES[(4, signed)], values.shape, raw, raw=True)
    else:
        tensor = helper.make_tensor(name, ONNX_INT_TYPES[(8, signed)], values.shape,
                                    values.astype(np.int8 if signed else np.uint8).tobytes(), raw=True)
    g.initializers.append(tensor)
    return name


def byte_initializer(g, name: str, values: np.ndarray) -> str:
    """A uint8 initializer (MatMulNBits / GatherBlockQuantized storage)."""
    from onnx import numpy_helper

    name = g.fresh(name)
    g.initializers.append(numpy_helper.from_array(np.ascontiguousarray(values, dtype=np.uint8), name))
    return name


def gatherable(table) -> bool:
    """Whether a quantised token table can be gathered from: one format (not ``RowParts``)."""
    return isinstance(table, BlockQuantized)


class WeightQuantizer:
    """What one graph's weight products and token gathers do under a blockwise scheme: held by the
    ``GraphBuilder`` (``g.quantizer``) and consulted by ``emit.project`` and ``emit.gather_rows``,
    it quantises each weight once and hands it to the export target's lowering
    (``project_quantized``, ``gather_quantized``). A token table quantised here is kept by its
    graph name, so a tied head and the embedding gather read the same quantised rows."""

    def __init__(self, scheme: Quantization, target):
        self.scheme = scheme
        self.target = target
        self.tables: dict[str, BlockQuantized] = {}
        self.weight_bytes = 0  # bytes of quantised weights the graph's products read

    def table(self, g, name: str, rows: np.ndarray) -> str:
        """Quantise a token table [V, E]; returns the handle ``gather`` and ``project`` take."""
        table = self.scheme.quantize(rows, g.dtype)
        if not gatherable(table):  # float rows instead
            log.warning("%s: the quantised token table [%d, %d] mixes formats (%s); stored as %s rows",
                        name, *rows.shape, ", ".join(f"int{p.bits} blocks of {p.block_size}" for p in table.parts),
                        g.dtype)
            return g.weight(name, rows)
        handle = g.fresh(name)
        self.tables[handle] = table
        return handle

    def owns(self, weight) -> bool:
        return isinstance(weight, str) and weight in self.tables

    def project(self, g, x: str, weight, name: str, bias=None, transposed: bool = False) -> str:
        """x [..., K] @ W -> [..., N] with W quantised: ``weight`` an array [K, N], or a table
        handle read transposed (a tied head: rows [N = V, K = E])."""
        if isinstance(weight, str):
            assert transposed and weight in self.tables, (weight, transposed)
            quantized = self.tables[weight]
        else:
            rows = weight.T if not transposed else weight
            quantized = self.scheme.quantize(rows, g.dtype)
        self.weight_bytes += quantized.nbytes
        if isinstance(quantized, RowParts):  # one product per format, outputs side by side
            outputs, start = [], 0
            for i, part in enumerate(quantized.parts):
                stop = start + part.shape[0]
                outputs.append(self.target.project_quantized(
                    g, x, part, f"{name}.part{i}", None if bias is None else bias[start:stop]))
                start = stop
            return g.op("Concat", *outputs, axis=-1, name=f"{name}.parts")
        return self.target.project_quantized(g, x, quantized, name, bias)

    def gather(self, g, table: str, ids: str, name: str) -> str:
        """Rows ``ids`` of a quantised table, dequantised -> [..., E]. The target gathers codes,
        scales and zero points; block offsets (GGUF Q4_1 / Q4_K / Q5_1 / Q5_K: no gather kernel
        adds them) are gathered here, [..., Kb], and added to every value of their block."""
        quantized = self.tables[table]
        rows = self.target.gather_quantized(g, quantized, ids, name)  # [..., E]
        if quantized.offsets is None:
            return rows
        n, k = quantized.shape
        assert k == quantized.n_blocks * quantized.block_size, "offsets need whole blocks"
        if "offsets" not in quantized.stored:
            quantized.stored["offsets"] = (
                g.weight(f"{name}.row_offsets", quantized.offsets.astype("float32")),  # [V, Kb]
                g.weight(f"{name}.block_ones", np.ones(quantized.block_size, "float32")))
        offsets, ones = quantized.stored["offsets"]
        spread = g.op("Mul", g.op("Unsqueeze", g.op("Gather", offsets, ids, name=f"{name}.offsets_gather"),
                                  g.const([-1], name=f"{name}.offsets_axis"), name=f"{name}.offsets_blocks"),
                      ones, name=f"{name}.offsets_spread")  # [..., Kb, block]
        spread = g.op("Reshape", spread, g.const([0, 0, -1], name=f"{name}.offsets_shape"),
                      name=f"{name}.offsets_rows")  # [B, S, E]
        return g.op("Add", rows, spread, name=f"{name}.offsets_add")


def offset_product(g, x: str, weight: BlockQuantized, name: str) -> str:
    """x [B, S, K] @ (``weight.offsets`` [N, Kb] spread over their blocks)^T -> [B, S, N], as
    (x summed per block) [B, S, Kb] @ offsets^T [Kb, N]: the ``+ m`` of GGUF Q4_1 blocks."""
    n, k = weight.shape
    assert k == weight.n_blocks * weight.block_size, "offsets need whole blocks"
    blocks = g.op("Reshape", x, g.const([0, 0, weight.n_blocks, weight.block_size], name=f"{name}.blocks_shape"),
                  name=f"{name}.blocks")  # [B, S, Kb, bs]
    sums = g.op("ReduceSum", blocks, g.const([-1], name=f"{name}.block_axis"), keepdims=0,
                name=f"{name}.block_sums")  # [B, S, Kb]
    return g.op("MatMul", sums, g.weight(f"{name}.offsets", weight.offsets.T.astype("float32")),
                name=f"{name}.offset_product")
