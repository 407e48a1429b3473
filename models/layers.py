"""Norms, feed-forward networks and the transformer block (pre- or post-norm)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tfport.config import ModelConfig

from .attention import Attention


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight (Zhang & Sennrich, 2019).

    The normalisation is computed in float32 and cast back before the weight multiplies it, as
    LLaMA's and T5's reference implementations do.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 for every input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(),
                           self.bias.float(), self.eps)
        return out.to(x.dtype)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return LayerNorm(config.d_model, eps=config.norm_eps)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class FeedForward(nn.Module):
    """act(x W_up) W_down, or (act(x W_gate) * x W_up) W_down when gated (SwiGLU, GEGLU)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[config.activation]
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias) if config.gated_ffn else None
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.gate(x)) * self.up(x) if self.gate is not None else self.act(self.up(x))
        return self.down(hidden)


class Block(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; each wrapped in a residual.

    Pre-norm: ``x + f(norm(x))``; post-norm: ``norm(x + f(x))``.
    """

    def __init__(self, config: ModelConfig, cross: bool = False):
        super().__init__()
        self.pre = config.norm_position == "pre"
        self.attn_norm, self.attn = make_norm(config), Attention(config)
        self.cross_norm = make_norm(config) if cross else None
        self.cross_attn = Attention(config, cross=True) if cross else None
        self.ffn_norm, self.ffn = make_norm(config), FeedForward(config)

    def _residual(self, x: torch.Tensor, norm: nn.Module, f) -> tuple[torch.Tensor, object]:
        if self.pre:
            out, extra = f(norm(x))
            return x + out, extra
        out, extra = f(x)
        return norm(x + out), extra

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                memory: tuple[torch.Tensor, torch.Tensor] | None = None,
                memory_bias: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, S, E] -> ([B, S, E], present self-attention (k, v) [B, Hkv, P+S, D])."""
        x, present = self._residual(x, self.attn_norm, lambda h: self.attn(h, bias, rope, past))
        if self.cross_attn is not None:
            x, _ = self._residual(x, self.cross_norm,
                                  lambda h: self.cross_attn(h, memory_bias, memory=memory))
        x, _ = self._residual(x, self.ffn_norm, lambda h: (self.ffn(h), None))
        return x, present
