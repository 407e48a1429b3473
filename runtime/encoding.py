"""Encoder outputs and sentence embeddings (pooling over real tokens, L2 normalisation)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfport.embedding import POOLINGS  # cls, mean, max, mean_sqrt_len_tokens, lasttoken


@dataclass
class EncoderOutput:
    """Host arrays of one encoder call (rows right-padded).

    ``last_hidden_state`` float32 [B, S, E]; ``attention_mask`` int64 [B, S] (1 = real token);
    ``pooler_output`` float32 [B, E], ``logits`` float32 [B, S, V] and ``class_logits`` float32
    [B, n_labels] when the export has them.
    """

    last_hidden_state: np.ndarray
    attention_mask: np.ndarray
    pooler_output: np.ndarray | None = None
    logits: np.ndarray | None = None
    class_logits: np.ndarray | None = None  # [B, n_labels], with a sequence classification head


def mean_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Mean of states [B, S, E] over the real tokens of attention_mask [B, S] -> [B, E]."""
    weights = attention_mask.astype(np.float32)[:, :, None]  # [B, S, 1]
    count = np.maximum(weights.sum(axis=1), 1.0)  # [B, 1]; an all-padding row pools to 0
    return (states * weights).sum(axis=1) / count


def cls_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """States [B, S, E] of each row's first real token -> [B, E] (index 0 when right-padded)."""
    first = np.argmax(attention_mask != 0, axis=1)  # [B]
    return states[np.arange(states.shape[0]), first]


def max_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Per channel, the largest state over real tokens -> [B, E] (an all-padding row gives 0)."""
    real = attention_mask[:, :, None] != 0  # [B, S, 1]
    pooled = np.where(real, states, -np.inf).max(axis=1)
    return np.where(real.any(axis=1), pooled, 0.0)


def mean_sqrt_len_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Sum of states over real tokens divided by sqrt(their count) -> [B, E]."""
    weights = attention_mask.astype(np.float32)[:, :, None]  # [B, S, 1]
    return (states * weights).sum(axis=1) / np.sqrt(np.maximum(weights.sum(axis=1), 1.0))


def last_token_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """States [B, S, E] of each row's last real token -> [B, E]."""
    last = attention_mask.shape[1] - 1 - np.argmax(attention_mask[:, ::-1] != 0, axis=1)  # [B]
    return states[np.arange(states.shape[0]), last]


POOLERS = {"cls": cls_pool, "mean": mean_pool, "max": max_pool,
           "mean_sqrt_len_tokens": mean_sqrt_len_pool, "lasttoken": last_token_pool}


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows of x [B, E] scaled to unit L2 norm (a zero row stays zero)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, eps)


def pool(states: np.ndarray, attention_mask: np.ndarray, pooling: str = "mean",
         normalize: bool = False) -> np.ndarray:
    """Sentence embeddings [B, E] from states [B, S, E] and attention_mask [B, S]."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r}: expected one of {list(POOLINGS)}")
    pooled = POOLERS[pooling](states, attention_mask)
    pooled = pooled.astype(np.float32)
    return l2_normalize(pooled) if normalize else pooled
