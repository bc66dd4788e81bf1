"""Count and time every child process the test session starts, by kind, for the end-of-run summary.

Where a slow suite spends its time is mostly in the processes it starts (the b11434 converter in the torch
venv, llama-server, libllama loaders, llama-quantize, our own console scripts), so the summary tallies them.
``install()`` replaces ``subprocess.Popen`` with a subclass that records the wall time from start to the
moment a wait or poll first sees the exit; every ``subprocess.run``/``check_output`` goes through it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONSOLE_SCRIPTS = ("dflash-convert", "dflash-verify", "dflash-gguf")


@dataclass
class KindTally:
    count: int = 0
    seconds: float = 0.0


TALLY: dict[str, KindTally] = {}
_ORIGINAL_POPEN = subprocess.Popen


XDIST_WORKER = "exec(eval(sys.stdin.readline()))"  # how pytest-xdist (execnet) starts a worker: not tallied


def kind_of(args: Any) -> str | None:
    """The tally row of a command line: which reference piece or which of our tools it runs (None: none)."""
    argv: Sequence[str] = [args] if isinstance(args, (str, bytes, Path)) else list(args)
    words = [str(a) for a in argv]
    text = " ".join(words)
    head = Path(words[0]).name if words else ""
    if XDIST_WORKER in text or "preloaded_converter.py" in text:  # the preloaded converter tallies each run itself
        return None
    if "convert_hf_to_gguf.py" in text:
        return "reference converter"
    if head == "llama-server":
        return "llama-server"
    if head == "llama-quantize":
        return "llama-quantize"
    if "DFLASH_LOADER_RESULT" in text:
        return "libllama loader"
    if "ggml_quantize_chunk" in text:
        return "libggml quantize"
    if head in CONSOLE_SCRIPTS or "dflash_gguf" in text and "-m" in words:
        return "our CLI (subprocess)"
    return f"other ({head or '?'})"


class TalliedPopen(_ORIGINAL_POPEN):  # type: ignore[misc, valid-type]
    """Popen that adds its wall time to TALLY once it is seen to have exited."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        self._tally_kind = kind_of(args)
        self._tally_start = time.monotonic()
        self._tally_done = False
        super().__init__(args, *rest, **kwargs)

    def _tally(self) -> None:
        if self.returncode is not None and not getattr(self, "_tally_done", True) and self._tally_kind:
            self._tally_done = True
            row = TALLY.setdefault(self._tally_kind, KindTally())
            row.count += 1
            row.seconds += time.monotonic() - self._tally_start

    def wait(self, timeout: float | None = None) -> int:
        try:
            return super().wait(timeout)
        finally:
            self._tally()

    def poll(self) -> int | None:
        try:
            return super().poll()
        finally:
            self._tally()


def record(kind: str, seconds: float) -> None:
    """Add work done without a child process (a console script run in-process) to the table."""
    row = TALLY.setdefault(kind, KindTally())
    row.count += 1
    row.seconds += seconds


def install() -> None:
    subprocess.Popen = TalliedPopen  # type: ignore[misc]


def summary_lines() -> list[str]:
    """One line per kind, slowest first."""
    rows = sorted(TALLY.items(), key=lambda kv: -kv[1].seconds)
    lines = [f"  {kind:<28} {row.count:>5} runs {row.seconds:>9.1f} s" for kind, row in rows]
    return lines
    return lines


def export() -> dict[str, list[float]]:
    """The table as plain data, for an xdist worker to hand to the controller."""
    return {kind: [row.count, row.seconds] for kind, row in TALLY.items()}


def merge(data: dict[str, list[float]]) -> None:
    for kind, (count, seconds) in data.items():
        row = TALLY.setdefault(kind, KindTally())
        row.count += int(count)
        row.seconds += seconds
