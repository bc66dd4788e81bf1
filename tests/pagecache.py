"""Probes of the page cache for tests of read-ahead and drop-behind."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached(fd: int, offset: int, n: int) -> bool:
    """Whether all ``n`` bytes at ``offset`` are in the page cache, by ``mincore`` on a mapping of them.

    Why not a read with RWF_NOWAIT: a read that finds its page starts the kernel's read-ahead of the next ones,
    so a probe could bring back, before the next probe, the very pages a test checks were dropped."""
    page = mmap.PAGESIZE
    start = offset // page * page
    length = offset + n - start
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        vec = ctypes.create_string_buffer((length + page - 1) // page)
        if _libc.mincore(addr, length, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return all(b & 1 for b in vec.raw)
    finally:
        _libc.munmap(addr, length)


def uncached_file(tmp_path: Path, n: int) -> tuple[Path, int]:
    """A file of ``n`` random bytes, none of them in the page cache, and a read-only descriptor on it."""
    path = tmp_path / "input.bin"
    path.write_bytes(os.urandom(n))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, n, os.POSIX_FADV_DONTNEED)
    if cached(fd, 0, n):
        os.close(fd)
        pytest.skip(f"this file system keeps {tmp_path} in memory whatever it is told (tmpfs?)")
    return path, fd
