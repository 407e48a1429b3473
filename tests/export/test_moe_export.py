"""Mixture-of-experts decoders exported to every target, against transformers: the raw decoder
graph (prefill of a left- and a right-padded batch, decode steps, a chunk on a past) where the
cache layout is ``concat``, and the runtime's greedy tokens on every target; int4 experts.

The models are tests/hf/moe_cases.py's; the drivers are tests/hf/test_decoders.py's (the dense
decoders' per-target checks), so MoE and dense decoders are held to the same comparisons.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tfport.export import ExportOptions, export_model
from tfport.export.functions import SoftmaxTopKRouting, TopKSoftmaxRouting
from tfport.export.targets import TARGETS
from tfport.models.moe import routing_weights

from ..hf import test_decoders as dense_checks
from ..hf.moe_cases import MOE_CASES, importer

pytest.importorskip("transformers", reason="compared against transformers, which the 'dev' extra installs")

# Every case on the portable target; the other targets differ from it in attention and the cache,
# not in how the mixture is emitted, so they take the richest mixture (shared expert, a dense
# layer) and the cases whose attention or residuals no dense family has (OLMoE's all-head q/k
# norms and q/k/v clamp; Granite's attention multiplier and scaled residuals).
ALL = [pytest.param(name, target, id=f"{name}-{target}") for name in MOE_CASES for target in TARGETS
       if target == "portable" or name in ("qwen2-moe", "olmoe", "granitemoe")]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``exported(name, target)`` -> (Imported, export directory, Manifest), cached."""
    imported = importer(lambda name: tmp_path_factory.mktemp(f"hf-{name}"))
    cache: dict = {}

    def get(name: str, target: str):
        if (name, target) not in cache:
            it = imported(name)
            out = tmp_path_factory.mktemp(f"export-{name}-{target}") / "export"
            # The export's own check against the module runs where the runtime is the only driver.
            options = ExportOptions(target=target, validate=TARGETS[target].layout != "concat")
            cache[name, target] = (it, out, export_model(it.model, out, options))
        return cache[name, target]

    return get


@pytest.mark.parametrize("routing,normalize", [("softmax_topk", 1), ("softmax_topk", 0), ("topk_softmax", 1)])
def test_routing_functions_match_the_module(routing, normalize):
    """The ai.tfport routing functions (onnxscript, run eagerly by ONNX Runtime) give the
    reference module's dense routing weights."""
    logits = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    k = np.array([3], np.int64)
    if routing == "softmax_topk":
        ours = SoftmaxTopKRouting(logits.numpy(), k, normalize=normalize)
    else:
        ours = TopKSoftmaxRouting(logits.numpy(), k)
    np.testing.assert_allclose(ours, routing_weights(logits, 3, routing, bool(normalize)).numpy(),
                               rtol=1e-6, atol=1e-7)


# The dense decoders' per-target checks (tests/hf/test_decoders.py), on the MoE exports.
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name,target", ALL)
def test_graph_prefill(exported, name, target, padding):
    """The raw graph's prefill logits (``concat`` layouts)."""
    dense_checks.test_graph_prefill(exported, name, target, padding)


@pytest.mark.parametrize("name,target", ALL)
def test_graph_decode_and_chunk(exported, name, target):
    """Left-padded prefill, three decode steps, a three-token chunk on that past (``concat``)."""
    dense_checks.test_graph_decode_and_chunk(exported, name, target)


@pytest.mark.parametrize("name,target", ALL)
def test_runtime_greedy(exported, name, target):
    """``load_model(...).generate``'s greedy tokens on a ragged batch (every layout)."""
    dense_checks.test_runtime_greedy(exported, name, target)


def test_ort_lowers_the_experts_to_one_moe_node(exported):
    """Target "ort": each mixture's routed experts are one com.microsoft.MoE node (the shared
    expert and the dense layer stay products); test_runtime_greedy checks what they compute."""
    _, out, manifest = exported("qwen2-moe", "ort")
    graph = onnx.load(str(out / manifest.graphs["decoder"].file), load_external_data=False).graph
    fused = [n for n in graph.node if n.op_type == "MoE" and n.domain == "com.microsoft"]
    assert len(fused) == 1  # qwen2-moe: layer 0 a mixture, layer 1 dense
    assert not [i.name for i in graph.initializer if ".experts." in i.name]


@pytest.mark.parametrize("name,target,quantize,fused", [
    ("qwen2-moe", "portable", "int4", False),
    ("qwen3-moe", "ort", "int4", True),
    ("granitemoe", "ort", "int4", True),  # top-k-then-softmax weights sum to 1: QMoE computes them
    ("qwen2-moe", "ort", "int4", False),  # top-k weights not renormalised: QMoE's CPU kernel would
    ("qwen3-moe", "ort", "int8", False),  # int8: QMoE's CPU kernel is not exact
])
def test_quantized_experts(exported, tmp_path, name, target, quantize, fused):
    """``--quantize int4`` / ``int8`` quantise every expert's products like any other weight (no
    float expert matrix is left in the graph): one com.microsoft.QMoE node per mixture where it
    computes them exactly (``export.moe.fusable``), per-expert products otherwise. The export's own
    check (ONNX Runtime against the module with the same quantised weights, on random inputs)
    passes."""
    it, _, _ = exported(name, "portable")
    out = tmp_path / quantize
    manifest = export_model(it.model, out, ExportOptions(target=target, quantize=quantize, block_size=16))
    graph = onnx.load(str(out / manifest.graphs["decoder"].file), load_external_data=False).graph
    names = {i.name for i in graph.initializer}
    moe = it.model.config.moe
    mixtures = sum(moe.covers(i) for i in range(it.model.config.n_decoder_layers))
    assert sum(n.op_type == "QMoE" for n in graph.node) == (mixtures if fused else 0)
    layer = f"decoder.layers.{moe.layers[0] if moe.layers else 0}.ffn"  # a mixture of each case
    products = ["fc1", "fc2"] if fused else [f"experts.{n}.{p}" for n in range(4) for p in ("gate_up", "down")]
    products += ["shared.gate_up", "shared.down"] if moe.shared_d_ff else []
    for product in products:
        assert f"{layer}.{product}.qweight" in names, product
    assert not [name for name in names if name.endswith((".weight_t", ".fc1", ".fc2"))]


def _moe_model(**moe_fields):
    """A tiny random SwiGLU decoder (RoPE, GQA, head dim 16) whose layer 1 is a mixture of 4 experts."""
    from tfport.config import ModelConfig
    from tfport.config.moe import MoeConfig
    from tfport.models import build_model

    config = ModelConfig(family="decoder", vocab_size=96, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96,
                         n_decoder_layers=2, norm="rmsnorm", activation="silu", gated_ffn=True, position="rope",
                         attention_bias=False, mlp_bias=moe_fields.pop("mlp_bias", False),
                         moe=MoeConfig(n_experts=4, top_k=2, d_expert=32, layers=(1,), **moe_fields))
    model = build_model(config, seed=5)
    generator = torch.Generator().manual_seed(6)
    for p in model.parameters():  # biases and norms away from 0 / 1, routers too
        p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


@pytest.mark.parametrize("target,dtype,fields,fused", [
    ("ort", "float32", dict(routing="topk_softmax", router_bias=True), True),
    ("ort", "float16", dict(normalize=False, shared_d_ff=16), True),
    ("ort", "float32", dict(mlp_bias=True), False),  # biased experts: the dense form
    ("portable", "float32", dict(routing="topk_softmax", router_bias=True, mlp_bias=True), False),
], ids=["ort-topk-softmax-router-bias", "ort-float16-shared", "ort-biased-experts", "portable-all-options"])
def test_options_without_a_transformers_family(tmp_path, target, dtype, fields, fused):
    """Options no imported family has (gpt-oss' top-k-then-softmax routing, router and expert
    biases; a shared expert without its gate; float16): the export's own check (ONNX Runtime
    against the module on random inputs) passes, with com.microsoft.MoE where it applies."""
    manifest = export_model(_moe_model(**fields), tmp_path / "export", ExportOptions(target=target, dtype=dtype))
    graph = onnx.load(str(tmp_path / "export" / manifest.graphs["decoder"].file), load_external_data=False).graph
    assert sum(n.op_type == "MoE" for n in graph.node) == int(fused)
