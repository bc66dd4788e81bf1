"""Read a converter's input ahead of its consumer, into the page cache, within a bounded window.

Why: the quantizer's workers ``pread`` one chunk at a time, so while the kernels are busy (a Q6_K token
embedding of 262k rows costs seconds of CPU on two cores) the disk would sit idle, and while the disk is
slow the kernels would. A thread that asks for up to ``window`` bytes in front of the consumer keeps the
disk streaming; the workers' reads then come from memory. The pages are the kernel's page cache, not our
heap, so peak RSS does not change, and the window bounds how much of the cache a run claims.

How: ``posix_fadvise(WILLNEED)`` one piece at a time. The kernel reads the piece into the page cache without
copying it anywhere, where a ``pread`` into a scratch buffer would copy every input byte once more (a
quarter of a 12B conversion's system time) and, by touching each page twice, would promote the inputs to
the active list, where they crowd out the pages read ahead and get them evicted before use. The kernel caps
one hint at its readahead size (at least ``_PIECE`` on common block devices), so the thread gives the hints
in pieces, throttled by what the consumer reports done.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

_PIECE = 1 << 20  # not above the kernel's cap on one WILLNEED hint (max of read_ahead_kb, max_sectors_kb)
_MIN_WINDOW, _MAX_WINDOW = 256 << 20, 8 << 30


@dataclass(frozen=True)
class ByteRange:
    """``length`` bytes at ``offset`` of the open file ``fd``, in the order the consumer will read them."""

    fd: int
    offset: int
    length: int


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
    """Reads ``ranges`` in order on a daemon thread, never more than ``window`` bytes beyond what the consumer
    reported with :meth:`consumed`. A read error only stops the read-ahead: the consumer's own reads report it."""

    def __init__(self, ranges: Sequence[ByteRange], window: int | None = None) -> None:
        self._ranges = list(ranges)
        self._window = default_window() if window is None else window
        self._done = 0  # bytes the consumer is finished with
        self._ahead = 0  # bytes asked for so far
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="dflash-readahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        if self._ranges:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def bytes_requested(self) -> int:
        """How far it has asked the kernel to read (short ranges counted in full)."""
        with self._cond:
            return self._ahead

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def consumed(self, n_bytes: int) -> None:
        """The consumer is done with the next ``n_bytes`` of the ranges."""
        with self._cond:
            self._done += n_bytes
            self._cond.notify_all()

    def _run(self) -> None:
        for r in self._ranges:
            try:
                size = os.fstat(r.fd).st_size
            except OSError:
                return
            pos, end = r.offset, r.offset + r.length
            while pos < min(end, size):
                n = min(_PIECE, end - pos)
                with self._cond:
                    while not self._stop and self._ahead + n - self._done > self._window:
                        self._cond.wait()
                    if self._stop:
                        return
                try:
                    os.posix_fadvise(r.fd, pos, min(n, size - pos), os.POSIX_FADV_WILLNEED)
                except OSError:
                    return
                pos += n
                with self._cond:
                    self._ahead += n
            with self._cond:  # count a short range in full, so the window stays aligned with the consumer
                self._ahead += end - pos
