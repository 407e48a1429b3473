"""Parity cases, tolerances and the comparison of one output with its reference.

A ``Case`` says which inputs to make (batch, past length P, new tokens S, padding); the comparison
looks at real (unmasked) positions only, with a tolerance per (dtype, provider) (``TOLERANCES``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

# (rtol, atol) per (dtype, provider): an output passes where |ort - torch| <= atol + rtol * |torch|.
TOLERANCES: dict[tuple[str, str], tuple[float, float]] = {
    # fp32 on CPU: same operation order on both sides; the differences are summation order in
    # MatMul/LayerNorm kernels and libm sin/cos/erf, ~1e-6 relative, amplified a few times by depth.
    ("float32", "cpu"): (1e-4, 1e-4),
    # fp32 on CUDA: TF32 is off in ORT by default, but cuBLAS picks other reduction orders.
    ("float32", "cuda"): (1e-3, 1e-3),
    # fp16: 11-bit mantissa (~5e-4 relative per rounding); the reference runs the module in fp16
    # too, but rounds at different points (fused vs unfused kernels; on the CPU provider ONNX
    # Runtime computes products, norms and softmax in float32 between float16 activations), so a
    # few ulps per layer. Worst over the CPU matrix (every target x family x position x attention):
    # 6.6e-3, MLM logits of a tied vocabulary matrix.
    ("float16", "cpu"): (2e-2, 2e-2),
    ("float16", "cuda"): (2e-2, 2e-2),
    # bf16: 8-bit mantissa (~4e-3 relative per rounding, 8x float16's). The graph computes in
    # float32 from bfloat16 weights; the reference is the bfloat16 module, which rounds every
    # activation, so its own rounding is most of the difference. Worst over the CPU matrix: 4.4e-2
    # (the same MLM logits; float16 needed 6.6e-3 there); 8e-2 keeps a margin of 1.8x.
    ("bfloat16", "cpu"): (8e-2, 8e-2),
    ("bfloat16", "cuda"): (8e-2, 8e-2),
}
# Relative spacing of a cache dtype (one unit in the last place): where an export's cache is
# rounded to another dtype than its activations (``kv_dtype``), the graph and the reference round
# float32 values a few float32 ulps apart, and where one sits on a rounding boundary they land one
# unit apart; present K/V are compared with at least this rtol.
CACHE_ULPS: dict[str, float] = {"float16": 2.0 ** -10, "float32": 0.0}
# A float32 reference's own rounding error, measured per case and output against the same module
# in float64 (``Runner``), times this, is a floor under the tolerance above: an export cannot agree
# with a float32 reference much better than float32 lets the reference agree with exact arithmetic.
# The table's fixed tolerances are in units of the output's own size, which is wrong for a model
# whose residual stream is far larger than its outputs: SmolLM2-135M carries values up to 2e4 in
# one channel into a final RMSNorm, so its float32 logits (RMS 4-15) are 1e-4 to 7e-4 from float64,
# and the fp32 `ort` export's 1e-3 from the float32 reference, past the table's 4e-4. The factor
# covers another kernel's summation order: on SmolLM2, ONNX Runtime's float32 graph was 0.6-5x
# the reference's error (max abs, logits), and ``MatMulNBits`` with float activations (the exact
# check of an int4 export) 7x float32 MatMul's on one product with inputs of 2.8e3 and 32x at the
# logits of one case (64 keeps a margin of 2). On SmolLM2 that floor is 0.2-1% of the logits' RMS;
# a real error (a wrong position, angle, mask, weight or layout) is a sizeable fraction of the
# output. On the tiny test models the floor stays below the table's tolerance, so their checks are
# unchanged; only float32 references get one (a float16 or bfloat16 reference's error is the
# table's business).
ROUNDING_FACTOR = 64.0



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

def _compare(name: str, expected: np.ndarray, actual: np.ndarray, real: np.ndarray,
             tolerance: tuple[float, float], logits: bool = False, floor: float = 0.0) -> Diff:
    """Differences over entries where ``real`` (broadcastable bool) is True. ``floor``: an absolute
    difference every entry may have whatever the tolerance (``ROUNDING_FACTOR``)."""
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
                bool((err <= np.maximum(atol * scale + rtol * np.abs(e), floor)).all()))
    if logits:
        diff.token_agreement = token_agreement(expected, actual, real[..., 0], max((atol + rtol) * scale, floor))
    return diff


def token_agreement(expected: np.ndarray, actual: np.ndarray, real: np.ndarray, tie: float) -> float:
    """Fraction of real positions whose argmax agrees, counting near-ties as agreement.

    Tokens whose reference logits are within ``tie`` of the reference's largest have no
    well-defined order at that precision: the runtime's pick agrees if it is one of them (a
    bfloat16 reference rounds logits of size ~1 to steps of 2^-7, so several can tie exactly).
    """
    picked = actual.argmax(-1)[..., None]
    best = expected.max(-1)
    agree = best - np.take_along_axis(expected, picked, -1)[..., 0] <= tie
    return float(agree[real].mean()) if real.any() else 1.0
