"""tfport's import graph, read from the source with ``ast`` (nothing is imported): no cycles
between modules, and the layering the design asks for (the runtime never reaches torch, ONNX or
transformers; the core imports none of them at module level; each package imports only the ones
below it, ``LAYERS``, and the exporter reaches the runtime through one module, ``EXPORT_RUNTIME``).

Module names come from pyproject's ``[tool.setuptools.package-dir]`` (``models/hf/bart.py`` is
``tfport.models.hf.bart``); relative imports are resolved against the importing module.
``from P import n`` is an edge to the module ``P.n`` when there is one, else to ``P``.

What counts as an import differs per check, and each check says why:

* cycles: module-level imports first, i.e. what runs when the module is first imported
  (class bodies, ``try`` and ordinary ``if`` blocks included). Imports inside functions run on
  call, and imports under ``if TYPE_CHECKING:`` never run, so neither can close a cycle at import
  time. A second pass also counts the ``TYPE_CHECKING`` imports (a type-level cycle), a third the
  imports inside functions (but not the ``TYPE_CHECKING`` ones): a cycle hidden in a function still
  makes two modules that need each other (see ``test_no_import_cycles``). The implicit import of
  a module's parent package is not an edge (a package ``__init__`` that re-exports its submodules
  would otherwise be in a cycle with each).
* the layers (``LAYERS``, ``EXPORT_RUNTIME``, tools): every import statement, in functions and
  under ``TYPE_CHECKING`` too: a deferred import is still a dependency.
* the runtime: every import statement anywhere in ``runtime/`` (module level, inside functions and
  under ``TYPE_CHECKING``), since a deploy host lacks these packages and any code path reaching
  one would fail there; plus the module-level imports of every tfport
  module those reach, transitively (with parent packages, which do run first).
* the core (``tfport/``): module-level imports and what they reach transitively, since
  ``import tfport`` must work with the base install (numpy); a function of the core may import the
  packages above it lazily (``tfport.demo`` imports the exporter and the runtime; ``tfport.cli``
  imports each command's module by name).

``tests/runtime/test_no_torch.py`` proves the runtime works in a process where torch, onnx and
onnxscript cannot be imported, for the code paths it runs (load, generate, embed, the CLI); these
checks cover every module and every code path, without running them.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]
# What a deploy host lacks (the 'export' and 'dev' extras): the runtime never imports them, the
# core not at module level.
FORBIDDEN = ("torch", "onnx", "onnxscript", "transformers")
# tfport packages that import torch / onnx themselves (the reference modules and the exporter).
TORCH_PACKAGES = ("tfport.models", "tfport.export")
# The packages above the core, each with what it never imports (in functions and for type
# checkers too): docs/design.md's "Dependencies point one way". The core (``tfport`` outside them)
# imports none of them at module level (``test_core_imports_no_package_above_it_at_module_level``).
PACKAGES = ("tfport.models", "tfport.export", "tfport.runtime", "tfport.tools")
LAYERS = {
    "tfport.models": ("tfport.export", "tfport.runtime", "tfport.tools"),
    "tfport.export": ("tfport.runtime", "tfport.tools"),  # the runtime: through EXPORT_RUNTIME only
    "tfport.runtime": ("tfport.models", "tfport.export", "tfport.tools"),
}
# The modules of the exporter that may import the runtime: running an export it wrote (parity's
# sessions, a cache layout's relayout of parity inputs, --max-loss timing its candidates).
EXPORT_RUNTIME = ("tfport.export.validate",)


@dataclass(frozen=True)
class Import:
    """One imported name as written in ``module`` at ``line``: ``import base`` or
    ``from base import name``, ``base`` absolute (relative imports resolved)."""

    module: str
    base: str
    name: str | None
    line: int
    deferred: bool   # inside a function: runs when the function is called
    type_only: bool  # under ``if TYPE_CHECKING:``: never runs

    @property
    def target(self) -> str:
        """The dotted name imported: a module, or a name defined in one."""
        return self.base if self.name in (None, "*") else f"{self.base}.{self.name}"

    @property
    def at_import(self) -> bool:
        return not (self.deferred or self.type_only)


@cache
def source_modules() -> dict[str, Path]:
    """Every tfport module name -> its source file, from pyproject's package-dir mapping."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    modules = {}
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, package: str):
        self.module, self.package = module, package
        self.deferred = self.type_only = False
        self.imports: list[Import] = []

    def _add(self, base: str, name: str | None, line: int) -> None:
        self.imports.append(Import(self.module, base, name, line, self.deferred, self.type_only))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        deferred, self.deferred = self.deferred, True
        self.generic_visit(node)
        self.deferred = deferred

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        type_only, self.type_only = self.type_only, True
        for statement in node.body:
            self.visit(statement)
        self.type_only = type_only
        for statement in node.orelse:
            self.visit(statement)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, None, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            anchor = ".".join(parts[: len(parts) - node.level + 1])
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:
            self._add(base, alias.name, node.lineno)


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    path = source_modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    collector = _Collector(module, package)
    collector.visit(ast.parse(path.read_text(), filename=str(path)))
    return tuple(collector.imports)


def internal(target: str) -> str | None:
    """The tfport module an import target lands in: the longest known prefix (``P.n`` -> ``P``
    when ``n`` is a name defined in ``P``), or None outside tfport."""
    modules = source_modules()
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def parents(module: str) -> list[str]:
    """The packages Python imports before ``module`` (``tfport``, ``tfport.runtime``, ...)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def in_packages(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def counts(i: Import, type_only: bool, deferred: bool = False) -> bool:
    """Whether ``i`` is an edge of the graph: it runs at import (or, with ``type_only``, it is
    imported for type checkers, under ``if TYPE_CHECKING:``; with ``deferred``, inside a function)."""
    return i.at_import or (type_only and i.type_only and not i.deferred) or (deferred and i.deferred)


@cache
def import_graph(type_only: bool = False, deferred: bool = False) -> dict[str, frozenset[str]]:
    """tfport module -> the tfport modules its module-level imports name (self-imports dropped);
    with ``type_only``, its ``TYPE_CHECKING`` imports too; with ``deferred``, its imports inside
    functions too."""
    graph = {}
    for module in source_modules():
        targets = {internal(i.target) for i in imports_of(module) if counts(i, type_only, deferred)}
        graph[module] = frozenset(targets - {None, module})
    return graph


def strongly_connected(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def shortest_path(graph: dict[str, frozenset[str]], start: str, goal: str, within: set[str]) -> list[str]:
    """The shortest chain of edges start -> ... -> goal through ``within`` (breadth first)."""
    previous = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & within):
            if child == goal:
                chain = [child, node]
                while previous[chain[-1]] is not None:
                    chain.append(previous[chain[-1]])
                return chain[::-1]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"no path {start} -> {goal}")


def describe_cycle(component: list[str], type_only: bool, deferred: bool = False) -> str:
    """One cycle through the component's first module, each edge with the line that makes it
    (``in a function`` where that import is deferred)."""
    chain = shortest_path(import_graph(type_only, deferred), component[0], component[0], set(component))
    edges = []
    for a, b in zip(chain, chain[1:]):
        i = next(i for i in imports_of(a) if counts(i, type_only, deferred) and internal(i.target) == b)
        edges.append(f"{a} ({where(i)}{', in a function' if i.deferred else ''})")
    return " -> ".join(edges + [chain[-1]]) + f"   [component: {', '.join(component)}]"


def where(i: Import) -> str:
    """``file:line`` of an import, the file relative to the repository."""
    return f"{source_modules()[i.module].relative_to(ROOT)}:{i.line}"


def imports_into(importers: set[str], packages: tuple[str, ...]) -> list[tuple[Import, str]]:
    """Every import statement of ``importers`` (at any level) that lands in ``packages``, with the
    tfport module it lands in."""
    found = []
    for module in sorted(importers):
        for i in imports_of(module):
            target = internal(i.target)
            if target is not None and in_packages(target, packages):
                found.append((i, target))
    return found


def describe_edge(i: Import, target: str) -> str:
    kind = " (in a function)" if i.deferred else " (for type checkers)" if i.type_only else ""
    return f"{where(i)}: {i.module} imports {target}{kind}"


def test_module_names_cover_every_source_file():
    modules = source_modules()
    folders = ("tfport", "models", "export", "runtime", "tools")
    files = {path for folder in folders for path in (ROOT / folder).rglob("*.py")}
    assert set(modules.values()) == files
    assert {"tfport.config", "tfport.models.hf.bart", "tfport.export", "tfport.runtime.decoding",
            "tfport.tools.bench"} <= set(modules)


def test_imports_of_tfport_name_its_modules():
    """Every ``import tfport.X`` / ``from tfport.X import n`` (relative ones resolved) names a
    tfport module or package as X: a resolution slip would silently drop edges from the graph."""
    modules = source_modules()
    unknown = [f"{i.module}:{i.line} imports from {i.base}" for m in modules for i in imports_of(m)
               if i.base.split(".")[0] == "tfport" and i.base not in modules]
    assert not unknown, "\n".join(unknown)


@pytest.mark.parametrize("type_only, deferred", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["at-import", "with-type-checking", "with-function-level", "every-import"])
def test_no_import_cycles(type_only, deferred):
    """No cycle of module-level imports. ``with-type-checking`` also counts the imports under
    ``if TYPE_CHECKING:``: a cycle there cannot fail at import time, but it is still two modules
    that need each other (issue 22's ``export/emit.py`` <-> ``targets``: the targets imported
    ``StackInputs`` from ``emit``, which imported ``Target`` from them for its annotations).
    ``with-function-level`` also counts the imports inside functions, which hid five cycles
    (issue 42: the runtime's model / generation / decoding; ``export/budget.py`` timing its
    candidates with the exporter that calls it; parity's runner and ``localize``; the benchmark
    package and its CLI). ``every-import`` counts both (the model module calling the chat module
    in a function, which named ``Model`` for its annotations: it reads a ``Protocol`` now)."""
    graph = import_graph(type_only, deferred)
    cycles = [describe_cycle(c, type_only, deferred) for c in strongly_connected(graph)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("importer", sorted(LAYERS))
def test_packages_import_only_the_layers_below(importer):
    """``LAYERS``: the reference modules import neither the exporter, the runtime nor the tools;
    the runtime neither the reference modules, the exporter nor the tools; the exporter not the
    tools, and the runtime only from ``EXPORT_RUNTIME`` (where it runs an export it wrote).
    Every import statement counts, in functions too."""
    modules = {m for m in source_modules() if in_packages(m, (importer,))}
    bad = [describe_edge(i, target) for i, target in imports_into(modules, LAYERS[importer])
           if not (i.module in EXPORT_RUNTIME and in_packages(target, ("tfport.runtime",)))]
    assert not bad, f"{importer} imports a package above it:\n" + "\n".join(bad)


def test_export_reaches_the_runtime_through_its_allowed_modules_only():
    """``EXPORT_RUNTIME`` names modules of the exporter that exist and do import the runtime (an
    allow-list entry nothing needs is a hole for the next import)."""
    runtime_users = {i.module for i, _ in imports_into(set(EXPORT_RUNTIME), ("tfport.runtime",))}
    assert set(EXPORT_RUNTIME) <= set(source_modules()) and runtime_users == set(EXPORT_RUNTIME)


def test_only_tools_import_tools():
    """Nothing in the libraries imports ``tfport.tools`` (``tfport.cli`` names its commands'
    modules as strings)."""
    others = {m for m in source_modules() if not in_packages(m, ("tfport.tools",))}
    bad = [describe_edge(i, target) for i, target in imports_into(others, ("tfport.tools",))]
    assert not bad, "imports of tfport.tools outside it:\n" + "\n".join(bad)


def test_core_imports_no_package_above_it_at_module_level():
    """The core (``tfport/`` outside ``PACKAGES``) imports none of them when it is imported; its
    functions may (the CLI and the demo do, lazily)."""
    core = {m for m in source_modules() if not in_packages(m, PACKAGES)}
    bad = [describe_edge(i, target) for i, target in imports_into(core, PACKAGES) if i.at_import]
    assert not bad, "the core imports a package at module level:\n" + "\n".join(bad)


def reached(chains: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every tfport module whose module-level code runs when the modules of ``chains`` (module ->
    how it is imported) are imported, with the chain of imports that gets there (parent packages
    included: they run first). The walk stops at tfport.models / tfport.export."""
    graph = import_graph()
    chains = dict(chains)
    queue = deque(sorted(chains))
    while queue:
        module = queue.popleft()
        if in_packages(module, TORCH_PACKAGES):
            continue
        for child in sorted(graph[module] | set(parents(module))):
            if child not in chains:
                chains[child] = chains[module] + [child]
                queue.append(child)
    return chains


def forbidden_at_import(chains: dict[str, list[str]]) -> list[str]:
    """The modules reached that are tfport.models / tfport.export, or import a ``FORBIDDEN``
    package at module level, each with the chain that reaches it."""
    found = []
    for module, chain in sorted(chains.items()):
        via = " -> ".join(chain)
        if in_packages(module, TORCH_PACKAGES):
            found.append(f"{via} (the reference modules / exporter: torch and onnx)")
            continue
        found += [f"{via} imports {i.target} (line {i.line})" for i in imports_of(module)
                  if i.at_import and i.target.split(".")[0] in FORBIDDEN]
    return found


def runtime_modules() -> set[str]:
    return {m for m in source_modules() if in_packages(m, ("tfport.runtime",))}


def test_runtime_imports_no_torch_onnx_or_transformers_anywhere():
    """Every import statement of the runtime, in functions too."""
    bad = [f"{i.module}:{i.line} imports {i.target}" + (" (in a function)" if i.deferred else "")
           for m in sorted(runtime_modules()) for i in imports_of(m)
           if i.target.split(".")[0] in FORBIDDEN
           or in_packages(internal(i.target) or "", TORCH_PACKAGES)]
    assert not bad, "\n".join(bad)


def test_runtime_reaches_no_torch_through_tfport():
    """The tfport modules the runtime imports (at any level) import none of them at module level,
    transitively."""
    chains = {m: [m] for m in runtime_modules()}
    for m in sorted(runtime_modules()):
        for i in imports_of(m):
            target = internal(i.target)
            if target is not None and target not in chains:
                chains[target] = [f"{m}:{i.line}", target]
    bad = forbidden_at_import(reached(chains))
    assert not bad, "\n".join(bad)


def test_core_imports_no_torch_at_module_level():
    core = {m for m in source_modules() if not in_packages(m, PACKAGES)}
    bad = forbidden_at_import(reached({m: [m] for m in core}))
    assert not bad, "\n".join(bad)


def test_checks_see_deferred_and_type_checking_imports():
    """The collector's rules on a made-up module: what runs at import, what is deferred, what is
    for type checkers only, and how relative imports resolve."""
    source = ("import numpy\nfrom . import sibling\nfrom ..pkg import name\nif TYPE_CHECKING:\n"
              "    import torch\nelse:\n    import json\nclass C:\n    import os\n"
              "def f():\n    import onnx\n")
    collector = _Collector("tfport.runtime.decoding.mod", "tfport.runtime.decoding")
    collector.visit(ast.parse(source))
    seen = {i.target: (i.deferred, i.type_only) for i in collector.imports}
    assert seen == {"numpy": (False, False), "tfport.runtime.decoding.sibling": (False, False),
                    "tfport.runtime.pkg.name": (False, False), "torch": (False, True),
                    "json": (False, False), "os": (False, False), "onnx": (True, False)}


def test_cycle_finder_reports_a_cycle():
    graph = {k: frozenset(v) for k, v in
             {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}.items()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert shortest_path(graph, "a", "a", {"a", "b", "c"}) == ["a", "b", "c", "a"]
