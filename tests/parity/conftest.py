"""Exports shared by the parity tests (one per configuration and dtype, made once per session)."""

from __future__ import annotations

import pytest

from tfport.export import ExportOptions, export_model
from tfport.export.parity import cuda_available
from tfport.models import build_model

CUDA_USABLE, CUDA_REASON = cuda_available()

# (provider, dtype) pairs of the whole matrix. On the CPU provider float16 and bfloat16 run one
# configuration per target x family (test_dtypes.py): ONNX Runtime computes their products in
# float32 there, and every position / attention variant's lowering is covered by the float32 run
# (the whole matrix was run in both dtypes once to set their tolerances, export/parity/cases.py).
_GPU = [pytest.mark.cuda, pytest.mark.skipif(not CUDA_USABLE, reason=f"needs a GPU: {CUDA_REASON}")]
PROVIDER_DTYPES = [
    pytest.param("cpu", "float32", id="cpu-fp32"),
    pytest.param("cuda", "float32", id="cuda-fp32", marks=_GPU),
    pytest.param("cuda", "float16", id="cuda-fp16", marks=_GPU),
    pytest.param("cuda", "bfloat16", id="cuda-bf16", marks=_GPU),
]


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """``exported(config, dtype, target, kv_dtype) -> (model, export_dir)``, cached per argument set."""
    cache = {}

    def get(config, dtype="float32", target="portable", kv_dtype=None):
        key = (config, dtype, target, kv_dtype)
        if key not in cache:
            model = build_model(config, seed=1234)
            out = tmp_path_factory.mktemp("parity") / "export"
            export_model(model, out, ExportOptions(dtype=dtype, target=target, validate=False, kv_dtype=kv_dtype))
            cache[key] = (model, out)
        return cache[key]

    return get
