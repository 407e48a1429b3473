"""``tfport export``'s flags are ``ExportOptions``' fields (``tfport.flags``): no flags give the
options' defaults, each flag as a user types it gives its field, and options written back as
flags parse to the same options. The flags that are not fields (source, --out, --seed,
--progress, --calibration-tokens) are the command's own."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("torch", reason="needs the 'export' extra: pip install -e '.[export]'")

from tfport.export.cli import run_export  # noqa: E402
from tfport.export.hessians import Calibration  # noqa: E402
from tfport.export.options import ExportOptions  # noqa: E402
from tfport.flags import flags, from_args, to_args  # noqa: E402

# One case or more per flag field (checked below, so a new option needs its case here).
CASES = [
    (("--dtype", "float16"), {"dtype": "float16"}),
    (("--opset", "21"), {"opset": 21}),
    (("--target", "portable"), {"target": "portable"}),
    (("--no-validate",), {"validate": False}),
    (("--tokenizer", "tok.json"), {"tokenizer": "tok.json"}),
    (("--force",), {"overwrite": True}),
    (("--quantize", "int4"), {"quantize": "int4"}),
    (("--quantize", "int8", "--block-size", "64"), {"quantize": "int8", "block_size": 64}),
    (("--symmetric",), {"symmetric": True}),
    (("--no-symmetric",), {"symmetric": False}),
    (("--kv-dtype", "float16"), {"kv_dtype": "float16"}),
    (("--quantize", "keep", "--activations", "float"), {"quantize": "keep", "activations": "float"}),
    (("--calibration", "none"), {"calibration": "none"}),
    (("--head-bits", "8"), {"head_bits": 8}),
    (("--head-block-size", "16"), {"head_block_size": 16}),
    (("--max-loss", "kl=0.05"), {"max_loss": "kl=0.05"}),
    (("--loss-text", "text.txt"), {"loss_text": "text.txt"}),
    (("--calibration-threads", "3"), {"calibration_threads": 3}),
]


def parser() -> argparse.ArgumentParser:
    from tfport.cli import build_parser

    parser = build_parser("export")
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["export"]


def parse(*flags_: str) -> argparse.Namespace:
    return parser().parse_args(["tiny-decoder", "--out", "out", *flags_])


def test_no_flags_give_the_default_options():
    args = parse()
    assert from_args(ExportOptions, args, show_progress=None) == ExportOptions()
    assert (args.source, args.out, args.seed, args.progress, args.calibration_tokens) == (
        "tiny-decoder", "out", 0, False, None)


@pytest.mark.parametrize("typed, fields", CASES, ids=lambda c: " ".join(c) if isinstance(c, tuple) else None)
def test_each_flag_gives_its_field_and_writes_back(typed, fields):
    options = from_args(ExportOptions, parse(*typed))
    assert options == ExportOptions(**fields)
    assert from_args(ExportOptions, parse(*to_args(options))) == options


def test_the_cases_cover_every_flag_field():
    covered = {field for _, fields in CASES for field in fields}
    assert covered == {flag.field for flag in flags(ExportOptions)}
    not_flags = {f.name for f in dataclasses.fields(ExportOptions)} - covered
    assert not_flags == {"chat_template", "embedding", "generation", "external_data_threshold", "show_progress"}


def test_the_command_makes_its_own_arguments_into_options(monkeypatch, capsys):
    """--calibration TEXT with --calibration-tokens becomes a ``Calibration``; --progress always
    shows the bar (None: only for large models)."""
    seen = {}

    def export(source, out, options, seed):
        seen.update(source=source, out=out, options=options, seed=seed)
        raise SystemExit(0)

    monkeypatch.setattr("tfport.export.cli.export_checkpoint_or_preset", export)
    with pytest.raises(SystemExit):
        run_export(parse("--calibration", "builtin", "--calibration-tokens", "100", "--progress", "--seed", "3"))
    assert seen["options"].calibration == Calibration("builtin", 100)
    assert seen["options"].show_progress is True and seen["seed"] == 3
    with pytest.raises(ValueError, match="--calibration-tokens=5: applies with --calibration builtin"):
        run_export(parse("--calibration-tokens", "5"))
    with pytest.raises(SystemExit):
        parse("--opset", "２１")  # full-width digits are refused, not read as 21
    assert "expected an integer" in capsys.readouterr().err
