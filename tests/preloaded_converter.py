"""b11434's convert_hf_to_gguf.py from a preloaded process: torch, transformers and gguf-py imported once, each run a
fork of that process.

Why: on the suite's tiny fixtures a converter run spends most of its time importing torch and transformers (5 to 8 s
of CPU on a 2-core machine, the conversion itself often under a second), and a cold run of the suite converts a few
hundred times. A forked child runs the script's own ``main()`` with the run's argv, working folder and environment,
stdin from /dev/null and stdout/stderr to files, then exits with main's status, as ``python convert_hf_to_gguf.py``
would; every run gets a fresh copy of the converter's module state (its model classes are mutated by --mtp flags).
``tests/test_reference_env.py`` holds a forked run to a fresh process, byte for byte.

Run as a script (``<ref-venv python> preloaded_converter.py CONVERT_SCRIPT``) this file is the server: one JSON request
per line on stdin, a ``{"pid": N}`` line when the child starts and an ``{"status": S}`` line when it ends. Imported, it
is the client (:class:`PreloadedConverter`). ``DFLASH_GGUF_REF_CONVERTER=process`` runs every conversion as a process
of its own instead. Stdlib only: the server runs in the converter's venv.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

MODE_ENV = "DFLASH_GGUF_REF_CONVERTER"  # "process": a fresh interpreter per run (the preloaded one otherwise)
START_TIMEOUT = 300.0


def preloaded_enabled() -> bool:
    return os.environ.get(MODE_ENV, "").strip().lower() != "process"


class PreloadedConverter:
    """One server per test process, started on first use; runs one conversion at a time."""

    def __init__(self, python: Path, script: Path, env: Mapping[str, str]) -> None:
        self.python, self.script = python, script
        self.log = tempfile.TemporaryFile("w+")  # the server's own stderr (import-time warnings), read on failure
        self.proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), str(script)], env=dict(env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=str(script.parent))
        ready = self._read_line(START_TIMEOUT)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the preloaded converter did not start: {ready}")

    def _read_line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        line = self.proc.stdout.readline() if readable else ""
        if not line:
            self.log.seek(0)
            raise _NoAnswer(f"no answer from the preloaded converter within {timeout:.0f} s "
                            f"(exit {self.proc.poll()}): {self.log.read()[-3000:]}")
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, argv: Sequence[str], cwd: Path, env: Mapping[str, str],
            timeout: float) -> subprocess.CompletedProcess[str]:
        """``python CONVERT_SCRIPT argv...`` in ``cwd`` with ``env``, as a fork of the preloaded process.

        Raises:
            subprocess.TimeoutExpired: the run took longer than ``timeout`` (it is killed).
        """
        out, err = cwd / ".converter-stdout", cwd / ".converter-stderr"
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": list(argv), "cwd": str(cwd), "env": dict(env),
                                          "stdout": str(out), "stderr": str(err)}) + "\n")
        self.proc.stdin.flush()
        start = time.monotonic()
        pid = int(self._read_line(START_TIMEOUT)["pid"])
        try:
            status = int(self._read_line(timeout - (time.monotonic() - start))["status"])
        except _NoAnswer:
            os.kill(pid, 9)
            self._read_line(60)
            raise subprocess.TimeoutExpired([str(self.script), *argv], timeout) from None
        try:
            return subprocess.CompletedProcess([str(self.python), str(self.script), *argv], status,
                                               out.read_text(encoding="utf-8", errors="replace"),
                                               err.read_text(encoding="utf-8", errors="replace"))
        finally:
            out.unlink(missing_ok=True)
            err.unlink(missing_ok=True)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class _NoAnswer(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------- server


def _load_converter(script: Path) -> Any:
    """Import the converter as ``python script`` would see it (its folder first on sys.path), plus what it imports
    later on every run (transformers' tokenizer classes)."""
    import importlib.util

    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import sentencepiece  # noqa: F401 - imported by the SentencePiece vocabularies
    import transformers

    for name in ("AutoTokenizer", "AutoConfig", "PreTrainedTokenizerFast"):
        getattr(transformers, name)  # transformers imports these lazily
    return module


def _child(converter: Any, request: dict[str, Any]) -> int:
    """Run in the forked child: the converter's main() with the request's argv, folder, environment and files."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the child's whole life
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [converter.__file__, *request["argv"]]
    try:
        converter.main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter would: print the traceback, exit 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(script: Path, requests: IO[str], answers: IO[str]) -> None:
    converter = _load_converter(script)
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(converter, request)
            finally:
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


if __name__ == "__main__":
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the converter's import-time prints must not reach the protocol stream
    serve(Path(sys.argv[1]), sys.stdin, protocol)
