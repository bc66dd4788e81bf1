"""A head start for the one-pass writer: its first tensors quantized while the CPU is still busy elsewhere.

Why: a target's one pass first spends seconds on one core (the drafter check, the tokenizer.model synthesis, a
262k vocabulary), and the first tensor in llama-quantize's order is then the slowest: Gemma-4's tied token
embedding, 2 GB of BF16 that becomes Q6_K, kept both cores busy for about 5 s at 12B while the disk sat idle.
A :class:`HeadStart` thread quantizes the leading rows of the first tensors on the free core into a scratch file
beside the output; the writer :func:`claim` s them when it gets there, copies them in (``copy_file_range``) and
quantizes only the rows left. The bytes are the same: each row quantizes on its own, by the same chunk function.

Any failure of the head start (a read error, no space for the scratch, a value Q6_K refuses) only stops it:
the writer quantizes those rows itself and reports what is wrong. The writer never waits for more than the
chunk in hand.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

Chunk = bytes | memoryview | np.ndarray  # converted rows: bytes as read, or what a kernel returned
ConvertRows = Callable[[int, int, int], Chunk]  # (fd, first row, rows) -> the output bytes


def byte_view(chunk: Chunk) -> memoryview:
    """A chunk's bytes, without a copy."""
    return chunk.data.cast("B") if isinstance(chunk, np.ndarray) else memoryview(chunk).cast("B")


@dataclass(frozen=True)
class AheadJob:
    """One output tensor the head start may begin: ``key`` names its input bytes and output type, so that only the
    writer of the very same tensor claims it."""

    key: Hashable
    path: Path
    offset: int  # of the input's first row in ``path``
    in_row_bytes: int
    rows: int
    rows_per_chunk: int
    out_row_bytes: int
    convert: ConvertRows


@dataclass(frozen=True)
class Claimed:
    """The first ``rows`` rows of a tensor, quantized: ``nbytes`` bytes at the start of the open file ``fd``."""

    fd: int
    rows: int
    nbytes: int


class _Slot:
    def __init__(self, job: AheadJob, scratch: Path) -> None:
        self.job, self.scratch = job, scratch
        self.fd: int | None = None
        self.rows = 0


_ACTIVE: list[HeadStart] = []
_ACTIVE_LOCK = threading.Lock()


class HeadStart:
    """Quantizes ``jobs`` in order on one daemon thread, each into its own scratch file in ``scratch_dir``, until
    the writer claims one, ``budget`` output bytes are made, or the block exits (which removes the scratch files).

    No head start when ``scratch_dir`` lacks ``reserve`` bytes of free space beyond the budget (the output itself
    is to be written there) or there are no jobs."""

    def __init__(self, jobs: Sequence[AheadJob], scratch_dir: Path, stem: str, *, budget: int = 1 << 30,
                 reserve: int = 0) -> None:
        self._slots: list[_Slot] = []
        planned = 0
        for i, job in enumerate(jobs):
            if planned >= budget:
                break
            self._slots.append(_Slot(job, Path(scratch_dir) / f".{stem}.ahead{i}"))
            planned += job.rows * job.out_row_bytes
        with contextlib.suppress(OSError):
            if shutil.disk_usage(scratch_dir).free < reserve + planned:
                self._slots = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-head-start", daemon=True)
        self.handed_over: dict[Hashable, int] = {}  # rows each claim took, by job key

    def __enter__(self) -> HeadStart:
        if self._slots:
            with _ACTIVE_LOCK:
                _ACTIVE.append(self)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt()
        with _ACTIVE_LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
        for slot in self._slots:
            if slot.fd is not None:
                os.close(slot.fd)
                slot.fd = None
            slot.scratch.unlink(missing_ok=True)

    @property
    def rows_done(self) -> dict[Hashable, int]:
        """Rows made so far, per job key (for progress and tests)."""
        return {slot.job.key: slot.rows for slot in self._slots}

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the thread has made every row it was to make, or stopped; whether it is done."""
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _halt(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def claim(self, key: Hashable) -> Claimed | None:
        """The rows made for ``key``, after stopping the thread at its current chunk; None when it is not a job
        of this head start or none of its rows are made."""
        slot = next((s for s in self._slots if s.job.key == key), None)
        if slot is None:
            return None
        self._halt()  # the writer has got here: from now on its own pool is faster
        if slot.fd is None or slot.rows == 0:
            return None
        self.handed_over[key] = slot.rows
        return Claimed(slot.fd, slot.rows, slot.rows * slot.job.out_row_bytes)

    def _run(self) -> None:
        fds: dict[Path, int] = {}
        try:
            for slot in self._slots:
                job = slot.job
                src = fds.get(job.path)
                if src is None:
                    src = fds[job.path] = os.open(job.path, os.O_RDONLY)
                slot.scratch.unlink(missing_ok=True)  # left by a run that was killed
                slot.fd = os.open(slot.scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                for row0 in range(0, job.rows, job.rows_per_chunk):
                    if self._stop.is_set():
                        return
                    n = min(job.rows_per_chunk, job.rows - row0)
                    data = byte_view(job.convert(src, row0, n))
                    if len(data) != n * job.out_row_bytes or os.write(slot.fd, data) != len(data):
                        return
                    slot.rows = row0 + n
                    with contextlib.suppress(OSError):  # read once: recycle its pages (see ggufio.readahead)
                        os.posix_fadvise(src, job.offset + row0 * job.in_row_bytes, n * job.in_row_bytes,
                                         os.POSIX_FADV_DONTNEED)
        except Exception as e:  # noqa: BLE001 - a head start only ever stops; the writer redoes and reports
            log.debug("head start stopped: %s", e)
        finally:
            for fd in fds.values():
                os.close(fd)


def claim(key: Hashable) -> Claimed | None:
    """The rows any running head start made for ``key`` (see :meth:`HeadStart.claim`)."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for head in active:
        if (claimed := head.claim(key)) is not None:
            return claimed
    return None
