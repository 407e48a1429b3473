"""Layout "concat": the decoder takes ``past_key_values.*`` and returns ``present.*`` = past
followed by the new tokens; prompts are left-padded and described by the attention mask.

State is explicit: the attention mask [B, T] grows by one column per step and the KV cache is a
dict of OrtValues kept on the session's device (see ``binding``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..binding import PRESENT, Feed, GraphRunner, KVCache, empty_cache, past_name
from ..inputs import pad_batch, positions_from_mask


@dataclass
class DecodeState:
    """What changes from step to step: ``attention_mask`` int64 [B, T] covers the cache and the
    tokens fed next; ``cache`` maps ``past_key_values.*`` to OrtValues [B, Hkv, P, D]."""

    attention_mask: np.ndarray
    cache: Mapping[str, Feed]


def decoder_forward(runner: GraphRunner, input_ids: np.ndarray, attention_mask: np.ndarray,
                    cache: Mapping[str, Feed],
                    static: Mapping[str, Feed]) -> tuple[np.ndarray, KVCache]:
    """One decoder call: input_ids [B, S], attention_mask [B, P+S], cache [B, Hkv, P, D]
    -> (last-position logits float32 [B, V], present cache [B, Hkv, P+S, D] as OrtValues).

    ``static`` holds the inputs that do not change between steps (seq2seq
    ``encoder_attention_mask`` and cross-attention K/V). ``position_ids`` [B, S] are counted
    from the mask when the graph takes them.
    """
    feeds: dict[str, Feed] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if "position_ids" in runner.input_names:
        feeds["position_ids"] = positions_from_mask(attention_mask, input_ids.shape[1])
    feeds.update(cache)
    feeds.update(static)
    presents = [t.name for t in runner.spec.outputs if t.name.startswith(PRESENT)]
    outputs = runner.run(feeds, device_outputs=presents, host_outputs=["logits"])
    logits = outputs["logits"].numpy()[:, -1]  # [B, V]
    if not np.isfinite(logits).all():
        raise RuntimeError(f"the decoder produced non-finite logits (cache length "
                           f"{attention_mask.shape[1] - input_ids.shape[1]}); the export or its "
                           f"dtype may be broken")
    return logits, {past_name(name): outputs[name] for name in presents}


class ConcatCache:
    """Left-padded prompts, a growing mask, the cache returned by each call fed to the next."""

    def start(self, runner: GraphRunner, rows: Sequence[np.ndarray], max_new_tokens: int,
              pad_token_id: int, static: Mapping[str, Feed]):
        ids, mask = pad_batch(rows, pad_token_id, "left")  # [B, S]
        static = dict(static)
        state = DecodeState(mask, empty_cache(runner.spec, ids.shape[0]))
        logits, state.cache = decoder_forward(runner, ids, mask, state.cache, static)

        def advance(token: np.ndarray, step: int) -> np.ndarray:
            ones = np.ones((token.shape[0], 1), dtype=np.int64)
            state.attention_mask = np.concatenate([state.attention_mask, ones], axis=1)  # [B, T+1]
            next_logits, state.cache = decoder_forward(runner, token[:, None], state.attention_mask,
                                                       state.cache, static)
            return next_logits

        return logits, advance
