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


# Target "ort" (ONNX Runtime's fused GroupQueryAttention): decoder-only RoPE models whose head
# dimension is a multiple of 16 (the kernel's requirement), over the attention variants.
ORT_MATRIX = [("decoder", "rope", attention) for attention in ATTENTION]


def ort_config(attention: str) -> ModelConfig:
    return matrix_config("decoder", "rope", attention).replace(d_model=64)  # D = 64 / 4 = 16
