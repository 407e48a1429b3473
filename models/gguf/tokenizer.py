"""Build a ``tokenizer.json`` (``tokenizers`` library) from a GGUF file's tokenizer metadata.

GGUF stores the vocabulary (``tokenizer.ggml.tokens``, with a type per token), BPE merges, scores,
special token ids and BOS/EOS flags, but no tokenizer.json. Two kinds of ``tokenizer.ggml.model``
are built, each the way transformers' GGUF tokenizer builds it, except for the text splitting:

* ``gpt2``: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet (every byte mapped to a
  printable character); a token written in plain UTF-8 instead is respelled byte by byte. Text is
  split by the regexes llama.cpp uses for the file's ``tokenizer.ggml.pre`` (``PRE_TOKENIZER_SPLITS``:
  Llama 3's, Qwen2's, StarCoder's single digits ... differ from GPT-2's, which transformers' GGUF
  tokenizer applies to every file), NFC-normalised first for Qwen2 as its Hugging Face tokenizer
  does, and mapped to the byte alphabet before the merges. An unknown name is refused (another
  split gives other ids than the model was trained on, silently); a file without the key gets
  GPT-2's.
* ``llama``: SentencePiece BPE. ``▁`` stands for a space and is prepended to the text (not after
  special tokens); characters outside the vocabulary fall back to ``<0xNN>`` byte tokens. Merges
  come from the file or, when it has none, from the vocabulary and the scores.

Tokens typed CONTROL (3) become special added tokens (matched whole, dropped when decoding with
``skip_special_tokens``), USER_DEFINED (4) plain added tokens; BOS / EOS are prepended / appended
when ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say so (``llama`` files add BOS unless
they say otherwise, as llama.cpp does).

Imports only ``tokenizers``: no torch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPACE_MARK = "\u2581"  # SentencePiece's visible space

# tokenizer.ggml.pre -> the regexes text is split with, one after the other, before byte-level BPE
# (llama.cpp's llama-vocab.cpp: each regex splits every piece the previous ones left, the text
# between matches staying a piece of its own, as tokenizers' Split "isolated" does).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's: Llama 3's with single digits
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _cased_words(suffix: str, digits: str) -> str:
    """o200k's split (Phi-4-mini's tokenizer.json) and Mistral's tekken: case-aware letter runs
    (with English contractions as ``suffix``), ``digits``, punctuation, newlines, spaces."""
    upper, lower = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    lead = r"[^\r\n\p{L}\p{N}]?"
    return (f"{lead}{upper}*{lower}+{suffix}|{lead}{upper}+{lower}*{suffix}|{digits}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


_GPT4O_SPLIT = _cased_words(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"\p{N}{1,3}")
_TEKKEN_SPLIT = _cased_words("", r"\p{N}")
_PRE_TOKENIZERS = [  # (names, regexes)
    (("gpt-2", "phi-2", "mpt", "olmo", "jais"), (_GPT2_SPLIT,)),
    # llama.cpp's own default
    (("default",), (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")),
    (("gpt-4o", "llama4"), (_GPT4O_SPLIT,)),
    (("tekken",), (_TEKKEN_SPLIT,)),
    (("bloom", "poro-chat", "gpt3-finnish"), (r" ?[^(\s|.,!?…。，、।۔،)]+",)),
    (("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"), (_LLAMA3_SPLIT,)),
    (("qwen2", "stablelm2", "deepseek-r1-qwen"), (_QWEN2_SPLIT,)),
    # StarCoder's family: every digit alone, then GPT-2's
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
     (r"\p{N}", _GPT2_SPLIT)),
    (("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]")),
]
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    name: regexes for names, regexes in _PRE_TOKENIZERS for name in names}
# Pre-tokenizers whose Hugging Face tokenizer normalises text to NFC first (Qwen2Tokenizer).
NFC_PRE_TOKENIZERS = ("qwen2",)
# Without tokenizer.ggml.pre (files older than the key): GPT-2's regex, as llama.cpp and
# transformers read them.
DEFAULT_PRE_TOKENIZER = "gpt-2"


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError("building a tokenizer from GGUF metadata needs the 'tokenizers' package "
                          "(pip install 'tfport[text]')") from None
    return tokenizers


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the others
    (control characters, space, ...) are shifted to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _meta(metadata: dict[str, Any], key: str, default: Any = None) -> Any:
    return metadata.get(f"tokenizer.ggml.{key}", default)


def _byte_level(metadata: dict[str, Any], origin: str):
    tk = _tokenizers()
    alphabet = set(byte_alphabet().values())
    spell = byte_alphabet()
    vocab = {}
    for index, token in enumerate(metadata["tokenizer.ggml.tokens"]):
        if not set(token) <= alphabet:  # written as UTF-8 text: respell its bytes
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in _meta(metadata, "merges", [])]
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                           continuing_subword_prefix="", end_of_word_suffix=""))
    pre = _meta(metadata, "pre")
    if pre is None:
        log.warning("%s: no tokenizer.ggml.pre; splitting text with GPT-2's regex", origin)
        pre = DEFAULT_PRE_TOKENIZER
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"{origin}: tokenizer.ggml.pre={pre!r} is not supported: its text splitting "
                         "is not known to tfport, and another one would give other token ids than "
                         f"the model was trained on; supported: {sorted(PRE_TOKENIZER_SPLITS)}")
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Sequence([
        *(tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated") for split in PRE_TOKENIZER_SPLITS[pre]),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre in NFC_PRE_TOKENIZERS:
        tokenizer.normalizer = tk.normalizers.NFC()
    tokenizer.decoder = tk.decoders.ByteLevel()
    return tokenizer, alphabet


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens of
    the vocabulary, the merged token's score deciding the order (higher first; then longer left
    part, longer right part; then the parts' ids)."""
    vocab: dict[str, int] = {}
    score: dict[str, float] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
        score[token] = scores[index]
    candidates = []
    for token in score:
        pairs = [(token[:k], token[k:]) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        candidates += [(left, right, score[token]) for left, right in pairs]
    candidates.sort(key=lambda c: (-c[2], -len(c[0]), -len(c[1])))  # stable: ids break ties
    return [(left, right) for left, right, _ in candidates]


def _sentencepiece(metadata: dict[str, Any], origin: str):
    tk = _tokenizers()
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if _meta(metadata, "merges") is not None:
        merges = [tuple(m.split(" ", 1)) for m in _meta(metadata, "merges")]
    else:
        scores = _meta(metadata, "scores")
        if scores is None:
            raise ValueError(f"{origin}: tokenizer.ggml.model='llama' without tokenizer.ggml.merges or "
                             "tokenizer.ggml.scores: the merges cannot be recovered")
        merges = merges_from_scores(tokens, scores)
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                           byte_fallback=True))
    prefix = bool(_meta(metadata, "add_space_prefix", True))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.Metaspace(
        replacement=SPACE_MARK, prepend_scheme="first" if prefix else "never", split=False)
    steps = [tk.decoders.Replace(SPACE_MARK, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    if prefix:
        steps.append(tk.decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = tk.decoders.Sequence(steps)
    return tokenizer, None


# tokenizer.ggml.model -> builder(metadata, origin) -> (Tokenizer, alphabet a control token must be
# spelled in to be added, or None for any).
TOKENIZER_MODELS: dict[str, Callable] = {"gpt2": _byte_level, "llama": _sentencepiece}


def _add_special_tokens(tokenizer, metadata: dict[str, Any], alphabet: set[str] | None) -> None:
    tk = _tokenizers()
    tokens = metadata["tokenizer.ggml.tokens"]
    types = _meta(metadata, "token_type") or [0] * len(tokens)
    named = {_meta(metadata, f"{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
    # A byte-level token not spelled in the byte alphabet would be added as a new id, past the
    # vocabulary the model has: llama.cpp mislabels some, so they are skipped.
    special = [t for i, (t, kind) in enumerate(zip(tokens, types))
               if (kind == TOKEN_TYPE_CONTROL or i in named)
               and (alphabet is None or set(t) <= alphabet)]
    tokenizer.add_special_tokens([tk.AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tokenizer.get_vocab()
    user = [t for t, kind in zip(tokens, types) if kind == TOKEN_TYPE_USER_DEFINED and t in vocab]
    tokenizer.add_tokens([tk.AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(tokenizer, metadata: dict[str, Any], kind: str) -> None:
    """Prepend BOS / append EOS as the file's flags say (``llama`` defaults to adding BOS)."""
    tk = _tokenizers()
    tokens = metadata["tokenizer.ggml.tokens"]
    ends = []
    for end, default in (("bos", kind == "llama"), ("eos", False)):
        token_id = _meta(metadata, f"{end}_token_id")
        if _meta(metadata, f"add_{end}_token", default) and token_id is not None:
            ends.append((end, tokens[token_id], token_id))
    bos = [f"{t}:0" for end, t, _ in ends if end == "bos"]
    eos = [f"{t}:0" for end, t, _ in ends if end == "eos"]
    single = " ".join([*bos, "$A:0", *eos])
    pair = " ".join([single, *(b.replace(":0", ":1") for b in bos), "$B:1",
                     *(e.replace(":0", ":1") for e in eos)])
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, i) for _, t, i in ends])


def build_tokenizer(metadata: dict[str, Any], origin: str = "gguf"):
    """A ``tokenizers.Tokenizer`` from GGUF metadata (key -> value, as ``GGUFFile.metadata``)."""
    kind = _meta(metadata, "model")
    if kind not in TOKENIZER_MODELS:
        raise ValueError(f"{origin}: tokenizer.ggml.model={kind!r} is not supported; tfport builds "
                         f"{sorted(TOKENIZER_MODELS)} tokenizers")
    if not _meta(metadata, "tokens"):
        raise ValueError(f"{origin}: no tokenizer.ggml.tokens (the vocabulary)")
    tokenizer, alphabet = TOKENIZER_MODELS[kind](metadata, origin)
    _add_special_tokens(tokenizer, metadata, alphabet)
    _post_processor(tokenizer, metadata, kind)
    return tokenizer


def tokenizer_json(metadata: dict[str, Any], origin: str = "gguf") -> str:
    """The ``tokenizer.json`` text of ``build_tokenizer``."""
    return build_tokenizer(metadata, origin).to_str()
