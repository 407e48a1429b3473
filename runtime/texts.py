"""Texts (and text pairs) to token ids as an encoder checkpoint was trained on: truncated to its
length limit, in batches, saying when something was cut.

``SentenceTransformer.encode`` and ``CrossEncoder.predict`` truncate every input to
``max_seq_length`` tokens (special tokens included; pairs drop tokens from the longer side first)
and process texts in batches of 32; ``encode_texts`` does the same with ``tokenizers`` alone.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tfport.config.checks import is_integer

log = logging.getLogger(__name__)

BATCH_SIZE = 32  # sentence-transformers' default
# Show a progress bar (stderr) by default from this many batches on.
PROGRESS_MIN_BATCHES = 8


@dataclass
class EncodedTexts:
    """Token ids of each text (or pair), unpadded: ``ids`` and ``type_ids`` (segment 0 / 1 for
    pairs) per row, and which rows were truncated."""

    ids: list[list[int]]
    type_ids: list[list[int]]
    truncated: list[bool]


class TruncatingTokenizer:
    """The export's ``tokenizer.json`` with truncation at ``max_length`` tokens (longest first
    for pairs) and no padding; its own instance, so the model's other tokenizer is untouched."""

    def __init__(self, path: str | Path, max_length: int):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("texts: tokenizing needs the 'tokenizers' package (pip install "
                              "'tfport[text]'); or pass token ids instead") from None
        self.max_length = int(max_length)
        self._tokenizer = Tokenizer.from_file(str(path))
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(self.max_length, strategy="longest_first")

    def encode(self, texts: Sequence[str], pairs: Sequence[str] | None = None) -> EncodedTexts:
        inputs = list(texts) if pairs is None else list(zip(texts, pairs))
        encodings = self._tokenizer.encode_batch(inputs)
        return EncodedTexts([list(e.ids) for e in encodings], [list(e.type_ids) for e in encodings],
                            [bool(e.overflowing) for e in encodings])


def tokenizer_truncation(path: str | Path) -> int | None:
    """The truncation length configured in a ``tokenizer.json``, or None."""
    from tokenizers import Tokenizer

    truncation = Tokenizer.from_file(str(path)).truncation
    return int(truncation["max_length"]) if truncation else None


def check_texts(texts: str | Sequence[str], argument: str) -> list[str]:
    """One text or a sequence of texts -> a non-empty list of str, else ``TypeError``/``ValueError``."""
    if isinstance(texts, str):
        return [texts]
    if not isinstance(texts, Sequence):
        raise TypeError(f"{argument}: expected a str or a sequence of str, got {type(texts).__name__}")
    odd = [type(t).__name__ for t in texts if not isinstance(t, str)]
    if odd:
        raise TypeError(f"{argument}: expected str items, got {sorted(set(odd))}")
    if not texts:
        raise ValueError(f"{argument}: expected at least one text")
    return list(texts)


def batches(n: int, lengths: Sequence[int], batch_size: int, progress: bool | None, desc: str
            ) -> Iterator[np.ndarray]:
    """Row indices of each batch, longest rows first (rows of similar length share a batch, so
    little padding is computed), with a tqdm bar on stderr when ``progress`` (None: from
    ``PROGRESS_MIN_BATCHES`` batches on)."""
    if not is_integer(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: expected a positive integer")
    order = np.argsort(-np.asarray(lengths), kind="stable")
    chunks = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    show = len(chunks) >= PROGRESS_MIN_BATCHES if progress is None else bool(progress)
    yield from tqdm(chunks, desc=desc, unit="batch", file=sys.stderr, disable=not show, leave=False)


def report_truncation(truncated: Sequence[bool], max_length: int, why: str, method: str) -> None:
    """Log (warning) how many inputs were cut to ``max_length`` tokens."""
    count = sum(truncated)
    if count:
        rows = [i for i, t in enumerate(truncated) if t]
        shown = rows[:10] + (["..."] if len(rows) > 10 else [])
        log.warning("%s: %d of %d input(s) (index %s) were longer than %d tokens and were truncated "
                    "to %d (%s)", method, count, len(truncated), shown, max_length, max_length, why)
