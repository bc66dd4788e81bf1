"""File-to-file byte copies in the kernel (``copy_file_range``), with a ``pread``/``write`` fallback.

Why: the bytes never pass through Python or count against our RSS, and on one filesystem the kernel moves
page-cache pages instead of copying them through a user buffer twice.
"""

from __future__ import annotations

import os

_FALLBACK_CHUNK = 16 << 20


def copy_range(src_fd: int, offset: int, length: int, dst_fd: int) -> int:
    """Copy ``length`` bytes at ``offset`` of ``src_fd`` to ``dst_fd``'s current position; return how many were
    copied (fewer only when ``src_fd`` ends first). ``dst_fd`` must be unbuffered or flushed."""
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, offset + done)
        except OSError:  # e.g. across filesystems on old kernels, or a file system without it
            n = 0
        if n == 0:
            data = os.pread(src_fd, min(length - done, _FALLBACK_CHUNK), offset + done)
            if not data:
                break
            n = os.write(dst_fd, data)
        done += n
    return done
