"""Which optional encoder heads a Hugging Face checkpoint has, and its classification labels.

An encoder checkpoint may hold a pooler, an MLM head and a sequence classification head in any
combination (a ``*Model`` saved without its pooler, a ``*ForSequenceClassification``); the
tensor names say which when they are at hand, else the ``architectures`` class does.
"""

from __future__ import annotations

from tfport.config.classifier import ClassifierConfig

from .configs import refuse

# What each task class adds to its base model.
POOLER, MLM, CLASSIFIER = "pooler", "mlm", "classifier"


def present_heads(hf: dict, keys: frozenset[str] | None, head_keys: dict[str, str],
                  class_heads: dict[str, tuple[str, ...]], default_class: str) -> set[str]:
    """The heads of the checkpoint: those whose ``head_keys`` tensor is in ``keys``, or without
    keys those of its ``architectures`` class (``class_heads``)."""
    if keys is not None:
        return {head for head, key in head_keys.items() if key in keys}
    return set(class_heads[(hf.get("architectures") or [default_class])[0]])


def classifier_fields(hf: dict, present: bool, **options) -> dict:
    """``ModelConfig``'s ``classifier`` as keyword arguments: ``{"classifier":
    ClassifierConfig(...)}`` with ``options`` (``pooling``, ``activation`` ...: its other fields)
    and, when the head is ``present``, ``n_labels`` and ``labels`` (from ``id2label``)."""
    return {"classifier": ClassifierConfig(**(_labels(hf) if present else {}), **options)}


def _labels(hf: dict) -> dict:
    """``n_labels`` and ``labels`` from ``id2label`` / ``num_labels``."""
    id2label = hf.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            labels = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            refuse(hf, "id2label", id2label, "expected integer label ids")
        if sorted(labels) != list(range(len(labels))):
            refuse(hf, "id2label", id2label, "expected the label ids 0 .. n-1")
        n_labels = hf.get("num_labels", len(labels))
        if n_labels != len(labels):
            refuse(hf, "num_labels", n_labels, f"id2label names {len(labels)} labels")
        return {"n_labels": len(labels), "labels": tuple(labels[i] for i in range(len(labels)))}
    n_labels = int(hf.get("num_labels", 2))
    return {"n_labels": n_labels, "labels": None}
