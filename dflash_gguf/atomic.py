"""Atomic output files: write ``<out>.partial`` beside the target, fsync, rename on success.

An interrupted or failed run never leaves a file under the final name, and never a stray
``.partial`` either (it is removed in ``finally``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputError


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def check_free_space(out: Path, needed_bytes: int) -> None:
    """Refuse before writing anything when the output's filesystem cannot hold ``needed_bytes``.

    Raises:
        OutputError: not enough free space.
    """
    free = shutil.disk_usage(out.parent).free
    if needed_bytes > free:
        raise OutputError(
            f"Not enough disk space for {out}: about {needed_bytes / 1e6:.1f} MB is needed and "
            f"{free / 1e6:.1f} MB is free on that filesystem. Free some space or choose another --outfile."
        )


@contextlib.contextmanager
def atomic_output(out: Path, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield the ``.partial`` path to write; on clean exit fsync it and rename it to ``out``.

    Raises:
        OutputError: ``out`` exists and ``overwrite`` is false, or its folder is missing.
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise OutputError(f"Output folder {out.parent} does not exist. Create it or choose another --outfile.")
    if out.exists() and not overwrite:
        raise OutputError(f"{out} already exists. Delete it or choose another output name.")
    tmp = partial_path(out)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
        dir_fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
