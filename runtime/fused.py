"""Generation for exports of target "ort": one preallocated KV buffer per layer, updated in place.

The decoder graph calls ONNX Runtime's com.microsoft.GroupQueryAttention. Each layer's key and
value buffer [B, Hkv, M, D] (M = longest prompt + max_new_tokens) is allocated once per request on
the session's device and bound as both ``past_key_values.*`` and ``present.*``: the kernel writes
the new tokens' keys and values into their slots, so a step costs the same at any context length
and nothing is copied between steps. Prompts are right-padded; ``seqlens_k`` [B] holds the index
of each row's last token and ``total_sequence_length`` the longest row's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import onnxruntime as ort

from .binding import NUMPY_DTYPES, PAST, PRESENT, GraphRunner
from .inputs import pad_batch
from .sampling import SamplingParams, next_token


def allocate_cache(runner: GraphRunner, batch: int, slots: int) -> dict[str, ort.OrtValue]:
    """Zeroed buffers [B, Hkv, slots, D] on the session's device, one per ``past_key_values.*``."""
    cache = {}
    for spec in runner.spec.inputs:
        if spec.name.startswith(PAST):
            _, heads, _, dim = spec.shape
            zeros = np.zeros((batch, heads, slots, dim), dtype=NUMPY_DTYPES[spec.dtype])
            cache[spec.name] = ort.OrtValue.ortvalue_from_numpy(zeros, runner.device, runner.device_id)
    return cache


def fused_forward(runner: GraphRunner, input_ids: np.ndarray, seqlens_k: np.ndarray,
                  cache: dict[str, ort.OrtValue]) -> np.ndarray:
    """One call: input_ids [B, S] (right-padded), seqlens_k [B] -> logits float32 [B, S, V].

    ``cache`` is updated in place: row b's new keys/values land in slots
    seqlens_k[b] - S + 1 .. seqlens_k[b].
    """
    feeds = {"input_ids": input_ids, "seqlens_k": seqlens_k.astype(np.int32),
             "total_sequence_length": np.array(seqlens_k.max() + 1, dtype=np.int32)}
    bound = {PRESENT + name[len(PAST):]: value for name, value in cache.items()}
    outputs = runner.run({**feeds, **cache}, host_outputs=["logits"], bound_outputs=bound)
    logits = outputs["logits"].numpy()
    if not np.isfinite(logits).all():
        raise RuntimeError("the decoder produced non-finite logits; the export or its dtype may be broken")
    return logits


def generate_steps_fused(runner: GraphRunner, rows: Sequence[np.ndarray], max_new_tokens: int,
                         params: SamplingParams, rng: np.random.Generator | None,
                         stop_token_ids: tuple[int, ...], pad_token_id: int) -> Iterator[np.ndarray]:
    """Yield one token per row, int64 [B], for up to ``max_new_tokens`` steps (see module doc)."""
    ids, mask = pad_batch(rows, pad_token_id, "right")  # [B, S]
    lengths = mask.sum(axis=1)  # real prompt tokens per row
    batch = len(rows)
    cache = allocate_cache(runner, batch, ids.shape[1] + max_new_tokens)
    logits = fused_forward(runner, ids, lengths - 1, cache)[np.arange(batch), lengths - 1]  # [B, V]
    done = np.zeros(batch, dtype=bool)
    stops = np.asarray(stop_token_ids, dtype=np.int64)
    for step in range(max_new_tokens):
        token = np.where(done, pad_token_id, next_token(logits, params, rng))
        yield token
        if stops.size:
            done |= np.isin(token, stops)
            if done.all():
                return
        if step + 1 == max_new_tokens:
            return
        logits = fused_forward(runner, token[:, None], lengths + step, cache)[:, -1]  # [B, V]
