"""``tfport export FILE.gguf``: the export carries the tokenizer and chat template built from the
GGUF metadata; Hugging Face directories' chat templates are picked up too."""

from __future__ import annotations

import json

from tfport.cli import main
from tfport.contract import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from tfport.export.source import _chat_template
from tfport.manifest import Manifest

from .test_tiny import encoder
from .tiny import CHAT_TEMPLATE, sentencepiece_vocab, write_tiny_llama


def test_cli_export_of_a_gguf_file(tmp_path, capsys):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", encoder(0), "Q8_0")
    out = tmp_path / "out"
    assert main(["export", str(tiny.path), "--out", str(out)]) == 0, capsys.readouterr().err
    manifest = Manifest.read(out)
    assert (manifest.tokenizer, manifest.chat_template) == (TOKENIZER_FILE, CHAT_TEMPLATE_FILE)
    assert (out / CHAT_TEMPLATE_FILE).read_text() == CHAT_TEMPLATE
    assert manifest.config.n_kv_heads == 2 and manifest.config.bos_token_id == 1

    from tfport.runtime import load_model
    from tfport.runtime.chat import chat_format

    model = load_model(out)
    tokens, _, _ = sentencepiece_vocab()
    assert model.tokenizer.encode("the") == [1, tokens.index("\u2581the")]  # BOS, "▁the"
    fmt = chat_format(model)
    assert fmt.stop_ids == (model.tokenizer._tokenizer.token_to_id("<|end|>"), 2)
    assert fmt.render([{"role": "user", "content": "hi"}]) == "<s><|user|>hi<|end|><|assistant|>"
    assert isinstance(model.chat([{"role": "user", "content": "hi"}], max_new_tokens=3), str)


def test_chat_template_of_checkpoint_directories(tmp_path):
    assert _chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert _chat_template(tmp_path) == "{{ x }}"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert _chat_template(tmp_path) == "D"
    (tmp_path / CHAT_TEMPLATE_FILE).write_text("J")  # the file wins, as in transformers
    assert _chat_template(tmp_path) == "J"
