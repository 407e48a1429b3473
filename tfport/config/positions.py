"""Position schemes: the names a config's ``position`` may take, and the settings of the two
relative schemes, T5's bucketed attention bias (``ModelConfig.relative``) and DeBERTa's
disentangled attention (``ModelConfig.disentangled``). RoPE's settings are ``tfport.config.rope``.
``ModelConfig`` checks what needs the rest of the architecture (position, family, heads)."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import Part, is_int

POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative", "disentangled", "none")
ENCODER_ONLY_POSITIONS = ("disentangled",)  # no causal or cached form
ALIBI_SLOPES = ("press", "mpt")  # ALiBi's head slopes when H is not a power of two (ModelConfig)
DISENTANGLED_TERMS = ("c2p", "p2c")  # content-to-position, position-to-content (DeBERTa)


@dataclass(frozen=True)
class RelativeConfig(Part):
    """T5's bucketed relative attention bias (read when ``position="relative"``): one table of
    ``buckets`` rows [buckets, H] per stack, shared by its layers; distances below
    ``buckets // 2`` (causal; half that bidirectional) keep their own bucket, larger ones share
    log-spaced buckets up to ``max_distance``."""

    PATH = "relative"

    buckets: int = 32
    max_distance: int = 128

    def __post_init__(self) -> None:
        check = self.checks()
        if not is_int(self.buckets) or self.buckets < 4:
            check.fail("buckets", "an integer >= 4")
        # Causal stacks give exact buckets to distances below buckets // 2; the logarithmic
        # buckets need a larger max distance (bidirectional ones use half).
        if not is_int(self.max_distance) or self.max_distance <= self.buckets // 2:
            check.fail("max_distance", f"an integer > relative.buckets // 2 = {self.buckets // 2}")


@dataclass(frozen=True)
class DisentangledConfig(Part):
    """DeBERTa's disentangled attention (He et al., 2021; read when ``position="disentangled"``,
    encoders only): one table of 2R relative embeddings per stack, normalised by the stack's norm,
    which each layer projects with its own query and key projections (Qr, Kr [2R, H*D]). Query i
    and key j add c2p = q_i . Kr[r(i, j)] and p2c = k_j . Qr[r(i, j)] (``terms``, null: both;
    ``effective_terms`` says which are in effect) to q_i . k_j, all three scaled by
    ``ModelConfig.softmax_scale``, which defaults to (D (1 + number of terms)) ** -0.5 here.
    r(i, j) maps i - j to a row: with ``buckets`` R, distances up to R / 2 keep their own row and
    larger ones share log-spaced rows up to ``max_distance``; with null buckets, i - j is clipped
    to +-R, R = ``max_distance``. i and j are slot indices, as transformers numbers them (the same
    relative positions as tfport's mask-counted ones under left or right padding)."""

    PATH = "disentangled"

    buckets: int | None = 256
    max_distance: int = 512
    terms: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check = self.checks()
        buckets, terms = self.buckets, self.terms
        if buckets is not None and (not is_int(buckets) or buckets < 4 or buckets % 2):
            check.fail("buckets", "an even integer >= 4, or null (relative positions clipped, not bucketed)")
        least = 1 if buckets is None else buckets // 2 + 2
        if not is_int(self.max_distance) or self.max_distance < least:
            check.fail("max_distance", f"an integer >= {least}" + (
                "" if buckets is None else " (above disentangled.buckets // 2 + 1, where the "
                "logarithmic buckets start)"))
        if terms is not None and (not isinstance(terms, tuple) or not terms or len(set(terms)) != len(terms)
                                  or not set(terms) <= set(DISENTANGLED_TERMS)):
            check.fail("terms", f"a non-empty tuple of distinct terms from {list(DISENTANGLED_TERMS)}, "
                       "or null (both)")

    @property
    def effective_terms(self) -> tuple[str, ...]:
        """The terms in effect: ``terms``, or both when null."""
        return DISENTANGLED_TERMS if self.terms is None else self.terms
