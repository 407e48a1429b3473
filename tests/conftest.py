"""Checks every test gets."""

from __future__ import annotations

import pytest


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
