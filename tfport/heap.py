"""Giving the C heap's free pages back to the system.

Freed numpy arrays and protobuf buffers of a few megabytes stay in glibc's heap, so a process
that handles one large buffer after another (a server's big requests, an export's weights)
ratchets its resident memory up to its largest and keeps it. ``release_memory`` asks glibc to
hand the free pages back (``malloc_trim(0)``); where the C library has none (musl, macOS) it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_trimming = threading.Lock()


def release_memory() -> bool:
    """Hand the C heap's free pages back to the system; False where that cannot be done, or
    while another thread is already doing it."""
    trim = _malloc_trim()
    if trim is None or not _trimming.acquire(blocking=False):
        return False
    try:
        trim(0)
    finally:
        _trimming.release()
    return True


def peak_resident() -> int:
    """This process's peak resident memory so far, in bytes: Linux's ``VmHWM``, the high-water
    mark of its own address space. Not ``getrusage``'s ``ru_maxrss``: on Linux a process started
    by fork and exec inherits its parent's high-water mark there, so a small child of a large
    parent reports the parent's peak (a benchmark's or a test's child that measures itself)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
