"""Checking and padding token ids, and the position ids the graphs take.

Every function is pure numpy. Prompts enter as a ragged list of id sequences or as an integer
array [B, S] with an optional 0/1 ``attention_mask`` [B, S]; they leave as one padded batch:
left-padded for decoders (new tokens append on the right), right-padded for encoders (the first
token of every row is at index 0, where CLS pooling reads it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import numpy as np

from tfport.config.checks import is_int

# A batch of prompts: ragged sequences of ids, or an integer array [B, S].
Prompts = Union[np.ndarray, Sequence[Sequence[int]]]
PAD_SIDES = ("left", "right")


def _as_int_array(value: object, argument: str) -> np.ndarray:
    """``value`` as an array of rank 2 and an integer dtype, else ``TypeError``/``ValueError``."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{argument}: expected an integer numpy array [B, S], got "
                        f"{type(value).__name__}")
    if isinstance(value, np.ma.MaskedArray):
        raise TypeError(f"{argument}: a masked array's mask would be ignored; pass its data and "
                        "attention_mask (1 = token, 0 = padding) instead")
    value = np.asarray(value)  # np.matrix and other subclasses: a plain array (rows are 1-D)
    if value.dtype == np.bool_ or not np.issubdtype(value.dtype, np.integer):
        raise TypeError(f"{argument}: expected an integer dtype (int64), got {value.dtype}")
    if value.ndim != 2:
        raise ValueError(f"{argument}: expected rank 2 [B, S], got shape {tuple(value.shape)}"
                         + (" (wrap one prompt as ids[None])" if value.ndim == 1 else ""))
    if value.dtype.kind == "u" and value.size and value.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{argument}: ids up to {int(value.max())} do not fit int64 (expected token "
                         "ids in [0, vocab_size))")
    return value.astype(np.int64, copy=False)


def split_prompts(input_ids: Prompts, attention_mask: np.ndarray | None = None,
                  argument: str = "input_ids") -> list[np.ndarray]:
    """The real tokens of each prompt, as a list of int64 arrays [S_b].

    ``input_ids`` is an integer array [B, S] (with ``attention_mask`` [B, S] marking real tokens
    by 1; padding may be on either side) or a sequence of id sequences. Raises ``TypeError`` /
    ``ValueError`` naming the argument for a wrong type, dtype or rank, a mask of another shape or
    with values other than 0/1, an empty batch and an empty prompt.
    """
    if isinstance(input_ids, np.ndarray):
        ids = _as_int_array(input_ids, argument)
        if attention_mask is None:
            rows = list(ids)
        else:
            mask = _as_int_array(attention_mask, "attention_mask")
            if mask.shape != ids.shape:
                raise ValueError(f"attention_mask: shape {tuple(mask.shape)} does not match "
                                 f"{argument} {tuple(ids.shape)}; expected the same [B, S]")
            if not np.isin(mask, (0, 1)).all():
                raise ValueError(f"attention_mask: expected only 0 (padding) and 1 (token), got "
                                 f"values {sorted(set(np.unique(mask).tolist()) - {0, 1})}")
            rows = [row[keep == 1] for row, keep in zip(ids, mask)]
    else:
        if attention_mask is not None:
            raise ValueError(f"attention_mask: only accepted with an array {argument} [B, S]; "
                             f"pass ragged {argument} without a mask")
        if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
            raise TypeError(f"{argument}: expected an integer array [B, S] or a list of id "
                            f"lists, got {type(input_ids).__name__}")
        rows = []
        for index, row in enumerate(input_ids):
            if isinstance(row, (int, np.integer)):
                raise ValueError(f"{argument}: expected a list of prompts (id lists), got a flat "
                                 f"list of ids; wrap one prompt as [ids]")
            array = np.asarray(row)
            if array.dtype == object and all(is_int(v) for v in array.ravel()):
                huge = [v for v in array.ravel() if not -2**63 <= v < 2**63]  # Python ints past int64
                raise ValueError(f"{argument}[{index}]: ids {huge[:4]} do not fit int64 (expected token "
                                 "ids in [0, vocab_size))")
            integer = array.dtype != np.bool_ and np.issubdtype(array.dtype, np.integer)
            if array.size and not integer:
                raise TypeError(f"{argument}[{index}]: expected integer token ids, got dtype "
                                f"{array.dtype}")
            if array.ndim != 1:
                raise ValueError(f"{argument}[{index}]: expected a flat list of ids, got shape "
                                 f"{tuple(array.shape)}")
            rows.append(array.astype(np.int64))
    if not rows:
        raise ValueError(f"{argument}: expected at least one prompt, got an empty batch")
    for index, row in enumerate(rows):
        if row.size == 0:
            raise ValueError(f"{argument}: prompt {index} is empty; expected at least one token")
    return rows


def check_vocab(rows: Sequence[np.ndarray], vocab_size: int, argument: str = "input_ids") -> None:
    """``ValueError`` unless every id is in [0, vocab_size)."""
    for index, row in enumerate(rows):
        bad = row[(row < 0) | (row >= vocab_size)]
        if bad.size:
            raise ValueError(f"{argument}: prompt {index} has ids {bad[:8].tolist()} outside "
                             f"[0, {vocab_size}) (the model's vocab_size)")


def pad_batch(rows: Sequence[np.ndarray], pad_id: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """Pad prompts to one batch -> (ids int64 [B, S], attention_mask int64 [B, S])."""
    if side not in PAD_SIDES:
        raise ValueError(f"side={side!r}: expected one of {list(PAD_SIDES)}")
    length = max(len(row) for row in rows)
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for b, row in enumerate(rows):
        span = slice(length - len(row), length) if side == "left" else slice(0, len(row))
        ids[b, span] = row
        mask[b, span] = 1
    return ids, mask


def positions_from_mask(attention_mask: np.ndarray, query_length: int) -> np.ndarray:
    """Positions int64 [B, S] of the last ``query_length`` slots of ``attention_mask`` [B, T].

    Each real token's position is the count of real tokens before it (cumsum - 1); padded slots
    get 0 (the clamp), as ``tfport.models.positions.positions_from_mask``.
    """
    positions = np.maximum(np.cumsum(attention_mask.astype(np.int64), axis=-1) - 1, 0)
    return positions[:, attention_mask.shape[-1] - query_length:]


def check_length(name: str, length: int, max_positions: int, hint: str) -> None:
    """``ValueError`` if ``length`` positions exceed ``max_positions``."""
    if length > max_positions:
        raise ValueError(f"{name}: needs {length} positions, more than the model's max_positions="
                         f"{max_positions} ({hint})")
