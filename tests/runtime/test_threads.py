"""The default thread policy (runtime/threads.py): what it picks from CPUs, load and overrides."""

from __future__ import annotations

import pytest

from tfport.runtime import threads
from tfport.runtime.session import SessionSettings


@pytest.fixture
def machine(monkeypatch):
    """A 4-CPU machine with a settable load average and no overrides."""
    monkeypatch.delenv("TFPORT_THREADS", raising=False)
    monkeypatch.delenv("TFPORT_SPIN", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)

    def set_load(load):
        monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    return set_load


def test_idle_machine_spins_on_every_cpu(machine):
    machine(0.5)
    policy = threads.thread_policy()
    assert (policy.intra_op_threads, policy.allow_spinning) == (4, True)
    assert policy.config_entries() == {"session.intra_op.allow_spinning": "1"}


def test_busy_machine_takes_half_and_does_not_spin(machine):
    machine(12.0)
    policy = threads.thread_policy()
    assert (policy.intra_op_threads, policy.allow_spinning) == (2, False)
    machine(3.9)  # just under 1 per CPU: not busy
    assert threads.thread_policy().allow_spinning
    assert threads.thread_policy(3).intra_op_threads == 3  # the caller's choice stands


def test_environment_overrides(machine, monkeypatch):
    machine(9.0)
    monkeypatch.setenv("TFPORT_THREADS", "3")
    monkeypatch.setenv("TFPORT_SPIN", "1")
    policy = threads.thread_policy()
    assert (policy.intra_op_threads, policy.allow_spinning) == (3, True)


def test_session_options_apply_it(machine):
    machine(0.0)
    options = SessionSettings().session_options()
    assert options.intra_op_num_threads == 4
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
