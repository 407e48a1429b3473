"""models/attention.py: MHA, GQA and MQA against an einsum reference that repeats K/V heads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tfport.models import build_model
from tfport.models.attention import Attention, grouped_attention

from .torch_reference import (assert_close, model_for, random_ids, reference_attention,
                             reference_inv_freq, reference_rope, tiny)


def literal_allowed(mask: list[list[int]], query_length: int, causal: bool) -> torch.Tensor:
    """Boolean [B, 1, S, T] written out from the definition (queries are the last S positions)."""
    mask_t = torch.tensor(mask, dtype=torch.bool)
    b, t = mask_t.shape
    keep = torch.zeros(b, 1, query_length, t, dtype=torch.bool)
    for row in range(b):
        for s in range(query_length):
            for key in range(t):
                keep[row, 0, s, key] = mask_t[row, key] and (not causal or key <= t - query_length + s)
    return keep


def as_bias(keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, 0.0, torch.finfo(torch.float32).min).float()


# ------------------------------------------------------------------------------ grouped_attention
@dataclass(frozen=True)
class GroupedCase:
    name: str
    heads: int  # H
    kv_heads: int  # Hkv
    query_length: int  # S
    mask: list[list[int]]  # [B, T]
    causal: bool = True
    per_head_bias: bool = False  # add a [B, H, S, T] bias (as ALiBi does)


GROUPED_CASES = [
    GroupedCase("mha", 4, 4, 5, [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]),
    GroupedCase("gqa", 4, 2, 5, [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]),
    GroupedCase("mqa", 4, 1, 5, [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]),
    GroupedCase("gqa-8-2-per-head-bias", 8, 2, 4, [[1, 1, 1, 1], [0, 1, 1, 1]], per_head_bias=True),
    GroupedCase("gqa-decode-over-past", 4, 2, 1, [[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]),
    GroupedCase("mqa-chunk-over-past", 6, 1, 3, [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]]),
    GroupedCase("gqa-bidirectional-right-padding", 4, 2, 5, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]],
                causal=False),
]


@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: c.name)
def test_grouped_attention_matches_reference(case: GroupedCase):
    gen = torch.Generator().manual_seed(0)
    b, t, d = len(case.mask), len(case.mask[0]), 8
    q = torch.randn(b, case.heads, case.query_length, d, generator=gen)
    k = torch.randn(b, case.kv_heads, t, d, generator=gen)
    v = torch.randn(b, case.kv_heads, t, d, generator=gen)
    keep = literal_allowed(case.mask, case.query_length, case.causal)  # [B, 1, S, T]
    bias = as_bias(keep)
    extra = None
    if case.per_head_bias:
        extra = torch.randn(b, case.heads, case.query_length, t, generator=gen)
        bias = bias + extra
    out = grouped_attention(q, k, v, bias, scale=d**-0.5)
    assert out.shape == (b, case.query_length, case.heads * d)
    assert torch.isfinite(out).all(), "fully masked rows must stay finite"
    expected = reference_attention(q, k, v, keep, d**-0.5, extra)
    rows = keep.any(-1)[:, 0]  # [B, S]: queries with at least one key (others are NaN there)
    assert_close(out[rows], expected[rows], case.name)


# ---------------------------------------------------------------------------- Attention module
@dataclass(frozen=True)
class ModuleCase:
    name: str
    kv_heads: int | None
    rope: bool
    past_length: int  # P
    bias: bool  # attention_bias (projection biases)


MODULE_CASES = [
    ModuleCase("mha-prefill", None, False, 0, True),
    ModuleCase("gqa-rope-prefill", 2, True, 0, False),
    ModuleCase("gqa-rope-over-past", 2, True, 3, True),
    ModuleCase("mqa-rope-over-past", 1, True, 3, False),
    ModuleCase("mqa-no-rope-over-past", 1, False, 2, True),
]


def reference_self_attention(attn: Attention, x, keep, positions, inv_freq, past):
    """The module's computation from its weights, in float64 with einsum: (out [B, S, E], (k, v))."""
    h, hkv, d = attn.n_heads, attn.kv_heads, attn.head_dim
    b, s, _ = x.shape
    w = attn.qkv.weight.double()
    qkv = torch.einsum("bse,fe->bsf", x.double(), w)
    if attn.qkv.bias is not None:
        qkv = qkv + attn.qkv.bias.double()
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q = torch.einsum("bshd->bhsd", q.reshape(b, s, h, d))
    k = torch.einsum("bshd->bhsd", k.reshape(b, s, hkv, d))
    v = torch.einsum("bshd->bhsd", v.reshape(b, s, hkv, d))
    if inv_freq is not None:
        q, k = reference_rope(q, positions, inv_freq), reference_rope(k, positions, inv_freq)
    if past is not None:
        k, v = torch.cat([past[0].double(), k], dim=2), torch.cat([past[1].double(), v], dim=2)
    out = reference_attention(q, k, v, keep, attn.scale)  # [B, S, H*D]
    out = torch.einsum("bsf,ef->bse", out, attn.out.weight.double())
    if attn.out.bias is not None:
        out = out + attn.out.bias.double()
    return out, (k, v)


@pytest.mark.parametrize("case", MODULE_CASES, ids=lambda c: c.name)
def test_self_attention_module_matches_reference(case: ModuleCase):
    from tfport.models.positions import rope_cos_sin

    config = tiny("tiny-decoder", n_kv_heads=case.kv_heads, attention_bias=case.bias)
    torch.manual_seed(0)
    attn = Attention(config).eval()
    gen = torch.Generator().manual_seed(1)
    b, s, p = 2, 4, case.past_length
    hkv, d = config.kv_heads, config.dim_per_head
    x = torch.randn(b, s, config.d_model, generator=gen)
    mask = [[1] * (p + s), [0] * (p + 1) + [1] * (s - 1)]  # row 1 left-padded
    keep = literal_allowed(mask, s, causal=True)
    past = None
    if p:
        past = (torch.randn(b, hkv, p, d, generator=gen), torch.randn(b, hkv, p, d, generator=gen))
    positions = torch.tensor([list(range(p, p + s)), [0] + list(range(s - 1))])  # [B, S]
    inv_freq = reference_inv_freq(d, config.rope.theta) if case.rope else None
    rope = rope_cos_sin(positions, inv_freq.float()) if case.rope else None

    out, (k, v) = attn(x, as_bias(keep), rope=rope, past=past)
    ref_out, (ref_k, ref_v) = reference_self_attention(attn, x, keep, positions, inv_freq, past)
    assert out.shape == (b, s, config.d_model)
    assert k.shape == v.shape == (b, hkv, p + s, d)
    rows = keep.any(-1)[:, 0]
    assert_close(out[rows], ref_out[rows], f"{case.name} output")
    assert_close(k, ref_k, f"{case.name} present key")
    assert_close(v, ref_v, f"{case.name} present value")


@pytest.mark.parametrize("kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_cross_attention_module_matches_reference(kv_heads):
    config = tiny("tiny-encoder-decoder", n_kv_heads=kv_heads, attention_bias=True)
    torch.manual_seed(0)
    attn = Attention(config, cross=True).eval()
    h, hkv, d = config.n_heads, config.kv_heads, config.dim_per_head
    gen = torch.Generator().manual_seed(1)
    b, s, senc = 2, 3, 5
    x = torch.randn(b, s, config.d_model, generator=gen)
    states = torch.randn(b, senc, config.d_model, generator=gen)
    memory_mask = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    keep = literal_allowed(memory_mask, s, causal=False)

    memory = attn.project_memory(states)
    out, _ = attn(x, as_bias(keep), memory=memory)

    kv = torch.einsum("bse,fe->bsf", states.double(), attn.kv.weight.double()) + attn.kv.bias.double()
    k, v = kv.split([hkv * d, hkv * d], dim=-1)
    k = torch.einsum("bthd->bhtd", k.reshape(b, senc, hkv, d))
    v = torch.einsum("bthd->bhtd", v.reshape(b, senc, hkv, d))
    q = torch.einsum("bse,fe->bsf", x.double(), attn.q.weight.double()) + attn.q.bias.double()
    q = torch.einsum("bshd->bhsd", q.reshape(b, s, h, d))
    ref = reference_attention(q, k, v, keep, attn.scale)
    ref = torch.einsum("bsf,ef->bse", ref, attn.out.weight.double()) + attn.out.bias.double()
    assert_close(memory[0], k, "cross key")
    assert_close(memory[1], v, "cross value")
    assert_close(out, ref, "cross-attention output")


# ------------------------------------------------------------------------ whole models: GQA = MHA
def expand_kv_heads(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The GQA state dict rewritten for an MHA model: each K/V head copied to its G query heads."""
    h, hkv, d = config.n_heads, config.kv_heads, config.dim_per_head
    group = h // hkv

    def repeat(t: torch.Tensor) -> torch.Tensor:  # [Hkv*D, ...] -> [H*D, ...]
        return t.reshape(hkv, d, *t.shape[1:]).repeat_interleave(group, dim=0).reshape(h * d, *t.shape[1:])

    out = {}
    for name, t in state.items():
        if name.endswith(("attn.qkv.weight", "attn.qkv.bias")) and "cross" not in name:
            q, k, v = t.split([h * d, hkv * d, hkv * d], dim=0)
            t = torch.cat([q, repeat(k), repeat(v)], dim=0)
        elif name.endswith(("cross_attn.kv.weight", "cross_attn.kv.bias")):
            k, v = t.split([hkv * d, hkv * d], dim=0)
            t = torch.cat([repeat(k), repeat(v)], dim=0)
        out[name] = t
    return out


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-decoder-mqa", "tiny-encoder-decoder-gqa"])
def test_gqa_model_equals_mha_model_with_repeated_kv_heads(preset: str):
    config = tiny(preset, attention_bias=True)  # biases too, so their expansion is covered
    assert config.attention_kind in ("gqa", "mqa")
    gqa = build_model(config, seed=0)
    mha_config = config.replace(n_kv_heads=None)
    mha = build_model(mha_config, seed=1)
    mha.load_state_dict(expand_kv_heads(gqa.state_dict(), config), strict=True)
    ids, mask = random_ids((2, 6), config.vocab_size), torch.tensor([[1] * 6, [0, 0] + [1] * 4])
    group = config.n_heads // config.kv_heads
    if config.family == "decoder":
        logits, cache = gqa(ids, mask)
        ref_logits, ref_cache = mha(ids, mask)
        for (k, v), (rk, rv) in zip(cache.layers, ref_cache.layers):
            assert k.shape[1] == config.kv_heads and rk.shape[1] == config.n_heads
            assert_close(k.repeat_interleave(group, dim=1), rk, "present key")
            assert_close(v.repeat_interleave(group, dim=1), rv, "present value")
    else:
        dec = random_ids((2, 4), config.vocab_size, seed=1)
        logits, ref_logits = gqa(ids, dec, mask), mha(ids, dec, mask)
    assert_close(logits, ref_logits, f"{preset} logits")


def test_explicit_n_kv_heads_equal_to_n_heads_is_mha():
    implicit = tiny("tiny-decoder", n_kv_heads=None)
    explicit = tiny("tiny-decoder", n_kv_heads=implicit.n_heads)
    assert implicit.attention_kind == explicit.attention_kind == "mha"
    a, b = build_model(implicit, seed=0), build_model(explicit, seed=0)
    ids = random_ids((2, 5), implicit.vocab_size)
    assert torch.equal(a(ids)[0], b(ids)[0])


def test_mqa_model_runs_with_one_kv_head():
    config = tiny("tiny-decoder-mqa")
    assert config.attention_kind == "mqa"
    logits, cache = model_for(config)(random_ids((2, 5), config.vocab_size))
    assert logits.shape == (2, 5, config.vocab_size) and torch.isfinite(logits).all()
    for k, v in cache.layers:
        assert k.shape == v.shape == (2, 1, 5, config.dim_per_head)
