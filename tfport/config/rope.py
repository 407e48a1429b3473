"""RoPE's settings: the base, the scaling that stretches it past the trained context, partial and
interleaved rotation. ``ModelConfig.rope`` holds one; ``ModelConfig`` checks what needs the rest of
the architecture (position, head dimension, sliding window)."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import Part, is_number

ROPE_SCALINGS = (None, "linear", "ntk", "llama3", "longrope", "yarn", "dynamic")
# Scalings that rescale from a trained context length (original_max_positions).
CONTEXT_SCALINGS = ("llama3", "longrope", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeConfig(Part):
    """Rotary position embeddings (read when ``position="rope"``).

    ``theta`` is the base. ``scaling``: ``linear`` divides the frequencies by ``scaling_factor``,
    ``ntk`` raises the base, ``llama3`` divides the low frequencies (wavelength above
    ``original_max_positions / low_freq_factor``) by the factor, keeps the high ones (wavelength
    below ``... / high_freq_factor``) and interpolates smoothly between. ``longrope`` (Phi-3)
    divides frequency i by ``short_factor[i]``, or by ``long_factor[i]`` in a call whose longest
    row runs past ``original_max_positions`` (max(position_ids) + 1 > it, as transformers decides
    per forward; keys already cached keep the rotation they got). ``yarn`` (Peng et al., 2023)
    blends f / factor and f over the channels between the correction dims of ``beta_fast`` and
    ``beta_slow`` rotations in ``original_max_positions`` (rounded outwards when ``truncate``),
    linearly. ``attention_factor`` multiplies cos and sin (longrope, yarn). ``dynamic`` NTK is
    plain RoPE while a call's longest row (max(position_ids) + 1 = n) stays within
    ``original_max_positions`` L; past it the call uses base
    theta * (factor * n / L - (factor - 1)) ^ (R / (R - 2)), recomputed per call (transformers'
    module keeps the largest n seen until a call shorter than L; in one generation, whose calls
    only grow, the two agree).

    ``local_theta`` gives the sliding-window layers their own base, unscaled (Gemma 3).
    ``rotary_dim`` rotates only the first that many channels of each head (GPT-NeoX's
    ``rotary_pct``, ``partial_rotary_factor``); the rest pass unrotated. ``interleaved`` pairs
    channel 2i with 2i + 1 (GPT-J's rotate-every-two) instead of i with i + R/2.
    """

    PATH = "rope"

    theta: float = 10000.0
    scaling: str | None = None
    scaling_factor: float = 1.0
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    local_theta: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    rotary_dim: int | None = None
    interleaved: bool = False

    def __post_init__(self) -> None:
        check = self.checks()
        check.choice("scaling", ROPE_SCALINGS)
        check.booleans("interleaved", "truncate")
        check.positive_numbers("theta", "low_freq_factor", "high_freq_factor", "attention_factor",
                               "beta_fast", "beta_slow")
        check.positive_numbers("local_theta", optional=True)
        check.positive_ints("original_max_positions", "rotary_dim", optional=True)
        if not is_number(self.scaling_factor) or self.scaling_factor < 1.0:
            check.fail("scaling_factor", "a finite number >= 1")
        if self.scaling is None and self.scaling_factor != 1.0:
            check.fail("scaling_factor", "1.0 unless rope.scaling is set")
        if self.scaling == "llama3":
            if self.high_freq_factor <= self.low_freq_factor:
                check.fail("high_freq_factor", f"above rope.low_freq_factor={self.low_freq_factor} "
                           "(the band between them is interpolated)")
        else:
            check.defaults(("low_freq_factor", "high_freq_factor"),
                           "the default (1.0 / 4.0) unless rope.scaling='llama3'")
        if self.scaling in CONTEXT_SCALINGS and self.original_max_positions is None:
            check.fail("original_max_positions", f"the trained context length for rope.scaling={self.scaling!r}")
        if self.scaling not in CONTEXT_SCALINGS and self.original_max_positions is not None:
            check.fail("original_max_positions", "null unless rope.scaling is 'llama3', 'longrope', 'yarn' "
                       "or 'dynamic'")
        if self.scaling != "yarn":
            check.defaults(("beta_fast", "beta_slow", "truncate"), "the defaults (rope.beta_fast 32, "
                           "rope.beta_slow 1, rope.truncate true) unless rope.scaling='yarn'")
        if self.scaling == "longrope":
            for field in ("short_factor", "long_factor"):
                value = getattr(self, field)
                if not isinstance(value, tuple) or not all(is_number(v) and v > 0 for v in value):
                    check.fail(field, "a tuple of positive factors (one per rotary frequency)")
        else:
            check.defaults(("short_factor", "long_factor"), "null unless rope.scaling='longrope'")
        if self.attention_factor != 1.0 and self.scaling not in ("longrope", "yarn"):
            check.fail("attention_factor", "1.0 unless rope.scaling is 'longrope' or 'yarn'")
