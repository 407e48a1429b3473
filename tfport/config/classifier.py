"""The sequence classification head (rerankers, cross-encoders, classifiers).
``ModelConfig.classifier`` holds one; ``ModelConfig`` checks what needs the family and token ids."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import Part, is_int

CLASSIFIER_POOLINGS = ("cls", "mean", "last_eos")  # last_eos: encoder-decoder (BART)
# An encoder-decoder classifier's first decoder input: decoder_start_token_id (BART), or each row's
# last real token (mBART's shift_tokens_right: the language id its tokenizer appends).
CLASSIFIER_DECODER_STARTS = ("start_token", "last_token")
CLASSIFIER_ACTIVATIONS = ("tanh", "gelu", "gelu_tanh", "relu", "silu")


@dataclass(frozen=True)
class ClassifierConfig(Part):
    """A sequence classification head of ``n_labels`` classes (none when 0).

    On an encoder: the ``pooling`` state (``cls``: the first token, ``mean``: the mean over real
    tokens) -> dense [E, E] -> ``activation`` -> optional LayerNorm (``norm``, ModernBERT) ->
    out [E, n_labels]; ``labels`` names the classes (a checkpoint's ``id2label``). BERT's pooler
    followed by its classifier, RoBERTa's and DistilBERT's heads and DeBERTa's context pooler all
    have this form. An encoder-decoder classifies as BART's ``ForSequenceClassification`` does
    (``pooling="last_eos"``, the only pooling it takes): the decoder reads the input ids shifted
    right over the encoder's states, and the head reads the decoder's state at each row's last
    ``eos_token_id``. The decoder's first input is ``decoder_start_token_id``
    (``decoder_start="start_token"``, BART) or each row's last real token (``"last_token"``:
    mBART, whose tokenizer ends each text with its language id).
    """

    PATH = "classifier"

    n_labels: int = 0
    labels: tuple[str, ...] | None = None
    pooling: str = "cls"
    activation: str = "tanh"
    norm: bool = False
    decoder_start: str = "start_token"

    def __post_init__(self) -> None:
        check = self.checks()
        if not is_int(self.n_labels) or self.n_labels < 0:
            check.fail("n_labels", "a non-negative integer")
        if self.labels is not None:
            if not isinstance(self.labels, tuple) or not all(isinstance(x, str) for x in self.labels):
                check.fail("labels", "a tuple of label names or null")
            if len(self.labels) != self.n_labels:
                check.fail("labels", f"{self.n_labels} names (classifier.n_labels), got {len(self.labels)}")
        check.choice("pooling", CLASSIFIER_POOLINGS)
        check.choice("activation", CLASSIFIER_ACTIVATIONS)
        check.choice("decoder_start", CLASSIFIER_DECODER_STARTS)
        check.booleans("norm")
