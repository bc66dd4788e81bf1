"""Read a converter's input into the page cache before its consumer gets there, and drop it behind the consumer.

Why ahead: a run does seconds of CPU work before its stream starts (a 262k vocabulary, the tokenizer.model
synthesis) and then a Q6_K token embedding that keeps both cores busy; a thread that asks for up to ``window``
bytes of what comes next keeps the disk streaming meanwhile (:func:`warm_up`). The pages are the kernel's page
cache, not our heap, so peak RSS does not change, and the window bounds how much of the cache a run claims.
Why behind: see :class:`DropBehind`.

How: ``posix_fadvise(WILLNEED)`` one piece at a time. The kernel reads the piece into the page cache without
copying it anywhere, where a ``pread`` into a scratch buffer would copy every input byte once more and, by
touching each page twice, would promote the inputs to the active list. The kernel caps one hint at the device's
read-ahead size (``read_ahead_kb``), so the pieces are that size: each costs the thread one trip through the GIL,
which takes up to the interpreter's 5 ms switch interval while the main thread is busy in Python.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

_PIECE = 1 << 20  # not above the kernel's cap on one WILLNEED hint (max of read_ahead_kb, max_sectors_kb)
_MAX_PIECE = 64 << 20
_MIN_WINDOW, _MAX_WINDOW = 256 << 20, 8 << 30


@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes at ``offset`` of the open file ``fd``, in the order the consumer will read them."""

    fd: int
    offset: int
    length: int


def hint_size(fd: int) -> int:
    """The most one WILLNEED hint reads from ``fd``'s block device: its ``read_ahead_kb`` from sysfs (the
    partition's disk for a partition), at least ``_PIECE``, at most ``_MAX_PIECE``; ``_PIECE`` when the file
    is on no block device sysfs knows (tmpfs, overlay, network file systems)."""
    try:
        dev = os.fstat(fd).st_dev
    except OSError:
        return _PIECE
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):
        try:
            with open(f"{queue}/read_ahead_kb", encoding="ascii") as f:
                return max(_PIECE, min(_MAX_PIECE, int(f.read()) << 10))
        except (OSError, ValueError):
            continue
    return _PIECE


def default_window() -> int:
    """A third of the memory the system reports available, between 256 MiB and 8 GiB: enough to cover
    the slowest tensor, small enough that read-ahead pages are not evicted before they are used."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 1 << 30
    return max(_MIN_WINDOW, min(_MAX_WINDOW, available // 3))


class ReadAhead:
    """Asks the kernel for ``ranges`` in order on a daemon thread until ``window`` bytes are asked for, the ranges
    end, or the block exits. A read error only stops it: the consumer's own reads report it."""

    def __init__(self, ranges: Sequence[ByteRange], window: int | None = None) -> None:
        self._ranges = list(ranges)
        self._window = default_window() if window is None else window
        self._ahead = 0  # bytes asked for so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-readahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        if self._ranges:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def bytes_requested(self) -> int:
        """How far it has asked the kernel to read (short ranges counted in full)."""
        return self._ahead

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        pieces: dict[int, int] = {}
        for r in self._ranges:
            try:
                size = os.fstat(r.fd).st_size
            except OSError:
                return
            piece = pieces.setdefault(r.fd, hint_size(r.fd))
            pos, end = r.offset, r.offset + r.length
            while pos < min(end, size):
                n = min(piece, end - pos, self._window - self._ahead)
                if n <= 0 or self._stop.is_set():
                    return
                try:
                    os.posix_fadvise(r.fd, pos, min(n, size - pos), os.POSIX_FADV_WILLNEED)
                except OSError:
                    return
                pos += n
                self._ahead += n
            self._ahead += end - pos  # a short range counts in full


@contextlib.contextmanager
def warm_up(ranges: Iterable[tuple[Path, int, int]], window: int | None = None) -> Iterator[ReadAhead]:
    """Read ``(path, offset, length)`` ranges ahead of a consumer that has not started yet and opens the files
    itself: up to ``window`` bytes of them reach the page cache while the caller does other work (a run's
    vocabulary and tokenizer stages are CPU work that would otherwise leave the disk idle). A file that cannot
    be opened is left out; its consumer reports it."""
    fds: dict[Path, int] = {}
    try:
        byte_ranges = []
        for path, offset, length in ranges:
            if path not in fds:
                try:
                    fds[path] = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
            byte_ranges.append(ByteRange(fds[path], offset, length))
        with ReadAhead(byte_ranges, window) as readahead:
            yield readahead
    finally:
        for fd in fds.values():
            os.close(fd)


class DropBehind:
    """Drops each of ``ranges`` (in the order a streaming consumer reads them) from the page cache once the
    consumer reports it finished, as ``dd iflag=nocache`` does.

    Why: a conversion reads each input byte once, and a 24 GB checkpoint does not fit beside everything else in
    a 24 GiB machine. Kept, the pages fill memory, and from then on every page read costs a reclaim and a cold
    copy: on this project's VM, reading the 12B-shaped checkpoint (23.8 GB) in 2 MB ``pread`` calls took 56.7 s
    (55.5 s of it system time) keeping the pages and 19.4 s (3.1 s) dropping each 64 MB behind. The consumer then
    reads just behind the kernel's own sequential read-ahead, which also copied faster than pages hinted far
    ahead with ``WILLNEED``. Only whole pages inside a finished range are dropped (``POSIX_FADV_DONTNEED``
    leaves partial pages at either end), so a neighbour's bytes stay; pages another process maps stay too."""

    def __init__(self, ranges: Sequence[ByteRange]) -> None:
        self._ranges = list(ranges)
        self._done = 0  # bytes the consumer is finished with
        self._finished = 0  # ranges dropped
        self._finished_bytes = 0  # their bytes

    def consumed(self, n_bytes: int) -> None:
        """The consumer is done with the next ``n_bytes`` of the ranges: drop each range it finished."""
        self._done += n_bytes
        while (self._finished < len(self._ranges)
               and self._finished_bytes + self._ranges[self._finished].length <= self._done):
            r = self._ranges[self._finished]
            with contextlib.suppress(OSError):
                os.posix_fadvise(r.fd, r.offset, r.length, os.POSIX_FADV_DONTNEED)
            self._finished_bytes += r.length
            self._finished += 1
