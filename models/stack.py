"""Embeddings and a stack of blocks: the body shared by every family."""

from __future__ import annotations

import torch
from torch import nn

from tfport.config import ModelConfig

from .cache import KVCache
from .layers import Block, make_norm
from .masks import attention_bias
from .positions import (alibi_bias, alibi_slopes, positions_from_mask, relative_bias,
                        rope_cos_sin, rope_inv_freq, sinusoidal_table)


class Embeddings(nn.Module):
    """Token embedding plus, as configured, a position table and token types; optional norm."""

    def __init__(self, config: ModelConfig, tokens: nn.Embedding, token_types: bool = False):
        super().__init__()
        self.tokens = tokens
        self.positions = None
        if config.position == "learned":
            self.positions = nn.Embedding(config.max_positions, config.d_model)
        elif config.position == "sinusoidal":
            table = sinusoidal_table(config.max_positions, config.d_model)
            self.register_buffer("sinusoidal", table, persistent=False)  # [max_positions, E]
        self.token_types = nn.Embedding(config.type_vocab_size, config.d_model) if token_types else None
        self.norm = make_norm(config) if config.embedding_norm else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids, token_type_ids [B, S] -> [B, S, E]."""
        x = self.tokens(input_ids)
        if self.positions is not None:
            x = x + self.positions(position_ids)
        elif hasattr(self, "sinusoidal"):
            x = x + self.sinusoidal[position_ids].to(x.dtype)
        if self.token_types is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.token_types(types)
        return self.norm(x) if self.norm is not None else x


class Stack(nn.Module):
    """Embeddings, ``n_layers`` blocks and the final norm (pre-norm models)."""

    def __init__(self, config: ModelConfig, n_layers: int, causal: bool, tokens: nn.Embedding,
                 cross: bool = False, token_types: bool = False):
        super().__init__()
        self.config, self.causal = config, causal
        self.record: dict[str, torch.Tensor] | None = None  # set to a dict to capture the bias
        self.embed = Embeddings(config, tokens, token_types)
        self.layers = nn.ModuleList(Block(config, cross=cross) for _ in range(n_layers))
        self.norm = make_norm(config) if config.final_norm else None
        if config.position == "rope":
            self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # [D/2]
        if config.position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(config.n_heads), persistent=False)  # [H]
        if config.position == "relative":  # one bucket table for all layers of the stack
            self.relative_bias = nn.Embedding(config.relative_buckets, config.n_heads)  # [buckets, H]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, past: KVCache | None = None,
                memory: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                memory_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, KVCache]:
        """input_ids [B, S], attention_mask [B, P+S] -> (states [B, S, E], present KVCache).

        Missing ``position_ids`` are counted over real tokens (padding does not shift them); ``memory``
        is the per-layer cross-attention (k, v) and ``memory_mask`` [B, Senc] its padding.
        """
        batch, length = input_ids.shape
        past_length = past.length if past is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(batch, past_length + length, dtype=torch.long,
                                        device=input_ids.device)
        if attention_mask.shape != (batch, past_length + length):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: expected "
                             f"{(batch, past_length + length)} (batch, past + new tokens)")
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, length)
        x = self.embed(input_ids, position_ids, token_type_ids)
        bias = attention_bias(attention_mask, length, self.causal)  # [B, 1, S, T]
        if self.config.position == "alibi":
            bias = bias + alibi_bias(attention_mask, length, self.alibi_slopes)  # [B, H, S, T]
        if self.config.position == "relative":
            bias = bias + relative_bias(attention_mask, length, self.relative_bias.weight,
                                        bidirectional=not self.causal,
                                        max_distance=self.config.relative_max_distance)
        if self.record is not None:
            self.record["bias"] = bias
        rope = rope_cos_sin(position_ids, self.inv_freq) if self.config.position == "rope" else None
        memory_bias = None
        if memory is not None:
            if memory_mask is None:
                memory_mask = torch.ones(batch, memory[0][0].shape[2], dtype=torch.long,
                                         device=input_ids.device)
            memory_bias = attention_bias(memory_mask, length, causal=False)  # [B, 1, S, Senc]
        presents = []
        for i, layer in enumerate(self.layers):
            layer_past = past.layer(i) if past is not None else None
            layer_memory = memory[i] if memory is not None else None
            x, present = layer(x, bias, rope, layer_past, layer_memory, memory_bias)
            presents.append(present)
        if self.norm is not None:
            x = self.norm(x)
        return x, KVCache(presents)
