"""The sha256 of a file while it is being written, so pair.json can record it without reading the output again.

Why a thread that follows the writer instead of hashing each ``write``: the converters copy same-type tensors
with ``os.copy_file_range`` (the bytes never pass through Python) and the quantizer's worker threads hand back
chunks, so the one place every byte is sure to pass is the file. The follower reads what the writer has
reported as written (the pages are still in the page cache), and ``hashlib`` releases the GIL on large
updates, so hashing overlaps with the writing on another core instead of costing a second pass afterwards.

Why it drops what it hashed from the page cache: nothing in a run reads a multi-GB output again, and kept, its
pages claim fresh memory at the writer's pace. On this project's VM a write into memory the system has not
touched for a while cost several times a write into recycled pages (the 12B one pass spent half a core in
``copy_folio_from_iter_atomic`` at 250 MB/s); dropped behind, the output's pages are written back early and
recycled, the dirty set stays small, and the final fsync has little left to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path
from types import TracebackType

_CHUNK = 8 << 20
_DROP_LAG = 64 << 20  # each hashed page is asked to leave the cache this long: the first ask only starts writeback


class FollowingHasher:
    """sha256 of ``path`` as it grows: the writer calls :meth:`advance` with the bytes safely in the file (after a
    flush), then :meth:`finish` with the final size. Equal to ``hashlib.sha256(path.read_bytes())`` at the end."""

    def __init__(self, path: Path) -> None:
        self._path = Path(path)
        self._hash = hashlib.sha256()
        self._limit = 0
        self._final: int | None = None
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"sha256 {self._path.name}", daemon=True)
        self._thread.start()

    def advance(self, n_bytes: int) -> None:
        """The first ``n_bytes`` of the file are written and will not change."""
        with self._cond:
            if n_bytes > self._limit:
                self._limit = n_bytes
                self._cond.notify()

    def finish(self, size: int) -> str:
        """The file is complete at ``size`` bytes: wait for the follower and return the hex digest."""
        with self._cond:
            self._limit = max(self._limit, size)
            self._final = size
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def abandon(self) -> None:
        """Stop following (the write failed); the digest is never used."""
        with self._cond:
            self._final = -1
            self._cond.notify()
        self._thread.join()

    def __enter__(self) -> FollowingHasher:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._thread.is_alive():
            self.abandon()

    def _run(self) -> None:
        try:
            with open(self._path, "rb", buffering=0) as f:
                view = memoryview(bytearray(_CHUNK))  # one buffer: a fresh 8 MB object per read is fresh memory
                pos = 0
                while True:
                    with self._cond:
                        while pos >= self._limit and self._final is None:
                            self._cond.wait()
                        if self._final == -1:
                            return
                        limit, final = self._limit, self._final
                    while pos < limit:
                        n = f.readinto(view[:min(_CHUNK, limit - pos)])
                        if not n:
                            raise OSError(f"{self._path} ended at {pos} bytes, {limit} were reported written")
                        self._hash.update(view[:n])
                        pos += n
                        with contextlib.suppress(OSError):  # DONTNEED writes dirty pages back, drops clean ones
                            os.posix_fadvise(f.fileno(), max(0, pos - _DROP_LAG), min(pos, _DROP_LAG),
                                             os.POSIX_FADV_DONTNEED)
                    if final is not None and pos >= final:
                        return
        except BaseException as e:  # noqa: BLE001 - re-raised in the writer's thread by finish()
            self._error = e
