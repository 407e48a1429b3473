"""Tiny models that read text: a word-level tokenizer of the built-in calibration text and a
decoder / encoder with every parameter perturbed (shared by the calibration and budget tests)."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import torch

from tfport.export import hessians as activations
from tfport.models import build_model


def word_tokenizer(vocab_size: int, path: Path | None = None):
    """A word-level tokenizer of the calibration text's most frequent words (the rest [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = re.findall(r"\w+|[^\w\s]", activations.Calibration().read())
    common = [w for w, _ in collections.Counter(words).most_common(vocab_size - 4)]
    vocab = {s: i for i, s in enumerate(["[PAD]", "[BOS]", "[EOS]", "[UNK]"] + common)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if path is not None:
        tokenizer.save(str(path))
    return tokenizer


def perturbed(config):
    model = build_model(config, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


