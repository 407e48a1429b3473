"""Multi-head, grouped-query and multi-query attention with a fused QKV projection."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tfport.config import ModelConfig

from .disentangled import DisentangledBias
from .norms import RMSNorm
from .positions import apply_rope


class Tap(nn.Identity):
    """A named point in the forward whose value a forward hook can capture (the parity suite
    compares it with the exported graph's value of the same name); computes nothing."""


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                      scale: float, softcap: float | None = None, dropout: float = 0.0,
                      probs_tap: nn.Module | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v with H query heads sharing Hkv key/value heads.

    q [B, H, S, D], k and v [B, Hkv, T, D], bias float32 [B, 1 or H, S, T] -> [B, S, H*D].
    Query heads h*G .. h*G+G-1 (G = H / Hkv) read key/value head h. Scores and softmax are
    float32 whatever the input dtype. K and V are broadcast, never copied per query head.
    ``softcap`` c replaces the scaled scores s by c * tanh(s / c) before the bias is added.
    ``probs_tap`` (a ``Tap``) sees the probabilities [B, H, S, T] (calibration hooks read them).
    """
    b, h, s, d = q.shape
    hkv = k.shape[1]
    q = q.reshape(b, hkv, h // hkv, s, d)  # [B, Hkv, G, S, D]
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, G, S, T]
    scores = scores.float().reshape(b, h, s, -1) * scale  # [B, H, S, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias
    probs = scores.softmax(dim=-1)
    if probs_tap is not None:
        probs = probs_tap(probs)
    if dropout:  # training only: the module passes 0 in eval mode
        probs = F.dropout(probs, dropout)
    probs = probs.to(v.dtype).reshape(b, hkv, h // hkv, s, -1)
    out = torch.matmul(probs, v.unsqueeze(2))  # [B, Hkv, G, S, D]
    return out.reshape(b, h, s, d).transpose(1, 2).reshape(b, s, h * d)  # [B, S, H*D]


class Attention(nn.Module):
    """Self-attention (fused QKV projection, optional RoPE and KV cache) or cross-attention.

    Self-attention projects ``x`` [B, S, E] with one ``qkv`` matrix into H query and Hkv key and
    value heads. Cross-attention projects queries from ``x`` and keys/values from the encoder
    memory once per request (``project_memory``). The taps ``rotary_q``, ``rotary_k``,
    ``content_term``, ``context``, ``cached_k``, ``cached_v`` and ``probs`` expose the rotated
    queries/keys, the position scheme's bias from them (DeBERTa), the attention context, the new
    keys/values entering the cache and the attention probabilities to forward hooks.
    """

    def __init__(self, config: ModelConfig, cross: bool = False):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.dim_per_head
        self.scale = config.softmax_scale
        self.softcap = config.attn_logit_softcap
        self.rotary_dim = config.rotary_channels  # channels RoPE rotates (partial rotary: < D)
        self.rope_factor = config.rope.attention_factor  # scales cos and sin (longrope)
        self.interleaved = config.rope.interleaved  # GPT-J's channel pairing
        self.dropout = config.dropout.attention  # on the attention probabilities, train() only
        self.cross = cross
        q_dim, kv_dim = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        bias = config.attention_bias
        if cross:
            self.q = nn.Linear(config.d_model, q_dim, bias=bias)
            self.kv = nn.Linear(config.d_model, 2 * kv_dim, bias=bias)
        else:
            self.qkv = nn.Linear(config.d_model, q_dim + 2 * kv_dim, bias=bias)
        self.out = nn.Linear(q_dim, config.d_model, bias=config.out_bias)
        self.q_norm = self.k_norm = None
        # q/k norms per head [D], or over all heads' channels [H*D] / [Hkv*D] (OLMoE)
        self.qk_norm_per_head = config.qk_norm_span == "head"
        if config.qk_norm:
            q_width, k_width = (self.head_dim,) * 2 if self.qk_norm_per_head else (q_dim, kv_dim)
            self.q_norm = RMSNorm(q_width, config.norm_eps, config.norm_weight_offset)
            self.k_norm = RMSNorm(k_width, config.norm_eps, config.norm_weight_offset)
        self.qkv_clip = config.qkv_clip  # q, k, v clamped to [-c, c] after the norms (OLMoE)
        self.rotary_q, self.rotary_k, self.context = Tap(), Tap(), Tap()
        # The new keys and values [B, Hkv, S, D] as they enter the cache (self-attention): a hook
        # can round them to a cache dtype (the parity reference of --kv-dtype exports).
        self.cached_k, self.cached_v = Tap(), Tap()
        self.content_term = Tap()  # the position scheme's bias from q and k (DeBERTa), if any
        self.probs = Tap()  # the attention probabilities [B, H, S, T] (export.calibrate reads them)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, self.head_dim).transpose(1, 2)  # [B, N, S, D]

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values [B, Hkv, Senc, D] from encoder states [B, Senc, E]."""
        k, v = self.kv(memory).chunk(2, dim=-1)
        return self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)

    def forward(self, x: torch.Tensor, bias: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                past: tuple[torch.Tensor, torch.Tensor] | None = None,
                memory: tuple[torch.Tensor, torch.Tensor] | None = None,
                content_bias: DisentangledBias | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, S, E], bias float32 [B, 1|H, S, T] -> ([B, S, E], present (k, v) [B, Hkv, T, D]).

        ``rope`` is (cos, sin) [B, 1, S, D/2]; ``past`` the cached (k, v) [B, Hkv, P, D];
        ``memory`` the projected encoder (k, v) for cross-attention; ``content_bias`` the
        position scheme's bias from these queries and keys (DeBERTa), added to ``bias``.
        """
        if self.cross:
            q = self._heads(self.q(x), self.n_heads)
            k, v = memory
        else:
            q_dim, kv_dim = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = self.qkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)  # [B, S, N*D] each
            if self.q_norm is not None and not self.qk_norm_per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = self._heads(q, self.n_heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
            if self.q_norm is not None and self.qk_norm_per_head:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.qkv_clip is not None:
                q, k, v = (t.clamp(-self.qkv_clip, self.qkv_clip) for t in (q, k, v))
            if rope is not None:
                q = self.rotary_q(apply_rope(q, *rope, self.interleaved))
                k = self.rotary_k(apply_rope(k, *rope, self.interleaved))
            k, v = self.cached_k(k), self.cached_v(v)
            if past is not None:
                k = torch.cat([past[0], k], dim=2)  # [B, Hkv, P+S, D]
                v = torch.cat([past[1], v], dim=2)
        if content_bias is not None:
            bias = bias + self.content_term(content_bias.bias(self, q, k))  # [B, H, S, T]
        dropout = self.dropout if self.training else 0.0
        out = self.context(grouped_attention(q, k, v, bias, self.scale, self.softcap, dropout, self.probs))
        return self.out(out), (k, v)
