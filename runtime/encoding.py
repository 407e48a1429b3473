"""Encoder outputs and sentence embeddings (pooling over real tokens, L2 normalisation), and an
export's encoder side (``Encoder``, whose methods ``Model``'s are): the one path ``tfport embed``,
the library and the server's ``/v1/embeddings`` share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tfport.config import ModelConfig
from tfport.embedding import POOLINGS, EmbeddingSettings  # cls, mean, max, mean_sqrt_len_tokens, lasttoken

from .binding import GraphRunner
from .inputs import Prompts, check_length, check_vocab, pad_batch, split_prompts
from .texts import (BATCH_SIZE, EncodedTexts, TruncatingTokenizer, batches, check_texts, report_truncation,
                    tokenizer_truncation)
from .tokenizer import TextTokenizer


@dataclass
class EncoderOutput:
    """Host arrays of one encoder call (rows right-padded).

    ``last_hidden_state`` float32 [B, S, E]; ``attention_mask`` int64 [B, S] (1 = real token);
    ``pooler_output`` float32 [B, E], ``logits`` float32 [B, S, V] and ``class_logits`` float32
    [B, n_labels] when the export has them.
    """

    last_hidden_state: np.ndarray
    attention_mask: np.ndarray
    pooler_output: np.ndarray | None = None
    logits: np.ndarray | None = None
    class_logits: np.ndarray | None = None  # [B, n_labels], with a sequence classification head


def mean_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Mean of states [B, S, E] over the real tokens of attention_mask [B, S] -> [B, E]."""
    weights = attention_mask.astype(np.float32)[:, :, None]  # [B, S, 1]
    count = np.maximum(weights.sum(axis=1), 1.0)  # [B, 1]; an all-padding row pools to 0
    return (states * weights).sum(axis=1) / count


def cls_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """States [B, S, E] of each row's first real token -> [B, E] (index 0 when right-padded)."""
    first = np.argmax(attention_mask != 0, axis=1)  # [B]
    return states[np.arange(states.shape[0]), first]


def max_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Per channel, the largest state over real tokens -> [B, E] (an all-padding row gives 0)."""
    real = attention_mask[:, :, None] != 0  # [B, S, 1]
    pooled = np.where(real, states, -np.inf).max(axis=1)
    return np.where(real.any(axis=1), pooled, 0.0)


def mean_sqrt_len_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Sum of states over real tokens divided by sqrt(their count) -> [B, E]."""
    weights = attention_mask.astype(np.float32)[:, :, None]  # [B, S, 1]
    return (states * weights).sum(axis=1) / np.sqrt(np.maximum(weights.sum(axis=1), 1.0))


def last_token_pool(states: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """States [B, S, E] of each row's last real token -> [B, E]."""
    last = attention_mask.shape[1] - 1 - np.argmax(attention_mask[:, ::-1] != 0, axis=1)  # [B]
    return states[np.arange(states.shape[0]), last]


POOLERS = {"cls": cls_pool, "mean": mean_pool, "max": max_pool,
           "mean_sqrt_len_tokens": mean_sqrt_len_pool, "lasttoken": last_token_pool}


def l2_normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows of x [B, E] scaled to unit L2 norm (a zero row stays zero)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norm, eps)


def pool(states: np.ndarray, attention_mask: np.ndarray, pooling: str = "mean",
         normalize: bool = False) -> np.ndarray:
    """Sentence embeddings [B, E] from states [B, S, E] and attention_mask [B, S]."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r}: expected one of {list(POOLINGS)}")
    pooled = POOLERS[pooling](states, attention_mask)
    pooled = pooled.astype(np.float32)
    return l2_normalize(pooled) if normalize else pooled


class Encoder:
    """The encoder side of an export: per-token states, sentence embeddings (``embedding.json``'s
    pipeline, ``embedding``) and text encoding with truncation. ``runner(method)``: the encoder
    graph's session (``ValueError`` naming ``method`` for an export without one); ``tokenizer(
    argument)``: the export's tokenizer (``ValueError`` naming ``argument`` without one).
    ``Model``'s encoder methods are this object's."""

    def __init__(self, runner: Callable[[str], GraphRunner], config: ModelConfig,
                 embedding: EmbeddingSettings | None, tokenizer: Callable[[str], TextTokenizer]):
        self._runner = runner
        self.config = config
        self.embedding = embedding
        self._tokenizer = tokenizer
        self._truncating_tokenizer: TruncatingTokenizer | None = None

    def encode(self, input_ids: Prompts, attention_mask: np.ndarray | None = None,
               token_type_ids: Prompts | None = None) -> EncoderOutput:
        """Per-token states of the encoder -> EncoderOutput (rows right-padded).

        ``input_ids`` as in ``generate``; ``token_type_ids`` alike (same lengths), only for
        exports whose config has token types (default all 0).
        """
        runner = self._runner("encode")
        config = self.config
        rows = split_prompts(input_ids, attention_mask)
        check_vocab(rows, config.vocab_size)
        check_length("input_ids", max(len(r) for r in rows), config.max_positions,
                     "the longest prompt")
        ids, mask = pad_batch(rows, config.fill_token_id, "right")
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in runner.input_names:
            feeds["token_type_ids"] = self._token_types(token_type_ids, attention_mask, rows)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids: this export takes none (config.type_vocab_size=0)")
        host = [t.name for t in runner.spec.outputs if not t.name.startswith("present.")]
        out = {name: value.numpy() for name, value in runner.run(feeds, host_outputs=host).items()}
        return EncoderOutput(out["last_hidden_state"], mask, out.get("pooler_output"),
                             out.get("logits"), out.get("class_logits"))

    def _token_types(self, token_type_ids: Prompts | None, attention_mask: np.ndarray | None,
                     rows: list[np.ndarray]) -> np.ndarray:
        if token_type_ids is None:
            return pad_batch([np.zeros_like(r) for r in rows], 0, "right")[0]
        types = split_prompts(token_type_ids, attention_mask, "token_type_ids")
        lengths = [len(r) for r in rows]
        if [len(t) for t in types] != lengths:
            raise ValueError(f"token_type_ids: lengths {[len(t) for t in types]} do not match "
                             f"input_ids {lengths}")
        check_vocab(types, self.config.type_vocab_size, "token_type_ids")
        return pad_batch(types, 0, "right")[0]

    def embed(self, input_ids: Prompts, attention_mask: np.ndarray | None = None,
              token_type_ids: Prompts | None = None, *, pooling: str | None = None,
              normalize: bool | None = None) -> np.ndarray:
        """Sentence embeddings float32 [B, E] pooled from ``last_hidden_state`` over real tokens
        (``cls``, ``mean``, ``max``, ``mean_sqrt_len_tokens``, ``lasttoken``), optionally
        L2-normalised. ``pooling`` / ``normalize`` default to the export's ``embedding.json``
        (a sentence-transformers checkpoint's pipeline), else ``mean`` / False."""
        pooling, normalize = self._pooling(pooling, normalize)
        out = self.encode(input_ids, attention_mask, token_type_ids)
        return pool(out.last_hidden_state, out.attention_mask, pooling, normalize)

    def _pooling(self, pooling: str | None, normalize: bool | None) -> tuple[str, bool]:
        settings = self.embedding or EmbeddingSettings()
        pooling = settings.pooling if pooling is None else pooling
        normalize = settings.normalize if normalize is None else normalize
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: expected one of {list(POOLINGS)}")
        if not isinstance(normalize, (bool, np.bool_)):
            raise TypeError(f"normalize={normalize!r}: expected true, false or None (the export's)")
        return pooling, bool(normalize)

    def text_limit(self) -> tuple[int, str]:
        """(tokens, why): the length texts are truncated to -- the export's ``embedding.json``
        ``max_seq_length``, else the truncation in ``tokenizer.json``, never above the model's
        ``max_positions``."""
        limit, why = self.config.max_positions, f"the model's max_positions={self.config.max_positions}"
        settings = self.embedding
        if settings is not None and settings.max_seq_length is not None:
            if settings.max_seq_length < limit:
                limit = settings.max_seq_length
                why = f"max_seq_length={limit} in embedding.json (the checkpoint's sentence-transformers config)"
        else:
            configured = tokenizer_truncation(self._tokenizer("texts").path)
            if configured is not None and configured < limit:
                limit, why = configured, f"truncation max_length={configured} in tokenizer.json"
        return limit, why

    def _truncating(self) -> TruncatingTokenizer:
        if self._truncating_tokenizer is None:
            limit, _ = self.text_limit()
            self._truncating_tokenizer = TruncatingTokenizer(self._tokenizer("texts").path, limit)
        return self._truncating_tokenizer

    def encode_texts(self, texts: str | Sequence[str], pairs: str | Sequence[str] | None = None,
                     method: str = "encode_texts") -> EncodedTexts:
        """Token ids of texts (or text pairs), truncated as ``text_limit`` says; a warning (log)
        names the truncated rows. Texts are lowercased first when ``embedding.json`` says so."""
        texts = check_texts(texts, "texts")
        if pairs is not None:
            pairs = check_texts(pairs, "pairs")
            if len(pairs) != len(texts):
                raise ValueError(f"pairs: {len(pairs)} texts for {len(texts)} texts; expected one "
                                 "pair per text")
        if self.embedding is not None and self.embedding.lowercase:
            texts = [t.lower() for t in texts]
            pairs = None if pairs is None else [t.lower() for t in pairs]
        tokenizer = self._truncating()
        encoded = tokenizer.encode(texts, pairs)
        report_truncation(encoded.truncated, tokenizer.max_length, self.text_limit()[1], method)
        return encoded

    def embed_text(self, texts: str | Sequence[str], *, pooling: str | None = None,
                   normalize: bool | None = None, batch_size: int = BATCH_SIZE,
                   progress: bool | None = None) -> np.ndarray:
        """Sentence embeddings float32 [B, E] of text(s) (B = 1 for one str), as
        ``SentenceTransformer.encode`` gives them for a sentence-transformers export: texts
        truncated to its ``max_seq_length`` (a logged warning says which), its pooling and
        normalisation (arguments as in ``embed``). Texts run in batches of ``batch_size``,
        longest first; ``progress`` shows a bar (None: for 8 batches or more)."""
        return self.embed_encoded(self.encode_texts(texts, method="embed_text"), pooling=pooling,
                                  normalize=normalize, batch_size=batch_size, progress=progress)

    def matryoshka(self, vectors: np.ndarray, dimensions: int) -> np.ndarray:
        """The first ``dimensions`` of each embedding float32 [B, E] -> [B, dimensions],
        L2-normalised again where the export normalises (a unit vector stays one, as vLLM's and
        OpenAI's ``dimensions`` give it). ``ValueError`` naming ``dimensions`` unless it is E or
        one of the export's ``matryoshka_dimensions`` (embedding.json): cutting a vector of a
        model not trained for it gives a worse embedding, not a shorter one."""
        width = vectors.shape[-1]
        if dimensions == width:
            return vectors
        declared = (self.embedding.matryoshka_dimensions if self.embedding else None) or ()
        if dimensions not in declared:
            expected = (f"one of {list(declared)} (its matryoshka_dimensions) or {width}" if declared else
                        f"{width}: the export declares no Matryoshka dimensions to cut its vectors to "
                        "(embedding.json's matryoshka_dimensions)")
            raise ValueError(f"dimensions={dimensions!r}: this model's embeddings have {width} "
                             f"dimensions; expected {expected}")
        cut = vectors[:, :dimensions]
        return l2_normalize(cut) if self._pooling(None, None)[1] else cut

    def embed_encoded(self, encoded: EncodedTexts, *, pooling: str | None = None,
                      normalize: bool | None = None, batch_size: int = BATCH_SIZE,
                      progress: bool | None = None) -> np.ndarray:
        """``embed_text`` of texts already encoded by ``encode_texts`` (whose ``ids`` also give
        the token counts) -> float32 [B, E]."""
        pooling, normalize = self._pooling(pooling, normalize)
        out = np.zeros((len(encoded.ids), self.config.d_model), np.float32)
        for rows in batches(len(encoded.ids), [len(i) for i in encoded.ids], batch_size, progress, "embed"):
            types = [encoded.type_ids[r] for r in rows] if self.config.type_vocab_size else None
            out[rows] = self.embed([encoded.ids[r] for r in rows], token_type_ids=types,
                                   pooling=pooling, normalize=normalize)
        return out
