"""No public function or method of tfport takes more than ``MAX_PARAMETERS`` parameters: past that,
related parameters belong together in a small frozen dataclass (an options object) or keyword
options, and a call site no longer reads as a row of positional values.

Read from the source with ``ast`` (nothing is imported). Public: a module-level function or a
method of a class whose name does not start with "_" (nor its class's; functions defined inside
functions are not counted). ``self`` / ``cls`` do not count; ``*args`` and ``**kwargs`` count one
each.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("tfport", "export", "runtime", "models", "tools")  # tools/: once it exists
MAX_PARAMETERS = 10

# Functions whose parameters are an operator's inputs, one for one: an onnxscript function that
# stands for an ONNX or ONNX Runtime contrib operator takes its inputs and attributes in the
# operator's order, so a graph node maps to the call. "path::qualified name" -> the operator.
OPERATOR_MIRRORS = {
    "export/targets/ort.py::FusedGroupQueryAttention": "com.microsoft GroupQueryAttention's inputs and attributes",
}
def parameter_count(args: ast.arguments, method: bool) -> int:
    names = [a.arg for a in args.posonlyargs + args.args]
    bound = method and bool(names) and names[0] in ("self", "cls")
    return len(names) - bound + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)


def public_functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """(qualified name, node, is a method) of every public function and method in ``tree``."""
    found = []

    def visit(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                found.append((prefix + node.name, node, in_class))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, f"{prefix}{node.name}.", True)
            elif isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:`, `try:`
                for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", ())),
                              getattr(node, "finalbody", [])):
                    visit(block, prefix, in_class)

    visit(tree.body, "", False)
    return found


def signatures() -> dict[str, tuple[int, int]]:
    """"path::qualified name" -> (parameters, line) of every public function under ``FOLDERS``."""
    counts = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for name, node, method in public_functions(tree):
                key = f"{path.relative_to(ROOT).as_posix()}::{name}"
                counts[key] = (parameter_count(node.args, method), node.lineno)
    return counts


def test_no_public_function_takes_more_than_ten_parameters():
    over = {key: found for key, found in signatures().items()
            if found[0] > MAX_PARAMETERS and key not in OPERATOR_MIRRORS}
    assert not over, (f"public functions with more than {MAX_PARAMETERS} parameters (group related ones in a "
                      "small frozen dataclass or keyword options): "
                      + "; ".join(f"{key} (line {line}): {n}" for key, (n, line) in sorted(over.items())))


def test_operator_mirrors_are_still_over_the_limit():
    """An entry of ``OPERATOR_MIRRORS`` names a function that exists and needs the exception."""
    found = signatures()
    stale = [key for key in OPERATOR_MIRRORS if found.get(key, (0,))[0] <= MAX_PARAMETERS]
    assert not stale, f"remove from OPERATOR_MIRRORS (gone, or within {MAX_PARAMETERS} parameters): {stale}"


@pytest.mark.parametrize("source, expected", [
    ("def f(a, b, *args, c, d=1, **kwargs): pass", {"f": 6}),
    ("class A:\n    def m(self, a, /, b): pass\n    @classmethod\n    def c(cls): pass\n"
     "    @staticmethod\n    def s(x, y): pass\n    def _private(self, a): pass\n", {"A.m": 2, "A.c": 0, "A.s": 2}),
    ("class _Hidden:\n    def m(self, a): pass\n", {}),
    ("def outer(a):\n    def inner(b, c): pass\n", {"outer": 1}),
    ("async def g(self, a): pass", {"g": 2}),  # a function's first `self` is an ordinary parameter
])
def test_counting(source, expected):
    found = {name: parameter_count(node.args, method) for name, node, method in public_functions(ast.parse(source))}
    assert found == expected
