"""Layout "inplace": one preallocated KV buffer per layer, updated in place (target "ort").

Each layer's key and
value buffer [B, Hkv, M, D] (M = longest prompt + max_new_tokens) is allocated once per request on
the session's device and bound as both ``past_key_values.*`` and ``present.*``: the kernel writes
the new tokens' keys and values into their slots, so a step costs the same at any context length
and nothing is copied between steps. Prompts are right-padded; ``seqlens_k`` [B] holds the index
of each row's last token and ``total_sequence_length`` the longest row's length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnxruntime as ort

from tfport.dtypes import NUMPY_DTYPES

from ..binding import PAST, PRESENT, Feed, GraphRunner
from ..inputs import pad_batch


class InplaceDecoder:
    """The decoder graph with its KV buffers bound once, as past and present, for one request.

    The buffers [B, Hkv, slots, D] live on the session's device for the whole request; a call
    rebinds only ``input_ids``, ``seqlens_k`` and ``total_sequence_length`` and reads the logits,
    so the per-step host work does not depend on the number of layers' caches.
    """

    def __init__(self, runner: GraphRunner, batch: int, slots: int):
        self.runner = runner
        self.cache: dict[str, ort.OrtValue] = {}
        self.binding = runner.session.io_binding()
        self.binding.bind_output("logits", "cpu")  # first: get_outputs()[0], rebinding keeps it there
        for spec in runner.spec.inputs:
            if spec.name.startswith(PAST):
                _, heads, _, dim = spec.shape
                zeros = np.zeros((batch, heads, slots, dim), dtype=NUMPY_DTYPES[spec.dtype])
                buffer = ort.OrtValue.ortvalue_from_numpy(zeros, runner.device, runner.device_id)
                self.cache[spec.name] = buffer
                self.binding.bind_ortvalue_input(spec.name, buffer)
                self.binding.bind_ortvalue_output(PRESENT + spec.name[len(PAST):], buffer)

    def __call__(self, input_ids: np.ndarray, seqlens_k: np.ndarray) -> np.ndarray:
        """input_ids [B, S] (right-padded), seqlens_k [B] -> logits float32 [B, S, V], or [B, 1, V]
        (each row's last new token) from an export with ``logits="last"``.

        ``seqlens_k[b]`` is the index of row b's last real token counting its cache: a prefill passes
        each prompt's length - 1 (its padded slots are ignored), a decode step the cached length.
        The new keys/values are written in place into the row's slots after its cache.
        """
        feeds = {"input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
                 "seqlens_k": seqlens_k.astype(np.int32),
                 "total_sequence_length": np.array(seqlens_k.max() + 1, dtype=np.int32)}
        for name, value in feeds.items():
            self.binding.bind_cpu_input(name, value)
        self.binding.bind_output("logits", "cpu")  # its shape [B, S, V] changes with S
        self.runner.session.run_with_iobinding(self.binding)
        logits = self.binding.get_outputs()[0].numpy()
        assert logits.shape[::2] == (input_ids.shape[0], self.runner.spec.outputs[0].shape[-1]), logits.shape
        if not np.isfinite(logits).all():
            raise RuntimeError("the decoder produced non-finite logits; the export or its dtype may be broken")
        return logits


class InplaceBuffer:
    """Right-padded prompts; ``seqlens_k`` says where each row's tokens go in its buffer."""

    def start(self, runner: GraphRunner, rows: Sequence[np.ndarray], max_new_tokens: int,
              pad_token_id: int, static: Mapping[str, Feed]):
        assert not static, "the inplace layout is decoder-only: no cross-attention inputs"
        ids, mask = pad_batch(rows, pad_token_id, "right")  # [B, S]
        lengths = mask.sum(axis=1)  # real prompt tokens per row
        batch = len(rows)
        decoder = InplaceDecoder(runner, batch, ids.shape[1] + max_new_tokens)
        logits = decoder(ids, lengths - 1)  # [B, S, V], or [B, 1, V]: each row's last token
        logits = logits[:, 0] if logits.shape[1] == 1 else logits[np.arange(batch), lengths - 1]  # [B, V]
        # Step k's token is row b's token number lengths[b] + k: seqlens_k = its index.
        return logits, lambda token, step: decoder(token[:, None], lengths + step)[:, -1]
