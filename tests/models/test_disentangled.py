"""DeBERTa's disentangled attention (``tfport.models.disentangled``) against independent references:
the row table against transformers' own bucket function far past its end, the two terms against
an einsum over a one-hot row selection written from the paper's formulas, and the config's
refusals. Shape legend: B batch, S queries, T keys, H heads, D head dim, R rows / 2."""

from __future__ import annotations

import pytest
import torch

from tfport.config.positions import DisentangledConfig
from tfport.models.attention import Attention
from tfport.models.disentangled import DisentangledBias, index_table, relative_index

from .torch_reference import assert_close, tiny

deberta = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2",
                              reason="the bucket reference is transformers' (the 'dev' extra)")


def disentangled(**changes):
    return tiny("tiny-encoder", position="disentangled", type_vocab_size=0, **changes)


@pytest.mark.parametrize("buckets, distance", [(256, 512), (8, 16), (6, 5), (None, 6), (None, 1)])
def test_row_table_matches_transformers(buckets, distance):
    """Row of relative position r, for |r| up to 5 M: transformers buckets r (when it has buckets)
    and clips r + R to [0, 2R - 1] at each use; tfport tables [-M, M] and clips r to it."""
    table = index_table(disentangled(disentangled=DisentangledConfig(buckets=buckets, max_distance=distance)))
    span = buckets or distance
    relative = torch.arange(-5 * distance, 5 * distance + 1)
    expected = relative
    if buckets is not None:
        expected = deberta.make_log_bucket_position(relative, buckets, distance).long()
    expected = (expected + span).clamp(0, 2 * span - 1)
    got = table[relative.clamp(-distance, distance) + distance]
    assert torch.equal(got, expected)


def test_relative_index_uses_slots():
    """Queries are the last S of T slots: entry (s, t) is the row of (T - S + s) - t."""
    table = index_table(disentangled(disentangled=DisentangledConfig(buckets=None, max_distance=3)))  # rows 0..5
    index = relative_index(table, 2, 5)
    # i - t for i = 3, 4 and t = 0..4, clipped to [-3, 2] after the shift by R = 3
    assert index.tolist() == [[5, 5, 4, 3, 2], [5, 5, 5, 4, 3]]


def einsum_terms(q, k, pos_query, pos_key, index, terms):
    """(c2p + p2c) with a one-hot row selection [S, T, 2R], in float64."""
    onehot = torch.nn.functional.one_hot(index, pos_key.shape[1]).double()  # [S, T, 2R]
    total = 0.0
    if "c2p" in terms:  # q_s . Kr[index[s, t]]
        total = total + torch.einsum("bhsd,hrd,str->bhst", q.double(), pos_key.double(), onehot)
    if "p2c" in terms:  # k_t . Qr[index[s, t]]
        total = total + torch.einsum("bhtd,hrd,str->bhst", k.double(), pos_query.double(), onehot)
    return total


@pytest.mark.parametrize("terms", [("c2p", "p2c"), ("c2p",), ("p2c",)])
def test_terms_match_einsum(terms):
    config = disentangled(disentangled=DisentangledConfig(buckets=8, max_distance=10, terms=terms))
    torch.manual_seed(0)
    attn = Attention(config).eval()
    relative = torch.randn(16, config.d_model)  # [2R, E]
    b, h, s, t, d = 2, config.n_heads, 3, 13, config.dim_per_head
    q, k = torch.randn(b, h, s, d), torch.randn(b, h, t, d)
    index = relative_index(index_table(config), s, t)  # [S, T]
    with torch.no_grad():
        got = DisentangledBias(index, relative, terms).bias(attn, q, k)
        projected = relative @ attn.qkv.weight.T + attn.qkv.bias  # [2R, 3 H D]
    pos_query = projected[:, : h * d].reshape(16, h, d).transpose(0, 1)  # [H, 2R, D]
    pos_key = projected[:, h * d: 2 * h * d].reshape(16, h, d).transpose(0, 1)
    expected = einsum_terms(q, k, pos_query, pos_key, index, terms) * (d * (1 + len(terms))) ** -0.5
    assert got.dtype == torch.float32 and got.shape == (b, h, s, t)
    assert_close(got, expected, f"terms {terms}")


@pytest.mark.parametrize("changes, field", [
    ({"disentangled.buckets": 7}, "disentangled.buckets"),
    ({"disentangled.buckets": 2}, "disentangled.buckets"),
    ({"disentangled.buckets": 8, "disentangled.max_distance": 5}, "disentangled.max_distance"),
    ({"disentangled.buckets": None, "disentangled.max_distance": 0}, "disentangled.max_distance"),
    ({"disentangled.terms": ("c2p", "c2p")}, "disentangled.terms"),
    ({"disentangled.terms": ("p2p",)}, "disentangled.terms"),
    ({"disentangled.terms": ()}, "disentangled.terms"),
    (dict(n_kv_heads=2), "n_kv_heads"),
])
def test_config_refusals(changes, field):
    with pytest.raises(ValueError, match=rf"config\.{field}="):
        disentangled(**changes)


def test_config_refuses_other_families_and_stray_fields():
    with pytest.raises(ValueError, match=r"config\.position='disentangled'.*family 'encoder'"):
        tiny("tiny-decoder", position="disentangled")
    with pytest.raises(ValueError, match=r"config\.disentangled\.buckets=8: expected the default unless "
                                         r"position='disentangled'"):
        tiny("tiny-encoder", disentangled=DisentangledConfig(buckets=8))
    config = disentangled(disentangled=DisentangledConfig(terms=("p2c",), buckets=None))
    assert config.softmax_scale == pytest.approx((config.dim_per_head * 2) ** -0.5)
    assert type(config).from_json(config.to_json()) == config
