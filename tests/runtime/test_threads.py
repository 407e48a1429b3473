"""The default thread policy (runtime/threads.py): what it picks from CPUs and overrides."""

from __future__ import annotations

import pytest

from tfport.runtime import threads
from tfport.runtime.session import SessionSettings


@pytest.fixture
def machine(monkeypatch):
    """A 4-CPU machine and no overrides."""
    monkeypatch.delenv("TFPORT_THREADS", raising=False)
    monkeypatch.delenv("TFPORT_SPIN", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)


def test_every_cpu_spinning_by_default(machine):
    policy = threads.thread_policy()
    assert (policy.intra_op_threads, policy.allow_spinning) == (4, True)
    assert policy.config_entries() == {"session.intra_op.allow_spinning": "1"}
    assert threads.thread_policy(3).intra_op_threads == 3  # the caller's choice stands


def test_environment_overrides(machine, monkeypatch):
    monkeypatch.setenv("TFPORT_THREADS", "1")
    monkeypatch.setenv("TFPORT_SPIN", "0")
    policy = threads.thread_policy()
    assert (policy.intra_op_threads, policy.allow_spinning) == (1, False)


def test_session_options_apply_it(machine):
    options = SessionSettings().session_options()
    assert options.intra_op_num_threads == 4
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "1"
