"""Atomic writes: all or nothing, with ordinary permissions."""

from __future__ import annotations

import os
import stat

import pytest

from tfport.files import atomic_directory, write_text_atomic


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
