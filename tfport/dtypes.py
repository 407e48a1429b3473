"""Element types by name, the one table both sides use (numpy only, so the runtime can import it).

Names are those of the graph contract (``TensorSpec.dtype``); ONNX codes are ``onnx.TensorProto``'s
enum values, written as numbers so that importing this needs no ``onnx``.
"""

from __future__ import annotations

import numpy as np

NUMPY_DTYPES: dict[str, type] = {"float32": np.float32, "float16": np.float16, "int64": np.int64,
                                 "int32": np.int32}
# onnx.TensorProto.FLOAT, FLOAT16, INT64, INT32 (the enum is part of the ONNX file format).
ONNX_DTYPES: dict[str, int] = {"float32": 1, "float16": 10, "int64": 7, "int32": 6}
