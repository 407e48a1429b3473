"""Weight-only quantisation of an export: the scheme (``QuantScheme``: bits, block size, zero
points), how ``export_model``'s options name one (``resolve_scheme``), and the fake-quantised
reference a quantised export is checked against (``fake_quantize``).

The block layout is ``blocks.BlockQuantized``; round-to-nearest is ``rounding.quantize_rows``;
calibrated codes (GPTQ) are ``calibrate``'s. Everything here is numpy; the export target decides
how a quantised product is lowered (``targets.base.PortableTarget.project_quantized``).
``fake_quantize`` returns a copy of a reference module whose weights are replaced by the
dequantised values the graph uses, so that parity against it holds with float32 tolerances.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from .blocks import BlockQuantized
from .rounding import quantize_rows

BLOCK_SIZES = (16, 32, 64, 128, 256)  # powers of two >= 16: what MatMulNBits and ONNX's blocks take
BITS = {"int4": 4, "int8": 8}  # --quantize FORMAT -> bits
FORMAT_W8A8 = "w8a8"  # int8 weights and activations (export/w8a8.py): not blockwise
# int4 of a model that generates: blocks of 32 (head and token table too, calibrate.head_block).
# Chosen by issue 43's measures (docs/quantisation.md#the-defaults): of the layouts at least as fast
# as onnxruntime-genai's default int4, the one that keeps most of float32's greedy chat answers
# (blocks of 128 kept none, and not the README's example), then the lowest KL divergence.
GENERATING_INT4_BLOCK = 32


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


# ------------------------------------------------------------------------------ the reference
def quantized_weight_names(model, scheme) -> list[str]:
    """Parameter names the export of ``model`` with ``scheme`` quantises: every ``nn.Linear``
    weight (a head tied to a table only with ``scheme.embeddings``) and, with
    ``scheme.embeddings``, the token tables; a tied parameter once."""
    from torch import nn

    tables = token_table_paths(model) if scheme.embeddings else []
    table_ids = {id(model.get_parameter(path)) for path in token_table_paths(model)}
    names, seen = [], set()
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and (id(module.weight) not in table_ids or scheme.embeddings):
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                names.append(f"{path}.weight")
    for path in tables:
        if id(model.get_parameter(path)) not in seen:
            seen.add(id(model.get_parameter(path)))
            names.append(path)
    return names


def dequantized(scheme, rows: np.ndarray, table: bool, dtype: str) -> np.ndarray:
    """``rows`` [out, in] as the export computes with them under ``scheme``: quantised and
    dequantised (a token table only if its codes can be gathered, ``gatherable``; else float, as
    ``WeightQuantizer.table`` stores it). Scales are rounded to ``dtype`` as the graph stores them."""
    quantized = scheme.quantize(rows, dtype)
    if table and not gatherable(quantized):
        return rows
    if hasattr(scheme, "holds") and scheme.holds(rows):  # keep: the file's blocks are these very values
        return rows
    return quantized.dequantize().astype(np.float32)


def quantized_weights(model, scheme: QuantScheme, dtype: str = "float32") -> dict[str, np.ndarray]:
    """Parameter name -> the dequantised value [out, in] (float32) the export of ``model`` with
    ``scheme`` computes with (``quantized_weight_names``, ``dequantized``)."""
    from tfport.models.lazy import read_weight

    tables = set(token_table_paths(model))
    return {name: dequantized(scheme, read_weight(model.get_parameter(name)), name in tables, dtype)
            for name in quantized_weight_names(model, scheme)}


def replaced_weights(model, names: list[str], transform):
    """A copy of ``model`` whose parameters ``names`` hold ``transform(name, float32 values)``:
    computed now for a loaded module; for a lazy one (``tfport.models.lazy``) each as it is read,
    so a quantised reference of a model larger than memory streams as the model does."""
    import torch

    from tfport.models.lazy import is_lazy, lazy_copy, wrap_loader

    if is_lazy(model):
        reference = lazy_copy(model)
        for name in names:
            wrap_loader(reference.get_parameter(name),
                        lambda values, name=name: torch.from_numpy(transform(name, values.float().numpy())))
        return reference
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        for name in names:
            parameter = reference.get_parameter(name)
            value = transform(name, parameter.detach().float().cpu().numpy())
            parameter.copy_(torch.from_numpy(value).to(parameter.dtype))
    return reference


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
    if hasattr(scheme, "reference"):  # w8a8 (export/w8a8.py): its own weights; activations stay float here
        return scheme.reference(model, dtype)
    tables = set(token_table_paths(model))
    return replaced_weights(model, quantized_weight_names(model, scheme),
                            lambda name, rows: dequantized(scheme, rows, name in tables, dtype))


def resolve_scheme(quantize, block_size: int | None = None, symmetric: bool | None = None,
                   generates: bool = False) -> QuantScheme | None:
    """``export_model``'s ``quantize`` argument: None, "int4" / "int8" (with ``block_size`` and
    ``symmetric``) or a ``QuantScheme`` (taken as is: ``block_size`` and ``symmetric`` are refused
    with it, as without quantisation). For int4 of a model that ``generates`` (a decoder)
    ``block_size`` defaults to ``GENERATING_INT4_BLOCK`` and ``symmetric`` to True (zero points
    cost 10-12% of SmolLM2's decode speed for 0.7 points of perplexity); otherwise to 32 and
    False (an encoder's embeddings need zero points: all-MiniLM-L6-v2's cosine 0.985 against
    0.978; int8 loses 0.1% with them, 0.8% without)."""
    if quantize is None or isinstance(quantize, QuantScheme) or hasattr(quantize, "quantize"):
        for option, value in (("block_size", block_size), ("symmetric", symmetric)):
            if value is not None:
                got = ("no quantisation" if quantize is None else
                       f"quantize={getattr(quantize, 'name', type(quantize).__name__)!r}, whose layout is its own")
                raise ValueError(f"{option}={value!r}: applies to quantize='int4' or 'int8', got {got}")
        return quantize  # a QuantScheme, or export.gguf_keep.KeptQuantization
    if quantize == FORMAT_W8A8:  # int8 weights per channel, activations per token: export/w8a8.py
        for option, value in (("block_size", block_size), ("symmetric", symmetric)):
            if value is not None:
                raise ValueError(f"{option}={value!r}: applies to quantize='int4' or 'int8'; quantize='w8a8' "
                                 "has one scale per output channel, symmetric")
        from .w8a8 import W8A8

        return W8A8()
    if quantize == "keep":
        raise ValueError("quantize='keep': keeps a GGUF file's own blocks, so the source must be a "
                         ".gguf file (tfport export FILE.gguf --quantize keep, or "
                         "export.gguf_keep.KeptQuantization)")
    if not isinstance(quantize, str):
        raise TypeError(f"quantize={quantize!r}: expected None, one of {[*BITS, FORMAT_W8A8]} or a QuantScheme")
    if quantize not in BITS:
        raise ValueError(f"quantize={quantize!r}: expected one of {[*BITS, FORMAT_W8A8, 'keep']}")
    if symmetric is None:
        symmetric = generates and quantize == "int4"
    if block_size is None:
        block_size = GENERATING_INT4_BLOCK if generates and quantize == "int4" else 32
    return QuantScheme.parse(quantize, block_size, symmetric)
