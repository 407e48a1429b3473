"""Decoder-only family (GPT/LLaMA-like): a causal stack and a language-model head."""

from __future__ import annotations

import torch
from torch import nn

from tfport.config import ModelConfig

from .cache import KVCache
from .stack import Stack


class DecoderLM(nn.Module):
    """Causal language model with a KV cache; the head is tied to the embedding or not."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.decoder = Stack(config, config.n_decoder_layers, causal=True, tokens=tokens)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                past_key_values: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """input_ids [B, S], attention_mask [B, P+S] -> (logits float32 [B, S, V], present cache)."""
        x, present = self.decoder(input_ids, attention_mask, position_ids, past=past_key_values)
        logits = self.lm_head(x * self.config.lm_head_scale).float()
        cap = self.config.final_logit_softcap
        if cap is not None:  # Gemma 2: c * tanh(logits / c)
            logits = torch.tanh(logits / cap) * cap
        return logits, present
