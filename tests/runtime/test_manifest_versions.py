"""Old manifests cannot switch the integrity checks off (issue 27, runtime finding 9): a format-3
manifest edited to claim format 2 is refused, and ``verify="full"`` (or ``"fast"``) refuses a
real format-2 export it cannot verify; ``--ids`` reads ASCII digits only."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from tfport.contract import MANIFEST_FILE
from tfport.runtime import load_model
from tfport.runtime.cli import parse_ids, parse_stop_ids

DEC = "decoder-rope"
PROMPT = [[1, 17, 33, 5]]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory) -> Path:
    """A decoder with the I/O of ``decoder-rope`` (same preset) but other weights (seed 1)."""
    from tfport.export import ExportOptions, export_model
    from tfport.models import build_model
    from tfport.presets import get_preset

    path = tmp_path_factory.mktemp("seed1") / "decoder-seed1"
    export_model(build_model(get_preset("tiny-decoder"), seed=1), path, ExportOptions(validate=False))
    return path


def edit_manifest(path: Path, change) -> None:
    data = json.loads((path / MANIFEST_FILE).read_text())
    change(data)
    (path / MANIFEST_FILE).write_text(json.dumps(data))


def swapped(exports, other_weights: Path, tmp_path: Path, change) -> Path:
    """A copy of ``decoder-rope`` with the other weights' decoder.onnx and ``change`` applied to
    its manifest."""
    path = tmp_path / "m"
    shutil.copytree(exports(DEC).path, path)
    shutil.copy(other_weights / "decoder.onnx", path / "decoder.onnx")
    edit_manifest(path, change)
    return path


def greedy(model) -> np.ndarray:
    return model.generate(PROMPT, max_new_tokens=8, temperature=0.0)


def test_the_swapped_graph_changes_the_tokens(exports, other_weights):
    """The premise: the swap is not harmless (otherwise the refusals below would prove nothing)."""
    original = greedy(load_model(exports(DEC).path))
    other = greedy(load_model(other_weights))
    assert original.shape == other.shape and not np.array_equal(original, other), (original, other)


@pytest.mark.parametrize("verify", ["full", "fast", "none"])
def test_a_format_3_manifest_claiming_format_2_is_refused(exports, other_weights, tmp_path, verify):
    path = swapped(exports, other_weights, tmp_path, lambda d: d.update(format_version=2))
    with pytest.raises(ValueError, match=r"format_version=2 but a 'files' section") as info:
        load_model(path, verify=verify)
    assert str(path / MANIFEST_FILE) in str(info.value)


@pytest.mark.parametrize("verify", ["full", "fast"])
def test_verify_refuses_a_format_2_export_it_cannot_check(exports, other_weights, tmp_path, verify):
    path = swapped(exports, other_weights, tmp_path,
                   lambda d: (d.pop("files"), d.update(format_version=2)))
    with pytest.raises(ValueError, match=rf"format 2\).*verify={verify!r} cannot check it.*"
                                         r"verify='none'"):
        load_model(path, verify=verify)


def test_verify_none_loads_a_format_2_export_with_a_warning(exports, other_weights, tmp_path, caplog):
    """What the refusals guard against: unverified, the swapped graph loads and generates the
    other weights' tokens."""
    path = swapped(exports, other_weights, tmp_path,
                   lambda d: (d.pop("files"), d.update(format_version=2)))
    with caplog.at_level(logging.WARNING, logger="tfport.runtime.opening"):
        model = load_model(path, verify="none")
    assert "manifest format 2" in caplog.text and "nothing is verified" in caplog.text
    np.testing.assert_array_equal(greedy(model), greedy(load_model(other_weights)))


def test_the_untouched_format_3_export_still_loads_verified(exports):
    assert load_model(exports(DEC).path, verify="full").manifest.files


# ------------------------------------------------------------------------------------- --ids
@pytest.mark.parametrize("text", [
    "\uff11,\uff12",  # full-width digits: int() reads them as 1, 2
    "1,\u0662",  # ARABIC-INDIC DIGIT TWO
    "\u0967",  # DEVANAGARI DIGIT ONE
    "1_0",  # int() reads 10
    "1,2\u00b2",  # a superscript: int() refuses it too
])
def test_ids_take_ascii_digits_only(text):
    with pytest.raises(argparse.ArgumentTypeError, match=r"--ids .*ASCII digits"):
        parse_ids(text)
    with pytest.raises(argparse.ArgumentTypeError, match=r"--stop .*ASCII digits"):
        parse_stop_ids(text)


@pytest.mark.parametrize("text, expected", [("1,2", [1, 2]), (" 3 , 40 ", [3, 40]), ("0", [0])])
def test_ascii_ids_are_read(text, expected):
    assert parse_ids(text) == expected == [int(part) for part in text.split(",")]


def test_the_command_line_refuses_full_width_ids(capsys):
    from tfport.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser("generate").parse_args(["generate", "DIR", "--ids", "\uff11,\uff12"])
    assert "ASCII digits" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "DIR", "--ids", "1", "--max-new-tokens", "１６"],
                                  ["serve", "DIR", "--port", "８０００"],
                                  ["serve", "DIR", "--max-rows", "１６"]])
def test_cli_numbers_are_ascii_digits(argv, capsys):
    """Python's int() reads full-width digits; every numeric CLI option refuses them instead."""
    from tfport.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser(argv[0]).parse_args(argv)
    err = capsys.readouterr().err
    assert "ASCII digits" in err or "expected an integer in [0, 65535]" in err, err
