"""Validation of ``ModelConfig`` field groups that have their own concepts: DeBERTa's disentangled
positions, and the classification head and dropout fields. ``ModelConfig.__post_init__`` calls
them; each raises ``ValueError`` naming the field, the value and what was expected."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig

DISENTANGLED_TERMS = ("c2p", "p2c")  # content-to-position, position-to-content (DeBERTa)
CLASSIFIER_POOLINGS = ("cls", "mean", "last_eos")  # last_eos: encoder-decoder (BART)
# An encoder-decoder classifier's first decoder input: decoder_start_token_id (BART), or each row's
# last real token (mBART's shift_tokens_right: the language id its tokenizer appends).
CLASSIFIER_DECODER_STARTS = ("start_token", "last_token")
CLASSIFIER_ACTIVATIONS = ("tanh", "gelu", "gelu_tanh", "relu", "silu")


def reject(config: "ModelConfig", field: str, expected: str) -> None:
    """Raise the ``ValueError`` every config check raises: ``config.FIELD=VALUE: expected ...``."""
    raise ValueError(f"config.{field}={getattr(config, field)!r}: expected {expected}")


def is_int(value: object) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def validate_disentangled(config: "ModelConfig") -> None:
    """The ``disentangled_*`` fields: set only with ``position="disentangled"``, which needs an
    encoder with as many key/value heads as query heads (DeBERTa)."""
    def fail(field: str, expected: str) -> None:
        reject(config, field, expected)

    buckets, distance, terms = (config.disentangled_buckets, config.disentangled_max_distance,
                                config.disentangled_terms)
    if config.position != "disentangled":
        for field in ("disentangled_buckets", "disentangled_max_distance", "disentangled_terms"):
            if getattr(config, field) != config.__dataclass_fields__[field].default:
                fail(field, f"the default unless position='disentangled' (position={config.position!r})")
        return
    if config.family != "encoder":  # ENCODER_ONLY_POSITIONS
        fail("position", f"another position for family {config.family!r}: 'disentangled' (DeBERTa) "
             "is bidirectional and uncached, for family 'encoder'")
    if config.kv_heads != config.n_heads:
        fail("n_kv_heads", f"null or n_heads={config.n_heads} with position='disentangled' (each "
             "query head reads its own relative keys)")
    if buckets is not None and (not is_int(buckets) or buckets < 4 or buckets % 2):
        fail("disentangled_buckets", "an even integer >= 4, or null (relative positions clipped, "
             "not bucketed)")
    least = 1 if buckets is None else buckets // 2 + 2
    if not is_int(distance) or distance < least:
        fail("disentangled_max_distance", f"an integer >= {least}" + (
            "" if buckets is None else " (above disentangled_buckets // 2 + 1, where the "
            "logarithmic buckets start)"))
    if terms is not None and (not isinstance(terms, tuple) or not terms or len(set(terms)) != len(terms)
                              or not set(terms) <= set(DISENTANGLED_TERMS)):
        fail("disentangled_terms", f"a non-empty tuple of distinct terms from {list(DISENTANGLED_TERMS)}, "
             "or null (both)")


def validate_heads_and_training(config: "ModelConfig") -> None:
    """The classification head and dropout fields.

    ``n_labels`` > 0 adds a sequence classification head to an encoder (rerankers,
    cross-encoders, classifiers): the ``classifier_pooling`` state (``cls``: the first token,
    ``mean``: the mean over real tokens) -> dense [E, E] -> ``classifier_activation`` ->
    optional LayerNorm (``classifier_norm``, ModernBERT) -> out [E, n_labels]; ``labels`` names
    the classes (a checkpoint's ``id2label``). BERT's pooler followed by its classifier,
    RoBERTa's and DistilBERT's heads and DeBERTa's context pooler all have this form.
    An encoder-decoder classifies as BART's ``ForSequenceClassification`` does
    (``classifier_pooling="last_eos"``, the only pooling it takes): the decoder reads the
    input ids shifted right over the encoder's states, and the head reads the decoder's state
    at each row's last ``eos_token_id``. The decoder's first input is ``decoder_start_token_id`` (``classifier_decoder_start="start_token"``,
    BART) or each row's last real token (``"last_token"``: mBART, whose tokenizer ends each
    text with its language id).
    ``*_dropout`` are the probabilities of dropping embeddings (after their norm), attention
    probabilities, sublayer outputs before the residual add, and the FFN's hidden activations.
    """
    def fail(field: str, expected: str) -> None:
        reject(config, field, expected)

    if isinstance(config.n_labels, bool) or not isinstance(config.n_labels, int) or config.n_labels < 0:
        fail("n_labels", "a non-negative integer")
    if config.n_labels and config.family == "decoder":
        fail("n_labels", "0 unless family is 'encoder' or 'encoder-decoder' (family='decoder')")
    if config.classifier_pooling == "last_eos" and config.family != "encoder-decoder":
        fail("classifier_pooling", f"'cls' or 'mean' for family {config.family!r} ('last_eos' reads the "
             "decoder of an encoder-decoder)")
    if config.n_labels and config.family == "encoder-decoder":
        if config.classifier_pooling != "last_eos":
            fail("classifier_pooling", "'last_eos' for family 'encoder-decoder' (the decoder's state at "
                 "each row's last eos token, as BART's sequence classification)")
        if config.eos_token_id is None:
            fail("eos_token_id", "a token id with classifier_pooling='last_eos' (the head reads the "
                 "decoder at each row's last one)")
    if config.classifier_decoder_start not in CLASSIFIER_DECODER_STARTS:
        fail("classifier_decoder_start", f"one of {list(CLASSIFIER_DECODER_STARTS)}")
    if config.classifier_decoder_start != "start_token" and not (config.family == "encoder-decoder" and config.n_labels):
        fail("classifier_decoder_start", "'start_token' unless an encoder-decoder has a classification "
             "head (n_labels > 0)")
    if config.labels is not None:
        if not isinstance(config.labels, tuple) or not all(isinstance(x, str) for x in config.labels):
            fail("labels", "a tuple of label names or null")
        if len(config.labels) != config.n_labels:
            fail("labels", f"{config.n_labels} names (n_labels), got {len(config.labels)}")
    if config.classifier_pooling not in CLASSIFIER_POOLINGS:
        fail("classifier_pooling", f"one of {list(CLASSIFIER_POOLINGS)}")
    if config.classifier_activation not in CLASSIFIER_ACTIVATIONS:
        fail("classifier_activation", f"one of {list(CLASSIFIER_ACTIVATIONS)}")
    if not isinstance(config.classifier_norm, bool):
        fail("classifier_norm", "true or false")
    for field in ("embedding_dropout", "attention_dropout", "residual_dropout", "ffn_dropout"):
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            fail(field, "a probability in [0, 1)")
