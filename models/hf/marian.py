"""Marian (``model_type`` ``marian``: the OPUS-MT translation models) -> encoder-decoder.

BART's layer layout (``bart.bart_stack``), post-norm, without ``layernorm_embedding`` or final
norms; token embeddings times sqrt(d_model) when ``scale_embedding``; SiLU ("swish") in the
OPUS-MT configs. One token table serves both stacks and the tied head, plus
``final_logits_bias``; decoding starts from ``decoder_start_token_id`` (the pad id in OPUS-MT).

Positions are a fixed sinusoidal table whose layout is Marian's own: sin(pos / 10000^(2i/E)) in
the first half of the channels and the matching cos in the second half (tfport's ``sinusoidal``
interleaves them), read at the slot index with no offset. ``MarianMTModel`` does not save the
table (``_keys_to_ignore_on_save``) while ``MarianModel`` does: tfport imports it as a learned
table, read from the file when it is there (as transformers does) and otherwise computed here as
``MarianSinusoidalPositionalEmbedding.create_weight`` computes it. As for BART, positions count
real tokens, equal to transformers' slot index under right padding.

Refused: separate encoder and decoder vocabularies (``share_encoder_decoder_embeddings`` false,
``decoder_vocab_size`` != ``vocab_size``): tfport's stacks share one token table.
"""

from __future__ import annotations

import math

import torch

from tfport.config import ModelConfig

from .bart import TOKEN_COPIES, bart_head, bart_stack, head_fields, shared_sizes, start_token
from .configs import hf_activation, hf_field, refuse, token_ids
from .rules import Architecture, Rule, Transform


def marian_positions(n_positions: int, dim: int) -> torch.Tensor:
    """Marian's sinusoidal table [n_positions, dim] (float32): channel j has angle
    pos / 10000^(2 (j // 2) / dim); the even channels' sines fill the first ceil(dim / 2) columns,
    the odd channels' cosines the rest. Computed in float64, as transformers does (numpy)."""
    position = torch.arange(n_positions, dtype=torch.float64)[:, None]
    j = torch.arange(dim, dtype=torch.float64)
    angles = position / 10000.0 ** (2 * torch.div(j, 2, rounding_mode="floor") / dim)  # [n_positions, dim]
    return torch.cat([torch.sin(angles[:, 0::2]), torch.cos(angles[:, 1::2])], dim=1).float()


SINUSOIDAL = Transform("Marian's sinusoidal table (sin | cos halves), computed", lambda shape, c: [],
                       lambda ts, shape, c: marian_positions(*shape))


def _marian_config(hf: dict, keys: frozenset[str] | None) -> ModelConfig:
    """Marian: post-norm BART layout, no embedding norm, sinusoidal (sin | cos) positions."""
    vocab_size = hf_field(hf, "vocab_size")
    if hf.get("share_encoder_decoder_embeddings", True) is False:
        refuse(hf, "share_encoder_decoder_embeddings", False, "tfport's encoder and decoder share one "
               "token table; expected true")
    if hf.get("decoder_vocab_size") not in (None, vocab_size):
        refuse(hf, "decoder_vocab_size", hf["decoder_vocab_size"], f"one vocabulary for both stacks; "
               f"expected vocab_size={vocab_size}")
    sizes = shared_sizes(hf)
    ids = token_ids(hf, vocab_size)
    scale = math.sqrt(sizes["d_model"]) if hf.get("scale_embedding") else 1.0
    return ModelConfig(
        family="encoder-decoder", vocab_size=vocab_size, **sizes, norm="layernorm", norm_position="post",
        norm_eps=1e-5, activation=hf_activation(hf, hf_field(hf, "activation_function", default="gelu")),
        position="learned", max_positions=hf_field(hf, "max_position_embeddings", default=1024),
        embedding_scale=scale, attention_bias=True, mlp_bias=True,
        **head_fields(hf, keys, ("MarianMTModel",)),
        decoder_start_token_id=start_token(hf, ids, ids["pad_token_id"]), **ids)


def _stack(name: str, cross: bool) -> list[Rule]:
    hf = f"model.{name}"
    target = f"{name}.embed.positions.weight"
    positions = [Rule(target, (f"{hf}.embed_positions.weight",), if_present=True), Rule(target, (), SINUSOIDAL)]
    return bart_stack(name, hf, cross, positions, norms=False)


MARIAN = Architecture(
    model_types=("marian",),
    classes=("MarianModel", "MarianMTModel"),
    base_prefix="model.",
    config=_marian_config,
    rules=(*bart_head(), *_stack("encoder", cross=False), *_stack("decoder", cross=True)),
    duplicates=TOKEN_COPIES,
)
