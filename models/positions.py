"""Position encodings: sinusoidal and learned tables, rotary (RoPE), ALiBi, T5 relative bias,
DeBERTa's disentangled attention (``disentangled``).

All are real-valued (no complex dtypes) so they export as plain ONNX ops. The functions compute;
``POSITION_SCHEMES`` (one entry per ``config.position`` value) says where each scheme enters the
modules: a table added to the embeddings, a bias added to the attention scores, rotary tables, or
a bias that each layer computes from its queries and keys (``content_bias``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tfport.config import ModelConfig

from .disentangled import DisentangledBias, index_table, relative_index, relative_rows
from .norms import make_norm


def sinusoidal_table(n_positions: int, dim: int) -> torch.Tensor:
    """Vaswani et al. (2017) table [n_positions, dim]: sin on even, cos on odd channels."""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv)
    table[:, 1::2] = torch.cos(position * inv)[:, : dim // 2]
    return table.float()


def rope_inv_freq(config: ModelConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies [D/2], with the config's scaling folded in.

    Linear scaling (position interpolation) divides positions by the factor, i.e. the
    frequencies; NTK-aware scaling raises the base to theta * factor^(D / (D - 2)). Llama 3
    scaling divides frequencies whose wavelength 2 pi / f exceeds L / low_freq_factor (L the
    original context) by the factor, keeps those below L / high_freq_factor, and in between blends
    f / factor and f with weight s = (L / wavelength - low) / (high - low) on f. ``local`` gives
    the sliding-window layers' frequencies: base ``rope.local_theta``, unscaled. Longrope divides
    each frequency by its short factor (``long``: its long factor).
    """
    dim = config.rotary_channels
    theta = config.rope.theta
    if local and config.rope.local_theta is not None:
        return (1.0 / config.rope.local_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()
    if config.rope.scaling == "ntk":
        theta = theta * config.rope.scaling_factor ** (dim / (dim - 2))
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    factor = config.rope.scaling_factor
    if config.rope.scaling == "linear":
        inv_freq = inv_freq / factor
    elif config.rope.scaling == "yarn":
        inv_freq = yarn_blend(config, inv_freq)
    elif config.rope.scaling == "longrope":
        factors = config.rope.long_factor if long else config.rope.short_factor
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float64) * theta ** (
            torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    elif config.rope.scaling == "llama3":
        context = config.rope.original_max_positions
        low, high = config.rope.low_freq_factor, config.rope.high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        smooth = (context / wavelength - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelength > context / low, inv_freq / factor,
                               torch.where(wavelength < context / high, inv_freq, blended))
    return inv_freq.float()


def yarn_blend(config: ModelConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (Peng et al., 2023) from the unscaled ones [R/2]: channel pair i keeps f
    (extrapolation) below the correction dim of ``rope.beta_fast`` rotations over the trained
    context L, takes f / factor (interpolation) above that of ``rope.beta_slow``, and blends
    linearly in between; the dims are floored / ceiled when ``rope.truncate``."""
    dim, theta, factor = config.rotary_channels, config.rope.theta, config.rope.scaling_factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(config.rope.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(config.rope.beta_fast), correction_dim(config.rope.beta_slow)
    if config.rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # weight of f
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [B, 1, S, D/2] (float32) for ``position_ids`` [B, S], times ``factor``
    (the attention factor of longrope)."""
    angles = position_ids.float()[:, None, :, None] * inv_freq.float()  # [B, 1, S, D/2]
    if factor != 1.0:
        return angles.cos() * factor, angles.sin() * factor
    return angles.cos(), angles.sin()


def dynamic_inv_freq(config: ModelConfig, position_ids: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: ``inv_freq`` while the call's longest row n = max(position_ids) + 1 is within
    the trained context L, else the frequencies of base theta * (factor n / L - factor + 1)^(R/(R-2))
    (float32, as the graphs compute them)."""
    n = int(position_ids.max()) + 1
    context = config.rope.original_max_positions
    if config.rope.scaling != "dynamic" or n <= context:
        return inv_freq
    dim, factor = config.rotary_channels, config.rope.scaling_factor
    growth = torch.tensor(factor * n / context - (factor - 1), dtype=torch.float32) ** (dim / (dim - 2))
    base = torch.tensor(config.rope.theta, dtype=torch.float32) * growth
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    return 1.0 / base ** exponents


def uses_long_factors(config: ModelConfig, position_ids: torch.Tensor) -> bool:
    """Longrope: whether this call's longest row runs past the trained context (transformers'
    max(position_ids) + 1 > original_max_position_embeddings)."""
    return config.rope.scaling == "longrope" and int(position_ids.max()) + 1 > config.rope.original_max_positions


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
               ) -> torch.Tensor:
    """Rotate ``x`` [B, N, S, D] by (cos, sin) [B, 1, S, R/2]: channel i pairs with channel
    i + R/2 ("rotate half") among the first R channels, or with ``interleaved`` channel 2i with
    2i + 1 (GPT-J's "rotate every two"), by angle i; channels R..D-1 pass unrotated (partial
    rotary, R < D)."""
    half = cos.shape[-1]
    if interleaved:
        pairs = x[..., :2 * half].float().unflatten(-1, (half, 2))  # [B, N, S, R/2, 2]
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
    else:
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return out if 2 * half == x.shape[-1] else torch.cat([out, x[..., 2 * half:]], dim=-1)


def alibi_slopes(n_heads: int, order: str = "press") -> torch.Tensor:
    """Head slopes from Press et al. (2022) [H].

    For n a power of two: 2^(-8i/n), i = 1..n. Otherwise (``press``, BLOOM) the slopes of the
    closest smaller power of two, then every other slope of the next power of two; ``mpt`` takes
    the slopes of the next power of two P, those at odd indices (2^(-8*2/P), 2^(-8*4/P), ...) then
    those at even ones, and keeps the first n (MPT's ``build_mpt_alibi_tensor``).
    """
    if order == "mpt" and not math.log2(n_heads).is_integer():
        p = 2 ** math.ceil(math.log2(n_heads))
        slopes = [2 ** (-8.0 * (i + 1) / p) for i in range(p)]
        return torch.tensor((slopes[1::2] + slopes[0::2])[:n_heads], dtype=torch.float32)
    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def positions_from_mask(attention_mask: torch.Tensor, query_length: int) -> torch.Tensor:
    """Positions [B, S] of the last ``query_length`` tokens: count of real tokens before each.

    ``attention_mask`` is [B, T] with 1 for real tokens; padded slots get position 0.
    """
    return positions_over_mask(attention_mask)[:, attention_mask.shape[-1] - query_length:]


def positions_over_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every slot of ``attention_mask`` [B, T]: real tokens before it (cumsum - 1),
    at least 0. ALiBi and the T5 bias take key positions from it and query positions from its
    last S columns, so left padding never shifts a distance."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """T5's bucket of each relative position (key - query), Raffel et al. (2020).

    Half the buckets (all, if causal) hold exact distances below ``num_buckets // 2`` (halved
    again if bidirectional); the rest cover distances up to ``max_distance`` logarithmically.
    Bidirectional buckets put keys after the query in the upper half.
    """
    bucket = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


def relative_bias(attention_mask: torch.Tensor, query_length: int, table: torch.Tensor,
                  bidirectional: bool, max_distance: int) -> torch.Tensor:
    """T5 relative attention bias float32 [B, H, S, T] from the bucket table [buckets, H]."""
    key_pos = positions_over_mask(attention_mask)  # [B, T]
    query_pos = key_pos[:, key_pos.shape[-1] - query_length:]  # [B, S]
    relative = key_pos[:, None, :] - query_pos[:, :, None]  # [B, S, T]
    buckets = relative_position_bucket(relative, bidirectional, table.shape[0], max_distance)
    return table.float()[buckets].permute(0, 3, 1, 2)  # [B, H, S, T]


def alibi_bias(attention_mask: torch.Tensor, query_length: int, slopes: torch.Tensor) -> torch.Tensor:
    """ALiBi bias [B, H, S, T] = -slope_h * |pos(query) - pos(key)|, positions from the mask."""
    key_pos = positions_over_mask(attention_mask).float()  # [B, T]
    query_pos = key_pos[:, key_pos.shape[-1] - query_length:]  # [B, S]
    distance = (query_pos[:, :, None] - key_pos[:, None, :]).abs()  # [B, S, T]
    return -slopes.float()[None, :, None, None] * distance[:, None]


# ------------------------------------------------------------------------------------ schemes
class PositionScheme:
    """Where one position scheme enters the modules; every hook of this base adds nothing.

    ``Embeddings`` and ``Stack`` call ``init_*`` once to create their tables (names are part of
    the checkpoint format), then the forward hooks per call. The exporter has its own table,
    ``tfport.export.positions``, keyed by the same values.
    """

    def init_embeddings(self, embed: nn.Module, config: ModelConfig) -> None:
        pass

    def init_stack(self, stack: nn.Module, config: ModelConfig) -> None:
        pass

    def embed(self, embed: nn.Module, position_ids: torch.Tensor) -> torch.Tensor | None:
        """Added to the token embeddings: [B, S, E], or None."""
        return None

    def bias(self, stack: nn.Module, attention_mask: torch.Tensor, length: int) -> torch.Tensor | None:
        """Added to the attention scores: float32 [B, H, S, T], or None."""
        return None

    def rotary(self, stack: nn.Module, position_ids: torch.Tensor, local: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [B, 1, S, D/2] that rotate queries and keys (``local``: of the
        sliding-window layers), or None."""
        return None

    def content_bias(self, stack: nn.Module, attention_mask: torch.Tensor, length: int
                     ) -> DisentangledBias | None:
        """What every layer's attention calls as ``.bias(attn, q, k)`` for a bias that depends on
        its queries and keys (float32 [B, H, S, T]), or None."""
        return None


class Sinusoidal(PositionScheme):
    def init_embeddings(self, embed, config):
        table = sinusoidal_table(config.max_positions, config.d_model)
        embed.register_buffer("sinusoidal", table, persistent=False)  # [max_positions, E]

    def embed(self, embed, position_ids):
        return embed.sinusoidal[position_ids]


class Learned(PositionScheme):
    def init_embeddings(self, embed, config):
        embed.positions = nn.Embedding(config.max_positions, config.d_model)

    def embed(self, embed, position_ids):
        return embed.positions(position_ids)


class Rotary(PositionScheme):
    def init_stack(self, stack, config):
        stack.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # [D/2]
        if config.rope.local_theta is not None:
            stack.register_buffer("local_inv_freq", rope_inv_freq(config, local=True), persistent=False)
        if config.rope.scaling == "longrope":
            stack.register_buffer("long_inv_freq", rope_inv_freq(config, long=True), persistent=False)

    def rotary(self, stack, position_ids, local=False):
        config = stack.config
        if local and config.rope.local_theta is not None:
            return rope_cos_sin(position_ids, stack.local_inv_freq)
        inv_freq = stack.long_inv_freq if uses_long_factors(config, position_ids) else stack.inv_freq
        inv_freq = dynamic_inv_freq(config, position_ids, inv_freq)
        return rope_cos_sin(position_ids, inv_freq, config.rope.attention_factor)


class Alibi(PositionScheme):
    def init_stack(self, stack, config):
        stack.register_buffer("alibi_slopes", alibi_slopes(config.n_heads, config.alibi_slopes), persistent=False)  # [H]

    def bias(self, stack, attention_mask, length):
        return alibi_bias(attention_mask, length, stack.alibi_slopes)


class Relative(PositionScheme):
    def init_stack(self, stack, config):  # one bucket table for all layers of the stack
        stack.relative_bias = nn.Embedding(config.relative.buckets, config.n_heads)  # [buckets, H]

    def bias(self, stack, attention_mask, length):
        return relative_bias(attention_mask, length, stack.relative_bias.weight,
                             bidirectional=not stack.causal, max_distance=stack.config.relative.max_distance)


class Disentangled(PositionScheme):
    def init_stack(self, stack, config):  # one relative table and its norm for all layers
        stack.relative_embeddings = nn.Embedding(relative_rows(config), config.d_model)  # [2R, E]
        stack.relative_norm = make_norm(config)
        stack.register_buffer("relative_index", index_table(config), persistent=False)  # [2M + 1]

    def content_bias(self, stack, attention_mask, length):
        config = stack.config
        return DisentangledBias(relative_index(stack.relative_index, length, attention_mask.shape[-1]),
                                stack.relative_norm(stack.relative_embeddings.weight),
                                config.disentangled.effective_terms, config.dropout.embedding)


POSITION_SCHEMES: dict[str, PositionScheme] = {
    "sinusoidal": Sinusoidal(), "learned": Learned(), "rope": Rotary(), "alibi": Alibi(),
    "relative": Relative(), "disentangled": Disentangled(), "none": PositionScheme(),
}
