"""Attention masks as additive float32 biases.

Masked entries get ``MASK_VALUE`` (the float32 minimum, finite): a fully masked row then softmaxes
to a uniform distribution instead of NaN. Attention adds the bias to float32 scores, so fp16
models never overflow it to -inf.
"""

from __future__ import annotations

import torch

MASK_VALUE = torch.finfo(torch.float32).min


def allowed(attention_mask: torch.Tensor, query_length: int, causal: bool,
            window: int | None = None) -> torch.Tensor:
    """Boolean [B, 1, S, T]: may query s (at absolute index T - S + s) attend to key t.

    ``attention_mask`` is [B, T], 1 for real tokens and 0 for padding. A sliding ``window`` W also
    drops, when ``causal``, keys W or more positions before the query (W keys with itself:
    Mistral, Gemma), otherwise keys more than W // 2 positions away on either side (ModernBERT's
    ``local_attention`` W); positions are counted over real tokens (cumsum(mask) - 1), so padding
    never takes a place in the window.
    """
    keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]
    if causal:
        total = attention_mask.shape[-1]
        query_index = torch.arange(total - query_length, total, device=attention_mask.device)
        key_index = torch.arange(total, device=attention_mask.device)
        keep = keep & (key_index[None, :] <= query_index[:, None])[None, None]  # [B, 1, S, T]
    if window is not None:
        position = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        query_position = position[:, position.shape[-1] - query_length:]  # [B, S]
        distance = query_position[:, :, None] - position[:, None, :]  # [B, S, T]
        near = distance < window if causal else distance.abs() <= window // 2
        keep = keep & near[:, None]
    return keep.expand(attention_mask.shape[0], 1, query_length, attention_mask.shape[-1])


def attention_bias(attention_mask: torch.Tensor, query_length: int, causal: bool,
                   window: int | None = None) -> torch.Tensor:
    """Additive float32 bias [B, 1, S, T]: 0 where attention is allowed, MASK_VALUE elsewhere."""
    keep = allowed(attention_mask, query_length, causal, window)
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    return torch.where(keep, zero, torch.tensor(MASK_VALUE, device=attention_mask.device))
