"""The inputs of one case for one export: ONNX feeds, the matching reference call, and which
positions are real. Decoder inputs are made in the ``concat`` cache layout, then re-laid out for
the export's own layout (``LAYOUT_INPUTS``, one entry per ``tfport.contract.LAYOUTS`` value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tfport.config import ModelConfig
from tfport.contract import cache_names
from tfport.models.cache import KVCache
from tfport.models.positions import positions_from_mask

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
        self.layout = LAYOUT_INPUTS[layout]
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
        if self.config.family == "encoder-decoder" and self.config.n_labels:  # the classifier graph alone
            return [self._classifier(case, rng)]
        if self.config.family == "encoder":
            return [self._encoder(case, rng)]
        if self.config.family == "decoder":
            adapted = self.layout.adapt(case)
            return [self.layout.relayout(self._decoder(adapted, rng), adapted, rng, self)]
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
        feeds = {"input_ids": ids, "attention_mask": mask}
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



class ConcatInputs:
    """Layout "concat": the inputs as made."""

    def adapt(self, case: Case) -> Case:
        return case

    def relayout(self, prepared: Prepared, case: Case, rng: np.random.Generator, maker: CaseInputs) -> Prepared:
        return prepared

    def last_positions(self, prepared: Prepared) -> np.ndarray:
        """int [B]: the reference position a ``logits="last"`` graph returns per row (S - 1)."""
        batch, new = prepared.query_mask.shape
        return np.full(batch, new - 1)


class InplaceInputs:
    """Layout "inplace": the concat case re-laid out as ONNX Runtime's GroupQueryAttention wants
    it. Each row's real tokens move to the front (right padding), its past to the front of a
    buffer of P + S + 3 slots whose spare slots hold large random values (they must be ignored),
    ``seqlens_k`` = each row's real P + S - 1. The kernel accepts several new tokens on top of a
    past only for batch 1, so such cases run with batch 1."""

    def adapt(self, case: Case) -> Case:
        return dataclasses.replace(case, batch=1) if case.past and case.new > 1 else case

    def relayout(self, portable: Prepared, case: Case, rng: np.random.Generator, maker: CaseInputs) -> Prepared:
        c, mask = maker.config, portable.feeds["attention_mask"]  # [B, P+S], left- or right-padded
        batch, total = mask.shape
        slots = total + 3
        real = mask.astype(bool)
        new_real = real[:, case.past:]
        ids = np.zeros_like(portable.feeds["input_ids"])
        for b in range(batch):
            ids[b, :new_real[b].sum()] = portable.feeds["input_ids"][b][new_real[b]]
        feeds = {"input_ids": ids, "seqlens_k": (real.sum(1) - 1).astype(np.int32),
                 "total_sequence_length": np.array(real.sum(1).max(), dtype=np.int32)}
        buffers = {}
        for name, past in portable.feeds.items():
            if not name.startswith("past_key_values."):
                continue
            buffer = maker.random_cache(rng, batch, slots, scale=100.0)
            for b in range(batch):
                n_past = real[b, :case.past].sum()
                buffer[b][:, :n_past] = past[b][:, real[b, :case.past]]
            buffers[name] = buffer

        def to_reference_layout(name: str, value: np.ndarray) -> np.ndarray:
            if not name.startswith("present.") and value.shape[:2] == (batch, case.new):
                # logits and taps [B, S, ...]: row b's queries are at its real new slots
                out = np.zeros((batch, case.new) + value.shape[2:], dtype=value.dtype)
                for b in range(batch):
                    out[b, new_real[b]] = value[b, :new_real[b].sum()]
                return out
            if name.startswith("present."):  # [B, Hkv, M, D] -> [B, Hkv, P+S, D]
                out = np.zeros(value.shape[:2] + (total,) + value.shape[3:], dtype=value.dtype)
                for b in range(batch):
                    out[b][:, real[b]] = value[b][:, :real[b].sum()]
                return out
            return value

        return dataclasses.replace(portable, feeds=feeds, inplace=buffers,
                                   to_reference_layout=to_reference_layout, case=case)

    def last_positions(self, prepared: Prepared) -> np.ndarray:
        """int [B]: each row's last real new token in the reference layout."""
        real = prepared.query_mask
        return real.shape[1] - 1 - np.argmax(real[:, ::-1], axis=1)


# Cache layout (tfport.contract.LAYOUTS) -> how a decoder case is laid out for it.
LAYOUT_INPUTS = {"concat": ConcatInputs(), "inplace": InplaceInputs()}
