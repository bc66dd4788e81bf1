"""Run llama.cpp's own ``convert_hf_to_gguf.py`` from a checkout the user points at (``--llama-cpp DIR``).

For target architectures the built-in converter does not cover, and for drafters of targets whose vocabulary
path the built-in drafter converter does not mirror (with ``--target-model-dir``). It runs as a child process with
``$LLAMA_CPP_PYTHON`` (a venv with torch and llama.cpp's requirements) or this interpreter, offline
(the model is already local; nothing may be downloaded at convert time), in a scratch cwd, and writes
``<out>.partial`` that is renamed only when it succeeded. Only the user's checkout is executed, never
a file from a downloaded repo.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from ..atomic import atomic_output
from ..errors import ConfigError, InputError

log = logging.getLogger(__name__)

PYTHON_ENV = "LLAMA_CPP_PYTHON"
SCRIPT = "convert_hf_to_gguf.py"


def converter_script(llama_cpp: Path) -> Path:
    """``DIR/convert_hf_to_gguf.py``.

    Raises:
        InputError: DIR is not a llama.cpp checkout.
    """
    script = Path(llama_cpp).expanduser() / SCRIPT
    if not script.is_file():
        raise InputError(f"--llama-cpp {llama_cpp}: no {SCRIPT} there. Point it at a llama.cpp checkout (the folder "
                         f"holding {SCRIPT}).")
    return script


def converter_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


def llama_cpp_version(llama_cpp: Path) -> str:
    """A best-effort label of the checkout: its gguf-py version and the git HEAD when there is one."""
    root = Path(llama_cpp).expanduser().resolve()
    parts = [str(root)]
    head = root / ".git" / "HEAD"
    if head.is_file():
        ref = head.read_text(encoding="utf-8").strip()
        if ref.startswith("ref: ") and (root / ".git" / ref[5:]).is_file():
            ref = (root / ".git" / ref[5:]).read_text(encoding="utf-8").strip()
        parts.append(f"git {ref[:12]}")
    return " ".join(parts)


def run_converter(llama_cpp: Path, model_dir: Path, outfile: Path, outtype: str, workdir: Path,
                  extra_args: tuple[str, ...] = ()) -> int:
    """Convert ``model_dir`` with llama.cpp's converter into ``outfile``; returns its size.

    Raises:
        InputError: no converter in ``llama_cpp``.
        ConfigError: the converter failed (its last lines are quoted).
    """
    script = converter_script(llama_cpp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
    workdir.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=15)
    with atomic_output(Path(outfile)) as tmp:
        cmd = [converter_python(), str(script), str(Path(model_dir).resolve()), "--outfile", str(tmp.resolve()),
               "--outtype", outtype, *extra_args]
        log.info("running %s", " ".join(cmd))
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace")
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                log.debug("%s", line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:  # Ctrl-C included: stop the child before atomic_output removes the partial
            proc.kill()
            proc.wait()
            raise
        if rc != 0 or not tmp.is_file():
            quoted = "\n  ".join(tail)
            raise ConfigError(f"llama.cpp's converter ({script}) failed on {model_dir} with exit code {rc}. Check "
                              f"that {PYTHON_ENV} names a Python with llama.cpp's requirements installed (now: "
                              f"{converter_python()}). Its last lines:\n  {quoted}")
        return tmp.stat().st_size
