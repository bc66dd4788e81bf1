"""Atomic output files: write ``<out>.partial`` beside the target, fsync, rename on success.

An interrupted or failed run never leaves a file under the final name, and never a stray
``.partial`` either (it is removed in ``finally``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from .errors import OutputError


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


# Write failures that are about the destination, not the input: reported as OutputError.
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def _require_folder(out: Path) -> None:
    if not out.parent.is_dir():
        raise OutputError(f"Output folder {out.parent} does not exist. Create it or choose another output path.")


def check_free_space(out: Path, needed_bytes: int) -> None:
    """Refuse before writing anything when the output's filesystem cannot hold ``needed_bytes``.

    Raises:
        OutputError: the output folder is missing or has not enough free space.
    """
    _require_folder(Path(out))
    free = shutil.disk_usage(Path(out).parent).free
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
    _require_folder(out)
    if out.exists() and not overwrite:
        raise OutputError(f"{out} already exists. Delete it or choose another output name.")
    if out.is_dir():
        raise OutputError(f"{out} is a folder, so the output cannot be written under that name. Move the folder "
                          "away or choose another output name.")
    tmp = partial_path(out)
    try:
        try:
            yield tmp
        except OSError as e:
            if e.errno not in _OUTPUT_ERRNOS:
                raise
            raise OutputError(f"Writing {tmp} failed: {e.strerror} (errno {e.errno}). Nothing was left under "
                              f"{out.name}. Free space or fix permissions on {out.parent}, or choose another "
                              "output path.") from e
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
        # only what we made: on a read-only mount unlink() of an absent file fails with EROFS, not ENOENT
        if os.path.lexists(tmp):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
