"""Quantisation formats by name: the one place a ``--quantize`` name is looked up.

Each format is one module with one registry entry (``base.QuantFormat``) that parses its
options into a scheme (``base.Quantization``); the exporter, the CLI, parity and the benchmarks
hold the scheme and ask it (checks, graph quantiser, device refusals, reference, manifest entry),
never a name. Adding a format is a new module plus an entry here (or ``register_format``); the
tests parametrise over ``FORMATS``.

| name | module | scheme |
| --- | --- | --- |
| int4, int8 | ``blockwise.py`` | ``QuantScheme`` (and ``calibrate.PrecomputedQuantization``: GPTQ) |
| w8a8 | ``w8a8.py`` | ``W8A8`` |
| keep | ``keep.py`` | ``KeptQuantization`` (a GGUF file's own blocks) |
"""

from __future__ import annotations

from . import keep, w8a8
from .base import QuantFormat, Quantization
from .blockwise import (BLOCK_SIZES, DEFAULT_BLOCK, GENERATING_INT4_BLOCK, HEAD_BITS, INT4, INT8, PROMOTED_BITS,
                        Blockwise, QuantScheme)
from .exact import EXACT_SESSION_CONFIG, EXTERNAL_DATA_FOLDER, exact_graph
from .keep import KeptQuantization
from .reference import fake_quantize, quantized_weights, token_table_paths
from .w8a8 import W8A8

FORMATS: dict[str, QuantFormat] = {}
W8A8_FORMAT, KEEP = w8a8.FORMAT, keep.FORMAT


def register_format(fmt: QuantFormat) -> QuantFormat:
    """Make ``fmt`` a ``--quantize`` choice by its name; returns it."""
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str, argument: str = "quantize") -> QuantFormat:
    """The format called ``name``; ``ValueError`` naming ``argument``, the value and the choices."""
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"{argument}={name!r}: expected one of {list(FORMATS)}")
    return FORMATS[name]


def layout_formats() -> str:
    """The formats that take ``block_size`` and ``symmetric``, for messages: "'int4' or 'int8'"."""
    return " or ".join(repr(name) for name, fmt in FORMATS.items() if fmt.layout_options)


def resolve_scheme(quantize: str | Quantization | None, block_size: int | None = None,
                   symmetric: bool | None = None, generates: bool = False) -> Quantization | None:
    """``export_model``'s ``quantize`` argument: None, a format's name (parsed with ``block_size``
    and ``symmetric`` for a model that ``generates``: ``QuantFormat.parse``) or a scheme (taken as
    is: ``block_size`` and ``symmetric`` are refused with it, as without quantisation)."""
    if quantize is None or isinstance(quantize, Quantization):
        for option, value in (("block_size", block_size), ("symmetric", symmetric)):
            if value is not None:
                got = "no quantisation" if quantize is None else f"quantize={quantize.name!r}, whose layout is its own"
                raise ValueError(f"{option}={value!r}: applies to quantize={layout_formats()}, got {got}")
        return quantize
    if not isinstance(quantize, str):
        raise TypeError(f"quantize={quantize!r}: expected None, one of {list(FORMATS)} or a QuantScheme")
    return get_format(quantize).parse(block_size, symmetric, generates)


for _format in (INT4, INT8, W8A8_FORMAT, KEEP):
    register_format(_format)

__all__ = ["FORMATS", "QuantFormat", "Quantization", "get_format", "register_format", "resolve_scheme",
           "layout_formats", "INT4", "INT8", "W8A8_FORMAT", "KEEP", "Blockwise", "QuantScheme", "W8A8",
           "KeptQuantization", "BLOCK_SIZES", "DEFAULT_BLOCK", "GENERATING_INT4_BLOCK", "HEAD_BITS", "PROMOTED_BITS",
           "fake_quantize", "quantized_weights", "token_table_paths", "exact_graph", "EXACT_SESSION_CONFIG",
           "EXTERNAL_DATA_FOLDER"]
