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
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, _default_mode(directory=False))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
