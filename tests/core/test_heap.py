"""``tfport.heap.peak_resident``: a process's own peak, not its parent's. On Linux a child started
by fork and exec inherits its parent's ``ru_maxrss``, so a small child of a large parent (a
benchmark's or a test's measuring child) would report the parent's peak as its own."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tfport.heap import peak_resident

CHILD = """
import json, resource
from tfport.heap import peak_resident
print(json.dumps({"own": peak_resident(), "rusage": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_child_reports_its_own_peak_not_its_parents():
    big = np.ones(400 * 2**20 // 8)  # the parent touches 400 MiB
    parent = peak_resident()
    figures = json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                        check=True).stdout)
    del big
    assert parent >= 400 * 2**20
    assert figures["rusage"] >= 400 * 2**20  # what getrusage would have reported: the parent's
    assert 0 < figures["own"] < 150 * 2**20  # an interpreter with numpy-free tfport.heap
