"""Dropout probabilities, applied in ``train()`` mode only (eval mode and exports have none).
``ModelConfig.dropout`` holds them."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .checks import Part, is_number


@dataclass(frozen=True)
class DropoutConfig(Part):
    """The probabilities of dropping embeddings (after their norm; DeBERTa's relative embeddings
    too), attention probabilities, sublayer outputs before the residual add (and the classifier's
    pooled state), and the FFN's hidden activations."""

    PATH = "dropout"

    embedding: float = 0.0
    attention: float = 0.0
    residual: float = 0.0
    ffn: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not is_number(value) or not 0.0 <= value < 1.0:
                self.checks().fail(field.name, "a probability in [0, 1)")
