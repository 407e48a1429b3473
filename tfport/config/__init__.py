"""One configuration for every transformer family tfport handles.

The same frozen dataclass, ``ModelConfig``, is read by the PyTorch reference modules, the ONNX
exporter and the torch-free runtime, so this package imports nothing but the standard library.
The architecture's backbone (sizes, norm, activation, position scheme, token ids ...) is flat;
each concept with several settings is a small frozen part of its own, one module each:

* ``model``: ``ModelConfig`` itself and the checks that need more than one part;
* ``rope``: ``RopeConfig``; ``positions``: the position scheme names and the relative schemes'
  parts (``RelativeConfig``, ``DisentangledConfig``); ``window``: ``WindowConfig``;
  ``moe``: ``MoeConfig`` (mixture-of-experts layers); ``classifier``: ``ClassifierConfig``;
  ``dropout``: ``DropoutConfig``;
* ``checks``: the vocabulary every check speaks (``Checks``, ``reject``, ``is_int`` ...);
* ``json_forms``: the JSON forms, nested and the flat one earlier versions wrote.

Each part validates its own fields on construction, ``ModelConfig`` the combinations that need more
than one part; a bad value raises ``ValueError`` naming the field by its full path
(``config.rope.scaling_factor=0.5: expected ...``), the value and what was expected. It
round-trips through JSON (``to_json`` / ``from_json``, which also reads the flat form).

Shape legend used across the project: B batch, S new tokens, P past length, T = P + S,
H query heads, Hkv key/value heads, D head dim, E model dim (d_model), V vocab.
"""

from .classifier import CLASSIFIER_ACTIVATIONS, CLASSIFIER_DECODER_STARTS, CLASSIFIER_POOLINGS, ClassifierConfig
from .dropout import DropoutConfig
from .model import ACTIVATIONS, FAMILIES, NORM_POSITIONS, NORMS, QK_NORM_SPANS, ModelConfig
from .moe import ROUTINGS, MoeConfig
from .positions import (ALIBI_SLOPES, DISENTANGLED_TERMS, ENCODER_ONLY_POSITIONS, POSITIONS, DisentangledConfig,
                        RelativeConfig)
from .rope import CONTEXT_SCALINGS, ROPE_SCALINGS, RopeConfig
from .window import WindowConfig

__all__ = [
    "ModelConfig", "RopeConfig", "WindowConfig", "RelativeConfig", "DisentangledConfig", "MoeConfig",
    "ClassifierConfig", "DropoutConfig",
    "FAMILIES", "NORMS", "NORM_POSITIONS", "ACTIVATIONS", "QK_NORM_SPANS", "POSITIONS", "ENCODER_ONLY_POSITIONS",
    "ALIBI_SLOPES", "DISENTANGLED_TERMS", "ROPE_SCALINGS", "CONTEXT_SCALINGS", "ROUTINGS", "CLASSIFIER_POOLINGS",
    "CLASSIFIER_DECODER_STARTS", "CLASSIFIER_ACTIVATIONS",
]
