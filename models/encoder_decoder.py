"""Encoder-decoder family (T5-like): encoder, decoder with cross-attention, LM head, and an
optional sequence classification head read at the decoder's last eos (BART).

Cross-attention keys and values are projected from the encoder output once per request
(``cross_kv``) and reused at every decoding step.
"""

from __future__ import annotations

import torch
from torch import nn

from tfport.config import ModelConfig

from .cache import KVCache
from .encoder import ClassifierHead
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
        self.classifier = ClassifierHead(config) if config.classifier.n_labels else None  # read by ``classify``

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

    def classify(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Sequence classification as BART's ``ForSequenceClassification``: input_ids,
        attention_mask [B, S] (right-padded; each row holds ``eos_token_id``) -> logits float32
        [B, n_labels].

        The decoder reads ``input_ids`` shifted right (the last slot dropped) after a start token
        (``config.classifier.decoder_start``: ``decoder_start_token_id``, or each row's last real
        token as mBART's) at slot positions 0..S-1 over the encoder's states; the head reads its
        state at each row's last real eos. Transformers reads the last eos too, and refuses a
        batch whose rows hold different numbers of eos tokens.
        """
        if self.classifier is None:
            raise ValueError("classify: this model has no sequence classification head (config.classifier.n_labels=0)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        eos = (input_ids == self.config.eos_token_id) & attention_mask.bool()  # [B, S]
        missing = (~eos.any(dim=1)).nonzero().flatten().tolist()
        if missing:
            raise ValueError(f"input_ids: rows {missing} hold no eos_token_id={self.config.eos_token_id}; the "
                             "classification head reads the decoder at each row's last one")
        memory = self.cross_kv(self.encode(input_ids, attention_mask))
        slots = torch.arange(input_ids.shape[1], device=input_ids.device)
        if self.config.classifier.decoder_start == "last_token":
            last_real = torch.where(attention_mask.bool(), slots, -1).amax(dim=1)  # [B]
            start = input_ids.gather(1, last_real[:, None])  # [B, 1]
        else:
            start = torch.full_like(input_ids[:, :1], self.config.decoder_start_token_id)
        shifted = torch.cat([start, input_ids[:, :-1]], dim=1)  # [B, S]
        # No decoder mask, as transformers: causal attention keeps each eos from later slots.
        states, _ = self.decoder(shifted, memory=memory, memory_mask=attention_mask)  # [B, S, E]
        last = torch.where(eos, slots, -1).amax(dim=1)  # [B]
        pooled = states[torch.arange(states.shape[0], device=states.device), last]  # [B, E]
        return self.classifier.classify(pooled).float()
