"""What parity runs a quantised export as: its graphs with float activations (``exact_graph``),
so that they compute what the reference with dequantised weights computes (``fake_quantize``).
The int8-activation error of the shipped graphs is measured separately (``tfport parity
--accuracy``).
"""

from __future__ import annotations

from .w8a8 import float_activations

# ONNX Runtime fuses DequantizeLinear + MatMul into MatMulNBits at this accuracy level (default 4:
# int8 activations); parity sets 0 (float activations), so the graph computes what the
# fake-quantised reference computes.
EXACT_SESSION_CONFIG = {"session.qdq_matmulnbits_accuracy_level": "0"}
# Where ONNX Runtime reads the external data of a model given as bytes (``exact_graph``): the
# export's directory, so the weights are neither copied nor put in the bytes (a protobuf message
# is limited to 2 GiB; an 8B model in int4 is 4-5 GB).
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def exact_graph(path) -> bytes:
    """The graph at ``path`` with every ``MatMulNBits`` at accuracy level 0 and every w8a8
    product on float activations (``w8a8.float_activations``),
    serialised without its external data (open it with ``EXTERNAL_DATA_FOLDER`` set to
    ``path``'s directory): what parity runs a quantised export as. The int8-activation error of
    the shipped level is measured separately (``tfport parity --accuracy``)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    float_activations(model)  # w8a8's integer products
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute("accuracy_level", 0)])
    return model.SerializeToString()
