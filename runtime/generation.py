"""Autoregressive generation over an exported decoder graph (decoder-only and seq2seq).

The loop is ``tfport.models.generate.generate`` / ``generate_seq2seq`` in numpy: one forward over
the prompt (prefill; for seq2seq the decoder start token), then per step: pick a token from the
last logits, yield it, stop at a stop id once every row has produced one, append it and run one
decode step with the cache. Rows that are done continue with the pad id. The forward after the
last token is skipped (its logits would be unused).

State is explicit: the attention mask [B, T] grows by one column per step and the KV cache is a
dict of OrtValues (see ``binding``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from .binding import PRESENT, Feed, GraphRunner, KVCache, empty_cache, past_name
from .inputs import positions_from_mask
from .sampling import SamplingParams, next_token


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


def sample_loop(logits: np.ndarray, advance: Callable[[np.ndarray, int], np.ndarray],
                max_new_tokens: int, params: SamplingParams, rng: np.random.Generator | None,
                stop_token_ids: tuple[int, ...], pad_token_id: int) -> Iterator[np.ndarray]:
    """The token loop every decoder layout shares; yields int64 [B] per step.

    ``logits`` [B, V] are the prompt's last; ``advance(token [B], step)`` feeds the tokens just
    picked and returns the next logits. Rows that produced a stop id continue with
    ``pad_token_id``; the loop ends when every row has stopped, and skips the forward after the
    last token (its logits would be unused).
    """
    done = np.zeros(logits.shape[0], dtype=bool)
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
        logits = advance(token, step)


def generate_steps(runner: GraphRunner, input_ids: np.ndarray, attention_mask: np.ndarray,
                   max_new_tokens: int, params: SamplingParams, rng: np.random.Generator | None,
                   stop_token_ids: tuple[int, ...], pad_token_id: int,
                   static: Mapping[str, Feed] | None = None) -> Iterator[np.ndarray]:
    """Yield one token per row, int64 [B], for up to ``max_new_tokens`` steps.

    ``input_ids`` / ``attention_mask`` [B, S] are the first decoder input: the left-padded
    prompts, or for seq2seq the decoder start token [B, 1]. Inputs are assumed checked.
    """
    static = dict(static or {})
    state = DecodeState(attention_mask, empty_cache(runner.spec, input_ids.shape[0]))
    logits, state.cache = decoder_forward(runner, input_ids, attention_mask, state.cache, static)

    def advance(token: np.ndarray, step: int) -> np.ndarray:
        ones = np.ones((token.shape[0], 1), dtype=np.int64)
        state.attention_mask = np.concatenate([state.attention_mask, ones], axis=1)  # [B, T+1]
        next_logits, state.cache = decoder_forward(runner, token[:, None], state.attention_mask,
                                                   state.cache, static)
        return next_logits

    yield from sample_loop(logits, advance, max_new_tokens, params, rng, stop_token_ids, pad_token_id)
