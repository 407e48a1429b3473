"""Chat: the export's template rendered as transformers renders it, end-of-turn stops, streamed
text without partial characters, ``Model.chat`` on SmolLM2-135M-Instruct, and ``tfport chat`` in
a subprocess where torch cannot be imported."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tfport.runtime.chat import ChatFormat, chat_format
from tfport.runtime.tokenizer import TextStream, TextTokenizer

from ..gguf.smollm2 import smollm2_export, smollm2_path
from .test_no_torch import blocked_env

pytest.importorskip("jinja2", reason="chat needs the 'jinja2' package (extra 'text')")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TURNS = ["What is the capital of France?", "And of Germany?"]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_model(tmp_path_factory):
    from tfport.runtime import load_model

    return load_model(smollm2_export(tmp_path_factory))


def test_render_and_prompt_ids_match_transformers(smollm2_model):
    from transformers import AutoTokenizer

    path = smollm2_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    fmt = chat_format(smollm2_model)
    conversations = [MESSAGES, [{"role": "system", "content": "Be terse."}, *MESSAGES,
                                {"role": "assistant", "content": "Paris."},
                                {"role": "user", "content": "Café? 🤖"}]]
    for messages in conversations:
        assert fmt.render(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
        expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert fmt.prompt_ids(messages) == list(expected)
    assert fmt.stop_ids == (2,)  # <|im_end|>, which is also EOS


def _tiny_tokenizer(tmp_path) -> TextTokenizer:
    """The SentencePiece vocabulary of tests/gguf/tiny.py: control tokens <|end|> etc."""
    from tfport.models.gguf.tokenizer import build_tokenizer

    from ..gguf.tiny import sentencepiece_vocab

    tokens, scores, types = sentencepiece_vocab()
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    path = tmp_path / "tokenizer.json"
    build_tokenizer(metadata).save(str(path))
    return TextTokenizer(path)


@pytest.mark.parametrize("template, stops", [
    # end of turn = the first special token after the assistant's text, plus EOS (2)
    ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}", ("<|end|>", "</s>")),
    ("{% for m in messages %}{{ m.content }} </s>{% endfor %}", ("</s>",)),
    # a template that refuses a conversation without a system message is probed with one
    ("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
     "{% for m in messages %}{{ m.content }}<|end|>\n{% endfor %}", ("<|end|>", "</s>")),
])
def test_end_of_turn_ids(tmp_path, template, stops):
    tokenizer = _tiny_tokenizer(tmp_path)
    fmt = ChatFormat(template, tokenizer, bos_token_id=1, eos_token_id=2)
    assert fmt.stop_ids == tuple(tokenizer._tokenizer.token_to_id(t) for t in stops)


def test_template_errors_and_bad_messages(tmp_path):
    tokenizer = _tiny_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        ChatFormat("{% for %}", tokenizer, 1, 2)
    fmt = ChatFormat("{{ raise_exception('only one role') if messages|length > 1 }}{{ bos_token }}",
                     tokenizer, 1, 2)
    assert fmt.render(MESSAGES) == "<s>"
    with pytest.raises(ValueError, match="refused them: only one role"):
        fmt.render(MESSAGES * 2)
    for bad in ("hi", [], [{"role": "user"}], [{"role": "user", "content": 3}]):
        with pytest.raises(TypeError, match="messages"):
            fmt.render(bad)


def test_text_stream_never_shows_partial_characters(smollm2_model):
    tokenizer = smollm2_model.tokenizer
    text = "Robots 🤖 and café — 東京!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the emoji's first byte tokens were held back
    assert "".join(pieces) + stream.finish() == text


def test_model_chat_answers(smollm2_model):
    reply = smollm2_model.chat(MESSAGES, max_new_tokens=MAX_NEW_TOKENS)
    assert "Paris" in reply and "<|im_end|>" not in reply
    pieces = list(smollm2_model.chat_stream(MESSAGES, max_new_tokens=MAX_NEW_TOKENS))
    assert "".join(pieces) == reply
    assert len(pieces) < MAX_NEW_TOKENS  # stopped at the end of the turn


def test_chat_needs_a_template(loaded, capsys, monkeypatch):
    _, model = loaded("decoder-text")
    with pytest.raises(ValueError, match="no chat template"):
        model.chat(MESSAGES)
    # the CLI says so before reading any input (it used to wait, and exit 0 on an empty stdin)
    from tfport.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["chat", str(model.directory)]) == 2
    assert "no chat template" in capsys.readouterr().err


def test_cli_chat_without_torch(smollm2_model, tmp_path):
    """Scripted stdin, two turns; the replies equal ``Model.chat``'s."""
    directory = str(smollm2_model.directory)
    command = [sys.executable, "-m", "tfport", "chat", directory,
               "--max-new-tokens", str(MAX_NEW_TOKENS)]
    env = blocked_env(tmp_path)
    proc = subprocess.run(command, input="\n".join(TURNS) + "\n", env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    messages, expected = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        expected.append(smollm2_model.chat(messages, max_new_tokens=MAX_NEW_TOKENS))
        messages.append({"role": "assistant", "content": expected[-1]})
    assert proc.stdout == "".join(reply + "\n" for reply in expected)
    assert "Paris" in expected[0] and "Berlin" in expected[1]


def test_cli_chat_one_message(smollm2_model, capsys):
    from tfport.cli import main

    argv = ["chat", str(smollm2_model.directory), "--max-new-tokens", str(MAX_NEW_TOKENS),
            "--message", TURNS[0], "--system", "Answer in one word."]
    assert main(argv) == 0
    system = [{"role": "system", "content": "Answer in one word."}, MESSAGES[0]]
    assert capsys.readouterr().out == smollm2_model.chat(system, max_new_tokens=MAX_NEW_TOKENS) + "\n"
