"""Atomic writes: all or nothing, with ordinary permissions."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tfport.files import atomic_directory, remove_stale_outputs, write_text_atomic


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_directory_replaces_target_only_on_success(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("first")
    assert (target / "a.txt").read_text() == "first"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "a.txt").write_text("second")
            raise RuntimeError("boom")
    assert (target / "a.txt").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary left behind
    with atomic_directory(target) as tmp:
        (tmp / "b.txt").write_text("third")
    assert os.listdir(target) == ["b.txt"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_permissions_follow_the_umask(tmp_path):
    umask = os.umask(0o022)
    try:
        with atomic_directory(tmp_path / "d"):
            pass
        write_text_atomic(tmp_path / "f.json", "{}")
    finally:
        os.umask(umask)
    assert mode(tmp_path / "d") == 0o755
    assert mode(tmp_path / "f.json") == 0o644
    assert (tmp_path / "f.json").read_text() == "{}"


def test_files_written_0600_inside_get_umask_permissions(tmp_path):
    # onnx writes external data with mode 0600, which locked other users out of an export
    umask = os.umask(0o022)
    try:
        with atomic_directory(tmp_path / "d") as tmp:
            (tmp / "sub").mkdir(mode=0o700)
            for path in (tmp / "w.data", tmp / "sub" / "x"):
                path.write_bytes(b"x")
                os.chmod(path, 0o600)
    finally:
        os.umask(umask)
    assert mode(tmp_path / "d" / "w.data") == mode(tmp_path / "d" / "sub" / "x") == 0o644
    assert mode(tmp_path / "d" / "sub") == 0o755


# A writer in another process: fills its temporary directory, says so, then waits to be killed.
# Ctrl-C's KeyboardInterrupt is Python's default SIGINT handler, which Python does not install when
# SIGINT is ignored at start, as in any job a non-interactive shell starts with '&': set it here.
WRITER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from tfport.files import atomic_directory
with atomic_directory(sys.argv[1]) as tmp:
    (tmp / "weights.bin").write_bytes(bytes(1 << 20))
    print("writing", flush=True)
    time.sleep(60)
"""


def start_writer(target: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "writing"
    return process


def leftovers(parent: Path) -> list[str]:
    return sorted(name for name in os.listdir(parent) if name.startswith("."))


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    for signum in (signal.SIGINT, signal.SIGTERM):
        writer = start_writer(tmp_path / "out")
        assert len(leftovers(tmp_path)) == 2  # .out.tmpXXXX and its lock
        writer.send_signal(signum)
        code = writer.wait(timeout=30)
        assert code != 0 and (signum == signal.SIGINT or code == 128 + signal.SIGTERM)
        assert os.listdir(tmp_path) == [], signum  # nothing written, nothing left behind


def test_a_killed_writers_leftovers_go_with_the_next_write(tmp_path):
    killed = start_writer(tmp_path / "a")
    killed.kill()  # SIGKILL: no cleanup can run
    killed.wait(timeout=30)
    stale = leftovers(tmp_path)
    assert len(stale) == 2 and any(name.endswith(".lock") for name in stale)
    alive = start_writer(tmp_path / "b")  # still writing: its directory must stay
    try:
        with atomic_directory(tmp_path / "c") as tmp:
            (tmp / "x").write_text("x")
        names = leftovers(tmp_path)
        assert not any(name.startswith(".a.") for name in names)  # the dead writer's: removed
        assert sum(name.startswith(".b.") for name in names) == 2  # the live writer's: kept
        assert sorted(os.listdir(tmp_path / "c")) == ["x"]
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert remove_stale_outputs(tmp_path) == [tmp_path / next(n for n in names if n.startswith(".b.")
                                                               and not n.endswith(".lock"))]
    assert leftovers(tmp_path) == []


def test_only_marked_directories_are_removed(tmp_path):
    (tmp_path / ".model.tmp1234").mkdir()  # looks like a temporary output, but has no lock file
    (tmp_path / ".notes.tmp.lock").write_text("")  # a lock without its directory: just the lock goes
    assert remove_stale_outputs(tmp_path) == []
    assert leftovers(tmp_path) == [".model.tmp1234"]


def test_the_current_directory_and_unwritable_places_are_refused_naming_out_dir(tmp_path, monkeypatch):
    """Replacing "." could only fail half-way (it is in use) and left an empty .old directory."""
    monkeypatch.chdir(tmp_path)
    for target in (".", "", str(tmp_path), "x/.."):
        with pytest.raises(ValueError, match="out_dir=.*not the current directory"):
            with atomic_directory(target):
                pass
    (tmp_path / "file").write_text("a file, not a directory")
    with pytest.raises(OSError, match=r"out_dir=.*file/out.*cannot write in"):
        with atomic_directory(tmp_path / "file" / "out"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing left behind
