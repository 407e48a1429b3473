"""Independent references for the deployed-decoder options: the sliding-window mask as a literal
0/1 matrix, MPT's ALiBi slopes written out, and interleaved RoPE against complex rotation."""

from __future__ import annotations

import torch

from tfport.models.masks import allowed
from tfport.models.positions import alibi_slopes, apply_rope, rope_cos_sin


def test_sliding_window_mask_literal():
    """Window 2 over a left-padded row: each query sees itself and the real token before it."""
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 0, 0],
                             [0, 1, 0, 0, 0],
                             [0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed(mask, 5, causal=True, window=2)[0, 0], expected)


def test_mpt_slopes_for_six_heads():
    """MPT: the 8 slopes 2^-1 .. 2^-8, odd-indexed first (2^-2, 2^-4, 2^-6, 2^-8), then 2^-1, 2^-3."""
    expected = torch.tensor([2.0 ** -e for e in (2, 4, 6, 8, 1, 3)])
    assert torch.allclose(alibi_slopes(6, "mpt"), expected)
    assert torch.allclose(alibi_slopes(8, "mpt"), alibi_slopes(8))  # powers of two agree


def test_interleaved_rope_is_complex_rotation_of_adjacent_pairs():
    x = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))  # [B, N, S, D]
    positions = torch.tensor([[0, 4, 9]])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4)  # rotary_dim 4
    cos, sin = rope_cos_sin(positions, inv_freq)
    out = apply_rope(x, cos, sin, interleaved=True)
    pairs = torch.view_as_complex(x[..., :4].reshape(1, 2, 3, 2, 2).contiguous())
    angle = positions[0, :, None].float() * inv_freq  # [S, R/2]
    rotated = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).reshape(1, 2, 3, 4)
    torch.testing.assert_close(out[..., :4], rotated)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])  # partial: the rest passes
