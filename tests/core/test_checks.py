"""The value kinds every check in tfport asks about (``tfport.config.checks``): a bool is never an
integer or a number; ``is_integer`` also takes numpy's integers, which indexing an array gives."""

from __future__ import annotations

import numpy as np
import pytest

from tfport.config.checks import is_int, is_integer, is_number

# value, is_int, is_integer, is_number
CASES = [
    (3, True, True, True),
    (0, True, True, True),
    (-2, True, True, True),
    (True, False, False, False),
    (False, False, False, False),
    (np.int64(3), False, True, False),
    (np.uint8(3), False, True, False),
    (np.bool_(True), False, False, False),
    (2.0, False, False, True),
    (np.float64(2.0), False, False, True),  # a float subclass
    (float("inf"), False, False, False),
    (float("nan"), False, False, False),
    ("3", False, False, False),
    (None, False, False, False),
]


@pytest.mark.parametrize("value, integer, integer_or_numpy, number", CASES, ids=repr)
def test_value_kinds(value, integer, integer_or_numpy, number):
    assert (is_int(value), is_integer(value), is_number(value)) == (integer, integer_or_numpy, number)
