"""Run an exported graph and its PyTorch reference on the same inputs, and compare.

Used by the post-export validation, the parity test suite and ``tfport parity``. A ``Case`` says
which inputs to make (batch, past length P, new tokens S, padding); ``run_case`` feeds them to
ONNX Runtime and to the reference module and compares every output at real (unmasked) positions.

Tolerances are per (dtype, provider); see ``TOLERANCES``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from tfport.contract import Manifest, cache_names

from tfport.models.attention import Attention
from tfport.models.cache import KVCache
from tfport.models.layers import Block, FeedForward, RMSNorm
from tfport.models.masks import MASK_VALUE
from tfport.models.positions import positions_from_mask
from tfport.models.stack import Embeddings, Stack

from tfport.dtypes import ONNX_DTYPES

from .graph import TAPS_KEY

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


# The standard cases: padding (none, left, right) x phase (prefill; decode step with past; a chunk
# of several new tokens on top of a past). Decoders are causal in every case; "right" padding
# on top of a past becomes left padding (a real cache never has holes before new tokens).
PHASES = {"prefill": (0, 6), "decode": (5, 1), "chunk": (4, 3)}  # (P, S)
CASES = [Case(batch=3, past=p, new=s, padding=padding, seed=seed)
         for seed, (padding, (p, s)) in enumerate(
             (padding, phase) for padding in ("none", "left", "right") for phase in PHASES.values())]


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
    ort.set_default_logger_severity(4)  # the probe's failure is reported by the return value
    try:
        make_session(model.SerializeToString(), "cuda")
    except Exception as err:  # noqa: BLE001 - any failure means "not usable", with its reason
        return False, f"CUDA execution provider not usable here: {str(err).splitlines()[0][:200]}"
    finally:
        ort.set_default_logger_severity(2)
    return True, "CUDA execution provider creates sessions"


def _mask(batch: int, padding: str, total: int) -> np.ndarray:
    """attention_mask [B, total]; row 0 gets 2 padded slots on the ``padding`` side."""
    mask = np.ones((batch, total), dtype=np.int64)
    pad = min(2, total - 1)
    if padding == "left":
        mask[0, :pad] = 0
    elif padding == "right":
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


@dataclass
class Prepared:
    """Inputs of one graph run: ONNX feeds, the reference call, and which positions are real."""

    graph: str
    feeds: dict[str, np.ndarray]
    reference: Callable[[], dict[str, torch.Tensor]]
    query_mask: np.ndarray  # [B, S] bool: real query positions
    key_mask: np.ndarray  # [B, T] bool: real key positions (for present K/V)
    # Target "ort": buffers bound as both past and present (updated in place), and a function
    # mapping each ONNX output back to the portable layout the reference uses.
    inplace: dict[str, np.ndarray] | None = None
    to_reference_layout: Callable[[str, np.ndarray], np.ndarray] | None = None
    case: Case | None = None  # set when the case had to be adapted (e.g. batch 1)


@contextmanager
def capture(model: nn.Module):
    """Collect the outputs of the reference's norms, attention, FFNs and blocks by module path.

    Yields a dict filled during the forward: ``{"decoder.layers.0.ffn": tensor, ...}``, plus the
    attention internals (``...attn.rotary_q``, ``...attn.context``) and each stack's bias.
    """
    captured: dict[str, torch.Tensor] = {}
    handles, recorders = [], []

    def hook(path):
        def store(module, args, output):
            captured[path] = output[0] if isinstance(output, tuple) else output
        return store

    for path, module in model.named_modules():
        if isinstance(module, (Embeddings, RMSNorm, nn.LayerNorm, FeedForward, Attention, Block)):
            handles.append(module.register_forward_hook(hook(path)))
        if isinstance(module, (Attention, Stack)):
            module.record = {}
            recorders.append((path, module))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
        for path, module in recorders:
            captured.update({f"{path}.{key}": value for key, value in module.record.items()})
            module.record = None


class Runner:
    """Sessions of one export plus its reference module, for running cases."""

    def __init__(self, model: nn.Module, export_dir: str | Path, provider: str = "cpu"):
        self.model = model.eval()
        self.export_dir = Path(export_dir)
        self.manifest = Manifest.read(export_dir)
        self.config = self.manifest.config
        self.provider = provider
        self.dtype = self.manifest.dtype
        self.tolerance = TOLERANCES[(self.dtype, provider)]
        self.sessions = {name: make_session(self.export_dir / g.file, provider)
                         for name, g in self.manifest.graphs.items()}
        self._device = "cuda" if provider == "cuda" else "cpu"
        self.torch_dtype = torch.float16 if self.dtype == "float16" else torch.float32
        if self.torch_dtype != torch.float32:  # a converted copy: never round the caller's weights
            self.model = copy.deepcopy(self.model).to(self.torch_dtype)

    # ----------------------------------------------------------------------------- inputs
    def _ids(self, rng: np.random.Generator, shape) -> np.ndarray:
        return rng.integers(3, self.config.vocab_size, size=shape, dtype=np.int64)

    def _kv(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        c = self.config
        return rng.standard_normal((batch, c.kv_heads, length, c.dim_per_head)).astype(self.dtype)

    def prepare(self, case: Case) -> list[Prepared]:
        """The graph runs of ``case``: the encoder, the decoder, or both (seq2seq)."""
        rng = np.random.default_rng(case.seed)
        if self.config.family == "encoder":
            return [self._prepare_encoder(case, rng)]
        if self.config.family == "decoder":
            if self.manifest.target == "ort":
                return [self._prepare_fused_decoder(case, rng)]
            return [self._prepare_decoder(case, rng)]
        encoder = self._prepare_encoder(case, rng)
        return [encoder, self._prepare_decoder(case, rng, encoder)]

    def _prepare_encoder(self, case: Case, rng: np.random.Generator) -> Prepared:
        c = self.config
        seq2seq = c.family == "encoder-decoder"
        length = case.encoder_length if seq2seq else case.past + case.new  # no past in encoders
        padding = ("right" if case.padding != "none" else "none") if seq2seq else case.padding
        ids = self._ids(rng, (case.batch, length))
        mask = _mask(case.batch, padding, length)
        feeds = {"input_ids": ids, "attention_mask": mask}
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        kwargs = {}
        if c.type_vocab_size:
            feeds["token_type_ids"] = rng.integers(0, c.type_vocab_size, (case.batch, length), dtype=np.int64)
            kwargs["token_type_ids"] = torch.from_numpy(feeds["token_type_ids"])

        def reference() -> dict[str, torch.Tensor]:
            if not seq2seq:
                out = self.model(t_ids, t_mask, **kwargs)
                found = {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output,
                         "logits": out.logits}
                return {k: v for k, v in found.items() if v is not None}
            states = self.model.encode(t_ids, t_mask)
            found = {"last_hidden_state": states.float()}
            for i, (k, v) in enumerate(self.model.cross_kv(states)):
                found.update(zip(cache_names(i, "present", "encoder"), (k, v)))
            return found

        real = mask.astype(bool)
        return Prepared("encoder", feeds, reference, real, real)

    def _prepare_decoder(self, case: Case, rng: np.random.Generator,
                         encoder: Prepared | None = None) -> Prepared:
        """Random past [B, Hkv, P, D], S new tokens, the mask over P + S; for seq2seq the cross
        K/V come from running the encoder graph (computed once, reused as the decoder's past)."""
        c = self.config
        kind = "decoder" if encoder is not None else None
        total = case.past + case.new
        padding = "left" if (case.padding == "right" and case.past) else case.padding
        mask = _mask(case.batch, padding, total)
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
        memory = None
        if encoder is not None:
            outputs = self.run_onnx(encoder)
            kv = [outputs[name] for i in range(c.n_decoder_layers) for name in cache_names(i, "present", "encoder")]
            feeds["encoder_attention_mask"] = encoder.feeds["attention_mask"]
            feeds.update(_cache_feeds("past_key_values", "encoder", kv, c.n_decoder_layers))
            memory = [(torch.from_numpy(kv[2 * i]), torch.from_numpy(kv[2 * i + 1]))
                      for i in range(c.n_decoder_layers)]
            memory_mask = torch.from_numpy(encoder.feeds["attention_mask"])

        def reference() -> dict[str, torch.Tensor]:
            if memory is not None:
                logits, present = self.model.decode(t_ids, memory, memory_mask, t_mask, t_pos, cache)
            else:
                logits, present = self.model(t_ids, t_mask, t_pos, cache)
            found = {"logits": logits}
            for i, (k, v) in enumerate(present.layers):
                found.update(zip(cache_names(i, "present", kind), (k, v)))
            return found

        return Prepared("decoder", feeds, reference, mask[:, case.past:].astype(bool), mask.astype(bool))

    def _prepare_fused_decoder(self, case: Case, rng: np.random.Generator) -> Prepared:
        """Target "ort": the portable case, re-laid out as ONNX Runtime's GroupQueryAttention wants
        it. Each row's real tokens move to the front (right padding), its past to the front of a
        buffer of P + S + 3 slots whose spare slots hold large random values (they must be ignored),
        ``seqlens_k`` = each row's real P + S - 1. The kernel accepts several new tokens on top of a
        past only for batch 1, so such cases run with batch 1."""
        if case.past and case.new > 1:
            case = dataclasses.replace(case, batch=1)
        portable = self._prepare_decoder(case, rng)
        c, mask = self.config, portable.feeds["attention_mask"]  # [B, P+S], left- or right-padded
        batch, total = mask.shape
        slots = total + 3
        real = mask.astype(bool)
        new_real = real[:, case.past:]
        ids = np.zeros_like(portable.feeds["input_ids"])
        for b in range(batch):
            ids[b, :new_real[b].sum()] = portable.feeds["input_ids"][b][new_real[b]]
        feeds = {"input_ids": ids, "seqlens_k": (real.sum(1) - 1).astype(np.int32),
                 "total_sequence_length": np.array(real.sum(1).max(), dtype=np.int32)}
        buffers = {}
        for name, past in portable.feeds.items():
            if not name.startswith("past_key_values."):
                continue
            buffer = (rng.standard_normal((batch, c.kv_heads, slots, c.dim_per_head)) * 100).astype(self.dtype)
            for b in range(batch):
                n_past = real[b, :case.past].sum()
                buffer[b][:, :n_past] = past[b][:, real[b, :case.past]]
            buffers[name] = buffer

        def to_reference_layout(name: str, value: np.ndarray) -> np.ndarray:
            if not name.startswith("present.") and value.shape[:2] == (batch, case.new):
                # logits and taps [B, S, ...]: row b's queries are at its real new slots
                out = np.zeros((batch, case.new) + value.shape[2:], dtype=value.dtype)
                for b in range(batch):
                    out[b, new_real[b]] = value[b, :new_real[b].sum()]
                return out
            if name.startswith("present."):  # [B, Hkv, M, D] -> [B, Hkv, P+S, D]
                out = np.zeros(value.shape[:2] + (total,) + value.shape[3:], dtype=value.dtype)
                for b in range(batch):
                    out[b][:, real[b]] = value[b][:, :real[b].sum()]
                return out
            return value

        return dataclasses.replace(portable, feeds=feeds, inplace=buffers,
                                   to_reference_layout=to_reference_layout, case=case)

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
        if name == "pooler_output":
            return np.ones(expected.shape, dtype=bool)
        if name.endswith(".bias"):
            return expected > MASK_VALUE / 2  # [B, 1|H, S, T]
        if expected.ndim == 4:  # rotary q/k [B, N, S, D]
            return prepared.query_mask[:, None, :, None]
        return prepared.query_mask[:, :, None]  # [B, S, ...]

    @torch.no_grad()
    def check(self, prepared: Prepared, case: Case) -> CaseResult:
        actual = self.run_onnx(prepared)
        result = CaseResult(prepared.case or case, prepared.graph, self.provider)
        for name, tensor in prepared.reference().items():
            expected = tensor.float().numpy()
            result.diffs.append(_compare(name, expected, actual[name].astype(np.float32),
                                         self._real(name, expected, prepared), self.tolerance,
                                         logits=name == "logits"))
        return result

    def run(self, case: Case) -> list[CaseResult]:
        return [self.check(prepared, case) for prepared in self.prepare(case)]

    # ----------------------------------------------------------------------------- localisation
    def _tap_session(self, graph: str) -> tuple[ort.InferenceSession, dict[str, tuple[str, str]]]:
        """A session of ``graph`` whose outputs also include every recorded tap."""
        proto = onnx.load(str(self.export_dir / self.manifest.graphs[graph].file))
        props = {p.key: p.value for p in proto.metadata_props}
        taps = json.loads(props.get(TAPS_KEY, "{}"))
        existing = {o.name for o in proto.graph.output}
        for value, dtype in taps.values():
            if value not in existing:
                proto.graph.output.append(onnx.helper.make_tensor_value_info(value, ONNX_DTYPES[dtype], None))
                existing.add(value)
        return make_session(proto.SerializeToString(), self.provider), taps

    @torch.no_grad()
    def localize(self, case: Case) -> list[Diff]:
        """Compare every tapped intermediate of every graph of ``case`` in graph order.

        Returns the diffs in order; ``first_divergence`` names the first that fails.
        """
        diffs = []
        for prepared in self.prepare(case):
            session, taps = self._tap_session(prepared.graph)
            actual = self.run_onnx(prepared, session)
            with capture(self.model) as captured:
                prepared.reference()
            for point, (value, _) in taps.items():
                if point not in captured:
                    continue
                expected = captured[point].float().numpy()
                diffs.append(_compare(point, expected, actual[value].astype(np.float32),
                                      self._real(point, expected, prepared), self.tolerance))
        return diffs


PIECES = (("rotary_", "rotary"), ("context", "attention"), ("attn_norm", "norm"), ("cross_norm", "norm"),
          ("ffn_norm", "norm"), ("attn", "attention output"), ("cross_attn", "cross-attention"),
          ("ffn", "FFN"), ("bias", "mask / position bias (ALiBi, relative)"), ("embed", "embeddings"),
          ("norm", "final norm"))


def first_divergence(diffs: list[Diff]) -> str | None:
    """'layer 3 of decoder, rotary (decoder.layers.3.attn.rotary_q): max_abs=...' or None."""
    for diff in diffs:
        if diff.ok:
            continue
        parts = diff.output.split(".")
        last = parts[-1]
        piece = next((label for key, label in PIECES if last.startswith(key)), "block output")
        where = f"layer {parts[2]} of {parts[0]}" if len(parts) > 2 and parts[1] == "layers" else parts[0]
        return f"{where}, {piece} ({diff.output}): max_abs={diff.max_abs:.3g} max_rel={diff.max_rel:.3g}"
    return None


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
