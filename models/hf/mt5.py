"""mT5 (``model_type`` ``mt5``) -> encoder-decoder: T5 v1.1's layout and computation (gated GELU,
relative attention bias) under its own names; the rules are T5's (``t5``). Unlike T5 v1.0, the
decoder output is never scaled before the head: transformers' MT5 has no ``scale_decoder_outputs``
(its config forces ``tie_word_embeddings`` true, so that field says nothing here). A file with its
own ``lm_head.weight`` (the original mT5 releases) keeps it, as for T5."""

from __future__ import annotations

import dataclasses

from tfport.config import ModelConfig

from .t5 import T5


def _mt5_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    return T5.config(hf, keys).replace(lm_head_scale=1.0)


MT5 = dataclasses.replace(T5, model_types=("mt5",), classes=("MT5ForConditionalGeneration", "MT5Model"),
                          config=_mt5_config)
