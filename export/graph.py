"""A small builder over ``onnx.helper``: nodes, initializers and typed graph I/O.

The exporter writes graphs directly from a module's weights with this builder instead of tracing
the module with ``torch.onnx.export``: the dynamo exporter inlines model-local functions during
its opset conversion (torch 2.13, onnxscript 0.7.2), which would erase the ``ai.tfport`` rotary /
ALiBi / attention nodes this project promises. Building the graph from the weights keeps those
nodes, fixes the I/O names and dynamic dims to the contract, and takes milliseconds.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import external_data_helper, helper, numpy_helper

from tfport.contract import TensorSpec
from tfport.heap import release_memory
from tfport.models.lazy import read_weight
from tfport.dtypes import COMPUTE_DTYPES, NUMPY_DTYPES, ONNX_DTYPES, cache_dtype

from .functions import DOMAIN, DOMAIN_VERSION, OnnxFunction, function_protos

TAPS_KEY = "tfport.taps"  # metadata: reference point -> (graph value, dtype), for localisation
# How initializers of each dtype are held in numpy (ml_dtypes' bfloat16 rounds to nearest even,
# as torch's .to(torch.bfloat16) does, so stored weights equal the bfloat16 reference's).
STORAGE_DTYPES = {**NUMPY_DTYPES, "bfloat16": ml_dtypes.bfloat16}


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor's values as float32 numpy (the builder casts to the graph dtype); a lazy
    module's weight is read from its file now (``tfport.models.lazy``)."""
    return read_weight(tensor)


# Tensors whose bytes (with Python's bytes overhead) reach this go to the external data file, as
# ``onnx.save_model(..., save_as_external_data=True, size_threshold=1024)`` decides.
EXTERNAL_SIZE_THRESHOLD = 1024
BYTES_OVERHEAD = sys.getsizeof(b"")
RELEASE_BYTES = 4 * 2**20  # after spilling a tensor this large, the C heap's free pages go back


class Initializers(list):
    """A graph's initializers. With a ``data_file``, each one large enough for external data has
    its bytes appended to that file as it is added (the proto keeps only the reference), so a
    graph is never held in memory with its weights: exactly what ``onnx.save_model`` writes with
    ``save_as_external_data=True, all_tensors_to_one_file=True, size_threshold=1024`` (same
    order, offsets and fields). ``weight_bytes`` counts every tensor's serialised size as if
    inline (what decides whether the graph needs external data at all); ``inline()`` reads the
    bytes back into the protos and removes the file, for a graph small enough to be one file."""

    def __init__(self, data_file: Path | None = None):
        super().__init__()
        self.data_file = data_file
        self.weight_bytes = 0
        self._handle = None if data_file is None else data_file.open("wb")

    def append(self, tensor: onnx.TensorProto) -> None:
        self.weight_bytes += tensor.ByteSize()
        if self._handle is not None and tensor.HasField("raw_data"):
            raw = tensor.raw_data
            if len(raw) + BYTES_OVERHEAD >= EXTERNAL_SIZE_THRESHOLD:
                offset = self._handle.tell()
                self._handle.write(raw)
                external_data_helper.set_external_data(tensor, self.data_file.name, offset, len(raw))
                tensor.ClearField("raw_data")
                # a fresh message: protobuf keeps a cleared field's bytes in the message's arena
                # until the message itself is freed
                spilled = onnx.TensorProto()
                spilled.CopyFrom(tensor)
                tensor = spilled
                if len(raw) >= RELEASE_BYTES:  # the heap keeps earlier weights' freed copies
                    release_memory()
            del raw
        super().append(tensor)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def inline(self) -> None:
        """Every tensor's bytes back in its proto; the data file is removed."""
        self.close()
        if self.data_file is None:
            return
        with self.data_file.open("rb") as handle:
            for tensor in self:
                if external_data_helper.uses_external_data(tensor):
                    info = external_data_helper.ExternalDataInfo(tensor)
                    handle.seek(info.offset)
                    tensor.raw_data = handle.read(info.length)
                    tensor.ClearField("external_data")
                    tensor.ClearField("data_location")
        self.data_file.unlink()
        self.data_file = None


def ir_version_for(opset: int) -> int:
    """The oldest IR version that allows ``opset`` (older runtimes accept it; see onnx/helper.py)."""
    return 10 if opset <= 22 else 11


class GraphBuilder:
    """Collects nodes and initializers; ``op`` returns the name(s) of the new node's outputs.

    ``data_file``: where initializers' bytes go as they are added (``Initializers``).
    ``dtype`` is the export dtype: weights are stored in it (``storage``) and activations are
    computed in ``self.dtype`` (``tfport.dtypes.COMPUTE_DTYPES``: float32 for bfloat16, whose
    weights are then cast in the graph); ``kv_dtype`` is the KV cache's (the exporter sets it).
    """

    def __init__(self, name: str, dtype: str, data_file: Path | None = None):
        self.name, self.storage, self.dtype = name, dtype, COMPUTE_DTYPES[dtype]
        self.kv_dtype = cache_dtype(dtype)
        self.value_dtypes: dict[str, str] = {}  # values whose dtype is not self.dtype's default
        self.nodes: list[onnx.NodeProto] = []
        self.initializers = Initializers(data_file)  # weights stream to data_file as they come
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._used: Counter[str] = Counter()
        # Intermediate values worth comparing when a graph diverges from PyTorch, keyed by the
        # reference module path they correspond to ("decoder.layers.0.ffn"), in graph order.
        self.taps: dict[str, tuple[str, str]] = {}
        # Weight-only quantisation of this graph's products and token gathers
        # (the scheme's graph_quantizer, export/quant/), or None for weights in the graph dtype.
        self.quantizer = None

    def fresh(self, hint: str) -> str:
        self._used[hint] += 1
        count = self._used[hint]
        return hint if count == 1 else f"{hint}_{count - 1}"

    def weight(self, name: str, array: np.ndarray, dtype: str | None = None) -> str:
        """Add an initializer (cast to ``dtype``) and return its name. Without ``dtype``, a
        weight of the model: stored in ``storage`` and, where that is not the compute dtype
        (bfloat16), returned through a Cast to it (ONNX Runtime folds it when the session opens)."""
        stored = dtype or self.storage
        name = self.fresh(name)
        self.initializers.append(numpy_helper.from_array(
            np.array(array, dtype=STORAGE_DTYPES[stored], order="C"), name))
        if dtype is None and stored != self.dtype:  # at the front: before any node a rewrite moves
            self.nodes.insert(0, helper.make_node("Cast", [name], [f"{name}.compute"], to=ONNX_DTYPES[self.dtype],
                                                  name=self.fresh(f"{name}.compute")))
            return f"{name}.compute"
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
        return self.set_dtype(value, dtype)

    def set_dtype(self, value: str, dtype: str) -> str:
        """Note that ``value`` is of ``dtype`` (e.g. a KV cache in its own dtype), so that
        ``add_output`` casts it only where its spec asks for another."""
        self.value_dtypes[value] = dtype
        return value

    def add_input(self, spec: TensorSpec) -> str:
        self.inputs.append(helper.make_tensor_value_info(spec.name, ONNX_DTYPES[spec.dtype], list(spec.shape)))
        return self.set_dtype(spec.name, spec.dtype)

    def add_output(self, value: str, spec: TensorSpec) -> None:
        """Expose ``value`` as the graph output ``spec`` (cast to its dtype if needed): float
        values are in the compute dtype unless ``set_dtype`` said otherwise."""
        floating = spec.dtype in ("float32", "float16", "bfloat16")
        source_dtype = self.value_dtypes.get(value, self.dtype if floating else spec.dtype)
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
