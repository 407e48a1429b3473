"""Run an exported graph and its PyTorch reference on the same inputs, and compare.

Used by the post-export validation (``validate_export``), the parity test suite and ``tfport
parity``: a ``Runner`` holds an export's sessions (opened by ``export/validate.py``) and the
reference module, makes each case's inputs (``inputs``), runs both sides and compares every
output at real positions (``cases``). ``localize(runner, case)`` names the first diverging layer.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from tfport.contract import LAST_LOGITS
from tfport.dtypes import COMPUTE_DTYPES
from tfport.manifest import Manifest
from tfport.models.lazy import is_lazy
from tfport.models.masks import MASK_VALUE

from ..quant import EXACT_SESSION_CONFIG, EXTERNAL_DATA_FOLDER, exact_graph
from ..validate import make_session
from .cases import CACHE_ULPS, ROUNDING_FACTOR, TOLERANCES, Case, CaseResult, _compare
from .inputs import CaseInputs, Prepared
from .reference import TORCH_DTYPES, reference_module

# A decoder's logits run again with ``last_logits`` (the head on each row's last new token), as
# checked beside the others.
LAST_POSITIONS = "logits (last_logits)"


def _tolerance(manifest: Manifest, provider: str) -> tuple[float, float]:
    """(rtol, atol) of an export: its dtype's, or the looser of that and its cache dtype's where
    the target runs attention in the cache dtype (``Target.attention_dtype``)."""
    from ..targets import TARGETS

    tolerance = TOLERANCES[(manifest.dtype, provider)]
    target = TARGETS.get(manifest.target)
    compute = COMPUTE_DTYPES[manifest.dtype]
    if target is not None and target.attention_dtype(compute, manifest.kv_dtype) != compute:
        other = TOLERANCES[(target.attention_dtype(compute, manifest.kv_dtype), provider)]
        tolerance = (max(tolerance[0], other[0]), max(tolerance[1], other[1]))
    return tolerance


class Runner:
    """Sessions of one export plus its reference module, for running cases."""

    def __init__(self, model: nn.Module, export_dir: str | Path, provider: str = "cpu"):
        self.model = model.eval()
        self.export_dir = Path(export_dir)
        self.manifest = Manifest.read(export_dir)
        self.config = self.manifest.config
        self.provider = provider
        self.dtype = self.manifest.dtype
        self.kv_dtype = self.manifest.kv_dtype
        self.tolerance = _tolerance(self.manifest, provider)
        # A quantised export runs its products with float activations (``exact_graph``, at
        # ``EXACT_SESSION_CONFIG``), so it matches the fake-quantised reference exactly. Graphs
        # opened from bytes read their external data from the export's directory.
        self._session_config = {**(EXACT_SESSION_CONFIG if self.manifest.quantization else {}),
                                EXTERNAL_DATA_FOLDER: str(self.export_dir.resolve())}
        self._sessions: dict[str, ort.InferenceSession] | None = None
        self._device = "cuda" if provider == "cuda" else "cpu"
        self.torch_dtype = TORCH_DTYPES[self.dtype]
        # A converted copy where the dtype or the cache rounding differ: never the caller's weights.
        self.model = reference_module(self.model, self.dtype, self.kv_dtype)
        self._float64: nn.Module | None = None  # the reference in float64 (float64_outputs)
        self.inputs = CaseInputs(self.model, self.config, self.kv_dtype, self.manifest.layout,
                                 self.run_onnx)

    @property
    def sessions(self) -> dict[str, ort.InferenceSession]:
        """Every graph's session by name, opened on first use: a validation computes its
        references first, so a large model's session and the reference's reads (a token table
        in float32) are never in memory at once."""
        if self._sessions is None:
            self._sessions = {name: self._session(self.export_dir / g.file)
                              for name, g in self.manifest.graphs.items()}
        return self._sessions

    def _session(self, path: Path) -> ort.InferenceSession:
        """A graph's session, run as parity runs it (see ``__init__``)."""
        model = exact_graph(path) if self.manifest.quantization else path
        return make_session(model, self.provider, self._session_config)

    def graph_model(self, graph: str) -> onnx.ModelProto:
        """``graph``'s model as the runner's sessions run it (a quantised export's 4-bit products
        at float activations), to be changed (e.g. given extra outputs) and opened with ``open``;
        external data is not loaded (``open`` reads it from the export's directory)."""
        path = self.export_dir / self.manifest.graphs[graph].file
        if self.manifest.quantization:
            return onnx.load_from_string(exact_graph(path))
        return onnx.load(str(path), load_external_data=False)

    def open(self, model: onnx.ModelProto) -> ort.InferenceSession:
        """A session of ``model`` (from ``graph_model``) on the runner's provider with the session
        config its sessions have: a quantised export's fused DequantizeLinear + MatMul at float
        activations too, never ONNX Runtime's default int8 activations."""
        return make_session(model.SerializeToString(), self.provider, self._session_config)

    def prepare(self, case: Case) -> list[Prepared]:
        """The graph runs of ``case``: the encoder, the decoder, or both (seq2seq)."""
        return self.inputs.prepare(case)


    # ----------------------------------------------------------------------------- running
    def run_onnx(self, prepared: Prepared, session: ort.InferenceSession | None = None) -> dict[str, np.ndarray]:
        session = session or self.sessions[prepared.graph]
        names = [o.name for o in session.get_outputs()]
        if prepared.inplace is None:
            return dict(zip(names, session.run(None, prepared.feeds)))
        binding = session.io_binding()  # one OrtValue per buffer, bound as past AND present
        for name, value in prepared.feeds.items():
            binding.bind_cpu_input(name, value)
        shared = {}
        for name, buffer in prepared.inplace.items():
            shared[name] = ort.OrtValue.ortvalue_from_numpy(buffer.copy(), self._device, 0)
            binding.bind_ortvalue_input(name, shared[name])
        for name in names:
            past = "past_key_values." + name[len("present."):]
            if past in shared:
                binding.bind_ortvalue_output(name, shared[past])
            else:
                binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        outputs = dict(zip(names, (v.numpy() for v in binding.get_outputs())))
        return {name: prepared.to_reference_layout(name, value) for name, value in outputs.items()}

    def _real(self, name: str, expected: np.ndarray, prepared: Prepared) -> np.ndarray:
        """Where ``expected`` holds real values: real queries, real keys, unmasked bias entries."""
        if name.startswith("present"):
            return prepared.key_mask[:, None, :, None]  # [B, 1, T, 1]
        if name in ("pooler_output", "class_logits"):  # one row per input: all real
            return np.ones(expected.shape, dtype=bool)
        if name.endswith(".bias"):
            return expected > MASK_VALUE / 2  # [B, 1|H, S, T]
        if expected.ndim == 4:  # rotary q/k [B, N, S, D]
            return prepared.query_mask[:, None, :, None]
        return prepared.query_mask[:, :, None]  # [B, S, ...]

    @torch.no_grad()
    def check(self, prepared: Prepared, case: Case,
              reference: dict[str, torch.Tensor] | None = None) -> CaseResult:
        """Run ``prepared`` on both sides (``reference``: the reference's outputs, computed
        earlier) and compare every output. The float64 reference (the rounding floor) is only run
        for a case the table's tolerance alone fails: a floor can only let more through, and its
        float64 copy of the module doubles the reference's memory.

        A decoder with several new tokens runs twice: with every position's logits
        (``last_logits`` false), then with the head on each row's last new token alone (true), as
        the runtime's prefills run it (with one new token both are the same position)."""
        actual = self.run_onnx(prepared)
        if LAST_LOGITS in prepared.feeds and prepared.feeds["input_ids"].shape[1] > 1:
            feeds = {**prepared.feeds, LAST_LOGITS: np.array(True)}
            actual[LAST_POSITIONS] = self.run_onnx(dataclasses.replace(prepared, feeds=feeds))["logits"]
        reference = prepared.reference() if reference is None else reference
        result = self._compare_outputs(prepared, case, actual, reference, {})
        if not result.ok and self.float64_reference() is not None:
            result = self._compare_outputs(prepared, case, actual, reference, self.float64_outputs(prepared))
        return result

    def _compare_outputs(self, prepared: Prepared, case: Case, actual: dict[str, np.ndarray],
                         reference: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> CaseResult:
        """One ``Diff`` per output; ``exact``: the float64 reference's outputs ({}: no floor)."""
        result = CaseResult(prepared.case or case, prepared.graph, self.provider)
        for name, tensor in reference.items():
            tolerance = self.tolerance
            if name.startswith("present"):  # the cache holds what its dtype can: round it the same way
                tensor = tensor.to(TORCH_DTYPES[self.kv_dtype])
                tolerance = (max(tolerance[0], CACHE_ULPS.get(self.kv_dtype, 0.0)), tolerance[1])
            expected = tensor.float().numpy()
            real = self._real(name, expected, prepared)
            floor = self.rounding_floor(tensor, exact.get(name), real)
            result.diffs.append(_compare(name, expected, actual[name].astype(np.float32), real,
                                         tolerance, logits=name == "logits", floor=floor))
            if name == "logits" and LAST_POSITIONS in actual:
                rows = np.arange(expected.shape[0])
                last = self.inputs.layout.last_positions(prepared.query_mask)
                result.diffs.append(_compare(LAST_POSITIONS, expected[rows, last][:, None],
                                             actual[LAST_POSITIONS].astype(np.float32),
                                             real[rows, last][:, None], tolerance, logits=True, floor=floor))
        return result

    # ------------------------------------------------------------ the reference's own rounding
    def float64_reference(self) -> nn.Module | None:
        """The reference module in float64 (a copy of the same float32 weights, made once), or
        None where the reference is not float32 throughout (a float16 or bfloat16 module, or a
        cache rounded to another dtype: the tolerance table covers those) or is lazy."""
        if (self.dtype, self.kv_dtype) != ("float32", "float32") or is_lazy(self.model):
            return None  # a lazy module's copy would read its weights again (model larger than memory)
        if self._float64 is None:
            self._float64 = copy.deepcopy(self.model).double().eval()
        return self._float64

    def float64_outputs(self, prepared: Prepared) -> dict[str, torch.Tensor]:
        """The reference's outputs of ``prepared`` in float64; {} without a float64 reference."""
        model = self.float64_reference()
        return {} if model is None else prepared.reference(model)

    @staticmethod
    def rounding_floor(reference: torch.Tensor, exact: torch.Tensor | None, real: np.ndarray) -> float:
        """``ROUNDING_FACTOR`` x the float32 reference's largest difference from float64 over
        ``real`` entries: how far float32 rounding alone takes this output (0.0 without ``exact``)."""
        if exact is None or exact.shape != reference.shape:
            return 0.0
        err = (reference.double() - exact).abs().numpy()[np.broadcast_to(real, reference.shape)]
        return ROUNDING_FACTOR * float(err.max()) if err.size else 0.0

    def run(self, case: Case) -> list[CaseResult]:
        return [self.check(prepared, case) for prepared in self.prepare(case)]

def validate_export(model: nn.Module, export_dir: str | Path, provider: str = "cpu",
                    log=None) -> list[CaseResult]:
    """Prefill (left padding) and a decode step with past on fresh random inputs; raise on mismatch.

    Every reference output is computed before ONNX Runtime opens the export (a decoder's runs
    need no session to be prepared), so validating a model larger than memory holds either the
    reference's reads (one layer, or the token table in float32) or the session, never both."""
    log = log or logging.getLogger("tfport.export")
    runner = Runner(model, export_dir, provider)
    cases = [Case(batch=3, past=0, new=7, padding="left", seed=11),
             Case(batch=3, past=6, new=1, padding="left", seed=12)]
    runs = [(case, prepared) for case in cases for prepared in runner.prepare(case)]
    with torch.no_grad():
        references = [prepared.reference() for _, prepared in runs]
    results = [runner.check(prepared, case, reference) for (case, prepared), reference in zip(runs, references)]
    for result in results:
        log.info("validation %s", result.describe())
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError("export validation failed (ONNX Runtime differs from PyTorch beyond "
                           f"tolerance {runner.tolerance}):\n" + "\n".join(r.describe() for r in failed))
    return results
