"""The documentation: the MkDocs site builds strictly (a broken link or anchor, or a page left
out of the nav, fails), the quickstart and the README's example run as written, the README's links
resolve, every option of every ``tfport`` command is documented on a user page, every source file
a page names exists, the install table is one table that matches ``pyproject.toml``, the
benchmarks page holds current figures (dated runs live on ``docs/history.md``), no page speaks of
our own process (issue or session numbers), and every speed figure of the README names its CPU."""

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
README_MAX_LINES = 150  # the README is the front door; details live in docs/
HISTORY = DOCS / "history.md"  # dated runs and superseded figures: the one page that is a record
BENCHMARKS_MAX_LINES = 250  # current figures, their machine and command; the rest is history


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


def documented_text(history: bool = True) -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")) if history or p != HISTORY)


def test_named_source_files_exist():
    """A file the docs send a reader to (`export/targets/ort.py`, `runtime/decoding/`) is there:
    code that moves takes its page along."""
    top = r"(?:tfport|models|export|runtime|tools|tests|\.ci)/"
    named = set(re.findall(rf"`({top}[\w./-]*)`", documented_text() + README.read_text()))
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert named and not missing, f"docs name files that do not exist: {missing}"
    # Bare module names (`rope.py`, `engine.py`) exist somewhere in the packages or tests.
    bare = set(re.findall(r"`(\w+\.py)`", documented_text()))
    sources = {p.name for folder in ("tfport", "models", "export", "runtime", "tools", "tests")
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
    text = documented_text(history=False)  # a user page, not the record of past runs
    missing = []
    for name, sub in [("tfport", parser), *commands.items()]:
        for action in sub._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help" and \
                        not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text):
                    missing.append(f"{name} {option}")
    assert not missing, f"options no page of docs/ mentions: {missing}"


def table_rows(text: str, header: str) -> list[str]:
    """The lines of the Markdown table whose header line is ``header``, header included."""
    lines = text.splitlines()
    assert header in lines, f"no table headed {header!r}"
    start = lines.index(header)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def requirement_names(requirements: list[str]) -> set[str]:
    """Normalised distribution names (PEP 503) of ``requirements``, tfport's own extras left out."""
    names = {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower()) for r in requirements}
    return names - {"tfport"}


INSTALL_HEADER = "| use | extra | what it adds |"


def test_one_install_table_that_matches_pyproject():
    """The README's install table is the one table: docs/index.md reproduces it row for row, its
    extras are pyproject.toml's, and each row names every package its extra installs."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    rows = table_rows(README.read_text(), INSTALL_HEADER)
    assert table_rows((DOCS / "index.md").read_text(), INSTALL_HEADER) == rows, \
        "docs/index.md's install table differs from the README's: copy the README's"
    by_extra = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 3, row
        for extra in re.findall(r"`([\w-]+)`", cells[1]):
            by_extra[extra] = row
    assert sorted(by_extra) == sorted(extras), "the table's extras are not pyproject.toml's"
    table = re.sub(r"[-_.]+", "-", "\n".join(rows).lower())
    for extra, requirements in {"": project["dependencies"], **extras}.items():
        text = re.sub(r"[-_.]+", "-", by_extra[extra].lower()) if extra else table
        missing = sorted(name for name in requirement_names(requirements)
                         if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text))
        assert not missing, f"the install table's {extra or 'base'} row does not name {missing}"
    # The README's first command exports a GGUF file: the export extra reads it.
    assert "gguf" in requirement_names(extras["export"])


def test_benchmarks_page_holds_current_figures():
    lines = (DOCS / "benchmarks.md").read_text().count("\n")
    assert lines < BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md has {lines} lines (fewer than {BENCHMARKS_MAX_LINES}): keep the current "
        "table of each benchmark with its machine and command, and move earlier runs to docs/history.md")
    assert re.search(r"^\s+- [^:]+: history\.md$", (ROOT / "mkdocs.yml").read_text(), re.M), \
        "docs/history.md is in the site's nav"


# Our own process means nothing to a reader: issue, pull-request or session numbers, which session
# or wave did what, the people doing it. ("session" alone is ONNX Runtime's, and stays.)
PROCESS_WORDS = re.compile(
    r"\b(?:issues?|PRs?|pull requests?|waves?)\s*#?\d+|\bsessions?\s*#\d+"
    r"|(?<![\w/&#])#\d+\b"
    r"|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|that|same|later"
    r"|earlier|next|previous)\s+session\b"
    r"|\bsession's machine\b|\bthe issue'?s?\b|\bengineers?\b|\bwaves?\b",
    re.I)


def test_pages_do_not_speak_of_our_process():
    """No page (history.md included: it uses dates) nor the README names an issue or a session."""
    found = [f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
             for path in [README, *sorted(DOCS.glob("*.md"))]
             for number, line in enumerate(path.read_text().splitlines(), 1)
             for match in PROCESS_WORDS.finditer(line)]
    assert not found, "pages that speak of issues or sessions:\n" + "\n".join(found)


# A ratio (1.19x, 2.9-4.5x) or a rate (tokens/s) depends on the CPU it was measured on.
SPEED_FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b|tokens/s")
CPU_CLASS = re.compile(r"AVX2|AVX-512|VNNI|AMX|NEON|SVE|EPYC|Xeon|Graviton|Apple M\d|Ryzen|Core i\d")


def test_readme_speed_figures_name_their_cpu():
    """Every paragraph of the README (code blocks aside) with a speed figure names the CPU class."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", README.read_text(), flags=re.S | re.M)
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if SPEED_FIGURE.search(p)]
    assert paragraphs, "the README quotes no speed figure: drop this test or the figures' check"
    bare = [p.strip()[:120] for p in paragraphs if not CPU_CLASS.search(p)]
    assert not bare, f"README speed figures without their CPU class (AVX2, AVX-512 VNNI, ...): {bare}"
