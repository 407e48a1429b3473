"""Export of tfport reference modules to ONNX, with tfport's onnxscript function library."""

from .exporter import export_checkpoint_or_preset, export_model

__all__ = ["export_model", "export_checkpoint_or_preset"]
