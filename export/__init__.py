"""Export of tfport reference modules to ONNX, with tfport's onnxscript function library."""

from .exporter import export_checkpoint_or_preset, export_model, source_options
from .options import ExportOptions

__all__ = ["ExportOptions", "export_model", "export_checkpoint_or_preset", "source_options"]
