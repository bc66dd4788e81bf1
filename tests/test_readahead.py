"""Read-ahead and drop-behind: bounded by the window, never a reason to hang or to fail a run, and only the
consumer's finished ranges leave the page cache."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from pagecache import cached, uncached_file

from dflash_gguf.ggufio.readahead import ByteRange, DropBehind, ReadAhead, default_window, hint_size, warm_up


def _file(tmp_path: Path, n: int) -> int:
    path = tmp_path / "input.bin"
    path.write_bytes(os.urandom(n))
    return os.open(path, os.O_RDONLY)


def _reaches(ra: ReadAhead, n: int) -> bool:
    """Whether the read-ahead gets to exactly ``n`` bytes (within 30 s) and stays there a moment."""
    for _ in range(3000):
        if ra.bytes_requested >= n:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # going past ``n`` is the failure; a slow thread cannot cause it
    return ra.bytes_requested == n


def _ends(ra: ReadAhead) -> bool:
    for _ in range(3000):
        if not ra.running:
            return True
        threading.Event().wait(0.01)
    return False


def test_stops_at_its_window_across_ranges(tmp_path: Path) -> None:
    piece = 8 << 20
    fd = _file(tmp_path, 5 * piece)
    try:
        ranges = [ByteRange(fd, 0, 2 * piece), ByteRange(fd, 2 * piece, 3 * piece)]
        with ReadAhead(ranges, window=3 * piece + 4096) as ra:  # into the second range, not a whole piece of it
            assert _ends(ra) and ra.bytes_requested == 3 * piece + 4096
        with ReadAhead(ranges, window=64 * piece) as ra:  # a window larger than the ranges: all of them
            assert _ends(ra) and ra.bytes_requested == 5 * piece
    finally:
        os.close(fd)


def test_a_consumer_that_stops_early_does_not_wait_for_it(tmp_path: Path) -> None:
    fd = _file(tmp_path, 1 << 20)
    try:
        with ReadAhead([ByteRange(fd, 0, 64 << 30)], window=1 << 20) as ra:  # far more than the file holds
            pass
        assert not ra.running
    finally:
        os.close(fd)


def test_a_short_or_unreadable_input_only_stops_the_read_ahead(tmp_path: Path) -> None:
    fd = _file(tmp_path, 1 << 20)
    with ReadAhead([ByteRange(fd, 0, 4 << 20), ByteRange(fd, 8 << 20, 1 << 20)], window=1 << 30) as ra:
        assert _ends(ra) and ra.bytes_requested == 5 << 20  # short ranges count in full
    os.close(fd)
    with ReadAhead([ByteRange(fd, 0, 1 << 20)], window=1 << 30) as ra:  # a closed descriptor: EBADF
        assert _ends(ra)


def test_puts_the_input_in_the_page_cache(tmp_path: Path) -> None:
    n = 4 << 20
    _, fd = uncached_file(tmp_path, n)
    try:
        with ReadAhead([ByteRange(fd, 0, n)], window=n) as ra:
            assert _ends(ra) and ra.bytes_requested == n
            for _ in range(3000):  # the hint is asynchronous: the kernel reads in the background
                if cached(fd, 0, n):
                    break
                threading.Event().wait(0.01)
            assert cached(fd, 0, n)
    finally:
        os.close(fd)


def test_default_window_is_bounded() -> None:
    assert 256 << 20 <= default_window() <= 8 << 30


def test_drop_behind_drops_only_what_the_consumer_finished(tmp_path: Path) -> None:
    mb = 1 << 20
    _, fd = uncached_file(tmp_path, 4 * mb)
    try:
        os.preadv(fd, [bytearray(4 * mb)], 0)  # the consumer reads everything
        assert cached(fd, 0, 4 * mb)
        dropped = DropBehind([ByteRange(fd, 0, mb), ByteRange(fd, mb, 2 * mb), ByteRange(fd, 3 * mb, mb)])
        dropped.consumed(mb + mb // 2)  # the first range and half the second
        assert not cached(fd, 0, 4096) and not cached(fd, mb - 4096, 4096)
        assert cached(fd, mb, 3 * mb)  # the unfinished range and the one after it stay
        dropped.consumed(mb + mb // 2)
        assert not cached(fd, mb, 4096) and not cached(fd, 3 * mb - 4096, 4096)
        assert cached(fd, 3 * mb, mb)
    finally:
        os.close(fd)


def test_drop_behind_keeps_a_neighbours_partial_page(tmp_path: Path) -> None:
    _, fd = uncached_file(tmp_path, 3 * 4096)
    try:
        os.preadv(fd, [bytearray(3 * 4096)], 0)
        dropped = DropBehind([ByteRange(fd, 100, 2 * 4096), ByteRange(fd, 100 + 2 * 4096, 4096 - 100)])
        dropped.consumed(2 * 4096)  # whole page 1 is inside the finished range; pages 0 and 2 are shared
        assert cached(fd, 0, 4096) and not cached(fd, 4096, 4096) and cached(fd, 2 * 4096, 4096)
    finally:
        os.close(fd)


def test_warm_up_reads_a_window_ahead_and_skips_what_it_cannot_open(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The hints it gives are recorded, not the page cache's state: WILLNEED is advice, and a kernel short of
    free pages (two test workers streaming GGUFs beside it) may read nothing for it."""
    mb = 1 << 20
    path, fd = uncached_file(tmp_path, 8 * mb)
    hints: list[tuple[str, int, int]] = []
    advise = os.posix_fadvise

    def recording(f: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            hints.append((os.readlink(f"/proc/self/fd/{f}"), offset, length))
        advise(f, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recording)
    try:
        with warm_up([(tmp_path / "missing.bin", 0, mb), (path, 0, 8 * mb)], window=4 * mb) as ra:
            assert _reaches(ra, 4 * mb)  # no consumer: it stops at its window
        assert not ra.running
    finally:
        os.close(fd)
    assert {h[0] for h in hints} == {str(path)}  # the missing file skipped
    covered = sorted((offset, offset + length) for _, offset, length in hints)
    assert covered[0][0] == 0 and covered[-1][1] == 4 * mb  # the window from the start, and no further
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))  # no gap


def test_hint_size_is_bounded(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        assert 1 << 20 <= hint_size(fd) <= 64 << 20
    finally:
        os.close(fd)
    assert hint_size(-1) == 1 << 20  # not a file: the safe piece
