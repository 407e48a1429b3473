"""The CPU thread policy a session gets when the caller does not choose one.

Decode at batch 1 runs ~150 small kernels per token; how ONNX Runtime's intra-op pool waits
between them decides a good part of the step time:

* **threads** -- one per CPU this process may run on (``os.sched_getaffinity``), not ONNX
  Runtime's own default (physical cores as it detects them, which on some VMs is fewer).
* **spinning** -- idle pool threads spin for work instead of sleeping. On a quiet machine that
  saves a wake-up per kernel; on a heavily oversubscribed one (1-minute load average at least
  ``BUSY_LOAD_PER_CPU`` per CPU) the spinning threads steal time from the thread doing the work
  and a second thread mostly waits for a core: there the policy takes half the CPUs and no
  spinning. Measured on the 2-core VM (one run each): under load ~10, SmolLM2-135M int4, 2
  threads spinning 35.2 ms/token, 2 not spinning 30.9, 1 spinning 20.9, 1 not spinning 20.0;
  under load 5.5 falling to 3.7, SmolLM2 fp32, 2 threads spinning 29.3, 1 thread 31.2, and the
  then-policy (busy at load >= CPUs: 1 thread, no spinning) 32.8 -- hence the threshold of 3 per
  CPU. A load average lags, so this is a heuristic; pass ``intra_op_threads`` to pin it.
  ``tfport bench --thread-sweep`` times this default against explicit settings in one run.

``TFPORT_THREADS`` / ``TFPORT_SPIN`` (``0`` / ``1``) override the policy for a process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# "Busy": a 1-minute load average of at least this many runnable processes per usable CPU.
BUSY_LOAD_PER_CPU = 3


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
