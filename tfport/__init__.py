"""tfport: take a PyTorch transformer to production without PyTorch.

``tfport`` itself (config, presets, I/O contract, CLI) imports neither torch nor onnxruntime.
``tfport.models`` (PyTorch reference modules), ``tfport.export`` (ONNX export) and
``tfport.runtime`` (ONNX Runtime, numpy only) live beside it.
"""

from .config import ModelConfig
from .presets import PRESETS, get_preset

__all__ = ["ModelConfig", "PRESETS", "get_preset"]
__version__ = "0.1.0"
