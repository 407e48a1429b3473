"""PyTorch reference modules for the three transformer families."""

from __future__ import annotations

from torch import nn

from tfport.config import ModelConfig

from .cache import KVCache
from .decoder import DecoderLM
from .encoder import EncoderModel, EncoderOutput
from .encoder_decoder import EncoderDecoderLM

FAMILY_CLASSES = {"encoder": EncoderModel, "decoder": DecoderLM, "encoder-decoder": EncoderDecoderLM}


def build_model(config: ModelConfig, seed: int | None = None) -> nn.Module:
    """A model of ``config``'s family in eval mode, randomly initialised (seeded if given)."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    model = FAMILY_CLASSES[config.family](config)
    return model.eval()


__all__ = ["build_model", "DecoderLM", "EncoderModel", "EncoderOutput", "EncoderDecoderLM",
           "KVCache", "FAMILY_CLASSES"]
