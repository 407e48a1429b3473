"""Targets "ort" (RoPE attention lowered to ONNX Runtime's fused GroupQueryAttention inside the
named ai.tfport function, with a KV buffer shared by past and present) and "onnx23" (ONNX's
opset-23 Attention and RotaryEmbedding); refusals name the reason."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.matrix import ort_config
from tfport.export import ExportOptions, export_model
from tfport.export.functions import DOMAIN
from tfport.manifest import Manifest
from tfport.models import build_model
from tfport.models.generate import generate
from tfport.presets import PRESETS
from tfport.runtime import load_model


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    model = build_model(ort_config("gqa"), seed=5)
    out = tmp_path_factory.mktemp("ort") / "export"
    export_model(model, out, ExportOptions(target="ort"))  # validated against PyTorch on export
    return model, out


def test_graph_keeps_named_function_over_the_fused_kernel(fused):
    _, out = fused
    path = out / "decoder.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path))
    called = {n.op_type for n in proto.graph.node if n.domain == DOMAIN}
    assert "FusedGroupQueryAttention" in called and "GroupQueryAttention" not in called
    body = next(f for f in proto.functions if f.name == "FusedGroupQueryAttention")
    assert [(n.domain, n.op_type) for n in body.node] == [("com.microsoft", "GroupQueryAttention")]
    calls = [n for n in proto.graph.node if n.op_type == "FusedGroupQueryAttention"]
    assert calls and all(n.input[1] == n.input[2] == "" for n in calls)  # packed QKV, no Split
    inputs = [i.name for i in proto.graph.input]
    assert inputs[:3] == ["input_ids", "seqlens_k", "total_sequence_length"]
    assert "attention_mask" not in inputs and "position_ids" not in inputs
    assert Manifest.read(out).target == "ort"


def test_cache_is_updated_in_place(fused):
    """The runtime binds one buffer as past and present: its OrtValue is written, not replaced."""
    _, out = fused
    runtime = load_model(out)
    from tfport.runtime.decoding.inplace_binding import InplaceDecoder

    decoder = InplaceDecoder(runtime.runners["decoder"], batch=1, slots=8)
    before = {name: value.data_ptr() for name, value in decoder.cache.items()}
    decoder(np.array([[5, 6, 7]]), np.array([2]))
    key = decoder.cache["past_key_values.0.key"].numpy()
    assert np.abs(key[0, :, :3]).sum() > 0 and np.abs(key[0, :, 3:]).sum() == 0
    decoder(np.array([[9]]), np.array([3]))
    assert np.abs(decoder.cache["past_key_values.0.key"].numpy()[0, :, 3]).sum() > 0
    assert {name: value.data_ptr() for name, value in decoder.cache.items()} == before


def test_runtime_generates_like_the_reference(fused):
    model, out = fused
    runtime = load_model(out)
    prompts = [[5, 17, 33, 8, 61], [44, 9], [70, 2, 91, 12]]
    tokens = runtime.generate(prompts, max_new_tokens=24, stop_token_ids=())
    for row, prompt in zip(tokens, prompts):
        assert row.tolist() == generate(model, torch.tensor([prompt]), max_new_tokens=24)[0].tolist()
    streamed = np.stack(list(runtime.stream(prompts, max_new_tokens=24, stop_token_ids=())), axis=1)
    assert (streamed == tokens).all()


def test_kv_buffers_are_reused_across_requests(fused):
    """When a request ends its KV buffers stay on the runner; the next request of the same batch
    size that fits in them reuses them (their stale slots unread) and generates as the reference."""
    model, out = fused
    runtime = load_model(out)
    runner = runtime.runners["decoder"]
    runtime.generate([[5, 17, 33, 8, 61], [44, 9]], max_new_tokens=12, stop_token_ids=())
    kept = runner.kept["inplace"]
    pointers = {name: value.data_ptr() for name, value in kept.cache.items()}
    prompts = [[70, 2, 91], [12, 40, 7, 3]]  # 4 + 8 slots <= 5 + 12
    tokens = runtime.generate(prompts, max_new_tokens=8, stop_token_ids=())
    assert runner.kept["inplace"] is kept
    assert {name: value.data_ptr() for name, value in kept.cache.items()} == pointers
    for row, prompt in zip(tokens, prompts):
        assert row.tolist() == generate(model, torch.tensor([prompt]), max_new_tokens=8)[0].tolist()
    stream = runtime.stream([[9, 8]], max_new_tokens=4, stop_token_ids=())  # batch 1: new buffers
    next(stream)
    assert "inplace" not in runner.kept  # leased while the request runs
    del stream  # an abandoned request hands its buffers back too
    assert runner.kept["inplace"] is not kept and runner.kept["inplace"].batch == 1


@pytest.mark.parametrize("config,needle", [
    (PRESETS["tiny-encoder"], "family='encoder'"),
    (PRESETS["tiny-encoder-decoder"].replace(position="rope"), "family='encoder-decoder'"),
    (ort_config("mha").replace(position="alibi"), "position='alibi'"),
    (PRESETS["tiny-decoder"], "multiple of 16, got 8"),
])
def test_unsupported_combinations_are_refused(tmp_path, config, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        export_model(build_model(config, seed=0), tmp_path / "x", ExportOptions(target="ort"))
    assert not (tmp_path / "x").exists()


def test_unknown_target(tmp_path):
    with pytest.raises(ValueError, match="target='tensorrt'"):
        export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "x", ExportOptions(target="tensorrt"))


@pytest.mark.parametrize("family,position", [("decoder", "rope"), ("encoder-decoder", "alibi"),
                                             ("encoder", "relative")])
def test_onnx23_target_uses_the_standard_operators(tmp_path, family, position):
    """Target "onnx23": same ai.tfport functions, bodies on opset-23 Attention/RotaryEmbedding."""
    from tests.matrix import matrix_config

    model = build_model(matrix_config(family, position, "gqa"), seed=2)
    manifest = export_model(model, tmp_path / "x", ExportOptions(target="onnx23"))  # validated against PyTorch
    assert manifest.opset == 23 and Manifest.read(tmp_path / "x").target == "onnx23"
    for spec in manifest.graphs.values():
        proto = onnx.load(str(tmp_path / "x" / spec.file))
        bodies = {f.name: {n.op_type for n in f.node} for f in proto.functions}
        attention = bodies.get("GroupQueryAttention") or bodies["ScaledDotProductAttention"]
        assert "Attention" in attention and "Softmax" not in attention
        if position == "rope":
            assert bodies["RotaryEmbedding"] == {"RotaryEmbedding"}
        assert {o.domain: o.version for o in proto.opset_import}[""] == 23


def test_onnx23_target_needs_opset_23(tmp_path):
    with pytest.raises(ValueError, match="opset=18: target 'onnx23'"):
        export_model(build_model(PRESETS["tiny-decoder"], seed=0), tmp_path / "x", ExportOptions(
            target="onnx23", opset=18))


def test_a_float16_cache_casts_the_packed_qkv_once(tmp_path):
    """--kv-dtype float16 on a float32 model: one Cast of the packed product per layer feeds the
    kernel (no Split, no three Casts), and validation against PyTorch passes."""
    model = build_model(ort_config("gqa"), seed=5)
    export_model(model, tmp_path / "e", ExportOptions(target="ort", kv_dtype="float16"))  # validated on export
    proto = onnx.load(str(tmp_path / "e" / "decoder.onnx"))
    calls = [n for n in proto.graph.node if n.op_type == "FusedGroupQueryAttention"]
    producers = {out: n for n in proto.graph.node for out in n.output}
    assert calls and all(n.input[1] == n.input[2] == "" for n in calls)
    assert all(producers[n.input[0]].op_type == "Cast" for n in calls)
    splits = [n for n in proto.graph.node if n.op_type == "Split"]
    assert len(splits) == model.config.n_decoder_layers  # the FFN's gate/up only
    assert all(n.input[0].endswith("gate_up_out") for n in splits)
