"""Our console scripts run inside the test process, as a fresh process would run them.

A console script costs a Python start and the imports of numpy, gguf and huggingface_hub each time; the tests
that are about what a command decides and prints do not need that process. ``run`` invokes the same Click
command the entry point calls, through Click's ``CliRunner`` (its own stdout/stderr, empty stdin, the
environment given), after resetting the module state a new process would not have: every ``functools`` cache
in ``dflash_gguf``, the pipeline's kept vocabulary and the Hub client's pins and listings. Logging is
configured by the command itself, as in a process of its own (the test's log handlers are set aside meanwhile).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import click
import process_tally
from click.testing import CliRunner

# The console scripts of pyproject.toml's [project.scripts]: the command each entry point runs (None: the group).
ENTRY_POINTS = {"dflash-convert": "convert", "dflash-verify": "verify", "dflash-gguf": None}


def _command(exe: str) -> click.Command:
    from dflash_gguf import cli

    name = ENTRY_POINTS[exe]
    return cli.main if name is None else cli.command(name)


def reset_module_state() -> None:
    """Forget what an earlier run in this process remembered (a new process starts without any of it)."""
    from dflash_gguf import hub, jsonfile
    from dflash_gguf.convert import vocab
    from dflash_gguf.quantize import ahead

    for name, module in list(sys.modules.items()):
        if name == "dflash_gguf" or name.startswith("dflash_gguf."):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", "") == name:
                    value.cache_clear()
    jsonfile._BY_CONTENT.clear()
    vocab._last_built = None
    hub._PINS.clear()
    hub._LISTINGS.clear()
    hub._PARTIAL.clear()
    assert not ahead._ACTIVE, "a head start of an earlier run is still active"


@contextlib.contextmanager
def _working_dir(path: Path | None) -> Iterator[None]:
    """``cwd`` as ``subprocess.run`` takes it (contextlib.chdir is Python 3.11+)."""
    previous = Path.cwd()
    os.chdir(path or previous)
    try:
        yield
    finally:
        os.chdir(previous)


@contextlib.contextmanager
def _own_logging() -> Iterator[None]:
    """The root logger as a new process has it, so the command's logging.basicConfig writes to its stderr."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        yield
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


@contextlib.contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """HF_HUB_OFFLINE as a process started with it set sees it: huggingface_hub reads it once, at import."""
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = offline or saved
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def run(exe: str, args: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
        offline: bool = True) -> subprocess.CompletedProcess[str]:
    """``exe args`` in this process; returns what ``subprocess.run`` would (exit code, stdout, stderr).

    An exception the command lets escape is printed on stderr with exit code 1, as Python does."""
    reset_module_state()
    started = time.monotonic()
    runner = CliRunner()
    with _working_dir(cwd), _own_logging(), _hub_offline(offline):
        result = runner.invoke(_command(exe), list(args), prog_name=exe,
                               env={**({"HF_HUB_OFFLINE": "1"} if offline else {}), **(env or {})})
    process_tally.record("our CLI (in-process)", time.monotonic() - started)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        assert result.exc_info is not None
        stderr += "".join(traceback.format_exception(*result.exc_info))
    return subprocess.CompletedProcess([exe, *args], result.exit_code, result.stdout, stderr)
