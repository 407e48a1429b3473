"""Embeddings and a stack of blocks: the body shared by every family."""

from __future__ import annotations

import torch
from torch import nn

from tfport.config import ModelConfig

from .cache import KVCache
from .attention import Tap
from .layers import Block, make_norm
from .masks import attention_bias
from .moe import MixtureOfExperts
from .positions import POSITION_SCHEMES, positions_from_mask


class Embeddings(nn.Module):
    """Token embedding plus, as configured, a position table and token types; optional norm."""

    def __init__(self, config: ModelConfig, tokens: nn.Embedding, token_types: bool = False):
        super().__init__()
        self.tokens = tokens
        self.scheme = POSITION_SCHEMES[config.position]
        self.scheme.init_embeddings(self, config)
        self.token_types = nn.Embedding(config.type_vocab_size, config.d_model) if token_types else None
        self.norm = make_norm(config) if config.embedding_norm else None
        self.dropout = nn.Dropout(config.dropout.embedding)  # train() only
        self.scale = config.embedding_scale  # Gemma: sqrt(E), rounded to the model dtype

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids, token_type_ids [B, S] -> [B, S, E]."""
        x = self.tokens(input_ids)
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        positions = self.scheme.embed(self, position_ids)
        if positions is not None:
            x = x + positions.to(x.dtype)
        if self.token_types is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            x = x + self.token_types(types)
        x = self.norm(x) if self.norm is not None else x
        return self.dropout(x)


class Stack(nn.Module):
    """Embeddings, ``n_layers`` blocks and the final norm (pre-norm models)."""

    def __init__(self, config: ModelConfig, n_layers: int, causal: bool, tokens: nn.Embedding,
                 cross: bool = False, token_types: bool = False):
        super().__init__()
        self.config, self.causal = config, causal
        self.scheme = POSITION_SCHEMES[config.position]
        self.embed = Embeddings(config, tokens, token_types)
        self.layers = nn.ModuleList(
            Block(config, cross=cross, first=i == 0, ffn=MixtureOfExperts(config) if config.moe.covers(i) else None)
            for i in range(n_layers))
        self.norm = make_norm(config) if config.final_norm else None
        self.scheme.init_stack(self, config)
        self.bias = Tap()  # the attention bias every layer adds (masks, ALiBi, relative)
        self.local_bias = Tap()  # the sliding-window layers' bias, if any

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
        config = self.config
        position_bias = self.scheme.bias(self, attention_mask, length)  # [B, H, S, T] or None
        content_bias = self.scheme.content_bias(self, attention_mask, length)  # DeBERTa's, or None

        def layer_bias(window: int | None) -> torch.Tensor:
            bias = attention_bias(attention_mask, length, self.causal, window)  # [B, 1, S, T]
            return bias if position_bias is None else bias + position_bias

        bias = self.bias(layer_bias(None))
        local_bias = self.local_bias(layer_bias(config.window.size)) if config.window.size else None
        rope = self.scheme.rotary(self, position_ids)
        local_rope = self.scheme.rotary(self, position_ids, local=True) if config.rope.local_theta else rope
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
            local = config.is_local(i)
            x, present = layer(x, local_bias if local else bias, local_rope if local else rope,
                               layer_past, layer_memory, memory_bias, content_bias)
            presents.append(present)
        if self.norm is not None:
            x = self.norm(x)
        return x, KVCache(presents)
