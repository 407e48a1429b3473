"""Encoder-decoder family (T5-like): encoder, decoder with cross-attention, LM head.

Cross-attention keys and values are projected from the encoder output once per request
(``cross_kv``) and reused at every decoding step.
"""

from __future__ import annotations

import torch
from torch import nn

from tfport.config import ModelConfig

from .cache import KVCache
from .stack import Stack


class EncoderDecoderLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        tokens = nn.Embedding(config.vocab_size, config.d_model)  # shared by both stacks
        self.encoder = Stack(config, config.n_encoder_layers, causal=False, tokens=tokens)
        self.decoder = Stack(config, config.n_decoder_layers, causal=True, tokens=tokens, cross=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        if config.tie_embeddings:
            self.lm_head.weight = tokens.weight

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, attention_mask [B, Senc] -> encoder states [B, Senc, E]."""
        return self.encoder(input_ids, attention_mask)[0]

    def cross_kv(self, states: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per decoder layer, cross-attention (k, v) [B, Hkv, Senc, D] from encoder states."""
        return [layer.cross_attn.project_memory(states) for layer in self.decoder.layers]

    def decode(self, input_ids: torch.Tensor, cross_kv: list[tuple[torch.Tensor, torch.Tensor]],
               encoder_attention_mask: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               past_key_values: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Decoder input_ids [B, S] -> (logits float32 [B, S, V], self-attention cache)."""
        x, present = self.decoder(input_ids, attention_mask, position_ids, past=past_key_values,
                                  memory=cross_kv, memory_mask=encoder_attention_mask)
        return self.lm_head(x * self.config.lm_head_scale).float(), present

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full teacher-forced pass -> logits float32 [B, Sdec, V]."""
        memory = self.cross_kv(self.encode(input_ids, attention_mask))
        return self.decode(decoder_input_ids, memory, attention_mask, decoder_attention_mask)[0]
