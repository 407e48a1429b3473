"""Norms: RMSNorm and LayerNorm, both computed in float32 for every input dtype."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tfport.config import ModelConfig


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (weight + offset) (Zhang & Sennrich, 2019).

    The normalisation is computed in float32 and cast back before the weight multiplies it, as
    LLaMA's and T5's reference implementations do. ``offset`` 1 is Gemma's ``(1 + w)``, whose
    weights are stored as w; Gemma multiplies in float32 and casts after (the same in float32).
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.weight.float() + self.offset)).to(x.dtype)
        return xf.to(x.dtype) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 for every input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                           self.bias.float(), self.eps)
        return out.to(x.dtype)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps, config.norm_weight_offset)
    return LayerNorm(config.d_model, eps=config.norm_eps)
