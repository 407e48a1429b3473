"""Text in, text out: the export's ``tokenizer.json`` through the ``tokenizers`` library.

``tokenizers`` is optional (extra ``text``) and imported only when a tokenizer is used, so an
install without it still runs models on token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``path`` (a ``tokenizer.json``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"tokenizer: {str(self.path)!r} is not a file; expected a "
                             "tokenizer.json from the 'tokenizers' library")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("tokenizer: reading tokenizer.json needs the 'tokenizers' package "
                              "(pip install 'tfport[text]'); or pass token ids instead") from None
        try:
            self._tokenizer = Tokenizer.from_file(str(self.path))
        except Exception as err:  # tokenizers raises its own Exception type
            raise ValueError(f"tokenizer: could not read {str(self.path)!r}: {err}") from None
        # The runtime pads batches itself (left for decoders, right for encoders) and masks the
        # padding; padding configured in tokenizer.json (e.g. fixed to 128) would be averaged in.
        self._tokenizer.no_padding()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (unpadded)."""
        if isinstance(texts, str):
            texts = [texts]
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self._tokenizer.decode([int(i) for i in ids],
                                      skip_special_tokens=skip_special_tokens)
