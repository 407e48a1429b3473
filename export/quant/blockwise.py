"""``--quantize int4`` / ``int8``: weight-only blockwise quantisation. ``QuantScheme`` is the
layout (bits, block size, zero points), ``Blockwise`` what every scheme of blocks of codes with
scales shares (the target lowers them: ``targets.base.PortableTarget.project_quantized``), and
``INT4`` / ``INT8`` the registry entries.

The block layout is ``blocks.BlockQuantized``; round-to-nearest is ``rounding.quantize_rows``;
calibrated codes (GPTQ) are ``calibrate``'s (``calibrate.PrecomputedQuantization``) and a GGUF
file's own blocks ``keep.KeptQuantization``'s, both ``Blockwise`` too. Everything here is numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import BlockQuantized
from ..rounding import quantize_rows
from .base import QuantFormat, Quantization
from .graph import WeightQuantizer
from .reference import dequantized_reference

BLOCK_SIZES = (16, 32, 64, 128, 256)  # powers of two >= 16: what MatMulNBits and ONNX's blocks take
BITS = (4, 8)
# int4 of a model that generates: blocks of 32 (head and token table too, calibrate.head_block).
# Chosen by issue 43's measures (docs/quantisation.md#the-defaults): of the layouts at least as fast
# as onnxruntime-genai's default int4, the one that keeps most of float32's greedy chat answers
# (blocks of 128 kept none, and not the README's example), then the lowest KL divergence.
GENERATING_INT4_BLOCK = 32
DEFAULT_BLOCK = 32  # every other int4 / int8 export
HEAD_BITS = (4, 8)  # --head-bits: the LM head and token table re-quantised at these bits
PROMOTED_BITS = 8  # the bits of the matrices of a promoted (sensitive) layer: --max-loss


class Blockwise(Quantization):
    """A scheme of blocks of codes with scales along each weight row (``BlockQuantized``, or
    ``RowParts`` of several): lowered by the export target, which needs its own opset for them
    (``quantized_opset``, ``check_quantized``); validated against the module with its weights
    dequantised."""

    def default_opset(self, target) -> int:
        return target.quantized_opset(target.default_opset)

    def check(self, dtype: str, target, opset: int) -> None:
        self.check_dtype(dtype)
        target.check_quantized(self, opset)

    def check_dtype(self, dtype: str) -> None:
        """``ValueError`` for an export ``dtype`` this scheme cannot be stored in."""
        if dtype == "bfloat16":
            raise ValueError(f"quantize={self.name!r} with dtype='bfloat16': quantised weights replace "
                             "the stored ones and bfloat16 graphs compute in float32; export with "
                             "dtype='float32' (same activations)")

    def graph_quantizer(self, target) -> WeightQuantizer:
        return WeightQuantizer(self, target)

    def reference(self, model, dtype: str = "float32"):
        return dequantized_reference(model, self, dtype)


@dataclass(frozen=True)
class QuantScheme(Blockwise):
    """How weights are quantised: ``bits`` 4 or 8, ``block_size`` values per scale along K,
    ``symmetric`` (no zero points) or not; ``embeddings`` also quantises the token table (gathered
    from its quantised rows where the target can) and with it a tied output head."""

    bits: int = 4
    block_size: int = 32
    symmetric: bool = False
    embeddings: bool = True
    rechoosable = True  # not a field: its codes are rounded when each weight is quantised

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits={self.bits!r}: expected one of {list(BITS)}")
        if isinstance(self.block_size, bool) or self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size!r}: expected one of {list(BLOCK_SIZES)}")
        for option in ("symmetric", "embeddings"):
            if not isinstance(getattr(self, option), bool):
                raise TypeError(f"{option}={getattr(self, option)!r}: expected True or False")

    @property
    def name(self) -> str:
        return format_name(self.bits)

    def to_dict(self) -> dict:
        return {"format": self.name, "bits": self.bits, "block_size": self.block_size,
                "symmetric": self.symmetric, "embeddings": self.embeddings,
                "scale_search": self.bits == 4}  # quantize_rows(search=True) searches 4-bit scales

    def quantize(self, rows: np.ndarray, scale_dtype: str = "float32") -> BlockQuantized:
        return quantize_rows(rows, self.bits, self.block_size, self.symmetric, scale_dtype)

    def bytes_per_value(self) -> float:
        """The codes, a float32 scale per block and a byte of zero point per block unless symmetric."""
        return self.bits / 8 + 4 / self.block_size + (0 if self.symmetric else 1 / self.block_size)


def format_name(bits: int) -> str:
    """The ``--quantize`` name of blockwise codes of ``bits``: "int4", "int8"."""
    return f"int{bits}"


class BlockwiseFormat(QuantFormat):
    """``--quantize int4`` or ``int8`` (``bits``), with ``block_size`` and ``symmetric``."""

    layout_options = True
    summary = ("weight-only blockwise quantisation of every weight product, the token table "
               "and a tied head (codes chosen as --calibration says; the target lowers it: DequantizeLinear + "
               "MatMul for portable/onnx23, MatMulNBits for ort)")

    def __init__(self, bits: int):
        self.bits = bits
        self.name = format_name(bits)

    def parse(self, block_size: int | None = None, symmetric: bool | None = None,
              generates: bool = False) -> QuantScheme:
        """For int4 of a model that ``generates`` (a decoder) ``block_size`` defaults to
        ``GENERATING_INT4_BLOCK`` and ``symmetric`` to True (zero points cost 10-12% of SmolLM2's
        decode speed for 0.7 points of perplexity); otherwise to ``DEFAULT_BLOCK`` and False (an
        encoder's embeddings need zero points: all-MiniLM-L6-v2's cosine 0.985 against 0.978;
        int8 loses 0.1% with them, 0.8% without)."""
        generating_int4 = generates and self.bits == 4
        if symmetric is None:
            symmetric = generating_int4
        if block_size is None:
            block_size = GENERATING_INT4_BLOCK if generating_int4 else DEFAULT_BLOCK
        return QuantScheme(self.bits, block_size, symmetric)

    def from_manifest(self, entry: dict, source: str) -> QuantScheme:
        return QuantScheme(entry["bits"], entry["block_size"], entry["symmetric"], entry.get("embeddings", True))

    def describe(self, entry: dict) -> str:
        """E.g. "int4 in blocks of 32, symmetric (GPTQ, head int8)", with the layout a loss budget chose."""
        method = "GPTQ" if entry.get("method") == "gptq" else "round-to-nearest"
        head = f", head int{entry['head_bits']}" if "head_bits" in entry else ""
        if entry.get("head_block_size", entry["block_size"]) != entry["block_size"]:
            head += f"{' in' if head else ', head in'} blocks of {entry['head_block_size']}"
        if entry.get("promoted"):
            head += f", {len(entry['promoted'])} layers int{PROMOTED_BITS}"
        symmetric = "symmetric" if entry["symmetric"] else "with zero points"
        text = f"{entry['format']} in blocks of {entry['block_size']}, {symmetric} ({method}{head})"
        budget = entry.get("budget")
        if budget:
            show = (lambda v: f"{v:.4f}") if budget["metric"] == "mean KL divergence" else (lambda v: f"{v:.1%}")
            text += (f", the fastest of {len(budget['candidates'])} layouts within --max-loss "
                     f"{show(budget['max_loss'])} ({budget['metric']} {show(budget['loss'])})")
        return text


INT4, INT8 = BlockwiseFormat(4), BlockwiseFormat(8)
