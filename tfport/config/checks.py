"""The vocabulary every config check speaks: one ``ValueError`` form, ``config.PATH=VALUE:
expected ...``, where PATH is the field's full path (``d_model``, ``rope.scaling_factor``), and the
few kinds of value a field can expect. ``ModelConfig`` and each of its parts validate with these."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar


def is_int(value: object) -> bool:
    """A Python integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integer(value: object) -> bool:
    """An integer that is not a bool: a Python int, or a numpy integer (``np.int64(3)``, what
    indexing an array gives). numpy registers its integer types as ``numbers.Integral`` (its bool
    is not one), so this needs no numpy import."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def reject(path: str, value: Any, expected: str) -> NoReturn:
    """Raise the ``ValueError`` every config check raises."""
    raise ValueError(f"config.{path}={value!r}: expected {expected}")


class Checks:
    """Checks on the fields of ``owner`` (a ``ModelConfig`` or one of its parts), whose messages
    name each field under ``prefix`` (``"rope."``: ``config.rope.theta=...``)."""

    def __init__(self, owner: Any, prefix: str = "") -> None:
        self.owner, self.prefix = owner, prefix

    def fail(self, field: str, expected: str) -> NoReturn:
        reject(self.prefix + field, getattr(self.owner, field), expected)

    def choice(self, field: str, options: tuple) -> None:
        if getattr(self.owner, field) not in options:
            self.fail(field, f"one of {list(options)}")

    def booleans(self, *fields: str) -> None:
        for field in fields:
            if not isinstance(getattr(self.owner, field), bool):
                self.fail(field, "true or false")

    def positive_ints(self, *fields: str, optional: bool = False) -> None:
        self._positive(fields, is_int, "a positive integer", optional)

    def positive_numbers(self, *fields: str, optional: bool = False) -> None:
        self._positive(fields, is_number, "a positive finite number", optional)

    def _positive(self, fields: tuple[str, ...], kind: Callable[[object], bool], expected: str,
                  optional: bool) -> None:
        for field in fields:
            value = getattr(self.owner, field)
            if not (optional and value is None) and (not kind(value) or value <= 0):
                self.fail(field, expected + " or null" * optional)

    def non_negative_ints(self, *fields: str) -> None:
        for field in fields:
            if not is_int(getattr(self.owner, field)) or getattr(self.owner, field) < 0:
                self.fail(field, "a non-negative integer")

    def defaults(self, fields: tuple[str, ...], expected: str) -> None:
        """Each of ``fields`` at its dataclass default, else ``expected`` names when it may differ."""
        for field in fields:
            if getattr(self.owner, field) != self.owner.__dataclass_fields__[field].default:
                self.fail(field, expected)


P = TypeVar("P", bound="Part")


class Part:
    """A frozen group of related ``ModelConfig`` fields (``RopeConfig`` ...), held at
    ``ModelConfig.<PATH>``; it validates its own fields on construction."""

    PATH = ""

    def checks(self) -> Checks:
        return Checks(self, f"{self.PATH}.")

    def replace(self: P, **changes: Any) -> P:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)
