"""GGUF import (llama.cpp's format): read with the ``gguf`` package, map onto Hugging Face names
and config, import through ``tfport.models.hf``; build tokenizer.json from the GGUF vocabulary.

``reader`` (file, metadata, dequantisation), ``architectures`` (one table entry per GGUF
architecture), ``loader`` (config dict, tensor source, ``load_gguf``), ``tokenizer``.
"""

from .architectures import ARCHITECTURES, GGUFArchitecture, unpermute_rows
from .loader import GGUFCheckpoint, GGUFTensors, hf_config, load_gguf, read_gguf
from .reader import SUPPORTED_TYPES, GGUFFile, is_gguf_file

__all__ = ["ARCHITECTURES", "GGUFArchitecture", "GGUFCheckpoint", "GGUFFile", "GGUFTensors",
           "SUPPORTED_TYPES", "hf_config", "is_gguf_file", "load_gguf", "read_gguf", "unpermute_rows"]
