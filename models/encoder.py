"""Encoder-only family (BERT-like): per-token states, pooled output, masked-LM head, sequence
classification head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tfport.config import ModelConfig

from .layers import ACTIVATIONS, make_norm
from .stack import Stack


@dataclass
class EncoderOutput:
    last_hidden_state: torch.Tensor  # [B, S, E]
    pooler_output: torch.Tensor | None = None  # [B, E]
    logits: torch.Tensor | None = None  # [B, S, V]
    class_logits: torch.Tensor | None = None  # [B, n_labels]


class MLMHead(nn.Module):
    """dense -> activation -> norm -> vocabulary projection (optionally tied) + bias."""

    def __init__(self, config: ModelConfig, tokens: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.act = ACTIVATIONS[config.activation]
        self.norm = make_norm(config)
        self.decoder = nn.Linear(config.d_model, config.vocab_size)
        if config.tie_embeddings:
            self.decoder.weight = tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(x))))


CLASSIFIER_ACTIVATIONS = {"tanh": torch.tanh, **ACTIVATIONS}


def pool_states(x: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """[B, S, E] -> [B, E]: the first token's state (``cls``; rows are right-padded) or the mean
    over real tokens (``mean``). (``last_eos`` pools from the token ids:
    ``EncoderDecoderLM.classify``.)"""
    if pooling == "cls":
        return x[:, 0]
    if pooling != "mean":
        raise ValueError(f"pooling={pooling!r}: expected 'cls' or 'mean' over encoder states")
    weights = attention_mask.to(x.dtype)[:, :, None]  # [B, S, 1]
    return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class ClassifierHead(nn.Module):
    """pool -> dense -> activation -> (LayerNorm) -> out [n_labels] (see ModelConfig's
    ``classifier``); dropout before ``out`` in train mode, as the Hugging Face heads have."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.pooling = config.classifier.pooling
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.act = CLASSIFIER_ACTIVATIONS[config.classifier.activation]
        self.norm = make_norm(config) if config.classifier.norm else None
        self.dropout = nn.Dropout(config.dropout.residual)
        self.out = nn.Linear(config.d_model, config.classifier.n_labels)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """States [B, S, E], attention_mask [B, S] -> logits [B, n_labels]."""
        return self.classify(pool_states(x, attention_mask, self.pooling))

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled states [B, E] -> logits [B, n_labels]."""
        h = self.act(self.dense(pooled))
        if self.norm is not None:
            h = self.norm(h)
        return self.out(self.dropout(h))


class EncoderModel(nn.Module):
    """Bidirectional encoder. ``forward`` returns states, pooled [CLS] output and MLM logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Stack(config, config.n_encoder_layers, causal=False, tokens=tokens,
                             token_types=config.type_vocab_size > 0)
        self.pooler = nn.Linear(config.d_model, config.d_model) if config.pooler else None
        self.mlm = MLMHead(config, tokens) if config.mlm_head else None
        self.classifier = ClassifierHead(config) if config.classifier.n_labels else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> EncoderOutput:
        """input_ids, attention_mask, token_type_ids [B, S] -> EncoderOutput (float32)."""
        x, _ = self.encoder(input_ids, attention_mask, token_type_ids=token_type_ids)
        pooled = torch.tanh(self.pooler(x[:, 0])).float() if self.pooler is not None else None
        logits = self.mlm(x).float() if self.mlm is not None else None
        class_logits = None
        if self.classifier is not None:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            class_logits = self.classifier(x, mask).float()
        return EncoderOutput(x.float(), pooled, logits, class_logits)
