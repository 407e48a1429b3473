"""Run an exported graph and its PyTorch reference on the same inputs, and compare.

Used by the post-export validation, the parity test suite and ``tfport parity``. A ``Case`` says
which inputs to make (batch, past length P, new tokens S, padding); ``run_case`` feeds them to
ONNX Runtime and to the reference module and compares every output at real (unmasked) positions.

Tolerances are per (dtype, provider); see ``TOLERANCES``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from tfport.contract import Manifest, cache_names

from tfport.models.cache import KVCache
from tfport.models.positions import positions_from_mask

# (rtol, atol) per (dtype, provider): an output passes where |ort - torch| <= atol + rtol * |torch|.
TOLERANCES: dict[tuple[str, str], tuple[float, float]] = {
    # fp32 on CPU: same operation order on both sides; the differences are summation order in
    # MatMul/LayerNorm kernels and libm sin/cos/erf, ~1e-6 relative, amplified a few times by depth.
    ("float32", "cpu"): (1e-4, 1e-4),
    # fp32 on CUDA: TF32 is off in ORT by default, but cuBLAS picks other reduction orders.
    ("float32", "cuda"): (1e-3, 1e-3),
    # fp16: 11-bit mantissa (~5e-4 relative per rounding); the reference runs the module in fp16
    # too, but rounds at different points (fused vs unfused kernels), so a few ulps per layer.
    ("float16", "cpu"): (2e-2, 2e-2),
    ("float16", "cuda"): (2e-2, 2e-2),
}

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


@dataclass(frozen=True)
class Case:
    """One set of inputs. ``padding`` pads row 0 of the batch ('left', 'right' or 'none')."""

    batch: int = 2
    past: int = 0  # P
    new: int = 5  # S
    padding: str = "none"
    encoder_length: int = 6
    seed: int = 0

    @property
    def label(self) -> str:
        return f"B{self.batch}-P{self.past}-S{self.new}-{self.padding}"


@dataclass
class Diff:
    """Largest differences of one output over its real positions."""

    output: str
    max_abs: float
    max_rel: float
    ok: bool
    token_agreement: float | None = None  # fraction of positions whose argmax agrees (logits)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CaseResult:
    case: Case
    graph: str
    provider: str
    diffs: list[Diff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.diffs)

    def describe(self) -> str:
        worst = max(self.diffs, key=lambda d: d.max_abs)
        return (f"{self.graph} {self.case.label} on {self.provider}: "
                f"{'ok' if self.ok else 'MISMATCH'}; worst {worst.output} max_abs={worst.max_abs:.3g} "
                f"max_rel={worst.max_rel:.3g}; failing: {[d.output for d in self.diffs if not d.ok]}")


def make_session(model: str | Path | bytes, provider: str = "cpu") -> ort.InferenceSession:
    """An ONNX Runtime session on ``provider``; raises if CUDA was asked for and not obtained."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = model if isinstance(model, bytes) else str(model)
    session = ort.InferenceSession(source, options, providers=PROVIDERS[provider])
    if provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"provider='cuda': ONNX Runtime could not create a CUDA session "
                           f"(got {session.get_providers()})")
    return session


def cuda_available() -> tuple[bool, str]:
    """(usable, reason): whether a CUDA session can really be created here."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False, "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    try:
        make_session(model.SerializeToString(), "cuda")
    except Exception as err:  # noqa: BLE001 - any failure means "not usable", with its reason
        return False, f"CUDA execution provider not usable here: {str(err).splitlines()[0][:200]}"
    return True, "CUDA execution provider creates sessions"


def _mask(case: Case, total: int, rng: np.random.Generator) -> np.ndarray:
    """attention_mask [B, total]; row 0 gets 2 padded slots on the requested side."""
    mask = np.ones((case.batch, total), dtype=np.int64)
    pad = min(2, total - 1)
    if case.padding == "left":
        mask[0, :pad] = 0
    elif case.padding == "right":
        mask[0, total - pad:] = 0
    return mask


def _compare(name: str, expected: np.ndarray, actual: np.ndarray, real: np.ndarray,
             tolerance: tuple[float, float], logits: bool = False) -> Diff:
    """Differences over entries where ``real`` (broadcastable bool) is True."""
    rtol, atol = tolerance
    if expected.shape != actual.shape:
        return Diff(name, math.inf, math.inf, False)
    real = np.broadcast_to(real, expected.shape)
    e, a = expected[real].astype(np.float64), actual[real].astype(np.float64)
    if not np.isfinite(actual).all():
        return Diff(name, math.inf, math.inf, False)
    if e.size == 0:
        return Diff(name, 0.0, 0.0, True)
    err = np.abs(a - e)
    # atol is in units of the output's own scale (its RMS, at least 1): fp16 rounding errors grow
    # with the magnitude of what is computed, e.g. logits of std ~6 from a tied vocabulary matrix.
    scale = max(1.0, float(np.sqrt(np.mean(e * e))))
    diff = Diff(name, float(err.max()), float((err / (np.abs(e) + 1e-12)).max()),
                bool((err <= atol * scale + rtol * np.abs(e)).all()))
    if logits:
        diff.token_agreement = token_agreement(expected, actual, real[..., 0], (atol + rtol) * scale)
    return diff


def token_agreement(expected: np.ndarray, actual: np.ndarray, real: np.ndarray, tie: float) -> float:
    """Fraction of real positions whose argmax agrees, counting near-ties as agreement.

    A position where the reference's top two logits are within ``tie`` of each other has no
    well-defined argmax at that precision; it agrees if the runtime picks either of the two.
    """
    top2 = np.argsort(expected, axis=-1)[..., -2:]
    gap = np.take_along_axis(expected, top2, -1)
    near_tie = (gap[..., 1] - gap[..., 0]) <= tie
    picked = actual.argmax(-1)
    agree = (picked == top2[..., 1]) | (near_tie & (picked == top2[..., 0]))
    return float(agree[real].mean()) if real.any() else 1.0


def _cache_feeds(prefix: str, kind: str | None, tensors: list[np.ndarray], n_layers: int) -> dict:
    feeds = {}
    for i in range(n_layers):
        key, value = cache_names(i, prefix, kind)
        feeds[key], feeds[value] = tensors[2 * i], tensors[2 * i + 1]
    return feeds


class Runner:
    """Sessions of one export plus its reference module, for running cases."""

    def __init__(self, model: nn.Module, export_dir: str | Path, provider: str = "cpu"):
        self.model = model.eval()
        self.manifest = Manifest.read(export_dir)
        self.config = self.manifest.config
        self.provider = provider
        self.dtype = self.manifest.dtype
        self.tolerance = TOLERANCES[(self.dtype, provider)]
        self.sessions = {name: make_session(Path(export_dir) / g.file, provider)
                         for name, g in self.manifest.graphs.items()}
        self.torch_dtype = torch.float16 if self.dtype == "float16" else torch.float32
        if self.torch_dtype != torch.float32:
            self.model = self.model.to(self.torch_dtype)

    # ----------------------------------------------------------------------------- inputs
    def _rng(self, case: Case) -> np.random.Generator:
        return np.random.default_rng(case.seed)

    def _ids(self, rng: np.random.Generator, shape) -> np.ndarray:
        return rng.integers(3, self.config.vocab_size, size=shape, dtype=np.int64)

    def _kv(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        c = self.config
        return rng.standard_normal((batch, c.kv_heads, length, c.dim_per_head)).astype(self.dtype)

    # ----------------------------------------------------------------------------- cases
    def run(self, case: Case) -> list[CaseResult]:
        if self.config.family == "encoder":
            return [self.run_encoder(case)]
        if self.config.family == "decoder":
            return [self.run_decoder(case)]
        return self.run_seq2seq(case)

    @torch.no_grad()
    def run_encoder(self, case: Case) -> CaseResult:
        c, rng = self.config, self._rng(case)
        length = case.new + case.past  # encoders have no past: use the whole length
        ids = self._ids(rng, (case.batch, length))
        mask = _mask(case, length, rng)
        feeds = {"input_ids": ids, "attention_mask": mask}
        kwargs = {}
        if c.type_vocab_size:
            feeds["token_type_ids"] = rng.integers(0, c.type_vocab_size, (case.batch, length), dtype=np.int64)
            kwargs["token_type_ids"] = torch.from_numpy(feeds["token_type_ids"])
        session = self.sessions["encoder"]
        actual = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        result = CaseResult(case, "encoder", self.provider)
        real_tokens = mask.astype(bool)[:, :, None]  # [B, S, 1]
        if c.family == "encoder":
            out = self.model(torch.from_numpy(ids), torch.from_numpy(mask), **kwargs)
            expected = {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output,
                        "logits": out.logits}
        else:
            states = self.model.encode(torch.from_numpy(ids), torch.from_numpy(mask))
            expected = {"last_hidden_state": states.float()}
            for i, (k, v) in enumerate(self.model.cross_kv(states)):
                key, value = cache_names(i, "present", "encoder")
                expected[key], expected[value] = k, v
        for name, tensor in expected.items():
            if tensor is None:
                continue
            e = tensor.float().numpy()
            if name == "pooler_output":
                real = np.ones(e.shape, dtype=bool)
            elif name.startswith("present"):
                real = mask.astype(bool)[:, None, :, None]
            else:
                real = real_tokens
            result.diffs.append(_compare(name, e, actual[name], real, self.tolerance, logits=name == "logits"))
        return result

    @torch.no_grad()
    def run_decoder(self, case: Case, memory: dict | None = None) -> CaseResult:
        """Decoder graph: random past [B, Hkv, P, D], S new tokens, the mask over P + S."""
        c, rng = self.config, self._rng(case)
        seq2seq = c.family == "encoder-decoder"
        kind = "decoder" if seq2seq else None
        total = case.past + case.new
        padding = case.padding if not (case.padding == "right" and case.past) else "left"
        mask = _mask(Case(case.batch, padding=padding), total, rng)
        ids = self._ids(rng, (case.batch, case.new))
        position_ids = positions_from_mask(torch.from_numpy(mask), case.new).numpy()
        past = [self._kv(rng, case.batch, case.past) for _ in range(2 * c.n_decoder_layers)]
        feeds = {"input_ids": ids, "attention_mask": mask}
        if c.uses_position_ids:
            feeds["position_ids"] = position_ids
        feeds.update(_cache_feeds("past_key_values", kind, past, c.n_decoder_layers))
        cache = KVCache([(torch.from_numpy(past[2 * i]), torch.from_numpy(past[2 * i + 1]))
                         for i in range(c.n_decoder_layers)]) if case.past else None
        t_ids, t_mask, t_pos = (torch.from_numpy(x) for x in (ids, mask, position_ids))
        if seq2seq:
            memory = memory or self._memory(case, rng)
            feeds["encoder_attention_mask"] = memory["mask"]
            feeds.update(_cache_feeds("past_key_values", "encoder", memory["kv"], c.n_decoder_layers))
            t_memory = [(torch.from_numpy(memory["kv"][2 * i]), torch.from_numpy(memory["kv"][2 * i + 1]))
                        for i in range(c.n_decoder_layers)]
            logits, present = self.model.decode(t_ids, t_memory, torch.from_numpy(memory["mask"]),
                                                t_mask, t_pos, cache)
        else:
            logits, present = self.model(t_ids, t_mask, t_pos, cache)
        session = self.sessions["decoder"]
        actual = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        result = CaseResult(case, "decoder", self.provider)
        real_queries = mask[:, case.past:].astype(bool)[:, :, None]  # [B, S, 1]
        result.diffs.append(_compare("logits", logits.numpy(), actual["logits"], real_queries,
                                     self.tolerance, logits=True))
        real_keys = mask.astype(bool)[:, None, :, None]  # [B, 1, T, 1]
        for i, (k, v) in enumerate(present.layers):
            for name, tensor in zip(cache_names(i, "present", kind), (k, v)):
                result.diffs.append(_compare(name, tensor.float().numpy(), actual[name].astype(np.float32),
                                             real_keys, self.tolerance))
        return result

    def _memory(self, case: Case, rng: np.random.Generator) -> dict:
        """Encoder side of a seq2seq case, computed by the ONNX encoder graph (run once)."""
        ids = self._ids(rng, (case.batch, case.encoder_length))
        mask = _mask(Case(case.batch, padding="right" if case.padding != "none" else "none"),
                     case.encoder_length, rng)
        session = self.sessions["encoder"]
        outputs = dict(zip([o.name for o in session.get_outputs()],
                           session.run(None, {"input_ids": ids, "attention_mask": mask})))
        kv = []
        for i in range(self.config.n_decoder_layers):
            kv += [outputs[name] for name in cache_names(i, "present", "encoder")]
        return {"mask": mask, "kv": kv}

    def run_seq2seq(self, case: Case) -> list[CaseResult]:
        """Encoder case, then the decoder with the encoder's cross K/V reused."""
        return [self.run_encoder(case), self.run_decoder(case)]


def validate_export(model: nn.Module, export_dir: str | Path, provider: str = "cpu",
                    log=None) -> list[CaseResult]:
    """Prefill (left padding) and a decode step with past on fresh random inputs; raise on mismatch."""
    import logging

    log = log or logging.getLogger("tfport.export")
    runner = Runner(model, export_dir, provider)
    cases = [Case(batch=3, past=0, new=7, padding="left", seed=11),
             Case(batch=3, past=6, new=1, padding="left", seed=12)]
    results = [r for case in cases for r in runner.run(case)]
    for result in results:
        log.info("validation %s", result.describe())
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError("export validation failed (ONNX Runtime differs from PyTorch beyond "
                           f"tolerance {runner.tolerance}):\n" + "\n".join(r.describe() for r in failed))
    return results
