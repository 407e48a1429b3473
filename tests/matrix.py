"""The option matrix shared by the export and parity tests: family x position x attention."""

from __future__ import annotations

import itertools

from tfport.config import POSITIONS, ModelConfig
from tfport.presets import PRESETS

FAMILY_BASE = {
    "encoder": PRESETS["tiny-encoder"],
    "decoder": PRESETS["tiny-decoder"],
    # Untied head: a random tied model greedily repeats its input token, which would make the
    # greedy-token parity checks compare constant sequences.
    "encoder-decoder": PRESETS["tiny-encoder-decoder"].replace(tie_embeddings=False),
}
ATTENTION = {"mha": None, "gqa": 2, "mqa": 1}  # n_kv_heads for 4 query heads


def matrix_config(family: str, position: str, attention: str) -> ModelConfig:
    return FAMILY_BASE[family].replace(position=position, n_kv_heads=ATTENTION[attention])


def _accepted(family: str, position: str, attention: str) -> bool:
    """Whether the config takes the combination: it refuses an encoder-only position (DeBERTa's
    disentangled attention) outside the encoder or with fewer key/value heads than query heads."""
    try:
        matrix_config(family, position, attention)
    except ValueError:
        return False
    return True


# Every position tfport.config knows, in each family that takes it (tests/core/test_registries.py
# checks that exactly the refused combinations are left out).
MATRIX = [entry for entry in itertools.product(FAMILY_BASE, POSITIONS, ATTENTION) if _accepted(*entry)]


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
