"""What every quantisation format offers the exporter, and what one export's scheme does.

Two objects per format:

* ``QuantFormat``, the registry entry (``export.quant.FORMATS``, one per ``--quantize`` name):
  how its options are parsed into a scheme (``parse``; ``for_source`` where a scheme needs the
  source file), how a manifest entry is read back (``from_manifest``) and described
  (``describe``).
* ``Quantization``, the scheme one export is built with (a format with its settings: bits and
  blocks, a GGUF file's own blocks, codes chosen by GPTQ ...): the checks against the export's
  dtype, target and opset, the graph quantiser every weight product goes through, the devices
  its graphs must not run on, the PyTorch reference it is validated against, its manifest entry
  and the bytes a weight takes (for the memory estimate).

The exporter holds the scheme and asks it; no code outside this package tests a scheme's type
or compares a format's name.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Quantization:
    """The quantisation of one export (subclasses: ``blockwise.Blockwise`` for blocks of codes
    with scales, ``w8a8.W8A8``). ``name`` is its format's name, the manifest's ``"format"``;
    ``embeddings`` also quantises the token table (and a head tied to it)."""

    name: str
    embeddings: bool
    # Whether the scheme is a blockwise layout whose codes are still to be rounded (int4 / int8 as
    # named): the options that re-choose codes (calibration, head_bits, head_block_size,
    # max_loss) apply to it, and ONNX Runtime's QMoE takes its int4 experts. False for codes
    # chosen elsewhere (a GGUF file's, GPTQ's) and for other layouts.
    rechoosable: bool = False

    # ------------------------------------------------------------------------------ weights
    def quantize(self, rows: np.ndarray, scale_dtype: str = "float32") -> Any:
        """Weights [N, K] -> their quantised form, with scales in ``scale_dtype``."""
        raise NotImplementedError

    def bytes_per_value(self) -> float:
        """Bytes one weight value takes in the export (codes, scales, zero points): what a
        memory estimate (``export.memory``) takes the quantised weights to need."""
        raise NotImplementedError

    def holds(self, rows: np.ndarray) -> bool:
        """Whether ``quantize(rows)`` dequantises to ``rows`` exactly (a reference then keeps them)."""
        return False

    # ------------------------------------------------------------------------------ the export
    def default_opset(self, target) -> int:
        """The opset of an export with this scheme when the options give none."""
        return target.default_opset

    def check(self, dtype: str, target, opset: int) -> None:
        """``ValueError`` naming the option unless an export in ``dtype`` to ``target`` at
        ``opset`` can use this scheme (``options.plan_export``)."""

    def check_activations(self, activations: str) -> None:
        """``ValueError`` naming ``activations`` unless this scheme's products can compute with
        them (``ACTIVATIONS``): the blockwise formats take both."""

    def graph_quantizer(self, target):
        """What one graph's weight products and token gathers go through (``g.quantizer``:
        ``table``, ``owns``, ``project``, ``gather``, ``weight_bytes``)."""
        raise NotImplementedError

    def device_refusals(self) -> dict[str, str]:
        """Devices this scheme's graphs must not run on -> the reason (the manifest's)."""
        return {}

    def reference(self, model, dtype: str = "float32"):
        """The PyTorch module the export is validated against: a copy of ``model`` computing
        with the weights the graphs compute with."""
        raise NotImplementedError

    def to_dict(self) -> dict:
        """The manifest's ``quantization`` entry (``"format"``: ``name``)."""
        raise NotImplementedError

    def report(self) -> None:
        """Log what building the graphs found (once they are built)."""


class QuantFormat:
    """One ``--quantize`` format: the registry entry (``export.quant.FORMATS``). ``summary`` is
    its ``--quantize`` help; ``layout_options``: it takes ``block_size`` and ``symmetric``."""

    name: str
    summary: str
    layout_options: bool = False

    def parse(self, block_size: int | None = None, symmetric: bool | None = None,
              generates: bool = False) -> Quantization:
        """The scheme ``ExportOptions(quantize=name, block_size=..., symmetric=...)`` asks for, for
        a model that ``generates`` (a decoder) or not; ``ValueError`` naming the option."""
        raise NotImplementedError

    def check_source(self, source: str, dtype: str) -> None:
        """``ValueError`` unless an export of ``source`` (a preset, directory or file) in ``dtype``
        can take this format: checked before anything is loaded."""

    def for_source(self, source: str, dtype: str) -> Quantization | None:
        """The scheme an export of the file ``source`` takes (a GGUF file's own blocks), or None
        when ``parse`` makes it from the options alone."""
        self.check_source(source, dtype)
        return None

    def from_manifest(self, entry: dict, source: str) -> Quantization:
        """The scheme a manifest's ``quantization`` entry records, to rebuild the reference of an
        export of ``source`` (calibrated codes aside: ``calibrate.recorded_scheme``)."""
        raise NotImplementedError

    def describe(self, entry: dict) -> str:
        """One phrase for a manifest's ``quantization`` entry (``tfport export`` prints it)."""
        return entry["format"]
