"""Independent references and the tolerance table shared by the tests of ``tfport.models``.

Nothing here calls the code under test: attention is einsum over explicitly repeated K/V heads,
RoPE is a complex rotation, both in float64. Shape legend: B batch, S new tokens, P past length,
T = P + S, H query heads, Hkv key/value heads, D head dim, E model dim, V vocab.
"""

from __future__ import annotations

import functools

import torch

from tests.changes import changed
from tfport.config import ModelConfig
from tfport.models import build_model
from tfport.presets import PRESETS

# {dtype: (rtol, atol)} for float32 outputs compared with another float32 path or a float64
# reference. The paths sum in different orders (one [S, T] matmul vs S one-row matmuls, a
# concatenated cache vs a fresh projection, a padded batch vs one row, float64 vs float32); each
# op is exact to about one float32 ulp (6e-8 relative), and the tiny presets (2 layers, E=32,
# activations and logits of order 1..10) accumulate a few 1e-7 at most. 1e-5 leaves margin for
# other BLAS builds while still catching any real masking or position error (those are >= 1e-3).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """``actual`` against ``expected`` (cast to ``actual``'s dtype) within TOLERANCES."""
    rtol, atol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}" if what else m)


def tiny(preset: str, **changes) -> ModelConfig:
    """A tiny preset with ``changes`` applied (validated again); a part's field is named by its
    path: ``tiny("tiny-decoder", **{"rope.theta": 1e5})`` (tests.changes)."""
    return changed(PRESETS[preset], changes)


@functools.lru_cache(maxsize=None)
def model_for(config: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """A seeded model in eval mode; cached because tests only read it."""
    return build_model(config, seed=seed)


def random_ids(shape: tuple[int, ...], vocab: int, seed: int = 0, low: int = 3) -> torch.Tensor:
    """Token ids in [low, vocab): above the special ids of the tiny presets (0, 1, 2)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, shape, generator=generator)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                        scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + bias, masked to ``allowed``) v in float64 -> [B, S, H*D].

    q [B, H, S, D]; k, v [B, Hkv, T, D]; allowed bool [B, 1|H, S, T]; bias [B, 1|H, S, T].
    K/V heads are copied to every query head of their group with ``repeat_interleave``; masked
    scores are -inf, so a row with nothing allowed is NaN here (callers avoid such rows).
    """
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhsd,bhtd->bhst", q, k) * scale
    if bias is not None:
        scores = scores + bias.double()
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bhst,bhtd->bshd", probs, v)
    return out.reshape(out.shape[0], out.shape[1], -1)  # [B, S, H*D]


def reference_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """RoPE frequencies theta_i = theta^(-2i/D), i = 0 .. D/2 - 1 (Su et al. 2021), float64."""
    return torch.tensor([theta ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)


def reference_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, N, S, D] as complex numbers x_i + j x_{i+D/2} times exp(j pos theta_i), float64.

    positions [B, S]; inv_freq [D/2].
    """
    half = x.shape[-1] // 2
    x = x.double()
    z = torch.complex(x[..., :half], x[..., half:])  # [B, N, S, D/2]
    angle = positions.double()[:, None, :, None] * inv_freq.double()  # [B, 1, S, D/2]
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)  # [B, N, S, D]


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D id rows right-aligned -> (ids [B, L], attention_mask [B, L])."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, length - len(row):], mask[b, length - len(row):] = row, 1
    return ids, mask


def right_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D id rows left-aligned -> (ids [B, L], attention_mask [B, L])."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
    return ids, mask
