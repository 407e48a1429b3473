"""The option matrix shared by the export and parity tests: family x position x attention."""

from __future__ import annotations

import itertools

from tfport.config import ModelConfig
from tfport.presets import PRESETS

FAMILY_BASE = {
    "encoder": PRESETS["tiny-encoder"],
    "decoder": PRESETS["tiny-decoder"],
    # Untied head: a random tied model greedily repeats its input token, which would make the
    # greedy-token parity checks compare constant sequences.
    "encoder-decoder": PRESETS["tiny-encoder-decoder"].replace(tie_embeddings=False),
}
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "relative", "none")
ATTENTION = {"mha": None, "gqa": 2, "mqa": 1}  # n_kv_heads for 4 query heads


def matrix_config(family: str, position: str, attention: str) -> ModelConfig:
    return FAMILY_BASE[family].replace(position=position, n_kv_heads=ATTENTION[attention])


MATRIX = list(itertools.product(FAMILY_BASE, POSITIONS, ATTENTION))


def ort_config(attention: str) -> ModelConfig:
    """A decoder-only RoPE model with head dimension 16 (64 / 4 heads), which ONNX Runtime's fused
    GroupQueryAttention (target "ort") needs."""
    return matrix_config("decoder", "rope", attention).replace(d_model=64)


def target_matrix(target) -> list[tuple[tuple[str, str, str], ModelConfig]]:
    """The matrix entries an export target takes, each with its config: the standard one, or the
    same with head dimension 16 where the target needs it (fused kernels); entries the target
    refuses both ways are left out (their refusal is tested in tests/export)."""
    entries = []
    for entry in MATRIX:
        config = matrix_config(*entry)
        for candidate in (config, config.replace(d_model=64)):
            try:
                target.check(candidate, "float32", target.default_opset)
            except ValueError:
                continue
            entries.append((entry, candidate))
            break
    return entries
