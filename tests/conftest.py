"""Checks every test gets, and the order of the test files."""

from __future__ import annotations

from pathlib import Path

import pytest

# The files that take longest (seconds in one process on a 2-core VM, 2026-12-02), run first: `make
# test` runs whole files in two processes (pytest-xdist --dist loadfile), and a long file handed
# out last keeps one process busy while the other has nothing left to run.
LONG_FILES = ("gguf/test_quantized.py",  # 227: GPTQ on SmolLM2, twice then (once since 2026-12-07)
              "gguf/test_smollm2.py",  # 58: transformers' GGUF import
              "runtime/serve/test_ray.py",  # 46: Ray in a private network
              "export/test_quantize.py",  # 28
              "export/test_budget.py",  # 25
              "runtime/test_chat.py")  # 23


def pytest_collection_modifyitems(config, items) -> None:
    """Move ``LONG_FILES``' tests to the front, in that order; the rest keep theirs."""
    root = Path(__file__).resolve().parent
    rank = {root / name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).resolve(), len(LONG_FILES)))


@pytest.fixture(autouse=True)
def _no_process_wide_thread_pool():
    """Fail the test that makes ONNX Runtime's process-wide thread pool in the test process: once
    it exists, every later session of the process must use it, and the sessions that other tests
    open without tfport's settings fail ("use_per_session_threads must be false"). Such a test
    runs its work in a child process (e.g. tests/export/test_bench_speculative.py)."""
    yield
    from tfport.runtime.threads import shared_pool

    assert shared_pool() is None, ("this test made ONNX Runtime's process-wide thread pool in the test "
                                   "process; run the part that shares threads in a child process")
