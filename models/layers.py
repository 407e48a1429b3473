"""Feed-forward networks and the transformer block (pre- or post-norm; norms in ``norms``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tfport.config import ModelConfig

from .attention import Attention
from .norms import LayerNorm, RMSNorm, make_norm

__all__ = ["ACTIVATIONS", "Block", "FeedForward", "LayerNorm", "RMSNorm", "make_norm"]


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class FeedForward(nn.Module):
    """act(x W_up) W_down, or (act(x W_gate) * x W_up) W_down when gated (SwiGLU, GEGLU); hidden
    width ``d_ff`` (default ``config.d_ff``; a mixture of experts' experts have their own)."""

    def __init__(self, config: ModelConfig, d_ff: int | None = None):
        super().__init__()
        d_ff = config.d_ff if d_ff is None else d_ff
        self.act = ACTIVATIONS[config.activation]
        self.gate = nn.Linear(config.d_model, d_ff, bias=config.mlp_bias) if config.gated_ffn else None
        self.up = nn.Linear(config.d_model, d_ff, bias=config.mlp_bias)
        self.down = nn.Linear(d_ff, config.d_model, bias=config.mlp_bias)
        self.dropout = nn.Dropout(config.dropout.ffn)  # on the hidden activations, train() only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.gate(x)) * self.up(x) if self.gate is not None else self.act(self.up(x))
        return self.down(self.dropout(hidden))


class Block(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; each wrapped in a residual.

    Pre-norm: ``x + f(norm(x))``; post-norm: ``norm(x + f(x))``. With ``post_sublayer_norm``
    (pre-norm only, Gemma 2/3) the output is normalised too: ``x + post_norm(f(norm(x)))``
    (``attn_post_norm``, ``ffn_post_norm``); with ``residual_scale`` r it is scaled before the add:
    ``x + r * f(norm(x))`` (Granite). With ``parallel_residual`` both sublayers read the
    block's input: ``x + attn(attn_norm(x)) + ffn(ffn_norm(x))``. The ``first`` block of a stack
    has an identity ``attn_norm`` when ``config.first_attn_norm`` is false (ModernBERT). ``ffn``
    replaces the feed-forward (a mixture of experts: ``models.moe.MixtureOfExperts``).
    """

    def __init__(self, config: ModelConfig, cross: bool = False, first: bool = False,
                 ffn: nn.Module | None = None):
        super().__init__()
        self.pre = config.norm_position == "pre"
        self.dropout = nn.Dropout(config.dropout.residual)  # sublayer outputs, train() only
        self.attn_norm = nn.Identity() if first and not config.first_attn_norm else make_norm(config)
        self.attn = Attention(config)
        self.cross_norm = make_norm(config) if cross else None
        self.cross_attn = Attention(config, cross=True) if cross else None
        self.ffn_norm, self.ffn = make_norm(config), FeedForward(config) if ffn is None else ffn
        self.parallel = config.parallel_residual
        self.residual_scale = config.residual_scale  # each sublayer's output, pre-norm blocks only
        self.attn_post_norm = self.ffn_post_norm = None
        if config.post_sublayer_norm:
            self.attn_post_norm, self.ffn_post_norm = make_norm(config), make_norm(config)

    def _residual(self, x: torch.Tensor, norm: nn.Module, f, post: nn.Module | None = None
                  ) -> tuple[torch.Tensor, object]:
        if self.pre:
            out, extra = f(norm(x))
            out = self.dropout(out)
            if post is not None:
                out = post(out)
            if self.residual_scale != 1.0:  # Granite's residual_multiplier
                out = out * self.residual_scale
            return x + out, extra
        out, extra = f(x)
        out = self.dropout(out)
        return norm(x + out), extra

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                memory: tuple[torch.Tensor, torch.Tensor] | None = None,
                memory_bias: torch.Tensor | None = None, content_bias=None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, S, E] -> ([B, S, E], present self-attention (k, v) [B, Hkv, P+S, D]).
        ``content_bias``: see ``Attention.forward`` (DeBERTa's disentangled terms)."""
        if self.parallel:
            out, present = self.attn(self.attn_norm(x), bias, rope, past, content_bias=content_bias)
            return x + self.dropout(out) + self.dropout(self.ffn(self.ffn_norm(x))), present
        x, present = self._residual(
            x, self.attn_norm, lambda h: self.attn(h, bias, rope, past, content_bias=content_bias),
            self.attn_post_norm)
        if self.cross_attn is not None:
            x, _ = self._residual(x, self.cross_norm,
                                  lambda h: self.cross_attn(h, memory_bias, memory=memory))
        x, _ = self._residual(x, self.ffn_norm, lambda h: (self.ffn(h), None), self.ffn_post_norm)
        return x, present
