"""The quantisation registry (``tfport.export.quant.FORMATS``) is where a format's name is defined
and looked up: the CLI offers its names, every format round-trips its manifest entry and exports
a GGUF source, an unknown name is refused with the choices, and no module outside
``export/quant/`` compares a format's name or tests a scheme's class (read with ``ast``).

The format cases parametrise over ``FORMATS``, so a new format is tested without editing them.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the exporter needs the 'export' extra")

import tfport.export.calibrate  # noqa: E402,F401  (PrecomputedQuantization: a scheme class too)
from tfport.export import ExportOptions, export_checkpoint_or_preset  # noqa: E402
from tfport.export.quant import FORMATS, QuantFormat, Quantization, get_format, resolve_scheme  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUANT = ROOT / "export" / "quant"
SOURCES = ("tfport", "models", "export", "runtime")  # the packages, tests aside
# Attributes of a scheme that many other objects have too: asking for them is no dispatch.
GENERIC_ATTRIBUTES = {"name", "check", "to_dict", "report"}


@pytest.fixture(scope="module")
def gguf_source(tmp_path_factory) -> str:
    """A tiny Q4_0 GGUF file: a source every format exports (keep keeps its blocks)."""
    gguf = pytest.importorskip("gguf", reason="writing a GGUF file needs gguf-py (the 'dev' extra)")
    from ..gguf.tiny import write_tiny_llama

    def encode(values, kind):  # gguf-py's own quantiser
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])

    return str(write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf", encode, "Q4_0").path)


def _scheme(fmt: QuantFormat, source: str) -> Quantization:
    """``fmt``'s scheme with its defaults, bound to ``source`` where the format needs one."""
    return fmt.for_source(source, "float32") or fmt.parse()


# ------------------------------------------------------------------------------ choices
def test_cli_and_benchmark_choices_are_the_registry():
    from tfport.cli import build_parser
    from tfport.tools.bench.compare import QUANTIZED_FORMATS

    parser = build_parser(None)
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    quantize = next(a for a in commands["export"]._actions if "--quantize" in a.option_strings)
    assert list(quantize.choices) == list(FORMATS)
    assert all(re.search(rf"\b{name}\b", quantize.help) for name in FORMATS), quantize.help
    assert set(FORMATS) <= set(QUANTIZED_FORMATS)
    assert all(name.removesuffix("-asym") in FORMATS for name in QUANTIZED_FORMATS)


def test_registry_entries_are_named_by_their_key():
    assert FORMATS and all(isinstance(fmt, QuantFormat) and fmt.name == name for name, fmt in FORMATS.items())


# ------------------------------------------------------------------------------ each format
@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_round_trips_its_manifest_entry(name, gguf_source):
    fmt = FORMATS[name]
    scheme = _scheme(fmt, gguf_source)
    assert isinstance(scheme, Quantization) and scheme.name == name
    assert 0 < scheme.bytes_per_value() < 4  # less than float32's, for the memory estimate
    entry = scheme.to_dict()
    assert entry["format"] == name and json.loads(json.dumps(entry)) == entry  # what manifest.json holds
    assert get_format(entry["format"]) is fmt
    assert fmt.from_manifest(entry, gguf_source).to_dict() == entry
    assert isinstance(fmt.describe(entry), str) and fmt.describe(entry)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_exports_validates_and_passes_parity(name, gguf_source, tmp_path):
    """Through ``export_checkpoint_or_preset`` (which binds keep to its file) and validation
    against the scheme's reference; ``tfport parity`` rebuilds that reference from the manifest
    entry (``from_manifest``); the CLI's phrase is the format's."""
    from tfport.cli import main
    from tfport.export.cli import describe_quantization

    manifest = export_checkpoint_or_preset(gguf_source, tmp_path / name, ExportOptions(
        quantize=name, calibration="none"))
    assert manifest.quantization["format"] == name
    assert describe_quantization(manifest.quantization) == FORMATS[name].describe(manifest.quantization)
    assert main(["parity", str(tmp_path / name), "--against", gguf_source, "--providers", "cpu"]) == 0


# ------------------------------------------------------------------------------ refusals
def test_an_unknown_name_is_refused_with_the_choices():
    expected = re.escape(f"quantize='int3': expected one of {list(FORMATS)}")
    with pytest.raises(ValueError, match=expected):
        get_format("int3")
    with pytest.raises(ValueError, match=expected):
        resolve_scheme("int3")
    with pytest.raises(ValueError, match=re.escape(f"quantization['format']='q9': expected one of {list(FORMATS)}")):
        get_format("q9", "quantization['format']")
    with pytest.raises(TypeError, match="quantize=3: expected None, one of"):
        resolve_scheme(3)


# ------------------------------------------------------------------------------ no dispatch
def _subclasses(cls: type) -> set[type]:
    found = {cls}
    for sub in cls.__subclasses__():
        found |= _subclasses(sub)
    return found


def _dispatch(tree: ast.AST, names: set[str], classes: set[str], attributes: set[str]):
    """(line, source) of each comparison with a format's name, isinstance / issubclass with a
    scheme or format class, and hasattr / getattr of a scheme's own attribute in ``tree``."""
    def listed(node):
        return node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [value for operand in (node.left, *node.comparators) for value in listed(operand)]
            if any(isinstance(v, ast.Constant) and v.value in names for v in operands):
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) and node.value.value in names:
            yield node.lineno, ast.unparse(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
            second = node.args[1]
            if node.func.id in ("isinstance", "issubclass"):
                named = {v.id if isinstance(v, ast.Name) else getattr(v, "attr", None) for v in listed(second)}
                if named & classes:
                    yield node.lineno, ast.unparse(node)
            elif node.func.id in ("hasattr", "getattr"):
                if isinstance(second, ast.Constant) and second.value in attributes:
                    yield node.lineno, ast.unparse(node)


def test_no_format_dispatch_outside_the_registry():
    """Outside ``export/quant/`` the code holds the scheme and asks it: it never compares a
    format's name (``quantization["format"] == "keep"``), never tests a scheme's or format's class
    (``isinstance(scheme, W8A8)``) and never probes a scheme for one of its own methods
    (``hasattr(scheme, "reference")``)."""
    classes = {cls.__name__ for cls in _subclasses(Quantization) | _subclasses(QuantFormat)}
    attributes = ({n for n in vars(Quantization) if not n.startswith("_")}
                  | set(Quantization.__annotations__)) - GENERIC_ATTRIBUTES
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if QUANT in path.parents:
                continue
            for line, source in _dispatch(ast.parse(path.read_text()), set(FORMATS), classes, attributes):
                found.append(f"{path.relative_to(ROOT)}:{line}: {source}")
    assert not found, "format dispatch outside export/quant/ (ask the scheme or the registry):\n" + "\n".join(found)


def test_the_checker_finds_dispatch():
    """The check above would catch each form it forbids."""
    source = """
if quantization["format"] == "keep": pass
if fmt in ("int4", "w8a8"): pass
if isinstance(scheme, W8A8): pass
if isinstance(scheme, (int, quant.QuantScheme)): pass
if hasattr(scheme, "reference"): pass
match name:
    case "int8": pass
"""
    found = list(_dispatch(ast.parse(source), set(FORMATS), {"W8A8", "QuantScheme"}, {"reference"}))
    assert [line for line, _ in found] == [2, 3, 4, 5, 6, 8], found
