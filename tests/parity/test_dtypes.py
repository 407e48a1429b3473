"""float16 and bfloat16 exports on the CPU provider, and float32 models with a float16 KV cache.

Each registered target x family (one representative configuration each, from the shared matrix)
is exported in float16 and bfloat16 and checked on ONNX Runtime's CPU provider against the
reference module in that dtype (every CASE at real positions, then greedy tokens of a padded
batch), with the tolerances of ``TOLERANCES``. ``--kv-dtype float16`` exports of float32 models
are checked against the float32 module whose cache is rounded to float16 as it is filled
(``reference_module``): exactly (float32 tolerances) where attention reads the cache cast back to
float32, within float16's where the target's kernel attends in the cache dtype (``ort``). A
negative control shows the rounding is what makes them agree.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tests.matrix import target_matrix
from tfport.export.parity import CASES, TOLERANCES, CaseInputs, Runner
from tfport.export.targets import TARGETS
from tfport.manifest import Manifest
from tfport.runtime import load_model
from tfport.runtime.binding import empty_cache
from tfport.runtime.decoding.inplace_binding import InplaceDecoder

from .test_parity import check_greedy, check_outputs

# One configuration per (target, family): the matrix's GQA entry with rotary positions where the
# family has them (the ort target's fused kernel needs them), else its first entry.
PREFERRED = (("rope", "gqa"), ("relative", "gqa"), ("learned", "gqa"))


def _representatives(decoders_only: bool = False) -> list:
    params = []
    for name, target in TARGETS.items():
        by_family: dict[str, dict] = {}
        for (family, position, attention), config in target_matrix(target):
            by_family.setdefault(family, {})[(position, attention)] = config
        for family, configs in by_family.items():
            if decoders_only and family == "encoder":
                continue
            key = next((k for k in PREFERRED if k in configs), next(iter(configs)))
            params.append(pytest.param(name, configs[key], id=f"{name}-{family}-{'-'.join(key)}"))
    return params


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("target,config", _representatives())
def test_half_precision_on_cpu(exported, target, config, dtype):
    """Outputs of every case and greedy tokens match the reference in ``dtype`` on the CPU."""
    model, out = exported(config, dtype, target)
    check_outputs(model, out, "cpu")
    if config.family != "encoder":
        check_greedy(model, out, config.family, "cpu", dtype)


def test_bfloat16_stores_bfloat16_weights_and_exchanges_float32(exported):
    """bfloat16 is the weights' storage: every weight matrix is a BFLOAT16 initializer, while the
    graphs' inputs, outputs and KV caches are float32 (no bfloat16 array reaches the runtime)."""
    config = next(p.values[1] for p in _representatives()
                  if p.values[0] == "portable" and p.values[1].family == "encoder-decoder")
    _, out = exported(config, "bfloat16", "portable")
    for graph in Manifest.read(out).graphs.values():
        proto = onnx.load(str(out / graph.file))
        matrices = [t.data_type for t in proto.graph.initializer if len(t.dims) == 2]
        assert matrices and set(matrices) == {onnx.TensorProto.BFLOAT16}
        io = {v.type.tensor_type.elem_type for v in (*proto.graph.input, *proto.graph.output)}
        assert onnx.TensorProto.BFLOAT16 not in io and onnx.TensorProto.FLOAT in io


@pytest.mark.parametrize("target,config", _representatives(decoders_only=True))
def test_float16_cache_of_a_float32_model(exported, target, config):
    """A float32 model with a float16 cache: the manifest and the graph say float16, the runtime
    allocates float16 buffers, and outputs, present K/V and greedy tokens match the float32
    reference that rounds its cache to float16 the same way."""
    model, out = exported(config, "float32", target, "float16")
    manifest = Manifest.read(out)
    assert (manifest.dtype, manifest.kv_dtype) == ("float32", "float16")
    caches = [t for g in manifest.graphs.values() for t in (*g.inputs, *g.outputs)
              if t.name.startswith(("past_key_values.", "present."))]
    assert caches and {t.dtype for t in caches} == {"float16"}
    runner = Runner(model, out, "cpu")
    check_outputs(model, out, "cpu")
    check_greedy(model, out, config.family, "cpu", "float32", "float16", runner.tolerance)
    runner = load_model(out).runners["decoder"]  # the buffers the runtime binds are float16
    if manifest.layout == "inplace":
        buffers = InplaceDecoder(runner, 2, 8).cache.values()
        assert buffers and {b.data_type() for b in buffers} == {"tensor(float16)"}
    else:
        assert {a.dtype for a in empty_cache(runner.spec, 2).values()} == {np.dtype(np.float16)}


def _prefill_logits_error(runner: Runner, inputs: CaseInputs) -> float:
    """Largest |export - reference| of the logits of a prefill (no past: every key and value the
    attention reads was rounded in this call), the reference being ``inputs``' module."""
    prepared = inputs.prepare(CASES[0])[-1]
    actual = runner.run_onnx(prepared)["logits"]
    with torch.no_grad():
        expected = prepared.reference()["logits"].float().numpy()
    return float(np.abs(actual - expected)[prepared.query_mask].max())


@pytest.mark.parametrize("target", [name for name, t in TARGETS.items()
                                    if t.attention_dtype("float32", "float16") == "float32"])
def test_float16_cache_needs_the_rounding_reference(exported, target):
    """Negative control: the float32 module that does not round its cache is off by float16
    rounding (~1e-4, beyond the float32 tolerance), the rounding reference by float32 noise only,
    so the agreement above comes from rounding at the same place, not from a loose check."""
    config = next(p.values[1] for p in _representatives(decoders_only=True) if p.values[0] == target)
    model, out = exported(config, "float32", target, "float16")
    runner = Runner(model, out, "cpu")
    unrounded = CaseInputs(model.eval(), config, "float16", runner.manifest.layout, runner.run_onnx)
    rounded_error = _prefill_logits_error(runner, runner.inputs)
    unrounded_error = _prefill_logits_error(runner, unrounded)
    rtol, atol = TOLERANCES[("float32", "cpu")]
    assert rounded_error < 1e-5 and unrounded_error > atol, (rounded_error, unrounded_error)
