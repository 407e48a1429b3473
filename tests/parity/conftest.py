"""Exports shared by the parity tests (one per configuration and dtype, made once per session)."""

from __future__ import annotations

import pytest

from tfport.export import export_model
from tfport.export.parity import cuda_available
from tfport.models import build_model

CUDA_USABLE, CUDA_REASON = cuda_available()

# (provider, dtype) pairs of the suite; fp16 runs on CUDA only (CPU fp16 kernels are partial and
# slow in ONNX Runtime, so fp16 parity there says little about deployments).
PROVIDER_DTYPES = [
    pytest.param("cpu", "float32", id="cpu-fp32"),
    pytest.param("cuda", "float32", id="cuda-fp32", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not CUDA_USABLE, reason=f"needs a GPU: {CUDA_REASON}")]),
    pytest.param("cuda", "float16", id="cuda-fp16", marks=[
        pytest.mark.cuda, pytest.mark.skipif(not CUDA_USABLE, reason=f"needs a GPU: {CUDA_REASON}")]),
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
            export_model(model, out, dtype=dtype, target=target, validate=False, kv_dtype=kv_dtype)
            cache[key] = (model, out)
        return cache[key]

    return get
