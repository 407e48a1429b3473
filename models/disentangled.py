"""DeBERTa's disentangled attention (He et al., 2021): relative-position terms that depend on
each layer's queries and keys, so they cannot be a table added once per stack.

A stack holds 2R relative embeddings [2R, E], normalised once per call. Each layer projects them
with its own query and key projections into Qr and Kr [H, 2R, D], and adds to the scores of query
i and key j

    c2p = q_i . Kr[r(i, j)]        (content to position)
    p2c = k_j . Qr[r(i, j)]        (position to content)

scaled like q_i . k_j. ``r(i, j)`` is the row of relative position i - j (``index_table``), with
i and j slot indices as transformers numbers them; for real tokens that is the difference of
tfport's mask-counted positions whenever a row's padding is on one side (left or right).
The exporter's counterpart is ``ai.tfport.DisentangledBias`` (``tfport.export.functions``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tfport.config import ModelConfig


def relative_rows(config: ModelConfig) -> int:
    """Rows of the relative embedding table: 2R, R the buckets (or the max distance unbucketed)."""
    return 2 * (config.disentangled.buckets or config.disentangled.max_distance)


def log_bucket(relative: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """DeBERTa's bucketed relative positions, int64 like ``relative``.

    With m = buckets // 2, distances |r| <= m keep r; larger ones become
    sign(r) (m + ceil(log(|r| / m) / log((max_distance - 1) / m) (m - 1))), computed in float32
    as transformers computes them (so every bucket boundary falls where its does).
    """
    half = buckets // 2
    distance = relative.abs()
    safe = distance.clamp(min=half)  # no log(0); those distances keep their own value anyway
    ratio = torch.log(safe / half) / torch.log(torch.tensor((max_distance - 1) / half))  # float32
    logarithmic = (torch.ceil(ratio * (half - 1)) + half).long() * relative.sign()
    return torch.where(distance <= half, relative, logarithmic)


def index_table(config: ModelConfig) -> torch.Tensor:
    """Row of the relative embeddings for each relative position i - j in [-M, M], M =
    ``disentangled_max_distance`` -> int64 [2M + 1]: the bucket (or i - j itself) shifted by R and
    clipped to [0, 2R - 1]. Positions beyond +-M read the end rows, as they do in transformers
    (its buckets reach the clip by distance M, for even bucket counts)."""
    limit, span = config.disentangled.max_distance, relative_rows(config) // 2
    relative = torch.arange(-limit, limit + 1)
    if config.disentangled.buckets is not None:
        relative = log_bucket(relative, config.disentangled.buckets, limit)
    table = (relative + span).clamp(0, 2 * span - 1)
    assert table[0] == 0 and table[-1] == 2 * span - 1, "the table must reach both end rows"
    return table


def relative_index(table: torch.Tensor, query_length: int, key_length: int) -> torch.Tensor:
    """Rows int64 [S, T] for the last S of T slots attending to all T: table[clip(i - j) + M]
    with i, j slot indices (i = T - S + s)."""
    limit = (table.shape[0] - 1) // 2
    query = torch.arange(key_length - query_length, key_length, device=table.device)
    key = torch.arange(key_length, device=table.device)
    return table[(query[:, None] - key[None, :]).clamp(-limit, limit) + limit]


def relative_projections(relative: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         n_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's query and key projections of the relative embeddings [2R, E] -> (Qr, Kr), each
    [H, 2R, D]. ``weight`` [3 H D, E] and ``bias`` [3 H D] are the layer's fused q/k/v
    projection, whose first 2 H D rows are q and k."""
    width = 2 * n_heads * head_dim
    rows = relative.shape[0]
    projected = F.linear(relative.to(weight.dtype), weight[:width], None if bias is None else bias[:width])
    pos_query, pos_key = projected.view(rows, 2, n_heads, head_dim).permute(1, 2, 0, 3)  # [2, H, 2R, D]
    return pos_query, pos_key


def relative_scores(content: torch.Tensor, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 [B, H, N, M]: entry (n, m) = content_n . positions[index[n, m]].

    content [B, H, N, D]; positions [H, 2R, D]; index int64 [N, M]. c2p is
    ``relative_scores(q, Kr, index)``; p2c is ``relative_scores(k, Qr, index^T)`` transposed.
    """
    scores = torch.matmul(content, positions.transpose(-1, -2)).float()  # [B, H, N, 2R]
    return scores.gather(-1, index.expand(*scores.shape[:2], *index.shape))


@dataclass
class DisentangledBias:
    """The disentangled terms of one call, for every layer of the stack: ``bias(attn, q, k)``.

    ``index`` int64 [S, T] (``relative_index``); ``relative`` the normalised relative embeddings
    [2R, E]; ``terms`` the configured ones (``c2p``, ``p2c``); ``dropout`` the probability of
    dropping relative embeddings in train mode (DeBERTa drops them per layer).
    """

    index: torch.Tensor
    relative: torch.Tensor
    terms: tuple[str, ...]
    dropout: float = 0.0

    def bias(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """float32 [B, H, S, T] added to the scaled scores of ``attn`` (an ``Attention``) for its
        queries q [B, H, S, D] and keys k [B, H, T, D]: the terms times ``attn.scale``."""
        relative = self.relative
        if attn.training and self.dropout:
            relative = F.dropout(relative, self.dropout)
        pos_query, pos_key = relative_projections(relative, attn.qkv.weight, attn.qkv.bias,
                                                 attn.n_heads, attn.head_dim)
        total = 0.0
        if "c2p" in self.terms:
            total = total + relative_scores(q, pos_key, self.index)
        if "p2c" in self.terms:
            total = total + relative_scores(k, pos_query, self.index.T).transpose(-1, -2)
        return total * attn.scale
