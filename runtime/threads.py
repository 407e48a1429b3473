"""The CPU thread policy a session gets when the caller does not choose one.

Decode at batch 1 runs ~150 small kernels per token, so how ONNX Runtime's intra-op pool is
sized and waits decides a good part of the step time. The default is **one intra-op thread per
usable CPU** (``os.sched_getaffinity``; ONNX Runtime's own default counts physical cores as it
detects them, which on some VMs is fewer) **with a spinning pool** (idle threads spin for the
next kernel instead of sleeping).

Measured on the 2-core VM, SmolLM2-135M, batch 1, each line one ``tfport bench --thread-sweep``
run (ms/token, float32 ``ort`` export):

- load 0.7 -> 1.8: 2 threads spinning 25.3, 1 thread 32.8;
- load 1.4 -> 1.6: 2 threads 21.6, 1 thread 32.7;
- load 2.1 -> 3.8, one core held by another process: 2 threads 54.2, 1 thread 29.4
  (onnxruntime-genai alike: int4 17.3 ms at 2 threads, 8.2 at 1).

So on a quiet machine every CPU wins; when other processes hold cores, fewer threads win, by up
to 2x. A load-average rule (half the CPUs, no spinning, at load >= CPUs) was tried and dropped:
the 1-minute average lags (it still counted the export that had just finished) and picked one
thread on a quiet machine, 34% slower. Pin it where the machine is shared: ``--threads`` /
``intra_op_threads``, or ``TFPORT_THREADS`` / ``TFPORT_SPIN`` (``0`` / ``1``) for a process.

**Sessions that take turns share one pool** (``SessionSettings(shared_threads=True)``, which
``--speculative DRAFT_DIR`` sets for the target and its draft): each session's own pool spins
after its run, on the cores the other session's next run needs. Measured on the 2-core VM
(SmolLM2-135M float32 target, its int4 export drafting, 128 tokens): the draft's forwards took
8-25 ms with a pool each and a steady 8.5 ms sharing one; the whole generation 22 against 31
tokens/s (plain decoding 36-39 either way). The shared pool is ONNX Runtime's process-wide one
(``set_global_thread_pool_sizes``): made once, with the first shared session's thread count,
always spinning, and once it exists every later session of the process runs on it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnxruntime as ort


@dataclass(frozen=True)
class ThreadPolicy:
    """``intra_op_threads`` for ONNX Runtime and whether its pool may spin."""

    intra_op_threads: int
    allow_spinning: bool

    def config_entries(self) -> dict[str, str]:
        """Session config entries for ONNX Runtime (``SessionOptions.add_session_config_entry``)."""
        return {"session.intra_op.allow_spinning": "1" if self.allow_spinning else "0"}


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_policy(intra_op_threads: int = 0) -> ThreadPolicy:
    """``intra_op_threads`` if the caller chose (> 0), else ``TFPORT_THREADS``, else one per usable
    CPU; spinning unless ``TFPORT_SPIN=0``."""
    threads = intra_op_threads or int(os.environ.get("TFPORT_THREADS", 0)) or usable_cpus()
    return ThreadPolicy(threads, os.environ.get("TFPORT_SPIN", "1") != "0")


_shared_threads: int | None = None  # the process-wide pool's size, once made


def shared_pool() -> int | None:
    """The size of this process's shared pool, None until ``share_pool`` makes it."""
    return _shared_threads


def share_pool(threads: int) -> None:
    """Make ONNX Runtime's process-wide intra-op pool with ``threads`` threads, once per process.
    From then on every session of the process must run on it (ONNX Runtime refuses a pool of a
    session's own once the process-wide one exists), so ``SessionSettings`` opens them all that
    way, and a session asking for another thread count gets a ``ValueError``: the pool cannot be
    resized."""
    global _shared_threads
    if _shared_threads is None:
        if not hasattr(ort, "set_global_thread_pool_sizes"):
            raise ValueError(f"shared_threads=True: onnxruntime {ort.__version__} has no process-wide "
                             "thread pool in Python (set_global_thread_pool_sizes); upgrade onnxruntime "
                             "or open the sessions with a pool each")
        ort.set_global_thread_pool_sizes(threads, 1)
        _shared_threads = threads
    elif threads != _shared_threads:
        raise ValueError(f"intra_op_threads={threads}: this process runs its sessions on a shared "
                         f"pool of {_shared_threads} threads (made for sessions that take turns, "
                         "shared_threads=True), and ONNX Runtime can neither resize it nor give a "
                         "session a pool of its own once it exists; open every session of the "
                         "process with the same thread count")
