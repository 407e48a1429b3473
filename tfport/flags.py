"""Command-line flags made from an options dataclass, so that a new option is one field.

Each field of a (frozen) options dataclass is declared with ``option(...)``: its default, its
help text and how it is spelled on the command line. From those fields, ``add_flags`` adds the
flags to an ``argparse`` parser, ``from_args`` makes the options from the parsed arguments, and
``to_args`` writes options back as arguments (to start another process with them)::

    @dataclass(frozen=True)
    class Options:
        rows: int = option(16, type=positive_int, help="rows at most (default {default})")
        ui: bool = option(True, help="do not serve the page")         # --no-ui
        key: str | None = option(None, flag=False)                     # set otherwise, not a flag

    add_flags(parser, Options)          # --rows N, --no-ui
    options = from_args(Options, parser.parse_args(argv))
    to_args(Options(rows=4))            # ["--rows=4"]

A field's flag is ``--`` + its name in kebab case, its value parsed by the type its annotation
names (``int``: ASCII digits only, ``float``, ``str``; ``X | None`` as ``X``), ``tuple[X, ...]`` a
repeatable flag (``action="append"``). A ``bool`` is a switch that sets the other value:
``--name`` when it defaults to False, ``--no-name`` when it defaults to True, both (argparse's
``BooleanOptionalAction``) with ``negatable=True``. ``option``'s arguments override each part;
the help text may name the field's default as ``{default}`` (a format field: ``{default:,}``).
Every field must be declared: one that is not a flag says so (``flag=False``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Collection, Sequence
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any

_ASCII_INT = re.compile(r"[+-]?[0-9]+")


def ascii_int(text: str) -> int:
    """An argparse type: an integer in ASCII digits (Python's ``int`` also reads the full-width
    ``１６`` and other scripts' digits, which a command line should refuse, not reinterpret)."""
    if not _ASCII_INT.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer (ASCII digits 0-9)")
    return int(text)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = ascii_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive integer")
    return value


# How a field's annotation is parsed when ``option`` gives no ``type``.
_PARSERS: dict[Any, Callable[[str], Any]] = {int: ascii_int, float: float, str: str}


def option(default: Any = MISSING, *, help: str | None = None, flag: bool | str | Sequence[str] = True,
           type: Callable[[str], Any] | None = None, metavar: str | None = None,
           choices: Sequence | None = None, none: str | None = None, negatable: bool = False,
           group: str | None = None, repr: bool = True) -> Any:
    """A dataclass field with its flag: ``dataclasses.field(default=..., metadata=...)``; an options
    dataclass is frozen and its defaults immutable (a tuple, not a list), so it takes no factory.

    ``flag``: True for ``--kebab-name`` (``--no-kebab-name`` for a bool that defaults to True),
    the flag's names (the first is the one ``to_args`` writes), or False when the field is not
    a flag. ``type``: parses the flag's text (default: from the annotation). ``none``: the text
    that stands for None (``type`` of it parses to the same value; e.g. "0" for "no limit").
    ``group``: a name ``add_flags`` can select by (commands that take only some of the options).
    ``metavar``, ``choices`` and ``help`` are argparse's (``help`` formatted with ``default=``)."""
    if not isinstance(flag, (bool, str)):
        flag = tuple(flag)
    metadata = {"help": help, "flag": flag, "type": type, "metavar": metavar,
                "choices": None if choices is None else tuple(choices), "none": none,
                "negatable": negatable, "group": group}
    return dataclasses.field(default=default, repr=repr, metadata=metadata)


@dataclass(frozen=True)
class Flag:
    """One field's flag, resolved. ``kind``: "value" (``--name VALUE``), "append" (repeatable,
    a tuple), "switch" (``--name`` or ``--no-name``: the other value of a bool) or "negatable"
    (both)."""

    field: str
    names: tuple[str, ...]
    kind: str
    default: Any
    parse: Callable[[str], Any] | None
    help: str | None = None
    metavar: str | None = None
    choices: tuple | None = None
    none: str | None = None
    group: str | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        help = None if self.help is None else self.help.format(default=self.default).replace("%", "%%")
        common = {"dest": self.field, "help": help}
        if self.kind == "switch":
            parser.add_argument(*self.names, action="store_false" if self.default else "store_true",
                                default=self.default, **common)
        elif self.kind == "negatable":
            parser.add_argument(*self.names, action=argparse.BooleanOptionalAction,
                                default=self.default, **common)
        else:
            parse = None if self.parse is str else self.parse
            parser.add_argument(*self.names, type=parse, metavar=self.metavar, choices=self.choices,
                                **({"action": "append", "default": None} if self.kind == "append"
                                   else {"default": self.default}), **common)

    def value(self, args: argparse.Namespace) -> Any:
        """The field's value from parsed arguments."""
        value = getattr(args, self.field)
        if self.kind == "append":
            return self.default if value is None else tuple(value)
        return value

    def arguments(self, value: Any) -> list[str]:
        """The arguments that parse to ``value`` (none for the default)."""
        if value == self.default:
            return []
        name = self.names[0]
        if self.kind == "switch" and isinstance(value, bool):
            return [name]
        if self.kind == "negatable" and isinstance(value, bool):
            return [name if value else "--no-" + name[2:]]
        if self.kind == "append" and value:
            return [f"{name}={item}" for item in value]
        if self.kind == "value" and (value is not None or self.none is not None):
            return [f"{name}={self.none if value is None else value}"]
        raise ValueError(f"{self.field}={value!r}: {name} cannot give this value")


@cache
def flags(cls: type) -> tuple[Flag, ...]:
    """The flags of options dataclass ``cls``, in field order (``TypeError`` for a field not
    declared with ``option``, or whose annotation names no parser and ``option`` gives none)."""
    hints = typing.get_type_hints(cls)
    resolved = []
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if "flag" not in meta:
            raise TypeError(f"{cls.__name__}.{field.name}: declare it with option(...) "
                            "(flag=False if it is not a flag)")
        if meta["flag"] is not False:
            resolved.append(_resolve(cls, field, hints[field.name]))
    return tuple(resolved)


def _resolve(cls: type, field: dataclasses.Field, hint: Any) -> Flag:
    meta = field.metadata
    default = field.default if field.default_factory is MISSING else field.default_factory()
    kebab = field.name.replace("_", "-")
    parse, kind = meta["type"], "value"
    base = _without_none(hint)
    if base is bool:
        kind = "negatable" if meta["negatable"] else "switch"
        if kind == "switch" and not isinstance(default, bool):
            raise TypeError(f"{cls.__name__}.{field.name}: a switch needs a bool default, got "
                            f"{default!r} (negatable=True for --x/--no-x)")
        parse = None
        kebab = "no-" + kebab if kind == "switch" and default else kebab
    elif typing.get_origin(base) is tuple and typing.get_args(base)[1:] == (Ellipsis,):
        kind = "append"
        parse = parse or _PARSERS.get(typing.get_args(base)[0])
    elif parse is None:
        parse = _PARSERS.get(base)
    if parse is None and kind not in ("switch", "negatable"):
        raise TypeError(f"{cls.__name__}.{field.name}: no parser for {hint!r}; give option(type=...)")
    flag = meta["flag"]
    names = (f"--{kebab}",) if flag is True else (flag,) if isinstance(flag, str) else flag
    if meta["none"] is not None:
        parse = _or_none(parse, meta["none"])
    return Flag(field.name, names, kind, default, parse, meta["help"], meta["metavar"],
                meta["choices"], meta["none"], meta["group"])


def _without_none(hint: Any) -> Any:
    """``X | None`` -> ``X``; anything else as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = tuple(a for a in typing.get_args(hint) if a is not type(None))
        return args[0] if len(args) == 1 else hint
    return hint


def _or_none(parse: Callable[[str], Any], none: str) -> Callable[[str], Any]:
    """``parse``, with None for text that parses as ``none`` does."""
    null = parse(none)

    def parse_or_none(text: str) -> Any:
        value = parse(text)
        return None if value == null else value

    parse_or_none.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid ... value"
    return parse_or_none


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
              groups: Collection[str | None] | None = None) -> None:
    """Add the flags of ``cls``'s fields to ``parser``, in field order; ``groups``: only the
    fields of these groups (``option(group=...)``; None, a field's default group), None: all."""
    for flag in flags(cls):
        if groups is None or flag.group in groups:
            flag.add_to(parser)


def from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """``cls`` from parsed arguments: each field whose flag the parser has from ``args``, the
    others their defaults or ``values``."""
    for flag in flags(cls):
        if flag.field not in values and hasattr(args, flag.field):
            values[flag.field] = flag.value(args)
    return cls(**values)


def to_args(options: Any, groups: Collection[str | None] | None = None) -> list[str]:
    """The flags that give ``options`` (as ``--name=value``; those at their default left out):
    ``from_args`` of them parsed gives ``options`` back, but for fields that are not flags
    (``ValueError`` for a value no flag can give)."""
    return [argument for flag in flags(type(options)) if groups is None or flag.group in groups
            for argument in flag.arguments(getattr(options, flag.field))]
