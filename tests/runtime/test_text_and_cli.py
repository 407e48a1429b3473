"""Text in, text out (tokenizer.json), and the ``tfport generate`` / ``tfport embed`` commands."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from tfport.cli import build_parser, main
from tfport.runtime.cli import parse_ids
from tfport.runtime.tokenizer import cut_at_stop

pytest.importorskip("tokenizers", reason="text tests need the 'tokenizers' package (extra 'text')")

PROMPT = [1, 5, 7, 9, 11]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_text_round_trip(loaded):
    _, model = loaded("decoder-text")
    assert model.tokenizer is not None
    ids = model.tokenizer.encode("w5 w7 w9")
    assert ids == [1, 5, 7, 9]  # [BOS] from the template
    tokens = model.generate([ids], max_new_tokens=12)[0]
    expected = model.tokenizer.decode(cut_at_stop(tokens, model.stop_ids()))
    assert model.generate_text("w5 w7 w9", max_new_tokens=12) == expected
    assert model.generate_text(["w5 w7 w9", "w20"], max_new_tokens=12)[0] == expected


def test_embed_text(loaded):
    _, model = loaded("encoder-text")
    np.testing.assert_allclose(model.embed_text(["w5 w7", "w9"], normalize=True),
                               model.embed([[1, 5, 7], [1, 9]], normalize=True), rtol=1e-6)


@pytest.mark.parametrize("text, expected", [("1,2,3", [1, 2, 3]), (" 1, 5 ", [1, 5]), ("7", [7])])
def test_ids_parse(text, expected):
    assert parse_ids(text) == expected


@pytest.mark.parametrize("text", ["1,,2", "1,2,", ",", "", " ", "1 2", "1;2", "a"])
def test_ids_refused(text):
    # "1,,2" and "1 2" used to give [1, 2] and [12]
    with pytest.raises(argparse.ArgumentTypeError, match="--ids"):
        parse_ids(text)


def test_parsers_are_registered():
    for command in ("generate", "embed"):
        args = build_parser(command).parse_args([command, "DIR", "--ids", "1,2"])
        assert args.ids == [[1, 2]] and callable(args.func)


def test_cli_generate_ids(loaded, capsys):
    exported, model = loaded("decoder-rope")
    code, out, _ = run_cli(capsys, "generate", str(exported.path), "--ids", "1,5,7,9,11",
                           "--ids", "1,20", "--max-new-tokens", "10")
    assert code == 0
    tokens = model.generate([PROMPT, [1, 20]], max_new_tokens=10)
    stops = model.stop_ids()
    expected = []
    for row in tokens:
        kept = cut_at_stop(row, stops)
        expected.append(",".join(map(str, [*kept, *row[len(kept):len(kept) + 1]])))
    assert out.splitlines() == expected


def test_cli_stream_equals_batch_output(loaded, capsys):
    exported, _ = loaded("encoder-decoder")
    base = ["generate", str(exported.path), "--ids", "1,5,7,9,11", "--max-new-tokens", "12",
            "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--seed", "4"]
    code, plain, _ = run_cli(capsys, *base)
    assert code == 0
    code, streamed, _ = run_cli(capsys, *base, "--stream")
    assert code == 0 and streamed == plain


def test_cli_text(loaded, capsys):
    exported, model = loaded("decoder-text")
    code, out, _ = run_cli(capsys, "generate", str(exported.path), "--text", "w5 w7 w9",
                           "--max-new-tokens", "12")
    assert code == 0
    assert out == model.generate_text("w5 w7 w9", max_new_tokens=12) + "\n"
    code, streamed, _ = run_cli(capsys, "generate", str(exported.path), "--text", "w5 w7 w9",
                                "--max-new-tokens", "12", "--stream")
    assert code == 0 and streamed == out


def test_cli_progress_bar_on_stderr(loaded, capsys):
    exported, _ = loaded("decoder-rope")
    code, out, err = run_cli(capsys, "generate", str(exported.path), "--ids", "1,5",
                             "--max-new-tokens", "40")
    assert code == 0 and "generate" in err and "generate" not in out


def test_cli_embed(loaded, capsys):
    exported, model = loaded("encoder")
    code, out, _ = run_cli(capsys, "embed", str(exported.path), "--ids", "1,5,7", "--ids", "1,9",
                           "--pooling", "cls", "--normalize")
    assert code == 0
    rows = np.array([json.loads(line) for line in out.splitlines()])
    expected = model.embed([[1, 5, 7], [1, 9]], pooling="cls", normalize=True)
    np.testing.assert_allclose(rows, expected, atol=1e-6)


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "{missing}", "--ids", "1,2"], "model_dir="),
    (["generate", "{dec}", "--text", "hello"], "--text:"),
    (["generate", "{dec}", "--ids", "1,2", "--ids", "3", "--stream"],
     "--stream: expects one prompt"),
    (["generate", "{dec}", "--ids", "1,200"], "input_ids"),
    (["generate", "{dec}", "--ids", "1,2", "--max-new-tokens", "100"], "max_new_tokens"),
    (["embed", "{dec}", "--ids", "1,2"], "no encoder graph"),
])
def test_cli_errors(argv, fragment, loaded, capsys, tmp_path):
    dec = str(loaded("decoder-rope")[0].path)
    argv = [a.format(missing=tmp_path / "missing", dec=dec) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert f"tfport {argv[0]}: error:" in err and fragment in err


def test_cli_rejects_malformed_ids(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "DIR", "--ids", "1,x"])
    assert info.value.code == 2 and "comma-separated integers" in capsys.readouterr().err
