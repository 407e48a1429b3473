"""tokenizer.json built from GGUF metadata encodes (and decodes) exactly as transformers' GGUF
tokenizer (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``): SmolLM2's byte-level BPE and
a tiny SentencePiece-style (``llama`` tokenizer model) vocabulary written in the test."""

from __future__ import annotations

import copy

import pytest
from tokenizers import Tokenizer, pre_tokenizers

from tfport.models.gguf import GGUFFile
from tfport.models.gguf.tokenizer import build_tokenizer, merges_from_scores

from .test_tiny import encoder
from .tiny import write_tiny_llama

HARD = [
    "Hello world", " leading space", "   three leading spaces", "trailing  ", "",
    "naïve café — 東京, Ελληνικά, русский 🤖🎉", "1234567 + 89 = 1234656; 3.14159", "don't I'm we'll",
    "tabs\tand\nnewlines\r\n\n", "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|>x<|im_end|>",
    "<s> literal specials </s>", "<|user|>hello<|end|><tool>", "x<|im_start|>y", "ﬁ ligature ½",
    "\u200bzero width", "the and the theory 12 112 1212",
]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12 + 30? Answer in café style 🤖"},
            {"role": "assistant", "content": "42."}, {"role": "user", "content": "  Thanks!"}]


def _same(ours: Tokenizer, theirs, texts) -> None:
    for text in texts:
        for special in (True, False):
            expected = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special).ids == expected, (text, special)
        ids = theirs(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip), (text, skip)


# SmolLM2's own tokenizer.json splits every digit off first, then GPT-2's byte-level regex
# (tokenizer.ggml.pre = "smollm"); transformers' GGUF tokenizer applies GPT-2's regex alone.
SMOLLM2_PRE_TOKENIZER = pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def test_smollm2_byte_level_bpe(smollm2, smollm2_hf_tokenizer):
    """Against transformers' GGUF tokenizer of the file with SmolLM2's own pre-tokenizer put
    back (transformers' own differs where a number follows a space: " ½")."""
    ours = Tokenizer.from_file(str(smollm2.tokenizer))
    theirs = copy.deepcopy(smollm2_hf_tokenizer)
    theirs.backend_tokenizer.pre_tokenizer = SMOLLM2_PRE_TOKENIZER
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    _same(ours, theirs, [*HARD, rendered])
    assert ours.encode("ﬁ ligature ½").ids != smollm2_hf_tokenizer("ﬁ ligature ½")["input_ids"]
    assert ours.get_vocab_size() == smollm2_hf_tokenizer.vocab_size == 49152  # nothing appended
    assert ours.token_to_id("<|im_end|>") == 2


@pytest.fixture(scope="module")
def sentencepiece_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-spm") / "tiny-spm.gguf"
    return write_tiny_llama(path, encoder(0), "F32").path


def test_sentencepiece_vocabulary(sentencepiece_file):
    from transformers import AutoTokenizer

    metadata = GGUFFile(sentencepiece_file).metadata
    assert "tokenizer.ggml.merges" not in metadata  # merges are recovered from the scores
    ours = build_tokenizer(metadata)
    theirs = AutoTokenizer.from_pretrained(str(sentencepiece_file.parent),
                                           gguf_file=sentencepiece_file.name)
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    _same(ours, theirs, [*HARD, rendered])
    assert ours.encode("the").ids[0] == 1  # BOS added, as llama.cpp does for SentencePiece
    assert "<0xF0>" in ours.encode("🤖").tokens  # byte fallback


def test_merges_from_scores_order():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0, 0, 0, -2.0, -1.0, -3.0]  # bc before ab; abc = ab + c or a + bc
    assert merges_from_scores(tokens, scores) == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_refuses_unknown_tokenizer_model():
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='rwkv' is not supported"):
        build_tokenizer({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
