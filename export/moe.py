"""A mixture-of-experts feed-forward (``tfport.models.moe.MixtureOfExperts``) as graph nodes.

The router's logits become dense routing weights [B, S, N] through the ``ai.tfport`` routing
function of the config's ``moe.routing`` (``SoftmaxTopKRouting`` / ``TopKSoftmaxRouting``:
zero outside each token's top k). Every expert is then evaluated on every token and weighted
(dense evaluation, as the reference module does): exact -- a weight-0 expert adds an exact 0 --,
at N / k times the FFN work of a sparse dispatch. Each expert is an ordinary feed-forward, so its
products go through the one weight emitter (``emit.project``) like any other: dtypes and
quantisation (``--quantize``) apply to experts unchanged.

Target "ort" lowers the routed experts to ONNX Runtime's ``com.microsoft.MoE`` instead
(``fused_mixture_of_experts``), or ``com.microsoft.QMoE`` under ``--quantize int4`` (the same
blocks ``MatMulNBits`` reads), which run only each token's top k experts, where the kernels
compute the same function: SiLU-gated experts without biases, float32 or float16, and int4 blocks
that tile each row, renormalised top-k weights. Elsewhere it emits the dense form: under
``--quantize int8`` too, whose QMoE CPU kernel (ONNX Runtime 1.31) differs from the dequantised
weights by ~0.1 in the logits of a tiny model where int4's agrees to float rounding, and for
``moe.normalize`` false, which the QMoE CPU kernel ignores (it renormalises; measured).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from torch import nn

from tfport.models.layers import ACTIVATIONS
from tfport.models.moe import MixtureOfExperts

from .blocks import BlockQuantized, pack_nibbles
from .graph import GraphBuilder, to_numpy
from .quant.graph import byte_initializer

# moe.routing -> the ai.tfport function computing the dense routing weights
ROUTING_FUNCTIONS = {"softmax_topk": "SoftmaxTopKRouting", "topk_softmax": "TopKSoftmaxRouting"}

# (x [..., E], module, name) -> [..., out]: the block's own emitters for an FFN and an nn.Linear
Emitter = Callable[[str, nn.Module, str], str]


def mixture_of_experts(g: GraphBuilder, x: str, module: MixtureOfExperts, ffn: Emitter, linear: Emitter,
                       name: str) -> str:
    """x [B, S, E] -> sum_n w[..., n] * expert_n(x) (+ the gated shared expert) [B, S, E], the
    experts added in order from expert 0, as the reference adds them."""
    moe = module.moe
    logits = linear(x, module.router, f"{name}.router")  # [B, S, N]
    attrs = {"normalize": int(moe.normalize)} if moe.routing == "softmax_topk" else {}
    weights = g.fn(ROUTING_FUNCTIONS[moe.routing], logits, g.const([moe.top_k], name="top_k"),
                   name=f"{name}.routing", **attrs)  # float32 [B, S, N]
    weights = g.op("CastLike", weights, x, name=f"{name}.routing_cast")  # as the reference: x's dtype
    parts = g.op("Split", weights, axis=-1, num_outputs=moe.n_experts, outputs=moe.n_experts,
                 name=f"{name}.routing_split")  # N x [B, S, 1]
    parts = [parts] if isinstance(parts, str) else parts
    out = None
    for n, (expert, weight) in enumerate(zip(module.experts, parts)):
        term = g.op("Mul", ffn(x, expert, f"{name}.experts.{n}"), weight, name=f"{name}.experts.{n}.weighted")
        out = term if out is None else g.op("Add", out, term, name=f"{name}.experts.{n}.sum")
    return _add_shared(g, x, out, module, ffn, linear, name)


def _renormalised(module: MixtureOfExperts) -> bool:
    """Whether the top-k routing weights sum to 1 ("topk_softmax" always: a softmax over the top
    k logits is the renormalised top k of the softmax)."""
    return module.moe.normalize or module.moe.routing == "topk_softmax"


def fusable(g: GraphBuilder, module: MixtureOfExperts) -> bool:
    """Whether ``com.microsoft.MoE`` (float weights) or ``QMoE`` (``g.quantizer``'s int4 blocks,
    tiling each row: E and F multiples of the block size; renormalised routing weights) computes
    ``module``'s routed experts in graph ``g``."""
    expert, quantizer = module.experts[0], getattr(g, "quantizer", None)
    if quantizer is not None and not (quantizer.scheme.rechoosable and quantizer.scheme.bits == 4
                                      and _renormalised(module)
                                      and expert.up.in_features % quantizer.scheme.block_size == 0
                                      and expert.up.out_features % quantizer.scheme.block_size == 0):
        return False
    return (g.storage in ("float32", "float16") and expert.gate is not None
            and expert.act is ACTIVATIONS["silu"] and expert.up.bias is None)


def _expert_weights(g: GraphBuilder, fc: np.ndarray, name: str) -> list[str]:
    """One of the kernels' expert weight stacks [N, rows, K] as its inputs: the weights (``MoE``),
    or ``QMoE``'s int4 codes [N, rows, K / 2], scales [N, rows, Kb] and zero points
    [N, rows, ceil(Kb / 2)] (none when symmetric: the implicit 8), two to a byte, quantised as
    ``g.quantizer`` quantises every other product."""
    if getattr(g, "quantizer", None) is None:
        return [g.weight(name, fc)]
    blocks: list[BlockQuantized] = [g.quantizer.scheme.quantize(rows, g.dtype) for rows in fc]
    g.quantizer.weight_bytes += sum(b.nbytes for b in blocks)
    codes = byte_initializer(g, f"{name}.qweight", np.stack([pack_nibbles(b.codes) for b in blocks]))
    scales = g.weight(f"{name}.scales", np.stack([b.scales for b in blocks]), g.dtype)
    if blocks[0].symmetric:
        return [codes, scales]
    return [codes, scales, byte_initializer(g, f"{name}.zero_points", np.stack([pack_nibbles(b.zero_points) for b in blocks]))]


def fused_mixture_of_experts(g: GraphBuilder, x: str, module: MixtureOfExperts, ffn: Emitter,
                             linear: Emitter, name: str) -> str:
    """As ``mixture_of_experts``, the routed experts as one ``com.microsoft.MoE`` node where
    ``fusable`` (else the dense form). The kernel takes the router's logits: softmax, top k,
    renormalised when ``normalize_routing_weights`` (``_renormalised``). Its SwiGLU reads
    each expert's gate and up rows interleaved (``swiglu_fusion=1``, the CPU kernel's layout):
    fc1 [N, 2F, E] with rows gate_0, up_0, gate_1, up_1 ...; fc2 [N, E, F]."""
    if not fusable(g, module):
        return mixture_of_experts(g, x, module, ffn, linear, name)
    moe = module.moe
    logits = linear(x, module.router, f"{name}.router")  # [B, S, N]
    fc1 = np.stack([np.stack([to_numpy(e.gate.weight), to_numpy(e.up.weight)], axis=1).reshape(-1, e.up.in_features)
                    for e in module.experts])  # [N, F, 2, E] -> [N, 2F, E]
    fc2 = np.stack([to_numpy(e.down.weight) for e in module.experts])  # [N, E, F]
    rows = g.op("Reshape", x, g.const([-1, module.router.in_features], name="moe_rows"), name=f"{name}.rows")  # [B*S, E]
    scores = g.op("Reshape", logits, g.const([-1, moe.n_experts], name="moe_scores"), name=f"{name}.scores")
    fc1, fc2 = _expert_weights(g, fc1, f"{name}.fc1"), _expert_weights(g, fc2, f"{name}.fc2")
    attrs = dict(k=moe.top_k, activation_type="swiglu", swiglu_fusion=1,
                 normalize_routing_weights=int(_renormalised(module)))
    if len(fc1) == 1:  # MoE(input, router_probs, fc1, fc1_bias, fc2)
        out = g.op("MoE", rows, scores, fc1[0], "", fc2[0], domain="com.microsoft", name=f"{name}.moe", **attrs)
    else:  # QMoE(input, router_probs, fc1, fc1_scales, fc1_bias, fc2, fc2_scales, fc2_bias,
        #        fc3, fc3_scales, fc3_bias, fc1_zero_points, fc2_zero_points)
        inputs = [rows, scores, fc1[0], fc1[1], "", fc2[0], fc2[1]]
        if len(fc1) == 3:  # zero points
            inputs += ["", "", "", "", fc1[2], fc2[2]]
        scheme = g.quantizer.scheme
        out = g.op("QMoE", *inputs, domain="com.microsoft", expert_weight_bits=4,
                   block_size=scheme.block_size, name=f"{name}.qmoe", **attrs)  # [B*S, E]
    g.declare(out, g.dtype, ["tokens", module.router.in_features])  # com.microsoft: no ONNX schema
    out = g.op("Reshape", out, g.op("Shape", x, name=f"{name}.shape"), name=f"{name}.unrows")
    return _add_shared(g, x, out, module, ffn, linear, name)


def _add_shared(g: GraphBuilder, x: str, out: str, module: MixtureOfExperts, ffn: Emitter, linear: Emitter,
                name: str) -> str:
    """``out`` plus the shared expert (sigmoid-gated), if the mixture has one."""
    if module.shared is not None:
        shared = ffn(x, module.shared, f"{name}.shared")
        if module.shared_gate is not None:
            gate = g.op("Sigmoid", linear(x, module.shared_gate, f"{name}.shared_gate"), name=f"{name}.shared_sigmoid")
            shared = g.op("Mul", gate, shared, name=f"{name}.shared_gated")
        out = g.op("Add", out, shared, name=f"{name}.shared_sum")
    return out
