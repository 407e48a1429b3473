"""The ``ai.tfport`` disentangled-attention functions (DisentangledIndex, DisentangledScores,
DisentangledBias) alone under ONNX Runtime against their PyTorch meaning
(``tfport.models.disentangled``), at opsets 18 and 23, for every term set, with fewer queries than
keys (the last S of T slots) and distances past the table's clipped ends."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tfport.config.positions import DisentangledConfig
from tfport.contract import TensorSpec
from tfport.export.graph import GraphBuilder
from tfport.export.positions import POSITION_EMITTERS
from tfport.models import build_model
from tfport.presets import PRESETS

ort = pytest.importorskip("onnxruntime", reason="the graphs run under ONNX Runtime (the 'cpu' extra)")


def bias_graph(model, opset: int) -> onnx.ModelProto:
    """query [B, H, S, D], key [B, H, T, D], attention_mask [B, T] -> layer 0's disentangled bias."""
    config = model.config
    h, d = config.n_heads, config.dim_per_head
    g = GraphBuilder("disentangled", "float32")
    q = g.add_input(TensorSpec("query", "float32", ("B", h, "S", d)))
    k = g.add_input(TensorSpec("key", "float32", ("B", h, "T", d)))
    mask = g.add_input(TensorSpec("attention_mask", "int64", ("B", "T")))
    length = g.op("Shape", q, start=2, end=3)  # [1] = S
    content = POSITION_EMITTERS["disentangled"].content_bias(g, model.encoder, mask, length, "encoder")
    out = content.bias(g, model.encoder.layers[0].attn, q, k, "layer0")
    g.add_output(out, TensorSpec("bias", "float32", ("B", h, "S", "T")))
    proto = g.build(opset)
    onnx.checker.check_model(proto, full_check=True)
    return proto


@pytest.mark.parametrize("opset", [18, 23])
@pytest.mark.parametrize("terms", [("c2p", "p2c"), ("c2p",), ("p2c",)])
def test_function_matches_pytorch(terms, opset):
    config = PRESETS["tiny-encoder"].replace(position="disentangled", type_vocab_size=0,
                                             disentangled=DisentangledConfig(buckets=8, max_distance=10, terms=terms))
    model = build_model(config, seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    b, s, t = 2, 3, 25
    q = torch.randn(b, config.n_heads, s, config.dim_per_head, generator=generator)
    k = torch.randn(b, config.n_heads, t, config.dim_per_head, generator=generator)
    mask = torch.ones(b, t, dtype=torch.long)
    stack = model.encoder
    with torch.no_grad():
        expected = stack.scheme.content_bias(stack, mask, s).bias(stack.layers[0].attn, q, k)
    proto = bias_graph(model, opset)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"query": q.numpy(), "key": k.numpy(), "attention_mask": mask.numpy()})
    called = {n.op_type for n in proto.graph.node if n.domain == "ai.tfport"}
    assert ("DisentangledBias" in called) == (len(terms) == 2) and "DisentangledIndex" in called
    # float32 both sides; the MatMul and the products sum in different orders (a few ulps)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)
