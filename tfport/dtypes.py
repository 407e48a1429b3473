"""Element types by name, the one table both sides use (numpy only, so the runtime can import it).

Names are those of the graph contract (``TensorSpec.dtype``); ONNX codes are ``onnx.TensorProto``'s
enum values, written as numbers so that importing this needs no ``onnx``.

An export has a *dtype* (how its weights are stored), a *compute* dtype (its activations, in
``COMPUTE_DTYPES``) and a KV cache dtype (``CACHE_DTYPES``). ``bfloat16`` is a storage format
only: ONNX Runtime's CPU provider has no bfloat16 MatMul, Add, Mul, Softmax or activation kernels
and, unlike float16, does not insert casts around the missing ones, so bfloat16 weights are cast
to float32 in the graph and every activation is float32 (one graph for every provider). Graph
inputs and outputs are never bfloat16, so the runtime needs no bfloat16 arrays (numpy has none).
"""

from __future__ import annotations

import numpy as np

NUMPY_DTYPES: dict[str, type] = {"float32": np.float32, "float16": np.float16, "int64": np.int64,
                                 "int32": np.int32, "bool": np.bool_}
# onnx.TensorProto.FLOAT, FLOAT16, INT64, INT32, BFLOAT16, BOOL (the enum is part of the ONNX file format).
ONNX_DTYPES: dict[str, int] = {"float32": 1, "float16": 10, "int64": 7, "int32": 6, "bfloat16": 16, "bool": 9}

# Export dtype -> the dtype the graph's activations are computed and exchanged in.
COMPUTE_DTYPES: dict[str, str] = {"float32": "float32", "float16": "float16", "bfloat16": "float32"}
# Export dtype -> the KV cache dtypes it can be exported with, its default first. A float16 cache
# halves the bytes per cached token of a float32 or bfloat16 model; a float16 model's cache is
# float16 (a float32 one would only cost memory).
CACHE_DTYPES: dict[str, tuple[str, ...]] = {"float32": ("float32", "float16"), "float16": ("float16",),
                                            "bfloat16": ("float32", "float16")}


def cache_dtype(dtype: str, kv_dtype: str | None = None) -> str:
    """The KV cache dtype of an export of ``dtype`` (``kv_dtype`` None: the default); raises
    ``ValueError`` naming ``kv_dtype`` when ``dtype`` cannot have it."""
    allowed = CACHE_DTYPES[dtype]
    if kv_dtype is None:
        return allowed[0]
    if kv_dtype not in allowed:
        raise ValueError(f"kv_dtype={kv_dtype!r}: a dtype={dtype!r} export keeps its KV cache in one of "
                         f"{list(allowed)}")
    return kv_dtype
