"""What an install with the 'export' extra alone (no ONNX Runtime) does: ``tfport export`` says
which extra to add instead of failing in an import, and exports with ``--no-validate``; ``tfport
parity``, which cannot run without ONNX Runtime, names the extra that brings it."""

from __future__ import annotations

import subprocess
import sys

from tfport.contract import MANIFEST_FILE

# The child makes ``import onnxruntime`` fail, as after ``pip install 'tfport[export]'``, then runs
# the CLI: argv[1:] are its arguments.
CHILD = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "onnxruntime":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
from tfport.cli import main
sys.exit(main(sys.argv[1:]))
"""


def tfport_without_ort(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=300)


def test_validation_without_onnxruntime_says_what_to_install(tmp_path):
    out = tmp_path / "dec"
    proc = tfport_without_ort("export", "tiny-decoder", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "tfport export: error: export validation runs the graphs under ONNX Runtime" in proc.stderr
    assert "pip install 'tfport[export,cpu]'" in proc.stderr and "--no-validate" in proc.stderr
    assert not out.exists()  # refused before anything was written


def test_no_validate_exports_without_onnxruntime(tmp_path):
    out = tmp_path / "dec"
    proc = tfport_without_ort("export", "tiny-decoder", "--out", str(out), "--no-validate")
    assert proc.returncode == 0, proc.stderr
    assert (out / MANIFEST_FILE).is_file() and (out / "decoder.onnx").is_file()


def test_parity_without_onnxruntime_names_the_extra(tmp_path):
    proc = tfport_without_ort("parity", str(tmp_path), "--against", "tiny-decoder")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "No module named 'onnxruntime'" in proc.stderr and "tfport[export,cpu]" in proc.stderr
