"""The CPU thread policy a session gets when the caller does not choose one.

Decode at batch 1 runs ~150 small kernels per token; how ONNX Runtime's intra-op pool waits
between them decides a good part of the step time:

* **threads** -- one per CPU this process may run on (``os.sched_getaffinity``), not ONNX
  Runtime's own default (physical cores as it detects them, which on some VMs is fewer).
* **spinning** -- idle pool threads spin for work instead of sleeping. On a quiet machine that
  saves a wake-up per kernel; on a busy one (1-minute load average at least ``BUSY_LOAD_PER_CPU``
  per CPU: other processes want the cores) the spinning threads steal time from the thread doing
  the work and a second thread mostly waits for a core: there the policy takes half the CPUs and
  no spinning. Measured on the 2-core VM, SmolLM2-135M, each line one run (ms/token):

  - load ~10: int4, 2 threads spinning 35.2, 2 not spinning 30.9, 1 spinning 20.9, 1 not 20.0;
  - load 2.1 -> 3.8: fp32, 2 threads 54.2, 1 thread 29.4 (onnxruntime-genai alike: int4 17.3
    at 2 threads, 8.2 at 1) -- one core was held by another process;
  - load 5.5 -> 3.7: fp32, 2 threads 29.3, 1 thread 31.2, 1 thread not spinning 32.8.

  Wrong the one way costs ~10%, the other 2x, hence busy = load >= 1 per CPU. A load average
  lags and cannot see which cores are held, so this is a heuristic; pass ``intra_op_threads``
  (``--threads``) to pin it, and ``tfport bench --thread-sweep`` to measure it.

``TFPORT_THREADS`` / ``TFPORT_SPIN`` (``0`` / ``1``) override the policy for a process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# "Busy": a 1-minute load average of at least this many runnable processes per usable CPU.
BUSY_LOAD_PER_CPU = 1


@dataclass(frozen=True)
class ThreadPolicy:
    """``intra_op_threads`` for ONNX Runtime and whether its pool may spin."""

    intra_op_threads: int
    allow_spinning: bool
    reason: str

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
    """The policy for a session: ``intra_op_threads`` if the caller chose (> 0), else one per
    usable CPU; spinning unless the load average says the CPUs are already busy."""
    cpus = usable_cpus()
    threads = intra_op_threads or int(os.environ.get("TFPORT_THREADS", 0)) or cpus
    if "TFPORT_SPIN" in os.environ:
        return ThreadPolicy(threads, os.environ["TFPORT_SPIN"] == "1", "TFPORT_SPIN")
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ThreadPolicy(threads, True, "no load average: ONNX Runtime's default (spin)")
    if load < BUSY_LOAD_PER_CPU * cpus:
        return ThreadPolicy(threads, True, f"load average {load:.1f} < {BUSY_LOAD_PER_CPU} x {cpus} CPUs: spin")
    if not intra_op_threads and "TFPORT_THREADS" not in os.environ:
        threads = max(1, cpus // 2)  # the other processes hold the rest
    return ThreadPolicy(threads, False, f"load average {load:.1f} >= {BUSY_LOAD_PER_CPU} x {cpus} CPUs: "
                                        "no spinning")
