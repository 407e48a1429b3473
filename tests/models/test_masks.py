"""models/masks.py against literal 0/1 matrices (rows = queries, columns = keys)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tfport.models.masks import MASK_VALUE, allowed, attention_bias


@dataclass(frozen=True)
class MaskCase:
    name: str
    attention_mask: list[list[int]]  # [B, T]
    query_length: int  # S; queries are the last S of the T positions
    causal: bool
    expected: list[list[list[int]]]  # [B, S, T]


CASES = [
    MaskCase("causal", [[1, 1, 1, 1]], 4, True, [[
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]]),
    MaskCase("left-padding", [[0, 0, 1, 1], [1, 1, 1, 1]], 4, False, [
        [[0, 0, 1, 1],
         [0, 0, 1, 1],
         [0, 0, 1, 1],
         [0, 0, 1, 1]],
        [[1, 1, 1, 1],
         [1, 1, 1, 1],
         [1, 1, 1, 1],
         [1, 1, 1, 1]],
    ]),
    MaskCase("right-padding", [[1, 1, 1, 0]], 4, False, [[
        [1, 1, 1, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 0],
    ]]),
    MaskCase("causal-left-padding", [[0, 0, 1, 1], [0, 1, 1, 1]], 4, True, [
        [[0, 0, 0, 0],  # padded queries see nothing (fully masked rows)
         [0, 0, 0, 0],
         [0, 0, 1, 0],
         [0, 0, 1, 1]],
        [[0, 0, 0, 0],
         [0, 1, 0, 0],
         [0, 1, 1, 0],
         [0, 1, 1, 1]],
    ]),
    MaskCase("causal-right-padding", [[1, 1, 0, 0]], 4, True, [[
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 0, 0],
    ]]),
    MaskCase("causal-past", [[1, 1, 1, 1, 1]], 2, True, [[
        [1, 1, 1, 1, 0],  # query at absolute index 3
        [1, 1, 1, 1, 1],  # query at absolute index 4
    ]]),
    MaskCase("causal-past-left-padding", [[0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], 2, True, [
        [[0, 1, 1, 1, 0],
         [0, 1, 1, 1, 1]],
        [[0, 0, 0, 1, 0],
         [0, 0, 0, 1, 1]],
    ]),
    MaskCase("decode-step", [[0, 1, 1, 1]], 1, True, [[
        [0, 1, 1, 1],
    ]]),
    # Cross-attention: decoder queries (S=3) over a padded encoder memory (T=Senc=4).
    MaskCase("cross-attention-padding", [[1, 1, 1, 0], [1, 1, 0, 0]], 3, False, [
        [[1, 1, 1, 0],
         [1, 1, 1, 0],
         [1, 1, 1, 0]],
        [[1, 1, 0, 0],
         [1, 1, 0, 0],
         [1, 1, 0, 0]],
    ]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_allowed_matches_literal(case: MaskCase):
    mask = torch.tensor(case.attention_mask)
    got = allowed(mask, case.query_length, case.causal)
    expected = torch.tensor(case.expected, dtype=torch.bool)[:, None]  # [B, 1, S, T]
    assert got.shape == expected.shape
    assert torch.equal(got, expected), f"{case.name}:\n{got.int()[:, 0]}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_attention_bias_matches_literal(case: MaskCase):
    mask = torch.tensor(case.attention_mask)
    bias = attention_bias(mask, case.query_length, case.causal)
    expected_keep = torch.tensor(case.expected, dtype=torch.bool)[:, None]
    assert bias.dtype == torch.float32
    assert torch.isfinite(bias).all(), "the mask value must be finite (float32 minimum, not -inf)"
    assert torch.equal(bias == 0, expected_keep)
    assert torch.equal(bias == MASK_VALUE, ~expected_keep)


def test_mask_value_is_finite_float32_minimum():
    assert MASK_VALUE == torch.finfo(torch.float32).min


def test_fully_masked_row_softmaxes_uniform_not_nan():
    # Query 0 of a left-padded causal row sees no key; the finite mask value keeps it a number.
    bias = attention_bias(torch.tensor([[0, 0, 1]]), 3, causal=True)  # [1, 1, 3, 3]
    scores = torch.tensor([[[[0.3, -1.2, 2.0]] * 3]]) + bias
    probs = scores.softmax(-1)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs[0, 0, 0], torch.full((3,), 1 / 3))
    torch.testing.assert_close(probs[0, 0, 2], torch.tensor([0.0, 0.0, 1.0]))


def test_mask_dtype_does_not_matter():
    # int64, int32 and bool attention masks all give the same boolean mask.
    ref = allowed(torch.tensor([[0, 1, 1]]), 3, True)
    for dtype in (torch.int32, torch.bool, torch.float32):
        assert torch.equal(allowed(torch.tensor([[0, 1, 1]], dtype=dtype), 3, True), ref)


def test_two_sided_window_literal():
    """An encoder's window W = 4 (and 5: W // 2 either way) over a right-padded row: each query
    sees the real tokens at most 2 positions away on either side (ModernBERT's local layers)."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 1, 0, 0],
                             [0, 1, 1, 1, 1, 1, 0],
                             [0, 0, 1, 1, 1, 1, 0],
                             [0, 0, 0, 1, 1, 1, 0],
                             [0, 0, 0, 1, 1, 1, 0]], dtype=torch.bool)  # the padded query: position 5
    for window in (4, 5):
        assert torch.equal(allowed(mask, 7, causal=False, window=window)[0, 0], expected)
