"""OpenAI's ``logprobs`` shapes of a choice, from the ``TokenLogprob`` the engine records.

Completions (``logprobs: k``) answer ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}``: one entry per token, ``top_logprobs[i]`` a dict of the k most likely tokens'
texts and the chosen token's (so up to k + 1 entries, as OpenAI documents), ``text_offset[i]``
the characters of the choice's text before token i. With ``echo`` the prompt's tokens come first,
the first with ``null`` log-probabilities (nothing precedes it). Chat (``logprobs: true``,
``top_logprobs: k``) answers ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
A stream's chunk carries the entries of its own tokens. Log-probabilities are the model's (the
log-softmax of the raw logits, ``tfport.runtime.sampling``).

A token's text is its id decoded alone (special tokens shown); its ``bytes`` are its exact UTF-8
bytes, also for a byte-level BPE token that holds part of a character (decoded alone it would be
U+FFFD).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from ..sampling import TokenLogprob
from ..tokenizer import TextTokenizer

# (a chosen token's score, or None for a prompt's first token; characters before it in the text)
Scored = tuple[TokenLogprob | None, int]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_text(tokenizer: TextTokenizer | None, token: int) -> str:
    """The text of ``token`` decoded alone; ``token_id:<id>`` without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


def token_bytes(tokenizer: TextTokenizer | None, token: int) -> list[int]:
    """The UTF-8 bytes ``token`` stands for: of its text, or where that is incomplete (U+FFFD)
    of its vocabulary entry read as byte-level BPE or a ``<0xNN>`` byte token."""
    text = token_text(tokenizer, token)
    if "\ufffd" in text and tokenizer is not None:
        entry = tokenizer.token(token) or ""
        table = _byte_level_table()
        byte = _BYTE_TOKEN.fullmatch(entry)
        if byte:
            return [int(byte.group(1), 16)]
        if entry and all(c in table for c in entry):
            return [table[c] for c in entry]
    return list(text.encode("utf-8"))


def completion_logprobs(tokenizer: TextTokenizer | None, tokens: Sequence[int],
                        scored: Sequence[Scored]) -> dict:
    """The completions ``logprobs`` of ``tokens`` (ids) with their ``scored`` entries."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, (score, offset) in zip(tokens, scored):
        text = token_text(tokenizer, token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        if score is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(score.logprob)
        top = {token_text(tokenizer, i): value for i, value in score.top}
        top.setdefault(text, score.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokenizer: TextTokenizer | None, scored: Sequence[TokenLogprob]) -> dict:
    """The chat ``logprobs`` (``{"content": [...]}``) of the chosen tokens' ``scored`` entries."""

    def entry(token: int, logprob: float) -> dict:
        return {"token": token_text(tokenizer, token), "logprob": logprob,
                "bytes": token_bytes(tokenizer, token)}

    return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(i, v) for i, v in s.top]}
                        for s in scored]}
