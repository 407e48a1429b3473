"""Writing outputs so that a failure leaves nothing half-written: temporary path, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _default_mode(directory: bool) -> int:
    """The permissions a plain open()/mkdir() would give (mkstemp/mkdtemp use 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def check_output_dir(path: str | os.PathLike, argument: str, overwrite: bool) -> Path:
    """``ValueError`` naming ``argument`` unless ``path`` may be written as a directory: absent,
    an empty directory, or (with ``overwrite``) an existing directory. Never a plain file."""
    path = Path(path)
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{argument}={str(path)!r}: {str(parent)!r} exists and is not a directory")
    if path.is_dir() and not overwrite and any(path.iterdir()):
        raise ValueError(f"{argument}={str(path)!r} exists and is not empty; pass overwrite=True "
                         "(CLI: --force) to replace it")
    return path


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; on success it replaces ``target``.

    On any exception the temporary directory is removed and ``target`` is left as it was. An
    existing ``target`` is moved aside first and deleted only once the new one is in place.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, _default_mode(directory=True))
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old", dir=target.parent))
            target.rename(old / target.name)
        try:
            tmp.rename(target)
        except BaseException:
            if old is not None:  # put the previous target back
                (old / target.name).rename(target)
                shutil.rmtree(old, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` (umask permissions)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _default_mode(directory=False))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)
