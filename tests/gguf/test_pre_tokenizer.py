"""tokenizer.ggml.pre decides how byte-level BPE files split text (issue 26): a Qwen2 file against
transformers' ``Qwen2Tokenizer`` built from the same vocabulary and merges (GPT-2's split, which
transformers' GGUF tokenizer uses for every file, gives other ids); every name of the table
against llama.cpp's splitting written out with the ``regex`` module; unknown names refused."""

from __future__ import annotations

import pytest
import regex

from tfport.models.gguf import GGUFFile
from tfport.models.gguf.tokenizer import PRE_TOKENIZER_SPLITS, build_tokenizer, byte_alphabet

TEXTS = ["Hello world", "1234567 + 89 = 1234656; 3.14", "don't I'M we'll", "tabs\tand\nnew\r\n\nlines  ",
         "naïve café — 東京 ½ 🤖", "x...!!! ``code`` <a+b=c>", "   leading", "Ｃafé\u0301 composed"]
ENDOFTEXT = "<|endoftext|>"


def _vocabulary() -> tuple[list[str], list[str]]:
    """Byte-level tokens (GPT-2's alphabet) and merges with multi-digit tokens, so that splitting
    digits one by one (Qwen2) or in runs (GPT-2) gives different ids."""
    alphabet = list(byte_alphabet().values())
    space = byte_alphabet()[ord(" ")]
    merges = ["1 2", "12 3", "4 5", "Ġ 1", "Ġ1 2", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or",
              "Ġwor l", "Ġworl d", "' t", "' M", "c a", "ca f", "Ġ 8", "Ġ8 9", "3 .", "3. 1", "3.1 4"]
    merges = [m.replace("Ġ", space) for m in merges]
    tokens = alphabet + ["".join(m.split(" ")) for m in merges]
    return tokens, merges


def _write(path, pre: str | None):
    import gguf

    tokens, merges = _vocabulary()
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list([*tokens, ENDOFTEXT])
    writer.add_token_types([1] * len(tokens) + [3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path).metadata


def test_qwen2_file_splits_as_qwen2_tokenizer(tmp_path):
    from transformers import Qwen2Tokenizer

    tokens, merges = _vocabulary()
    theirs = Qwen2Tokenizer(vocab={t: i for i, t in enumerate([*tokens, ENDOFTEXT])},
                            merges=[tuple(m.split(" ")) for m in merges])
    ours = build_tokenizer(_write(tmp_path / "qwen2.gguf", "qwen2"), "qwen2.gguf")
    gpt2 = build_tokenizer(_write(tmp_path / "gpt2.gguf", "gpt-2"), "gpt2.gguf")
    for text in [*TEXTS, f"a{ENDOFTEXT}12"]:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
    differs = [t for t in TEXTS if gpt2.encode(t).ids != theirs(t)["input_ids"]]
    assert "1234567 + 89 = 1234656; 3.14" in differs  # GPT-2's digit runs meet other merges


def _llama_cpp_split(text: str, regexes: tuple[str, ...]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex splits every piece in turn; text between
    matches stays a piece."""
    pieces = [text]
    for pattern in regexes:
        split = []
        for piece in pieces:
            end = 0
            for match in regex.finditer(pattern, piece):
                split += [piece[end:match.start()]] if match.start() > end else []
                split += [match.group()] if match.group() else []
                end = match.end()
            split += [piece[end:]] if end < len(piece) else []
        pieces = split
    return pieces


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS))
def test_split_as_llama_cpp(tmp_path, pre):
    ours = build_tokenizer(_write(tmp_path / "t.gguf", pre), "t.gguf").pre_tokenizer
    spell = byte_alphabet()
    for text in TEXTS:
        expected = ["".join(spell[b] for b in piece.encode("utf-8"))
                    for piece in _llama_cpp_split(text, PRE_TOKENIZER_SPLITS[pre])]
        assert [piece for piece, _ in ours.pre_tokenize_str(text)] == expected, (pre, text)


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    metadata = _write(tmp_path / "odd.gguf", "deepseek-llm")
    with pytest.raises(ValueError, match=r"odd\.gguf: tokenizer\.ggml\.pre='deepseek-llm' is not supported"):
        build_tokenizer(metadata, "odd.gguf")
    default = build_tokenizer(_write(tmp_path / "old.gguf", None), "old.gguf")  # no key: GPT-2's
    gpt2 = build_tokenizer(_write(tmp_path / "gpt2.gguf", "gpt-2"), "gpt2.gguf")
    assert default.encode(TEXTS[1]).ids == gpt2.encode(TEXTS[1]).ids
