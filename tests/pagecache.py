"""Probes of the page cache for tests of read-ahead and drop-behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def cached(fd: int, offset: int, n: int) -> bool:
    """Whether ``n`` bytes at ``offset`` are in the page cache: a read with RWF_NOWAIT fails with EAGAIN if not."""
    try:
        return os.preadv(fd, [bytearray(n)], offset, os.RWF_NOWAIT) == n
    except BlockingIOError:
        return False


def skip_if_always_cached(fd: int, path: Path, n: int) -> None:
    """Skip when the file system ignores DONTNEED for written-back pages (tmpfs keeps everything in memory)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
    if cached(fd, 0, n):
        pytest.skip(f"this file system keeps {path.parent} in memory whatever it is told (tmpfs?)")


def uncached_file(tmp_path: Path, n: int) -> tuple[Path, int]:
    """A file of ``n`` random bytes, none of them in the page cache, and a read-only descriptor on it."""
    path = tmp_path / "input.bin"
    path.write_bytes(os.urandom(n))
    fd = os.open(path, os.O_RDONLY)
    try:
        skip_if_always_cached(fd, path, n)
    except BaseException:
        os.close(fd)
        raise
    return path, fd
