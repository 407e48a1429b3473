"""Writing outputs so that a failure leaves nothing half-written: temporary path, then rename."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

logger = logging.getLogger(__name__)


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in ``path``; ``ValueError`` naming the file if it is unreadable, not JSON
    or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


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


def _normalise_modes(root: Path) -> None:
    """Give ``root`` and everything under it the permissions a plain open()/mkdir() would:
    writers such as onnx's external data use 0600, which locks other users out of an export."""
    dir_mode, file_mode = _default_mode(directory=True), _default_mode(directory=False)
    os.chmod(root, dir_mode)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), dir_mode)
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)


# ----------------------------------------------------------------- outputs of writers that died
# A temporary output ``.NAME.tmpXXXX`` has a lock file ``.NAME.tmpXXXX.lock`` beside it, locked
# (flock) by the writing process for as long as it lives; the kernel drops the lock when the
# process dies, however it dies (SIGKILL included). The next atomic write into the same parent
# removes each temporary output whose lock it can take. Without fcntl (Windows) nothing is locked
# and nothing is removed.
LOCK_SUFFIX = ".lock"


def _lock_partial(tmp: Path) -> int | None:
    """Create ``tmp``'s lock file, locked by this process -> its descriptor (keep it open)."""
    if fcntl is None:
        return None
    lock = tmp.with_name(tmp.name + LOCK_SUFFIX)
    staging = tmp.with_name(tmp.name + ".locking")  # appears under its name already locked
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(staging, lock)
    except BaseException:
        os.close(fd)
        staging.unlink(missing_ok=True)
        raise
    return fd


def _unlock_partial(tmp: Path, fd: int | None) -> None:
    if fd is not None:
        tmp.with_name(tmp.name + LOCK_SUFFIX).unlink(missing_ok=True)
        os.close(fd)


def _size(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(folder, name))
               for folder, _, files in os.walk(path) for name in files)


def remove_stale_outputs(parent: str | os.PathLike) -> list[Path]:
    """Remove the temporary outputs in ``parent`` whose writer died before finishing (killed,
    power loss): each ``.NAME.tmpXXXX`` directory whose lock file no live process holds.
    Returns what was removed; outputs still being written are left alone."""
    parent = Path(parent)
    if fcntl is None or not parent.is_dir():
        return []
    removed = []
    for lock in parent.iterdir():
        name = lock.name
        if not (name.startswith(".") and ".tmp" in name and name.endswith(LOCK_SUFFIX)):
            continue
        partial = lock.with_name(name[:-len(LOCK_SUFFIX)])
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its writer is alive
            os.close(fd)
            continue
        try:
            if partial.is_dir() and not partial.is_symlink():
                size = _size(partial)
                shutil.rmtree(partial)
                removed.append(partial)
                logger.info("removed %s (%.1f MiB), left by a write that did not finish (its "
                            "process is gone)", partial, size / 2**20)
            lock.unlink(missing_ok=True)
        except OSError as err:
            logger.warning("could not remove %s, left by a write that did not finish: %s", partial, err)
        finally:
            os.close(fd)
    return removed


@contextmanager
def terminate_as_exit() -> Iterator[None]:
    """While inside, SIGTERM raises ``SystemExit(143)`` in the main thread, as Ctrl-C raises
    ``KeyboardInterrupt``, so cleanups (``finally``, ``except BaseException``) run instead of the
    process vanishing. Later SIGTERMs are ignored until the block is left, so a cleanup is not
    cut short. Does nothing outside the main thread or when a SIGTERM handler is installed."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; on success it replaces ``target``.

    On any exception, Ctrl-C or SIGTERM (see ``terminate_as_exit``) the temporary directory is
    removed and ``target`` is left as it was; one left by a process that was killed outright is
    removed by the next call with the same parent (``remove_stale_outputs``). An existing
    ``target`` is moved aside first and deleted only once the new one is in place. Everything
    written gets umask permissions.
    """
    target = Path(target)
    if target.resolve() == Path.cwd().resolve() or target.name in ("", ".", ".."):
        raise ValueError(f"out_dir={str(target)!r}: expected a directory to create or replace, not "
                         "the current directory or a path ending in '.' or '..'")
    with terminate_as_exit():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_outputs(target.parent)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
        except OSError as err:
            raise OSError(err.errno, f"out_dir={str(target)!r}: cannot write in {str(target.parent)!r} "
                                     f"({err.strerror})") from None
        lock = None
        try:
            lock = _lock_partial(tmp)
            yield tmp
            _normalise_modes(tmp)
            old = None
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old", dir=target.parent))
                try:
                    target.rename(old / target.name)
                except BaseException:
                    shutil.rmtree(old, ignore_errors=True)
                    raise
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
        finally:
            _unlock_partial(tmp, lock)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` (umask
    permissions). On any exception, Ctrl-C or SIGTERM the temporary file is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with terminate_as_exit():
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
