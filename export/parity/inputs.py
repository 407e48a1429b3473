"""The inputs of one case for one export: ONNX feeds, the matching reference call, and which
positions are real. Decoder inputs are made in the ``concat`` cache layout, then re-laid out for
the export's own layout by that layout's runtime module (``tfport.runtime.decoding``:
``LayoutDecoding.relayout``, reached through ``export/validate.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tfport.config import ModelConfig
from tfport.contract import LAST_LOGITS, LAYOUTS, cache_names
from tfport.models.cache import KVCache
from tfport.models.positions import positions_from_mask

from ..validate import relayout_for
from .cases import Case


def _mask(batch: int, padding: str, total: int) -> np.ndarray:
    """attention_mask [B, total]; row 0 gets 2 padded slots on the ``padding`` side."""
    mask = np.ones((batch, total), dtype=np.int64)
    pad = min(2, total - 1)
    if padding == "left":
        mask[0, :pad] = 0
    elif padding == "right":
        mask[0, total - pad:] = 0
    return mask


def _cache_feeds(prefix: str, kind: str | None, tensors: list[np.ndarray], n_layers: int) -> dict:
    feeds = {}
    for i in range(n_layers):
        key, value = cache_names(i, prefix, kind)
        feeds[key], feeds[value] = tensors[2 * i], tensors[2 * i + 1]
    return feeds


@dataclass
class Prepared:
    """Inputs of one graph run: ONNX feeds, the reference call, and which positions are real."""

    graph: str
    feeds: dict[str, np.ndarray]
    # reference(model=None): the reference's outputs by name; ``model`` runs the same call on
    # another copy of the reference (its float64 copy: ``Runner.rounding_floor``).
    reference: Callable[..., dict[str, torch.Tensor]]
    query_mask: np.ndarray  # [B, S] bool: real query positions
    key_mask: np.ndarray  # [B, T] bool: real key positions (for present K/V)
    # Layout "inplace": buffers bound as both past and present (updated in place), and a function
    # mapping each ONNX output back to the portable layout the reference uses.
    inplace: dict[str, np.ndarray] | None = None
    to_reference_layout: Callable[[str, np.ndarray], np.ndarray] | None = None
    case: Case | None = None  # set when the case had to be adapted (e.g. batch 1)



class CaseInputs:
    """Makes the ``Prepared`` runs of a case for one export (its config, KV cache dtype
    ``kv_dtype`` and cache layout) and its reference ``model`` (in the export's dtype).

    ``run_encoder(prepared) -> outputs`` runs the export's encoder graph: a seq2seq decoder case
    takes the cross-attention K/V the encoder graph computed, as the runtime does.
    """

    def __init__(self, model: nn.Module, config: ModelConfig, kv_dtype: str, layout: str,
                 run_encoder: Callable[[Prepared], dict[str, np.ndarray]]):
        self.model, self.config, self.kv_dtype = model, config, kv_dtype
        self.model_dtype = next(model.parameters()).dtype
        self.layout = LAYOUTS[layout]  # tfport.contract.CacheLayout
        self.relayout = relayout_for(layout)
        self.run_encoder = run_encoder

    def _ids(self, rng: np.random.Generator, shape) -> np.ndarray:
        return rng.integers(3, self.config.vocab_size, size=shape, dtype=np.int64)

    def random_cache(self, rng: np.random.Generator, batch: int, length: int, scale: float = 1.0) -> np.ndarray:
        """A random cache [B, Hkv, length, D] in the cache dtype whose values the reference's
        dtype holds exactly too (rounded to the model dtype first: bfloat16 then float16 is exact)."""
        c = self.config
        values = torch.from_numpy(rng.standard_normal((batch, c.kv_heads, length, c.dim_per_head)) * scale)
        return values.to(self.model_dtype).float().numpy().astype(self.kv_dtype)

    def _reference_kv(self, array: np.ndarray) -> torch.Tensor:
        """A cache array as the reference module takes it (its dtype)."""
        return torch.from_numpy(array).to(self.model_dtype)

    def prepare(self, case: Case) -> list[Prepared]:
        """The graph runs of ``case``: the encoder, the decoder, or both (seq2seq)."""
        rng = np.random.default_rng(case.seed)
        if self.config.family == "encoder-decoder" and self.config.classifier.n_labels:  # the classifier graph alone
            return [self._classifier(case, rng)]
        if self.config.family == "encoder":
            return [self._encoder(case, rng)]
        if self.config.family == "decoder":
            adapted = dataclasses.replace(case, batch=self.relayout.batch_for(case.batch, case.past, case.new))
            prepared = self._decoder(adapted, rng)
            feeds, buffers, to_reference = self.relayout(
                prepared.feeds, adapted.past, lambda batch, slots: self.random_cache(rng, batch, slots, scale=100.0))
            if buffers is None:
                return [prepared]
            return [dataclasses.replace(prepared, feeds=feeds, inplace=buffers,
                                        to_reference_layout=to_reference, case=adapted)]
        encoder = self._encoder(case, rng)
        return [encoder, self._decoder(case, rng, encoder)]

    def _encoder(self, case: Case, rng: np.random.Generator) -> Prepared:
        c = self.config
        seq2seq = c.family == "encoder-decoder"
        length = case.encoder_length if seq2seq else case.past + case.new  # no past in encoders
        padding = ("right" if case.padding != "none" else "none") if seq2seq else case.padding
        ids = self._ids(rng, (case.batch, length))
        mask = _mask(case.batch, padding, length)
        feeds = {"input_ids": ids, "attention_mask": mask}
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        kwargs = {}
        if c.type_vocab_size:
            feeds["token_type_ids"] = rng.integers(0, c.type_vocab_size, (case.batch, length), dtype=np.int64)
            kwargs["token_type_ids"] = torch.from_numpy(feeds["token_type_ids"])

        def reference(model: nn.Module | None = None) -> dict[str, torch.Tensor]:
            model = model or self.model
            if not seq2seq:
                out = model(t_ids, t_mask, **kwargs)
                found = {"last_hidden_state": out.last_hidden_state, "pooler_output": out.pooler_output,
                         "logits": out.logits, "class_logits": out.class_logits}
                return {k: v for k, v in found.items() if v is not None}
            states = model.encode(t_ids, t_mask)
            found = {"last_hidden_state": states.float()}
            for i, (k, v) in enumerate(model.cross_kv(states)):
                found.update(zip(cache_names(i, "present", "encoder"), (k, v)))
            return found

        real = mask.astype(bool)
        return Prepared("encoder", feeds, reference, real, real)

    def _classifier(self, case: Case, rng: np.random.Generator) -> Prepared:
        """A seq2seq classifier's run: random ids right-padded as the runtime pads them, each
        row ending with eos and row 0 holding another one before (the head reads the last)."""
        c = self.config
        length = case.encoder_length
        mask = _mask(case.batch, "right" if case.padding != "none" else "none", length)
        ids = np.where(mask == 1, self._ids(rng, (case.batch, length)), c.fill_token_id)
        ids[np.arange(case.batch), mask.sum(axis=1) - 1] = c.eos_token_id
        ids[0, 0] = c.eos_token_id
        t_ids, t_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        real = np.ones((case.batch, length), dtype=bool)
        return Prepared("classifier", {"input_ids": ids, "attention_mask": mask},
                        lambda model=None: {"class_logits": (model or self.model).classify(t_ids, t_mask)},
                        real, real)

    def _decoder(self, case: Case, rng: np.random.Generator, encoder: Prepared | None = None) -> Prepared:
        """Random past [B, Hkv, P, D], S new tokens, the mask over P + S; for seq2seq the cross
        K/V come from running the encoder graph (computed once, reused as the decoder's past)."""
        c = self.config
        kind = "decoder" if encoder is not None else None
        total = case.past + case.new
        padding = "left" if (case.padding == "right" and case.past) else case.padding
        mask = _mask(case.batch, padding, total)
        ids = self._ids(rng, (case.batch, case.new))
        position_ids = positions_from_mask(torch.from_numpy(mask), case.new).numpy()
        past = [self.random_cache(rng, case.batch, case.past) for _ in range(2 * c.n_decoder_layers)]
        feeds = {"input_ids": ids, "attention_mask": mask, LAST_LOGITS: np.array(False)}
        if c.uses_position_ids:
            feeds["position_ids"] = position_ids
        feeds.update(_cache_feeds("past_key_values", kind, past, c.n_decoder_layers))
        cache = KVCache([(self._reference_kv(past[2 * i]), self._reference_kv(past[2 * i + 1]))
                         for i in range(c.n_decoder_layers)]) if case.past else None
        t_ids, t_mask, t_pos = (torch.from_numpy(x) for x in (ids, mask, position_ids))
        memory = None
        if encoder is not None:
            outputs = self.run_encoder(encoder)
            kv = [outputs[name] for i in range(c.n_decoder_layers) for name in cache_names(i, "present", "encoder")]
            feeds["encoder_attention_mask"] = encoder.feeds["attention_mask"]
            feeds.update(_cache_feeds("past_key_values", "encoder", kv, c.n_decoder_layers))
            memory = [(self._reference_kv(kv[2 * i]), self._reference_kv(kv[2 * i + 1]))
                      for i in range(c.n_decoder_layers)]
            memory_mask = torch.from_numpy(encoder.feeds["attention_mask"])

        def reference(model: nn.Module | None = None) -> dict[str, torch.Tensor]:
            model = model or self.model
            dtype = next(model.parameters()).dtype  # the float64 check runs the cache in float64
            past = KVCache([(k.to(dtype), v.to(dtype)) for k, v in cache.layers]) if cache is not None else None
            if memory is not None:
                kv = [(k.to(dtype), v.to(dtype)) for k, v in memory]
                logits, present = model.decode(t_ids, kv, memory_mask, t_mask, t_pos, past)
            else:
                logits, present = model(t_ids, t_mask, t_pos, past)
            found = {"logits": logits}
            for i, (k, v) in enumerate(present.layers):
                found.update(zip(cache_names(i, "present", kind), (k, v)))
            return found

        return Prepared("decoder", feeds, reference, mask[:, case.past:].astype(bool), mask.astype(bool))
