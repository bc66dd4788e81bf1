"""One writer per output folder: an advisory lock held while a command writes a pipeline folder.

Why: two runs on one ``--outdir`` write the same ``.partial`` files and pair.json, and each breaks the other
(a traceback from one, a corrupt tensor from the other, a pair.json verify cannot read). The lock is
``flock`` on ``<folder>/.dflash-work/lock``: the kernel releases it when its process ends, however it ends, so a
lock left by a dead run is simply taken. The file's text (pid, start time, command) is only for the message.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import FolderBusyError

WORK_DIR = ".dflash-work"  # inside an output folder: the pipeline's work (tokenizer overlay, scratch) and the lock
LOCK_NAME = "lock"


@contextlib.contextmanager
def writing(folder: Path, what: str) -> Iterator[None]:
    """Hold ``folder``'s lock while the block writes into it (the folder is created if needed).

    Raises:
        FolderBusyError: another process holds it (its pid, start time and command are named).
    """
    lock_dir = Path(folder) / WORK_DIR
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip().splitlines()
            pid, started, command = (holder + ["?", "?", "?"])[:3]
            raise FolderBusyError(
                f"{folder} is being written by another dflash-gguf run (pid {pid}, started {started}: {command}). "
                "Two runs on one folder would break each other's files; wait for that one to finish, or write to "
                "another folder.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n{what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
