"""Atomic writes: a file or a folder either exists complete or not at all, so a crash never leaves a
half-written one that looks finished. Plain standard library; every layer above the CP core uses it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call `write(tmp_path)` on a temporary file beside `path`, then rename it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (flushed to disk before the rename)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:  # not the locale's: reports hold non-ASCII text
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    return atomic_write(path, write)


def remove_dir(folder: str | os.PathLike) -> None:
    """Delete a folder by renaming it away first: a half-deleted folder never looks complete."""
    folder = Path(folder)
    trash = folder.with_name(f".{folder.name}.deleting")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


@contextmanager
def building_dir(target: str | os.PathLike, *, replace: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `target`; on success it is renamed onto `target` (an existing
    `target` is removed first when `replace`), on any error it is deleted and `target` stays as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700: the finished folder (a model, a checkpoint) stays readable
        yield tmp
        if target.exists() and replace:
            remove_dir(target)
        os.rename(tmp, target)
        fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
