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
        # encode_batch, unlike encode, lets go of the GIL while it works: a server's event loop
        # keeps answering while a long text is tokenised in a worker thread (same ids).
        encoding, = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def encode_batch(self, texts: str | Sequence[str], argument: str = "texts") -> list[list[int]]:
        """Token ids of each text (unpadded); ``TypeError``/``ValueError`` naming ``argument``
        unless ``texts`` is a str or a non-empty sequence of str."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or isinstance(texts, (bytes, bytearray)):
            raise TypeError(f"{argument}: expected a str or a sequence of str, got "
                            f"{type(texts).__name__}")
        if not texts:
            raise ValueError(f"{argument}: expected at least one text, got an empty sequence")
        odd = sorted({type(t).__name__ for t in texts if not isinstance(t, str)})
        if odd:
            raise TypeError(f"{argument}: expected str items, got {odd}")
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self._tokenizer.decode([int(i) for i in ids],
                                      skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (e.g. ``"<|im_end|>"``), or None."""
        return self._tokenizer.id_to_token(int(token_id))

    def unknown_token(self) -> str | None:
        """The model's unknown token (BPE / WordPiece / Unigram), if it has one."""
        model = self._tokenizer.model
        unk = getattr(model, "unk_token", None)
        if unk is None and getattr(model, "unk_id", None) is not None:
            unk = self.token(model.unk_id)
        return unk

    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (BOS, EOS, ``<|im_end|>``, ...)."""
        return frozenset(i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special)


class TextStream:
    """Token ids in, text out as soon as it is final: each ``push`` returns the text the new id
    completes. Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or while
    decoding the longer id list rewrote text already returned (byte-level BPE can); ``finish``
    returns what is still held back. Special tokens are not shown."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decoded = self.tokenizer.decode(self.ids)
        if not decoded.startswith(self.shown) or decoded.endswith("\ufffd"):
            return ""
        piece, self.shown = decoded[len(self.shown):], decoded
        return piece

    def finish(self) -> str:
        """The rest of the text (on a new line if it rewrote what was shown)."""
        decoded = self.tokenizer.decode(self.ids)
        rest = decoded[len(self.shown):] if decoded.startswith(self.shown) else "\n" + decoded
        self.shown = decoded
        return rest


def cut_at_stop(tokens: Sequence[int], stop_token_ids: Sequence[int]) -> list[int]:
    """Tokens before the first stop id."""
    out = []
    for token in tokens:
        if int(token) in stop_token_ids:
            break
        out.append(int(token))
    return out
