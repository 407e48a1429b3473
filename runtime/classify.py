"""Sequence classification with an export's classification head: classifiers, rerankers and
cross-encoders (``*ForSequenceClassification`` checkpoints); ``tfport classify`` is ``classify_cli``.

    >>> model.classify(["I loved it", "Meh"]).labels                    # ['POSITIVE', 'NEGATIVE']
    >>> model.classify("what is onnx?", pairs=["ONNX is ...", "A cat."]).scores[:, 0]   # relevance

Texts (or text pairs: query and passage) are tokenized as the checkpoint's tokenizer.json does,
truncated to the model's limit (a logged warning names truncated rows; pairs lose tokens from the
longer side first), and run in batches, longest first.

Encoders classify with their encoder graph (``class_logits`` beside the states); an
encoder-decoder classifier (BART-large-MNLI: ``classify(premise, pairs=hypotheses)``) with its
``classifier`` graph, which reads the decoder at each row's last eos token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tfport.config import ModelConfig

from .inputs import Prompts, check_length, check_vocab, pad_batch, split_prompts
from .texts import BATCH_SIZE, EncodedTexts, batches


class Model(Protocol):
    """What classifying reads of a ``model.Model`` (which calls in here from ``classify``)."""

    config: ModelConfig
    runners: dict[str, Any]

    def encode(self, input_ids: Prompts, attention_mask: np.ndarray | None = None,
               token_type_ids: Prompts | None = None) -> Any: ...

    def encode_texts(self, texts: Any, pairs: Any = None, method: str = "encode_texts") -> EncodedTexts: ...


@dataclass
class Classification:
    """``logits`` float32 [B, n_labels]; ``labels`` the name of each row's highest logit
    (``id2label``; ``LABEL_i`` when the checkpoint names none); ``scores`` float32 [B, n_labels]:
    softmax over the labels, or the sigmoid of the logit for a single-output head (rerankers:
    sentence-transformers' CrossEncoder gives that relevance score)."""

    logits: np.ndarray
    labels: list[str]
    scores: np.ndarray

    def to_rows(self) -> list[dict]:
        return [{"label": label, "logits": [float(x) for x in logits], "scores": [float(x) for x in scores]}
                for label, logits, scores in zip(self.labels, self.logits, self.scores)]


def label_names(model: Model) -> list[str]:
    head = model.config.classifier
    return list(head.labels) if head.labels is not None else [f"LABEL_{i}" for i in range(head.n_labels)]


def scores_of(logits: np.ndarray) -> np.ndarray:
    """Softmax over labels, or the sigmoid of a single logit."""
    if logits.shape[-1] == 1:
        return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)


def result(model: Model, logits: np.ndarray) -> Classification:
    names = label_names(model)
    return Classification(logits, [names[i] for i in logits.argmax(axis=-1)], scores_of(logits))


def _check_head(model: Model) -> None:
    if not model.config.classifier.n_labels:
        raise ValueError(f"classify: this export has no sequence classification head (config.classifier.n_labels=0, "
                         f"family {model.config.family!r}); export a *ForSequenceClassification checkpoint")


def class_logits(model: Model, input_ids: Prompts, attention_mask: np.ndarray | None = None,
                 token_type_ids: Prompts | None = None) -> np.ndarray:
    """Logits float32 [B, n_labels] of token ids (arguments as ``Model.encode``)."""
    if "classifier" not in model.runners:
        return model.encode(input_ids, attention_mask, token_type_ids).class_logits
    if token_type_ids is not None:
        raise ValueError("token_type_ids: this export takes none (an encoder-decoder classifier)")
    config = model.config
    rows = split_prompts(input_ids, attention_mask)
    check_vocab(rows, config.vocab_size)
    check_length("input_ids", max(len(r) for r in rows), config.max_positions, "the longest row")
    missing = [i for i, row in enumerate(rows) if config.eos_token_id not in row]
    if missing:
        raise ValueError(f"input_ids: rows {missing} hold no eos_token_id={config.eos_token_id}; this "
                         "classifier reads the decoder at each row's last one (the checkpoint's "
                         "tokenizer ends every text with it)")
    ids, mask = pad_batch(rows, config.fill_token_id, "right")
    out = model.runners["classifier"].run({"input_ids": ids, "attention_mask": mask},
                                          host_outputs=["class_logits"])
    return out["class_logits"].numpy()


def classify_ids(model: Model, input_ids, attention_mask: np.ndarray | None = None,
                 token_type_ids=None) -> Classification:
    """Classification of token ids (arguments as ``Model.encode``)."""
    _check_head(model)
    return result(model, class_logits(model, input_ids, attention_mask, token_type_ids))


def classify(model: Model, texts: str | Sequence[str], pairs: str | Sequence[str] | None = None, *,
             batch_size: int = BATCH_SIZE, progress: bool | None = None) -> Classification:
    """Classification of texts, or of (text, pair) rows when ``pairs`` is given (one str pairs
    with every text; one text with every pair)."""
    _check_head(model)
    if pairs is not None:
        if isinstance(texts, str) and not isinstance(pairs, str):
            texts = [texts] * len(pairs)
        elif isinstance(pairs, str) and not isinstance(texts, str):
            pairs = [pairs] * len(texts)
    return classify_encoded(model, model.encode_texts(texts, pairs, method="classify"),
                            batch_size=batch_size, progress=progress)


def classify_encoded(model: Model, encoded: EncodedTexts, *, batch_size: int = BATCH_SIZE,
                     progress: bool | None = None) -> Classification:
    """``classify`` of rows already encoded by ``Model.encode_texts`` (whose ``ids`` also give
    the token counts); logits [B, n_labels]."""
    _check_head(model)
    logits = np.zeros((len(encoded.ids), model.config.classifier.n_labels), np.float32)
    types = model.config.type_vocab_size > 0
    for rows in batches(len(encoded.ids), [len(i) for i in encoded.ids], batch_size, progress, "classify"):
        logits[rows] = class_logits(model, [encoded.ids[r] for r in rows],
                                    token_type_ids=[encoded.type_ids[r] for r in rows] if types else None)
    return result(model, logits)
