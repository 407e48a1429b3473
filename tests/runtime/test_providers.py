"""Execution providers: what a session really got, and no silent CPU fallback for ``cuda``."""

from __future__ import annotations

import functools
import logging

import numpy as np
import onnxruntime as ort
import pytest

from tfport.runtime import SessionSettings, load_model

CUDA = "CUDAExecutionProvider"


@functools.lru_cache(maxsize=None)
def cuda_usable(model_path: str) -> bool:
    """Whether a session on ``model_path`` really gets CUDA here."""
    if CUDA not in ort.get_available_providers():
        return False
    session = ort.InferenceSession(model_path, providers=[CUDA, "CPUExecutionProvider"])
    return session.get_providers()[0] == CUDA


def test_cpu_reports_cpu(loaded):
    _, model = loaded("encoder-decoder")
    assert model.providers == {"encoder": ["CPUExecutionProvider"],
                               "decoder": ["CPUExecutionProvider"]}
    assert model.device == "cpu"


def test_cuda_unusable_is_an_error(exports):
    path = exports("decoder-rope").path
    if cuda_usable(str(path / "decoder.onnx")):
        pytest.skip("CUDA works on this machine; test_cuda_matches_cpu covers it")
    with pytest.raises(RuntimeError,
                       match="provider='cuda'.*(could not use it|no CUDAExecutionProvider)"):
        load_model(path, "cuda")


@pytest.mark.cuda
def test_cuda_matches_cpu(exports, loaded):
    path = exports("decoder-rope").path
    if not cuda_usable(str(path / "decoder.onnx")):
        pytest.skip("needs a working CUDAExecutionProvider (onnxruntime-gpu with its CUDA and "
                    "cuDNN libraries on a GPU machine)")
    model = load_model(path, "cuda")
    assert model.device == "cuda" and model.providers["decoder"][0] == CUDA
    prompts = [[1, 5, 7, 9, 11], [1, 20, 3]]
    cpu = loaded("decoder-rope")[1].generate(prompts, max_new_tokens=16, stop_token_ids=())
    got = model.generate(prompts, max_new_tokens=16, stop_token_ids=())
    np.testing.assert_array_equal(got, cpu)


def test_auto_logs_its_choice(exports, caplog):
    path = exports("encoder-decoder").path
    with caplog.at_level(logging.INFO, logger="tfport.runtime.session"):
        model = load_model(path, "auto")
    expected = "CUDA" if cuda_usable(str(path / "decoder.onnx")) else "CPU"
    assert f"provider='auto': encoder.onnx runs on {expected}" in caplog.text
    assert model.device == expected.lower()
    # the decoder follows the encoder's device (CUDA is not tried twice)
    assert {runner.device for runner in model.runners.values()} == {expected.lower()}


def test_session_options_apply(exports, loaded):
    settings = SessionSettings(intra_op_threads=1, inter_op_threads=1, graph_optimization="disable")
    options = settings.session_options()
    assert options.intra_op_num_threads == 1
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    model = load_model(exports("decoder-rope").path, intra_op_threads=1,
                       graph_optimization="disable")
    reference = loaded("decoder-rope")[1]
    np.testing.assert_array_equal(model.generate([[1, 5, 7]], max_new_tokens=8),
                                  reference.generate([[1, 5, 7]], max_new_tokens=8))
