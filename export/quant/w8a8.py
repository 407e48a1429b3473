"""``--quantize w8a8``: int8 weights per output channel and int8 activations per token, computed
by ONNX's integer matrix product (``MatMulInteger``), for steps with many rows.

Why: ONNX Runtime's int4 kernel (``MatMulNBits``) costs about linearly in the rows of a step on
CPUs without VNNI/AMX (docs/benchmarks.md, "Products by row count"), so batched decoding,
verification of speculative drafts and long prefills gain little from int4. The integer GEMM
amortises over rows like a float GEMM. Its activations must be quantised per token: one scale
for a whole step (``DynamicQuantizeLinear``) lets one row's outliers erase the others' (+71%
perplexity on SmolLM2-135M through ONNX Runtime's ``DynamicQuantizeMatMul``, against +5.3% per row).

The scheme, for y [.., N] = x [.., K] @ W^T with W [N, K]:

- weights: one scale per output channel (row of W), ``w_scale = max|W_n| / WEIGHT_LEVELS``,
  codes ``round(W / w_scale)`` in [-63, 63]: 7 bits in int8, so that x86 without VNNI, which
  multiplies uint8 by int8 with ``vpmaddubsw`` and sums pairs in int16, cannot saturate
  (255 * 63 * 2 < 32767; with codes to 127 a product of the SmolLM2 shapes was 10.8% off);
- activations: one scale per row (token), ``s = max|x_row|``, codes ``round(x * 127 / s)`` in
  [-127, 127] stored as uint8 with the zero point 128 (one zero point for the tensor, as
  ``MatMulInteger`` takes it);
- y = (sum of code products, int32) * (w_scale / 127) * s;
- token tables (embeddings, a tied head) are quantised like the weights, per row (token).

Every row is quantised on its own, so a row's result does not depend on the other rows of its
step (one scale for the step would). It does depend on how a row's tokens are split between runs
(a prefill chunk against steps of one token): the float kernels (attention, norms) round those
a few ulps apart, and rounding activations to codes turns that into logits units apart on
SmolLM2-135M (1e-5 in float32), so greedy tokens drift sooner than float32's, and speculative
verification on a w8a8 target is inexact (``decoding.speculative.check_speculative``).

The graph uses standard ONNX operators only (``QuantizeLinear``, ``MatMulInteger``, ``Cast``,
``Mul``), so any runtime and target can run it; ONNX Runtime's CPU provider runs ``MatMulInteger``
with its integer GEMM (as fast as its fused ``MatMulIntegerToFloat``, measured). Its CUDA
provider's ``MatMulInteger`` takes int8 x int8 only, so these uint8 activations would run on the
CPU: the manifest refuses CUDA (``DEVICE_REFUSALS``). ``reference``
is the PyTorch module computing the same: its weights dequantised and each ``nn.Linear``'s input
rounded per row, which parity and export validation compare the graph against. ``W8A8`` is the
scheme, ``RowQuantizer`` its graph side and ``FORMAT`` the registry entry.

Shapes: B batch, S new tokens, K inputs, N outputs, V vocabulary, E model width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .base import QuantFormat, Quantization
from .graph import int_initializer
from .reference import replaced_weights, token_table_paths

WEIGHT_LEVELS = 63  # weight codes in [-63, 63] (see the module docstring)
ACTIVATION_LEVELS = 127  # activation codes in [-127, 127], stored as uint8 around 128
ACTIVATION_ZERO_POINT = 128
TINY = 1e-30  # the least row scale: an all-zero row gives zero codes, not 0 / 0
NAME = "w8a8"
DEVICE_REFUSALS = {"cuda": "quantize='w8a8': ONNX Runtime's CUDA MatMulInteger takes int8 x int8 only, "
                           "so the uint8 activations of every weight product would run on the CPU; "
                           "run this export on the CPU, or export int4/int8 or float16 for CUDA"}


@dataclass
class ChannelQuantized:
    """int8 codes [N, K] in [-WEIGHT_LEVELS, WEIGHT_LEVELS] and float32 scales [N], one per row."""

    codes: np.ndarray
    scales: np.ndarray
    stored: dict = field(default_factory=dict)  # graph initializers, once per graph

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def dequantize(self) -> np.ndarray:
        """[N, K] float32: codes times their row's scale, as the graph computes them."""
        return self.codes.astype(np.float32) * self.scales[:, None]


def quantize_channels(rows: np.ndarray) -> ChannelQuantized:
    """Weights [N, K] -> symmetric codes with one scale per row (an all-zero row gets scale 1)."""
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"rows: expected a matrix [N, K], got shape {rows.shape}")
    scales = np.abs(rows).max(axis=1) / np.float32(WEIGHT_LEVELS)
    scales = np.where(scales > 0, scales, 1.0).astype(np.float32)
    codes = np.clip(np.rint(rows / scales[:, None]), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8)
    return ChannelQuantized(codes, scales)


@dataclass(frozen=True)
class W8A8(Quantization):
    """The ``w8a8`` scheme (see the module docstring); token tables are always quantised too."""

    embeddings: ClassVar[bool] = True  # read by the graph builders (heads.token_table), not an option
    name: ClassVar[str] = NAME

    def quantize(self, rows: np.ndarray, scale_dtype: str = "float32") -> ChannelQuantized:
        """Weights [N, K] -> their codes, per row (``scale_dtype``: float32 only, checked at plan)."""
        return quantize_channels(rows)

    def bytes_per_value(self) -> float:
        """int8 codes and their float32 row scales, counted as one per 32 values (an upper bound)."""
        return 1 + 4 / 32

    def check(self, dtype: str, target, opset: int) -> None:
        if dtype != "float32":
            raise ValueError(f"quantize='w8a8' with dtype={dtype!r}: its integer products dequantise to float32; "
                             "export with dtype='float32'")

    def check_activations(self, activations: str) -> None:
        raise ValueError(f"activations={activations!r} with quantize='w8a8': its products round the "
                         "activations to int8 per token by design; --quantize int8 --activations float "
                         "keeps int8 weights with float activations")

    def graph_quantizer(self, target) -> "RowQuantizer":
        """Standard operators only: any target."""
        return RowQuantizer(self, target)

    def device_refusals(self) -> dict[str, str]:
        return dict(DEVICE_REFUSALS)

    def to_dict(self) -> dict:
        return {"format": NAME, "weights": f"int8 per output channel, codes in +-{WEIGHT_LEVELS}",
                "activations": f"int8 per token, codes in +-{ACTIVATION_LEVELS}", "embeddings": True}

    def reference(self, model, dtype: str = "float32", activations: bool = False):
        """A copy of ``model`` with every ``nn.Linear`` weight and token table dequantised per row:
        what the export computes with float activations (``float_activations``: how parity and
        validation run it; the rounding of a real model's activations flips codes at their
        boundaries, which 30 layers amplify to logits several units apart, with the same
        argmax). With ``activations``, every ``nn.Linear``'s input is rounded per row too
        (``round_rows``): the shipped graph's computation, to compare on small models."""
        from torch import nn

        from tfport.models.lazy import parameter_names

        names = {f"{path}.weight" for path, module in model.named_modules() if isinstance(module, nn.Linear)}
        names.update(token_table_paths(model))
        # a tied table is one parameter: quantised once, the same codes
        reference = replaced_weights(model, [n for n in sorted(names) if n in parameter_names(model)],
                                     lambda name, rows: quantize_channels(rows).dequantize())
        for module in reference.modules() if activations else ():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(lambda _module, args: (round_rows(args[0]), *args[1:]))
        return reference


def round_rows(x):
    """x [..., K] (a torch tensor) with each row rounded to ``ACTIVATION_LEVELS`` steps of its
    largest magnitude: what the graph's ``QuantizeLinear`` codes stand for."""
    import torch

    s = torch.clamp(x.abs().amax(dim=-1, keepdim=True), min=TINY)
    codes = torch.round(x * (ACTIVATION_LEVELS / s))  # half to even, as QuantizeLinear
    return codes * (s / ACTIVATION_LEVELS)


# -------------------------------------------------------------------------------------- graph
class RowQuantizer:
    """The graph side of ``W8A8``, in the place of ``graph.WeightQuantizer``
    (``g.quantizer``: ``emit.project`` and ``emit.gather_rows`` consult it). Each input is
    quantised once per graph however many products read it (a layer's q, k and v)."""

    def __init__(self, scheme: W8A8, target=None):
        self.scheme = scheme
        self.target = target
        self.tables: dict[str, ChannelQuantized] = {}
        self.weight_bytes = 0
        self._rows: dict[str, tuple[str, str]] = {}  # input -> (uint8 codes, row scales)
        self._constants: dict[str, str] = {}

    def _const(self, g, name: str, value) -> str:
        """A constant of the graph, stored once: int64 / float32 through ``g.const``, uint8 raw."""
        if name not in self._constants:
            value = np.asarray(value)
            self._constants[name] = (int_initializer(g, f"w8a8.{name}", value, 8, signed=False)
                                     if value.dtype == np.uint8 else g.const(value, str(value.dtype), f"w8a8.{name}"))
        return self._constants[name]

    def quantize_input(self, g, x: str) -> tuple[str, str]:
        """x [..., K] -> (uint8 codes [..., K] around ``ACTIVATION_ZERO_POINT``, scales [..., 1])."""
        if x not in self._rows:
            s = g.op("ReduceMax", g.op("Abs", x, name=f"{x}.abs"), self._const(g, "last_axis", np.array([-1], np.int64)),
                     keepdims=1, name=f"{x}.row_max")
            s = g.op("Max", s, self._const(g, "tiny", np.float32(TINY)), name=f"{x}.row_scale")  # [..., 1]
            inverse = g.op("Div", self._const(g, "levels", np.float32(ACTIVATION_LEVELS)), s, name=f"{x}.row_inverse")
            codes = g.op("QuantizeLinear", g.op("Mul", x, inverse, name=f"{x}.row_scaled"),
                         self._const(g, "one", np.float32(1.0)),
                         self._const(g, "zero_point", np.uint8(ACTIVATION_ZERO_POINT)), name=f"{x}.row_codes")
            self._rows[x] = (codes, s)
        return self._rows[x]

    def table(self, g, name: str, rows: np.ndarray) -> str:
        """Quantise a token table [V, E]; returns the handle ``gather`` and ``project`` take."""
        handle = g.fresh(name)
        self.tables[handle] = quantize_channels(rows)
        return handle

    def owns(self, weight) -> bool:
        return isinstance(weight, str) and weight in self.tables

    def project(self, g, x: str, weight, name: str, bias=None, transposed: bool = False) -> str:
        """x [..., K] @ W -> [..., N]: ``weight`` an array [K, N], or a table handle read
        transposed (a tied head: rows [N = V, K = E], stored again as [K, N] codes)."""
        if isinstance(weight, str):
            assert transposed and weight in self.tables, (weight, transposed)
            quantized = self.tables[weight]
        else:
            quantized = quantize_channels(weight if transposed else weight.T)
        if "product" not in quantized.stored:
            quantized.stored["product"] = (
                int_initializer(g, f"{name}.qweight_t", quantized.codes.T, 8, signed=True),  # [K, N]
                g.weight(f"{name}.qscale", quantized.scales / np.float32(ACTIVATION_LEVELS), "float32"))
            self.weight_bytes += quantized.nbytes
        codes_t, scale = quantized.stored["product"]
        x_codes, x_scale = self.quantize_input(g, x)
        y = g.op("MatMulInteger", x_codes, codes_t, self._const(g, "zero_point", np.uint8(ACTIVATION_ZERO_POINT)),
                 name=name)  # int32 [..., N]
        y = g.op("Cast", y, to=1, name=f"{name}.float")
        y = g.op("Mul", g.op("Mul", y, scale, name=f"{name}.channel_scale"), x_scale, name=f"{name}.row_scale")
        if bias is not None:
            y = g.op("Add", y, g.weight(f"{name}.bias", bias), name=f"{name}.bias_add")
        return y

    def gather(self, g, table: str, ids: str, name: str) -> str:
        """Rows ``ids`` [B, S] of a quantised table, dequantised -> [B, S, E] float32."""
        quantized = self.tables[table]
        if "gather" not in quantized.stored:
            quantized.stored["gather"] = (int_initializer(g, f"{name}.qrows", quantized.codes, 8, signed=True),
                                          g.weight(f"{name}.row_scales", quantized.scales[:, None], "float32"))
            self.weight_bytes += quantized.nbytes
        codes, scales = quantized.stored["gather"]
        rows = g.op("Cast", g.op("Gather", codes, ids, name=f"{name}.codes"), to=1, name=f"{name}.float")
        return g.op("Mul", rows, g.op("Gather", scales, ids, name=f"{name}.scales"), name=name)


def float_activations(model) -> None:
    """Change ``model`` (an ``onnx.ModelProto`` of a w8a8 export) in place so that its products
    take float activations: each ``MatMulInteger`` reads the scaled input x * 127 / s that its
    ``QuantizeLinear`` would round, times its weight codes as floats, so that the products
    compute x @ W_deq exactly as the float reference with dequantised weights (``W8A8.reference``);
    the ``QuantizeLinear`` nodes left unread are removed."""
    from onnx import helper

    producers = {output: node for node in model.graph.node for output in node.output}
    casts, changed = {}, set()
    for node in model.graph.node:
        quantize = producers.get(node.input[0]) if node.op_type == "MatMulInteger" else None
        if quantize is None or quantize.op_type != "QuantizeLinear":
            continue
        weight = node.input[1]
        if weight not in casts:
            casts[weight] = helper.make_node("Cast", [weight], [f"{weight}.float"], to=1, name=f"{weight}.float")
        node.op_type = "MatMul"
        del node.input[:]
        node.input.extend([quantize.input[0], f"{weight}.float"])
        changed.update(node.output)
    read = {name for node in model.graph.node for name in node.input}
    kept_nodes = [n for n in model.graph.node if n.op_type != "QuantizeLinear" or n.output[0] in read]
    nodes = [*casts.values(), *kept_nodes]  # the casts read initializers
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    kept = [info for info in model.graph.value_info if info.name not in changed]  # int32 no more
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


# ---------------------------------------------------------------------------------- registry
class W8A8Format(QuantFormat):
    """``--quantize w8a8``: no options (one scale per output channel, symmetric)."""

    name = NAME
    summary = ("int8 weights per output channel and int8 activations per token (MatMulInteger: fast for "
               "batches and prefill, e.g. as tfport serve --batch-export)")

    def parse(self, block_size: int | None = None, symmetric: bool | None = None,
              generates: bool = False) -> W8A8:
        for option, value in (("block_size", block_size), ("symmetric", symmetric)):
            if value is not None:
                raise ValueError(f"{option}={value!r}: applies to quantize='int4' or 'int8'; quantize='w8a8' "
                                 "has one scale per output channel, symmetric")
        return W8A8()

    def from_manifest(self, entry: dict, source: str) -> W8A8:
        return W8A8()

    def describe(self, entry: dict) -> str:
        return "w8a8: int8 weights per output channel, int8 activations per token"


FORMAT = W8A8Format()
