"""A small builder over ``onnx.helper``: nodes, initializers and typed graph I/O.

The exporter writes graphs directly from a module's weights with this builder instead of tracing
the module with ``torch.onnx.export``: the dynamo exporter inlines model-local functions during
its opset conversion (torch 2.13, onnxscript 0.7.2), which would erase the ``ai.tfport`` rotary /
ALiBi / attention nodes this project promises. Building the graph from the weights keeps those
nodes, fixes the I/O names and dynamic dims to the contract, and takes milliseconds.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from tfport.contract import TensorSpec
from tfport.dtypes import NUMPY_DTYPES, ONNX_DTYPES

from .functions import DOMAIN, DOMAIN_VERSION, OnnxFunction, function_protos

TAPS_KEY = "tfport.taps"  # metadata: reference point -> (graph value, dtype), for localisation


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor's values as float32 numpy (the builder casts to the graph dtype)."""
    return tensor.detach().float().cpu().numpy()


def ir_version_for(opset: int) -> int:
    """The oldest IR version that allows ``opset`` (older runtimes accept it; see onnx/helper.py)."""
    return 10 if opset <= 22 else 11


class GraphBuilder:
    """Collects nodes and initializers; ``op`` returns the name(s) of the new node's outputs."""

    def __init__(self, name: str, dtype: str):
        self.name, self.dtype = name, dtype
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._used: Counter[str] = Counter()
        # Intermediate values worth comparing when a graph diverges from PyTorch, keyed by the
        # reference module path they correspond to ("decoder.layers.0.ffn"), in graph order.
        self.taps: dict[str, tuple[str, str]] = {}
        # Weight-only quantisation of this graph's products and token gathers
        # (export/quantize.WeightQuantizer), or None for weights in the graph dtype.
        self.quantizer = None

    def fresh(self, hint: str) -> str:
        self._used[hint] += 1
        count = self._used[hint]
        return hint if count == 1 else f"{hint}_{count - 1}"

    def weight(self, name: str, array: np.ndarray, dtype: str | None = None) -> str:
        """Add an initializer (cast to ``dtype``, default the model dtype) and return its name."""
        target = NUMPY_DTYPES[dtype or self.dtype]
        name = self.fresh(name)
        self.initializers.append(numpy_helper.from_array(np.array(array, dtype=target, order="C"), name))
        return name

    def tap(self, point: str, value: str, dtype: str | None = None) -> str:
        """Record ``value`` as the graph's counterpart of reference point ``point``; returns it."""
        self.taps[point] = (value, dtype or self.dtype)
        return value

    def const(self, values, dtype: str = "int64", name: str = "const") -> str:
        return self.weight(name, np.asarray(values), dtype)

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, domain: str = "",
           name: str | None = None, **attrs) -> str | list[str]:
        hint = name or op_type.lower()
        out_names = outputs if isinstance(outputs, list) else [self.fresh(f"{hint}_out") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), out_names, name=self.fresh(hint),
                                           domain=domain, **attrs))
        return out_names[0] if len(out_names) == 1 else out_names

    def fn(self, function: str, *inputs: str, outputs: int | list[str] = 1, name: str | None = None,
           **attrs) -> str | list[str]:
        """Call a function of the ``ai.tfport`` library."""
        return self.op(function, *inputs, outputs=outputs, domain=DOMAIN, name=name, **attrs)

    def declare(self, value: str, dtype: str, shape: list) -> str:
        """State ``value``'s type where ONNX shape inference cannot (outputs of contrib ops)."""
        self.value_info.append(helper.make_tensor_value_info(value, ONNX_DTYPES[dtype], shape))
        return value

    def add_input(self, spec: TensorSpec) -> str:
        self.inputs.append(helper.make_tensor_value_info(spec.name, ONNX_DTYPES[spec.dtype], list(spec.shape)))
        return spec.name

    def add_output(self, value: str, spec: TensorSpec) -> None:
        """Expose ``value`` as the graph output ``spec`` (cast to its dtype if needed)."""
        source_dtype = self.dtype if spec.dtype in ("float32", "float16") else spec.dtype
        if spec.dtype != source_dtype:
            self.op("Cast", value, outputs=[spec.name], to=ONNX_DTYPES[spec.dtype], name=f"cast_{spec.name}")
        else:
            self.op("Identity", value, outputs=[spec.name], name=f"out_{spec.name}")
        self.outputs.append(helper.make_tensor_value_info(spec.name, ONNX_DTYPES[spec.dtype], list(spec.shape)))

    def build(self, opset: int, bodies: Mapping[str, OnnxFunction] | None = None,
              metadata: Mapping[str, str] | None = None) -> onnx.ModelProto:
        """The model, carrying the library functions it calls; ``bodies`` are the export
        target's functions (added, or replacing a library function's body under its name).
        ``metadata`` is added to the model's metadata props beside the taps (the exporter puts the
        settings fingerprint there, ``tfport.integrity.graph_metadata``)."""
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers,
                                  value_info=self.value_info)
        functions = self._used_functions(function_protos(opset, bodies or {}))
        imports = {"": opset, DOMAIN: DOMAIN_VERSION}
        for function in functions:  # e.g. com.microsoft for the ort target's fused operators
            imports.update({o.domain: o.version for o in function.opset_import if o.domain not in imports})
        model = helper.make_model(
            graph, producer_name="tfport", ir_version=ir_version_for(opset),
            opset_imports=[helper.make_opsetid(d, v) for d, v in imports.items()], functions=functions)
        helper.set_model_props(model, {TAPS_KEY: json.dumps(self.taps), **(metadata or {})})
        return model

    def _used_functions(self, library: list[onnx.FunctionProto]) -> list[onnx.FunctionProto]:
        """The library functions this graph calls, directly or through another function."""
        by_name = {f.name: f for f in library}
        needed, todo = set(), [n.op_type for n in self.nodes if n.domain == DOMAIN]
        while todo:
            name = todo.pop()
            if name not in needed:
                needed.add(name)
                todo += [n.op_type for n in by_name[name].node if n.domain == DOMAIN]
        return [f for f in library if f.name in needed]
