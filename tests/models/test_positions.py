"""models/positions.py against the papers' formulas, written out here independently."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tfport.config.rope import RopeConfig
from tfport.models.positions import (alibi_bias, alibi_slopes, apply_rope, positions_from_mask,
                                     relative_bias, relative_position_bucket, rope_cos_sin,
                                     rope_inv_freq, sinusoidal_table)

from .torch_reference import assert_close, reference_inv_freq, reference_rope, tiny


# ------------------------------------------------------------------------------------ sinusoidal
@pytest.mark.parametrize("n_positions, dim", [(16, 8), (5, 32), (9, 7)], ids=str)
def test_sinusoidal_matches_vaswani(n_positions: int, dim: int):
    # Vaswani et al. (2017): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).
    expected = torch.zeros(n_positions, dim, dtype=torch.float64)
    for pos in range(n_positions):
        for channel in range(dim):
            i = channel // 2
            angle = pos / 10000 ** (2 * i / dim)
            expected[pos, channel] = math.sin(angle) if channel % 2 == 0 else math.cos(angle)
    table = sinusoidal_table(n_positions, dim)
    assert table.shape == (n_positions, dim) and table.dtype == torch.float32
    assert_close(table, expected, "sinusoidal table")


# ------------------------------------------------------------------------------------------ RoPE
# {dtype: (rtol, atol)} for positions in the thousands: the module forms angles pos * theta_i in
# float32 (real-valued tables, as exported), which carries |pos * theta_i| * 2^-24 absolute error,
# about 5e-4 rad at position 8191; cos/sin pass it on unchanged. Below ~100 TOLERANCES applies.
FAR_POSITION_TOLERANCES = {torch.float32: (0.0, 1e-3)}


@dataclass(frozen=True)
class RopeCase:
    name: str
    dim: int  # D
    theta: float
    heads: int  # N
    positions: list[list[int]]  # [B, S]
    far: bool = False  # positions in the thousands: FAR_POSITION_TOLERANCES


ROPE_CASES = [
    RopeCase("d8-prefill", 8, 10000.0, 2, [[0, 1, 2, 3, 4]]),
    RopeCase("d8-left-padded-batch", 8, 10000.0, 3, [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]),
    RopeCase("d16-llama3-theta-far", 16, 500000.0, 1, [[1000, 4000, 8191]], far=True),
    RopeCase("d4-decode-step", 4, 10000.0, 2, [[37], [5]]),
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.name)
def test_apply_rope_matches_complex_rotation(case: RopeCase):
    positions = torch.tensor(case.positions)
    b, s = positions.shape
    x = torch.randn(b, case.heads, s, case.dim, generator=torch.Generator().manual_seed(0))
    inv_freq = reference_inv_freq(case.dim, case.theta)
    cos, sin = rope_cos_sin(positions, inv_freq.float())
    assert cos.shape == sin.shape == (b, 1, s, case.dim // 2)
    got = apply_rope(x, cos, sin)
    assert got.shape == x.shape and got.dtype == x.dtype
    expected = reference_rope(x, positions, inv_freq)
    if case.far:
        rtol, atol = FAR_POSITION_TOLERANCES[got.dtype]
        torch.testing.assert_close(got, expected.to(got.dtype), rtol=rtol, atol=atol)
    else:
        assert_close(got, expected, case.name)


def test_rope_scores_depend_only_on_relative_position():
    # <R(m) q, R(n) k> = <R(m + c) q, R(n + c) k>: the property RoPE is built for.
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 8, generator=gen), torch.randn(1, 1, 1, 8, generator=gen)
    inv_freq = reference_inv_freq(8, 10000.0).float()

    def score(m: int, n: int) -> torch.Tensor:
        rq = apply_rope(q, *rope_cos_sin(torch.tensor([[m]]), inv_freq))
        rk = apply_rope(k, *rope_cos_sin(torch.tensor([[n]]), inv_freq))
        return torch.einsum("bhsd,bhtd->bhst", rq, rk)

    # Positions stay small: float32 angles lose digits as pos * inv_freq grows.
    assert_close(score(7, 3), score(12, 8), "shifted by 5")
    assert_close(score(2, 0), score(9, 7), "shifted by 7")


@dataclass(frozen=True)
class InvFreqCase:
    name: str
    changes: dict
    expected: "callable"  # (D, theta, factor) -> list of D/2 frequencies, written from the papers


INV_FREQ_CASES = [
    InvFreqCase("plain", {}, lambda d, t, f: [t ** (-2 * i / d) for i in range(d // 2)]),
    InvFreqCase("plain-theta-500k-d16", {"rope.theta": 500000.0, "head_dim": 16},
                lambda d, t, f: [t ** (-2 * i / d) for i in range(d // 2)]),
    # Position interpolation (Chen et al. 2023): positions m -> m / factor.
    InvFreqCase("linear-x4", {"rope.scaling": "linear", "rope.scaling_factor": 4.0},
                lambda d, t, f: [t ** (-2 * i / d) / f for i in range(d // 2)]),
    # NTK-aware scaling (bloc97, 2023): base theta -> theta * factor^(D / (D - 2)).
    InvFreqCase("ntk-x2", {"rope.scaling": "ntk", "rope.scaling_factor": 2.0},
                lambda d, t, f: [(t * f ** (d / (d - 2))) ** (-2 * i / d) for i in range(d // 2)]),
    InvFreqCase("ntk-x8-d16", {"rope.scaling": "ntk", "rope.scaling_factor": 8.0, "head_dim": 16},
                lambda d, t, f: [(t * f ** (d / (d - 2))) ** (-2 * i / d) for i in range(d // 2)]),
]


@pytest.mark.parametrize("case", INV_FREQ_CASES, ids=lambda c: c.name)
def test_rope_inv_freq_matches_formula(case: InvFreqCase):
    config = tiny("tiny-decoder", **case.changes)
    d, theta, factor = config.dim_per_head, config.rope.theta, config.rope.scaling_factor
    expected = torch.tensor(case.expected(d, theta, factor), dtype=torch.float64)
    got = rope_inv_freq(config)
    assert got.shape == (d // 2,) and got.dtype == torch.float32
    assert_close(got, expected, case.name)


def test_linear_scaling_is_position_interpolation():
    # Rotating at position m with factor f equals rotating at position m / f without scaling.
    config = tiny("tiny-decoder", rope=RopeConfig(scaling="linear", scaling_factor=4.0))
    x = torch.randn(1, 2, 3, config.dim_per_head, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[4, 10, 33]])
    got = apply_rope(x, *rope_cos_sin(positions, rope_inv_freq(config)))
    expected = reference_rope(x, positions / 4.0, reference_inv_freq(config.dim_per_head, config.rope.theta))
    assert_close(got, expected, "linear x4")


def test_ntk_scaling_keeps_highest_and_interpolates_lowest_frequency():
    # The defining property of NTK-aware scaling: channel 0 untouched, the last channel pair
    # slowed by exactly the factor (interpolated), the ones between blended.
    config = tiny("tiny-decoder", rope=RopeConfig(scaling="ntk", scaling_factor=8.0), head_dim=16)
    plain = reference_inv_freq(16, config.rope.theta)
    got = rope_inv_freq(config)  # float32
    assert_close(got[0], plain[0], "highest frequency")
    assert_close(got[-1], plain[-1] / 8.0, "lowest frequency")
    ratio = plain / got.double()
    assert torch.all((ratio[1:] > 1) & (ratio[1:] <= 8.0 + 1e-6)), ratio


# ----------------------------------------------------------------------------------------- ALiBi
# Press et al. (2022): for n heads, n a power of two, slopes 2^(-8i/n), i = 1..n; otherwise the
# slopes for the closest smaller power of two followed by every other slope of the next one.
ALIBI_SLOPES = {
    2: [1 / 16, 1 / 256],
    4: [1 / 4, 1 / 16, 1 / 64, 1 / 256],
    8: [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256],
    # 8-head slopes, then 2^(-8i/16) for i = 1, 3, 5, 7 (every other 16-head slope, first 4).
    12: [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256,
         0.7071067811865476, 0.35355339059327373, 0.17677669529663687, 0.08838834764831845],
    # 4-head slopes, then 2^(-8i/8) for i = 1, 3: 1/2 and 1/8.
    6: [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8],
}


@pytest.mark.parametrize("n_heads", sorted(ALIBI_SLOPES))
def test_alibi_slopes_match_paper(n_heads: int):
    got = alibi_slopes(n_heads)
    assert got.shape == (n_heads,) and got.dtype == torch.float32
    assert_close(got, torch.tensor(ALIBI_SLOPES[n_heads], dtype=torch.float64), f"{n_heads} heads")


def test_alibi_bias_matches_literal():
    # -slope_h * |pos(query) - pos(key)| with positions counted over real tokens only.
    slopes = torch.tensor([0.5, 0.25])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    distance = torch.tensor([
        [0, 1, 2, 3],
        [1, 0, 1, 2],
        [2, 1, 0, 1],
        [3, 2, 1, 0],
    ], dtype=torch.float64)
    bias = alibi_bias(mask, 4, slopes)  # [B, H, S, T]
    assert bias.shape == (2, 2, 4, 4) and bias.dtype == torch.float32
    expected = torch.stack([-0.5 * distance, -0.25 * distance])  # [H, S, T]
    assert_close(bias[0], expected, "unpadded row")
    # Left padding shifts positions: the 3 real tokens are at positions 0..2 whatever the padding.
    # Padded keys/queries are masked elsewhere, so only the real 3x3 block is specified.
    assert_close(bias[1, :, 1:, 1:], expected[:, :3, :3], "left-padded row, real block")
    assert torch.isfinite(bias).all()


def test_alibi_bias_decode_step_over_past():
    slopes = torch.tensor([0.5, 0.25])
    bias = alibi_bias(torch.tensor([[0, 1, 1, 1]]), 1, slopes)  # one query, 3 real keys
    assert bias.shape == (1, 2, 1, 4)
    assert_close(bias[0, :, 0, 1:], torch.tensor([[-1.0, -0.5, 0.0], [-0.5, -0.25, 0.0]]), "decode")


# ------------------------------------------------------------------------------ T5 relative bias
def t5_bucket(relative: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Raffel et al. (2020), mesh-tensorflow ``_relative_position_bucket``, one scalar at a time.

    ``relative`` is key position - query position; n = -relative counts how far back the key is.
    """
    n, bucket = -relative, 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if n < 0 else 0  # keys after the query: upper half
        n = abs(n)
    else:
        n = max(n, 0)  # a causal model never sees later keys
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                            * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


RELATIVE = [-17, -16, -9, -8, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 8, 9, 16, 17]  # key - query
# 8 buckets, max distance 16 (the tiny T5 preset), worked by hand from the formula above.
BUCKETS_8_16 = {
    True: [3, 3, 3, 3, 2, 2, 2, 2, 1, 0, 5, 6, 6, 6, 6, 7, 7, 7, 7],
    False: [7, 7, 6, 6, 4, 4, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_relative_buckets_match_literal(bidirectional: bool):
    got = relative_position_bucket(torch.tensor(RELATIVE), bidirectional, 8, 16)
    assert got.tolist() == BUCKETS_8_16[bidirectional]


@pytest.mark.parametrize("num_buckets, max_distance", [(8, 16), (32, 128), (16, 64), (6, 20)], ids=str)
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_relative_buckets_match_t5_formula(num_buckets, max_distance, bidirectional):
    relative = torch.arange(-300, 301)
    got = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    expected = [t5_bucket(r, bidirectional, num_buckets, max_distance) for r in relative.tolist()]
    assert got.tolist() == expected


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_relative_buckets_in_range_for_every_accepted_config(bidirectional):
    accepted = 0
    for max_distance in range(1, 40):
        try:
            config = tiny("tiny-encoder-decoder-t5", **{"relative.max_distance": max_distance})
        except ValueError as err:
            assert "relative.max_distance" in str(err)
            continue
        accepted += 1
        buckets = relative_position_bucket(torch.arange(-60, 61), bidirectional, config.relative.buckets,
                                           config.relative.max_distance)
        assert ((buckets >= 0) & (buckets < config.relative.buckets)).all(), (max_distance, buckets.tolist())
    assert accepted > 30


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_relative_bias_matches_literal(bidirectional: bool):
    # table[bucket, h] = 10 h + bucket, so the bias shows the bucket of each (query, key) pair.
    table = torch.tensor([[10.0 * h + b for h in range(2)] for b in range(8)])  # [buckets, H]
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    bias = relative_bias(mask, 3, table, bidirectional=bidirectional, max_distance=16)
    assert bias.shape == (2, 2, 3, 3) and bias.dtype == torch.float32
    buckets = torch.tensor([  # key - query = [[0, 1, 2], [-1, 0, 1], [-2, -1, 0]]
        [[0, 5, 6], [1, 0, 5], [2, 1, 0]],
        [[0, 0, 0], [1, 0, 0], [2, 1, 0]],
    ][0 if bidirectional else 1], dtype=torch.float64)
    expected = torch.stack([buckets, 10.0 + buckets])  # [H, S, T]
    assert_close(bias[0], expected, "unpadded row")
    # Left padding: the 2 real tokens are positions 0 and 1, whatever precedes them.
    assert_close(bias[1, :, 1:, 1:], expected[:, :2, :2], "left-padded row, real block")


# ------------------------------------------------------------------------------ positions / mask
@pytest.mark.parametrize("mask, query_length, expected_real", [
    ([[1, 1, 1, 1]], 4, [[0, 1, 2, 3]]),
    ([[0, 0, 1, 1, 1]], 5, [[0, 1, 2]]),  # left padding: real tokens still start at 0
    ([[1, 1, 1, 0, 0]], 5, [[0, 1, 2]]),  # right padding
    ([[0, 1, 1, 1, 1]], 2, [[2, 3]]),  # the last 2 tokens on top of a past
    ([[0, 0, 1, 1, 1]], 1, [[2]]),  # decode step
], ids=["plain", "left", "right", "past", "decode"])
def test_positions_from_mask_at_real_tokens(mask, query_length, expected_real):
    mask = torch.tensor(mask)
    got = positions_from_mask(mask, query_length)
    assert got.shape == (1, query_length)
    real = mask[:, mask.shape[1] - query_length:].bool()
    assert got[real].tolist() == expected_real[0]
    assert (got >= 0).all(), "padded slots must still index a position table"
