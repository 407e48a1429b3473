"""KV cache consistency: prefill + decode steps (or a chunk) equal one full forward.

Logits are compared at real query positions and present keys/values at real key positions
(padded slots hold whatever a fully masked query produced, by design).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tfport.config import ENCODER_ONLY_POSITIONS, POSITIONS

from .torch_reference import assert_close, model_for, random_ids, tiny

KV_HEADS = {"mha": None, "gqa": 2, "mqa": 1}


@dataclass(frozen=True)
class CacheCase:
    position: str
    attention: str  # key of KV_HEADS
    prefill: int  # tokens in the first call
    chunk: int  # tokens per later call (1 = decode steps)

    @property
    def name(self) -> str:
        return f"{self.position}-{self.attention}-prefill{self.prefill}-chunk{self.chunk}"


DECODER_POSITIONS = [p for p in POSITIONS if p not in ENCODER_ONLY_POSITIONS]
DECODER_CASES = [CacheCase(p, a, 3, 1) for p in DECODER_POSITIONS for a in KV_HEADS] + [
    CacheCase(p, "gqa", 3, 4) for p in DECODER_POSITIONS
] + [CacheCase("rope", "gqa", 1, 2), CacheCase("alibi", "mqa", 5, 2)]

# Row 0 unpadded, row 1 left-padded by 2, row 2 by 3 (its whole 3-token prefill is padding).
PADDING = [0, 2, 3]
TOTAL = 7


def padded_mask(total: int) -> torch.Tensor:
    return torch.tensor([[0] * p + [1] * (total - p) for p in PADDING])  # [B, T]


def incremental(call, ids: torch.Tensor, mask: torch.Tensor, prefill: int, chunk: int):
    """Run ``call(ids, mask, past)`` over [0, prefill) then chunks -> (logits [B, T, V], cache)."""
    logits, cache = call(ids[:, :prefill], mask[:, :prefill], None)
    pieces = [logits]
    for start in range(prefill, ids.shape[1], chunk):
        stop = min(start + chunk, ids.shape[1])
        logits, cache = call(ids[:, start:stop], mask[:, :stop], cache)
        pieces.append(logits)
    return torch.cat(pieces, dim=1), cache


def check_cache(name, full_logits, full_cache, step_logits, step_cache, mask):
    real = mask.bool()  # [B, T]
    assert step_logits.shape == full_logits.shape
    assert_close(step_logits[real], full_logits[real], f"{name} logits")
    assert len(step_cache.layers) == len(full_cache.layers)
    for i, ((k, v), (fk, fv)) in enumerate(zip(step_cache.layers, full_cache.layers)):
        assert k.shape == fk.shape and v.shape == fv.shape
        keys = real[:, None, :, None].expand_as(k)  # [B, Hkv, T, D]
        assert_close(k[keys], fk[keys], f"{name} layer {i} present key")
        assert_close(v[keys], fv[keys], f"{name} layer {i} present value")


@pytest.mark.parametrize("case", DECODER_CASES, ids=lambda c: c.name)
def test_decoder_incremental_equals_full_forward(case: CacheCase):
    config = tiny("tiny-decoder", position=case.position, n_kv_heads=KV_HEADS[case.attention])
    model = model_for(config)
    ids, mask = random_ids((len(PADDING), TOTAL), config.vocab_size), padded_mask(TOTAL)
    full_logits, full_cache = model(ids, mask)
    step_logits, step_cache = incremental(
        lambda i, m, past: model(i, m, past_key_values=past), ids, mask, case.prefill, case.chunk)
    assert step_cache.length == TOTAL
    check_cache(case.name, full_logits, full_cache, step_logits, step_cache, mask)


SEQ2SEQ_CASES = [
    ("tiny-encoder-decoder", {}, 1),  # sinusoidal, MHA
    ("tiny-encoder-decoder-gqa", {}, 1),  # rope, GQA
    ("tiny-encoder-decoder", {"position": "learned", "n_kv_heads": 1}, 1),
    ("tiny-encoder-decoder", {"position": "alibi"}, 1),
    ("tiny-encoder-decoder-t5", {}, 1),  # T5 relative bias, lm_head_scale
    ("tiny-encoder-decoder-gqa", {}, 3),  # a chunk of 3 on top of the prefill
]


@pytest.mark.parametrize("preset, changes, chunk", SEQ2SEQ_CASES, ids=[
    "sinusoidal-mha", "rope-gqa", "learned-mqa", "alibi-mha", "relative-mha", "rope-gqa-chunk3"])
def test_encoder_decoder_incremental_equals_full_decode(preset, changes, chunk):
    config = tiny(preset, **changes)
    model = model_for(config)
    enc_ids = random_ids((2, 6), config.vocab_size, seed=1)
    enc_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])  # row 1 right-padded
    dec_ids = random_ids((2, 5), config.vocab_size, seed=2)
    dec_mask = torch.ones_like(dec_ids)
    cross_kv = model.cross_kv(model.encode(enc_ids, enc_mask))
    frozen = [(k.clone(), v.clone()) for k, v in cross_kv]

    full_logits, full_cache = model.decode(dec_ids, cross_kv, enc_mask, dec_mask)
    step_logits, step_cache = incremental(
        lambda i, m, past: model.decode(i, cross_kv, enc_mask, m, past_key_values=past),
        dec_ids, dec_mask, 2, chunk)
    check_cache(preset, full_logits, full_cache, step_logits, step_cache, dec_mask)
    # Cross-attention K/V are computed once and reused untouched.
    for (k, v), (k0, v0) in zip(cross_kv, frozen):
        assert torch.equal(k, k0) and torch.equal(v, v0)
        assert k.shape == (2, config.kv_heads, 6, config.dim_per_head)
