"""Atomic directory writes: build a directory under a temporary sibling name, then rename it into place.

Checkpoints, adapters and (later) trainer states are directories of several files that must appear whole or
not at all (`atomic_write_text` does the same for one file). `atomic_directory(dest, overwrite)` yields a staging directory `.NAME.tmp-*` next to `dest`; on
success it gives the tree plain-mkdir permissions, fsyncs every file and directory, moves an existing `dest`
aside, renames the staging directory to `dest` and only then deletes the old one; on any error it deletes the
staging directory and leaves `dest` as it was. A crash leaves at most a hidden `.NAME.tmp-*` sibling behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def stage_directory(dest: str | os.PathLike, overwrite: bool) -> Path:
    """Check `dest` may be written and create its staging sibling; returns the staging directory.

    Raises FileExistsError when `dest` exists and `overwrite` is false, or exists and is not a directory.
    """
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{dest} already exists; pass overwrite=True (CLI: --overwrite / "
                                  "overwrite=true) to replace it, or choose another directory")
        if not dest.is_dir():
            raise FileExistsError(f"{dest} exists and is not a directory; remove it or choose another path")
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))


def publish_directory(staging: Path, dest: str | os.PathLike) -> Path:
    """Make the staged tree durable and rename it to `dest` (an existing `dest` is replaced only after the
    rename succeeded; on failure it is put back). Returns `dest`."""
    dest = Path(dest)
    _apply_umask(staging)
    _fsync_tree(staging)
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dest, old)
    try:
        os.rename(staging, dest)
    except OSError:
        if old is not None:
            os.rename(old, dest)  # put the previous directory back
        raise
    _fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old)
    return dest


@contextmanager
def atomic_directory(dest: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a staging directory; publish it as `dest` when the block succeeds, delete it when it raises."""
    staging = stage_directory(dest, overwrite)
    try:
        yield staging
        publish_directory(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_write_text(dest: str | os.PathLike, text: str) -> Path:
    """Write one file atomically: a temporary sibling, fsync, rename over `dest` (readers see the old file or
    the new one, never a part), then fsync the directory. Returns `dest`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(dest.parent)
    return dest


def _apply_umask(root: Path) -> None:
    """Give the staged tree the permissions of a plain mkdir/open (mkdtemp, safetensors use 0o700/0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~umask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~umask)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath, name))
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    _fsync_path(path)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
