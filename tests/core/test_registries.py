"""The registries that name the same things agree, so none can drift from the others.

* Position schemes: ``tfport.config.POSITIONS`` (what a config may say), the reference modules'
  ``POSITION_SCHEMES``, the exporter's ``POSITION_EMITTERS`` and the export / parity test matrix
  (``tests.matrix.MATRIX``), which holds every position each family takes.
* Imported architectures: every Hugging Face ``model_type`` in ``tfport.models.hf.ARCHITECTURES``
  and every GGUF ``general.architecture`` in ``tfport.models.gguf.ARCHITECTURES`` has a test case
  that builds such a model (the rules are in ``hf_cases`` and ``gguf_cases``). The test modules are
  read with ``ast``, not run.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from pathlib import Path

import pytest

from tests.matrix import ATTENTION, FAMILY_BASE, MATRIX, matrix_config
from tfport.config import ENCODER_ONLY_POSITIONS, POSITIONS
from tfport.export.positions import POSITION_EMITTERS
from tfport.models.gguf import ARCHITECTURES as GGUF_ARCHITECTURES
from tfport.models.hf import ARCHITECTURES as HF_ARCHITECTURES
from tfport.models.positions import POSITION_SCHEMES

TESTS = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ positions
def test_position_registries_agree():
    registries = {"tfport.config.POSITIONS": set(POSITIONS),
                  "tfport.models.positions.POSITION_SCHEMES": set(POSITION_SCHEMES),
                  "tfport.export.positions.POSITION_EMITTERS": set(POSITION_EMITTERS)}
    assert len(POSITIONS) == len(set(POSITIONS)), f"POSITIONS repeats a name: {POSITIONS}"
    differ = {name: {"missing": sorted(set(POSITIONS) - names), "extra": sorted(names - set(POSITIONS))}
              for name, names in registries.items() if names != set(POSITIONS)}
    assert not differ, f"position registries differ from tfport.config.POSITIONS: {differ}"
    assert set(ENCODER_ONLY_POSITIONS) <= set(POSITIONS), ENCODER_ONLY_POSITIONS


def refused(family: str, position: str, attention: str) -> bool:
    """Whether the config refuses the combination, by the rule written out: an encoder-only
    position (bidirectional, uncached) outside the encoder, or DeBERTa's disentangled attention
    with fewer key/value heads than query heads (each query head reads its own relative keys)."""
    return ((position in ENCODER_ONLY_POSITIONS and family != "encoder")
            or (position == "disentangled" and ATTENTION[attention] is not None))


def test_matrix_holds_every_position_each_family_takes():
    """The matrix is family x position x attention less exactly the combinations the config
    refuses, and the config does refuse those."""
    full = set(itertools.product(FAMILY_BASE, POSITIONS, ATTENTION))
    assert len(MATRIX) == len(set(MATRIX)) and set(MATRIX) <= full
    missing = sorted(entry for entry in full - set(MATRIX) if not refused(*entry))
    assert not missing, f"tests.matrix.MATRIX lacks {missing}"
    assert not [entry for entry in MATRIX if refused(*entry)]
    for entry in sorted(full - set(MATRIX)):
        with pytest.raises(ValueError, match="position|n_kv_heads"):
            matrix_config(*entry)
    for family in FAMILY_BASE:
        assert {p for f, p, _ in MATRIX if f == family} == {
            p for p in POSITIONS if family == "encoder" or p not in ENCODER_ONLY_POSITIONS}, family


# --------------------------------------------------------------------------------- architectures
def names_in(path: Path) -> set[str]:
    """Every string constant and identifier of a module (names, attributes, imported names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rpartition(".")[2])
    return names


def hf_cases() -> dict[str, list[str]]:
    """model_type -> the tests/hf modules that build a transformers model of it: a module naming
    both the transformers config class of that model_type (whose ``model_type`` lands in the saved
    config.json, where tfport looks it up; transformers' own ``CONFIG_MAPPING_NAMES``) and one of
    the model classes tfport imports for it (``Architecture.classes``)."""
    transformers_auto = pytest.importorskip(
        "transformers.models.auto.configuration_auto",
        reason="transformers' config table (the 'dev' extra) names each model_type's config class")
    config_class = transformers_auto.CONFIG_MAPPING_NAMES
    cases: dict[str, list[str]] = {t: [] for t in HF_ARCHITECTURES}
    for path in sorted((TESTS / "hf").glob("*.py")):
        names = names_in(path)
        for model_type, arch in HF_ARCHITECTURES.items():
            if config_class.get(model_type) in names and names & set(arch.classes):
                cases[model_type].append(path.name)
    return cases


def test_every_hf_architecture_has_a_case():
    missing = sorted(t for t, modules in hf_cases().items() if not modules)
    assert not missing, (f"Hugging Face model_type(s) {missing} that tfport imports have no test case "
                         "in tests/hf (a module building a tiny transformers model of each: see "
                         "tests/hf/cases.py, tests/hf/encoder_cases.py)")


def gguf_cases() -> dict[str, list[str]]:
    """GGUF architecture -> the tests/gguf modules that write a file of it: the ``arch`` of each
    ``GGUFCase(...)`` written out (tests/gguf/from_hf.py), and for a module calling
    ``write_tiny_llama`` (tests/gguf/tiny.py) its ``architecture`` argument or default."""
    from tests.gguf.from_hf import GGUFCase
    from tests.gguf.tiny import write_tiny_llama

    arch_index = [f.name for f in dataclasses.fields(GGUFCase)].index("arch")
    default = inspect.signature(write_tiny_llama).parameters["architecture"].default
    cases: dict[str, list[str]] = {a: [] for a in GGUF_ARCHITECTURES}
    for path in sorted((TESTS / "gguf").glob("test_*.py")):
        written = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            if node.func.id == "GGUFCase":
                arch = keywords.get("arch", node.args[arch_index] if len(node.args) > arch_index else None)
            elif node.func.id == "write_tiny_llama":
                arch = keywords.get("architecture", ast.Constant(default))
            else:
                continue
            if isinstance(arch, ast.Constant):
                written.add(arch.value)
        for arch in written & set(cases):
            cases[arch].append(path.name)
    return cases


def test_every_gguf_architecture_has_a_case():
    missing = sorted(a for a, modules in gguf_cases().items() if not modules)
    assert not missing, (f"GGUF architecture(s) {missing} that tfport imports have no test case in "
                         "tests/gguf (a GGUFCase in test_architectures.py, or a write_tiny_llama file)")


def test_case_finders_see_the_known_cases():
    """The finders on cases that exist (so an empty or broken finder cannot pass the tests above):
    the tiny LLaMA files and a Qwen2 GGUFCase; BART in its own module, T5 built inline."""
    gguf = gguf_cases()
    assert "test_tiny.py" in gguf["llama"] and "test_architectures.py" in gguf["qwen2"]
    hf = hf_cases()
    assert "test_bart.py" in hf["bart"] and "test_t5.py" in hf["t5"] and "cases.py" in hf["llama"]
