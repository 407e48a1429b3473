"""``tfport.flags``: command-line flags made from an options dataclass's fields, and back."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from tfport.flags import add_flags, flags, from_args, option, positive_int, to_args


def _even(text: str) -> int:
    value = int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"{text}: expected an even number")
    return value


@dataclass(frozen=True, kw_only=True)
class Toy:
    rows: int = option(16, type=positive_int, metavar="N", help="rows (default {default:,}; 100%)")
    scale: float = option(0.5, help="scale")
    name: str = option("cpu", choices=("cpu", "cuda"), help="where")
    limit: int | None = option(None, help="a limit (default: none)")
    chunk: int | None = option(256, none="0", help="chunk (0: whole)")
    pairs: int = option(2, flag=("--pairs", "-p"), type=_even, help="an alias")
    verbose: bool = option(False, help="say more")
    page: bool = option(True, group="server", help="do not serve the page")
    sym: bool | None = option(None, negatable=True, help="symmetric or not (default: per format)")
    origins: tuple[str, ...] = option((), flag="--origin", group="server", help="repeat for more")
    secret: str | None = option(None, flag=False, repr=False)


def parser(groups=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flags(p, Toy, groups)
    return p


def parse(*argv: str, groups=None, **values) -> Toy:
    return from_args(Toy, parser(groups).parse_args(argv), **values)


def test_flags_are_named_typed_and_defaulted_by_their_fields():
    by_field = {f.field: f for f in flags(Toy)}
    assert list(by_field) == ["rows", "scale", "name", "limit", "chunk", "pairs", "verbose", "page",
                              "sym", "origins"]  # in field order; secret is not a flag
    assert [by_field[n].names for n in ("rows", "pairs", "verbose", "page", "sym", "origins")] == [
        ("--rows",), ("--pairs", "-p"), ("--verbose",), ("--no-page",), ("--sym",), ("--origin",)]
    assert [by_field[n].kind for n in ("rows", "verbose", "page", "sym", "origins")] == [
        "value", "switch", "switch", "negatable", "append"]
    actions = {a.dest: a for a in parser()._actions}
    assert "secret" not in actions
    assert actions["rows"].metavar == "N" and actions["name"].choices == ("cpu", "cuda")
    assert actions["rows"].help == "rows (default 16; 100%%)"  # formatted, '%' kept for argparse
    assert "rows (default 16; 100%)" in " ".join(parser().format_help().split())


def test_no_flags_give_the_defaults_and_each_flag_its_value():
    assert parse() == Toy()
    assert parse("--rows", "4", "--scale=2", "--name", "cuda", "--limit", "-3", "--chunk", "64",
                 "-p", "6", "--verbose", "--no-page", "--no-sym", "--origin", "a", "--origin", "b",
                 secret="s") == Toy(rows=4, scale=2.0, name="cuda", limit=-3, chunk=64, pairs=6,
                                    verbose=True, page=False, sym=False, origins=("a", "b"), secret="s")
    assert parse("--chunk", "0").chunk is None and parse("--chunk", "00").chunk is None
    assert parse("--sym").sym is True


@pytest.mark.parametrize("argv, message", [
    (("--rows", "0"), "expected a positive integer"),
    (("--limit", "\uff11\uff16"), "expected an integer (ASCII digits 0-9)"),  # full-width 16
    (("--pairs", "3"), "expected an even number"),
    (("--name", "tpu"), "invalid choice"),
])
def test_a_bad_value_is_refused_by_its_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_groups_choose_the_flags_a_command_takes():
    assert parse(groups={None}) == Toy()  # a field whose flag the parser lacks keeps its default
    with pytest.raises(SystemExit):
        parse("--no-page", groups={None})
    assert parse("--no-page", groups={"server"}) == Toy(page=False)


@pytest.mark.parametrize("options", [
    Toy(), Toy(rows=4), Toy(limit=5), Toy(chunk=None), Toy(chunk=8), Toy(pairs=-4), Toy(scale=1e-7),
    Toy(verbose=True, page=False), Toy(sym=True), Toy(sym=False), Toy(origins=("-x", "b")),
    Toy(name="cuda", limit=-1, secret="not written"),
])
def test_options_written_as_flags_parse_back(options):
    argv = to_args(options)
    written = {a.split("=")[0].replace("--no-", "--") for a in argv}
    assert written == {f.names[0].replace("--no-", "--") for f in flags(Toy)
                       if getattr(options, f.field) != f.default}
    assert parse(*argv, secret=options.secret) == options


def test_to_args_writes_only_what_differs_from_the_default():
    assert to_args(Toy()) == []
    assert to_args(Toy(chunk=None, verbose=True, page=False, origins=("a", "b"))) == [
        "--chunk=0", "--verbose", "--no-page", "--origin=a", "--origin=b"]
    assert to_args(Toy(rows=4, page=False), groups={None}) == ["--rows=4"]


def test_a_value_no_flag_gives_is_refused():
    @dataclass(frozen=True)
    class Limits:
        timeout: float | None = option(10.0, help="seconds")
        hosts: tuple[str, ...] = option(("a",), help="hosts")

    with pytest.raises(ValueError, match=r"timeout=None: --timeout cannot give this value"):
        to_args(Limits(timeout=None))
    with pytest.raises(ValueError, match=r"hosts=\(\): --hosts cannot give this value"):
        to_args(Limits(hosts=()))


def test_every_field_is_declared_and_parseable():
    @dataclass(frozen=True)
    class Undeclared:
        rows: int = field(default=16)

    @dataclass(frozen=True)
    class NoParser:
        rows: int | str = option("auto", help="rows")

    @dataclass(frozen=True)
    class NotABoolDefault:
        on: bool | None = option(None, help="on")

    with pytest.raises(TypeError, match=r"Undeclared.rows: declare it with option"):
        flags(Undeclared)
    with pytest.raises(TypeError, match=r"NoParser.rows: no parser for .*option\(type=...\)"):
        flags(NoParser)
    with pytest.raises(TypeError, match=r"NotABoolDefault.on: a switch needs a bool default"):
        flags(NotABoolDefault)
