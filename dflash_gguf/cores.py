"""How many threads the work gets by default: the cores this process may run on."""

from __future__ import annotations

import os


def machine_cores() -> int:
    """The CPUs this process may use (its affinity mask, which containers and ``taskset`` narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)
