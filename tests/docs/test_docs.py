"""The documentation: the MkDocs site builds strictly (a broken link or anchor, or a page left
out of the nav, fails), the quickstart and the README's example run as written, the README's links
resolve, every option of every ``tfport`` command is documented somewhere, and every source file
a page names exists."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
QUICKSTART = DOCS / "quickstart.md"
README_MAX_LINES = 150  # the README is the front door; details live in docs/ (issue 22)


def fenced_blocks(path: Path, languages: tuple[str, ...]) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of ``path`` in one of ``languages``, in order."""
    blocks = re.findall(r"^```(\w+)\n(.*?)^```\s*$", path.read_text(), flags=re.S | re.M)
    return [(lang, code) for lang, code in blocks if lang in languages]


def needs_export_extras() -> None:
    for module in ("torch", "onnxscript", "onnxruntime"):
        pytest.importorskip(module, reason=f"the example exports a model: needs {module} "
                                           "(extras 'export' and 'cpu')")


def tfport_on_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``tfport`` is this interpreter's (a shim, so a checkout run without
    the console script installed works too)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "tfport"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tfport.cli "$@"\n')
    shim.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"  # never into the checkout
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life banner
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    pages = sorted(p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.glob("*.md"))
    for page in pages:  # every page was rendered (strict mode also fails on pages outside the nav)
        html = site / "index.html" if page == "index" else site / page / "index.html"
        assert html.is_file(), page


def test_quickstart_runs_as_written(tmp_path, monkeypatch):
    needs_export_extras()
    blocks = fenced_blocks(QUICKSTART, ("bash", "python"))
    assert {lang for lang, _ in blocks} == {"bash", "python"}, "the quickstart's runnable blocks"
    env = tfport_on_path(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    namespace: dict = {}
    for index, (lang, code) in enumerate(blocks):
        where = f"{QUICKSTART.name} block {index} ({lang})"
        if lang == "bash":
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=work, env=env,
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"{where}:\n{code}\n{result.stdout}{result.stderr}"
        else:
            exec(compile(code, where, "exec"), namespace)
    # What the page says the blocks made.
    for path in ("out/dec/manifest.json", "out/dec/decoder.onnx", "ckpt/config.json",
                 "ckpt/model.safetensors", "out/alibi/decoder.onnx", "out/enc/encoder.onnx"):
        assert (work / path).is_file(), path
    rows = json.loads((work / "parity.json").read_text())["rows"]
    assert rows and all(row["ok"] for row in rows), rows
    tokens = namespace["tokens"]
    assert tokens.dtype == np.int64 and tokens.shape[0] == 2 and 1 <= tokens.shape[1] <= 8
    vectors = namespace["vectors"]
    assert vectors.shape == (2, namespace["encoder"].config.d_model)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)  # normalize=True


def test_readme_example_runs(tmp_path, monkeypatch):
    needs_export_extras()
    blocks = fenced_blocks(README, ("python",))
    assert len(blocks) == 1, "the README's one Python example"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(blocks[0][1], str(README), "exec"), namespace)
    assert (tmp_path / "out/dec/manifest.json").is_file()
    tokens = namespace["tokens"]
    assert tokens.shape[0] == 2 and 1 <= tokens.shape[1] <= 8


def test_readme_is_the_front_door():
    text = README.read_text()
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): "
                                       "move details into a page of docs/")
    for command in ("`make demo`", "`make test`"):
        assert command in text, command
    assert "make test" in (ROOT / ".ci" / "run").read_text(), "CI runs the README's test command"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):  # relative links only
        if not re.match(r"[a-z]+:", target):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def documented_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


def test_named_source_files_exist():
    """A file the docs send a reader to (`export/targets/ort.py`, `runtime/decoding/`) is there:
    code that moves takes its page along."""
    top = r"(?:tfport|models|export|runtime|tests|\.ci)/"
    named = set(re.findall(rf"`({top}[\w./-]*)`", documented_text() + README.read_text()))
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert named and not missing, f"docs name files that do not exist: {missing}"
    # Bare module names (`config_rope.py`, `engine.py`) exist somewhere in the packages or tests.
    bare = set(re.findall(r"`(\w+\.py)`", documented_text()))
    sources = {p.name for folder in ("tfport", "models", "export", "runtime", "tests")
               for p in (ROOT / folder).rglob("*.py")}
    assert not sorted(bare - sources), f"docs name modules that do not exist: {sorted(bare - sources)}"


def test_every_cli_option_is_documented():
    pytest.importorskip("torch", reason="listing every command needs the 'export' extra")
    pytest.importorskip("fastapi", reason="listing every command needs the 'serve' extra")
    from tfport.cli import build_parser

    parser = build_parser(None)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"export", "generate", "chat", "embed", "classify", "parity", "bench", "serve",
            "bench-serve"} <= set(commands)
    text = documented_text()
    missing = []
    for name, sub in [("tfport", parser), *commands.items()]:
        for action in sub._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help" and \
                        not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                    missing.append(f"{name} {option}")
    assert not missing, f"options no page of docs/ mentions: {missing}"
