"""Reference generation in PyTorch with the KV cache (greedy or seeded sampling).

The runtime's generation is checked against these loops. Prompts are left-padded: row b's real
tokens are where ``attention_mask[b] == 1``.
"""

from __future__ import annotations

import torch

from .decoder import DecoderLM
from .encoder_decoder import EncoderDecoderLM


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row from ``logits`` [B, V]: argmax when temperature is 0."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the first token always
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: DecoderLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             max_new_tokens: int = 16, eos_token_id: int | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> torch.Tensor:
    """Greedy or sampled continuation [B, max_new_tokens] of left-padded prompts [B, S].

    Rows that produced ``eos_token_id`` continue with ``config.fill_token_id`` (pad, or eos where
    pad is null). The last token is not fed
    back, so prompt + max_new_tokens - 1 positions are used.
    """
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    pad = model.config.fill_token_id
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    logits, cache = model(input_ids, attention_mask)
    tokens = []
    for _ in range(max_new_tokens):
        token = next_token(logits[:, -1], temperature, top_k, top_p, generator)
        token = torch.where(done, torch.full_like(token, pad), token)
        tokens.append(token)
        if eos_token_id is not None:
            done |= token == eos_token_id
            if bool(done.all()):
                break
        if len(tokens) == max_new_tokens:  # the last token's logits would be unused
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        logits, cache = model(token[:, None], attention_mask, past_key_values=cache)
    return torch.stack(tokens, dim=1)


@torch.no_grad()
def generate_seq2seq(model: EncoderDecoderLM, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, max_new_tokens: int = 16,
                     eos_token_id: int | None = None, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, seed: int | None = None) -> torch.Tensor:
    """Encode once, then decode from ``decoder_start_token_id`` -> tokens [B, max_new_tokens]."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    memory = model.cross_kv(model.encode(input_ids, attention_mask))
    batch = input_ids.shape[0]
    token = torch.full((batch,), model.config.decoder_start_token_id, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    cache, tokens = None, []
    for step in range(max_new_tokens):
        decoder_mask = torch.ones(batch, step + 1, dtype=torch.long)
        logits, cache = model.decode(token[:, None], memory, attention_mask, decoder_mask,
                                     past_key_values=cache)
        token = next_token(logits[:, -1], temperature, top_k, top_p, generator)
        token = torch.where(done, torch.full_like(token, model.config.fill_token_id), token)
        tokens.append(token)
        if eos_token_id is not None:
            done |= token == eos_token_id
            if bool(done.all()):
                break
    return torch.stack(tokens, dim=1)
