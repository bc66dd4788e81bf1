"""Reference results computed once: a b11434 run is reused when everything it could depend on is unchanged.

The fixtures are deterministic, so a reference output (the converter's GGUF, llama-quantize's file, what
libllama's loader says) depends only on its inputs. The key of a run hashes:
- the reference build's identity (the converter script and gguf-py, or the compiled binaries, by content);
- the harness code that starts it (the source of the helper and of the child script it runs);
- the arguments, with every input replaced by its name and content: each file's sha256, each folder's
  relative paths and their files' sha256, so one changed byte anywhere in an input is a new key;
- the names of the outputs' placeholders (an output path itself is not an input).

Stored under the reference cache folder (``<cache root>/ref-results``), so a second request in the same run
and a later run on the same machine both reuse it. ``DFLASH_GGUF_REF_CACHE=off`` runs everything afresh.
Paths in the captured stdout/stderr are stored as placeholders and put back for the caller's paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "DFLASH_GGUF_REF_CACHE"
KEY_VERSION = "1"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0


STATS: dict[str, CacheStats] = {}


def enabled() -> bool:
    """False when ``DFLASH_GGUF_REF_CACHE`` is off/0/false/no."""
    return os.environ.get(CACHE_ENV, "").strip().lower() not in ("off", "0", "false", "no")


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path and content under ``root`` (symlinks followed), sorted."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + file_digest(path).encode() + b"\n")
    return h.hexdigest()


def content_token(path: Path) -> str:
    """An input as the key sees it: its name and what it holds (missing paths by name alone)."""
    if path.is_dir():
        return f"dir:{path.name}:{tree_digest(path)}"
    if path.is_file():
        return f"file:{path.name}:{file_digest(path)}"
    return f"absent:{path.name}"


def files_identity(paths: Iterable[Path]) -> str:
    """Identity of a build: sha256 of the named files' names and contents (folders walked)."""
    return hashlib.sha256("\n".join(content_token(p) for p in sorted(paths)).encode()).hexdigest()


@dataclass(frozen=True)
class Run:
    """What a caller gets back, fresh or reused."""

    returncode: int
    stdout: str
    stderr: str
    reused: bool


def _marker(name: str) -> str:
    return f"<<dflash-ref-cache:{name}>>"


def _to_placeholders(text: str, paths: Mapping[str, Path]) -> str:
    for name, path in sorted(paths.items(), key=lambda kv: -len(str(kv[1]))):
        text = text.replace(str(path), _marker(name))
    return text


def _from_placeholders(text: str, paths: Mapping[str, Path]) -> str:
    for name, path in paths.items():
        text = text.replace(_marker(name), str(path))
    return text


def cache_dir(root: Path) -> Path:
    return root / "ref-results"


def cached_run(
    kind: str,
    *,
    root: Path,
    identity: str,
    harness: str,
    args: Sequence[str],
    inputs: Mapping[str, Path],
    outputs: Mapping[str, Path],
    scratch: Mapping[str, Path] | None = None,
    run: Callable[[], subprocess.CompletedProcess[str]],
) -> Run:
    """``run()`` once per key: afterwards its outputs are copied to ``outputs`` and its text returned.

    ``args`` are the run's arguments other than the inputs and outputs (which ``inputs``/``outputs`` name by
    placeholder); ``scratch`` paths (a temporary cwd) are only substituted in the text. A run that timed out
    raises as usual and stores nothing.
    """
    stats = STATS.setdefault(kind, CacheStats())
    inputs = {name: Path(p).resolve() for name, p in inputs.items()}
    outputs = {name: Path(p).resolve() for name, p in outputs.items()}
    if not enabled():
        stats.misses += 1
        proc = run()
        return Run(proc.returncode, proc.stdout, proc.stderr, reused=False)
    key_doc = {
        "version": KEY_VERSION,
        "kind": kind,
        "identity": identity,
        "harness": hashlib.sha256(harness.encode()).hexdigest(),
        "args": list(args),
        "inputs": {name: content_token(path) for name, path in sorted(inputs.items())},
        "outputs": sorted(outputs),
    }
    key = hashlib.sha256(json.dumps(key_doc, sort_keys=True).encode()).hexdigest()
    entry = cache_dir(root) / kind / key
    meta_path = entry / "result.json"
    text_paths = {**inputs, **outputs, **{n: Path(p) for n, p in (scratch or {}).items()}}
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        meta = None
    if meta is not None:
        for name, path in outputs.items():
            if name in meta["outputs"]:
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(entry / name, path)
        stats.hits += 1
        return Run(meta["returncode"], _from_placeholders(meta["stdout"], text_paths),
                   _from_placeholders(meta["stderr"], text_paths), reused=True)
    stats.misses += 1
    proc = run()
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=entry.parent))
    try:
        made = [name for name, path in outputs.items() if path.is_file()]
        for name in made:
            shutil.copyfile(outputs[name], staging / name)
        stored = {"key": key_doc, "returncode": proc.returncode, "outputs": made,
                  "stdout": _to_placeholders(proc.stdout, text_paths),
                  "stderr": _to_placeholders(proc.stderr, text_paths)}
        (staging / "result.json").write_text(json.dumps(stored, indent=1), encoding="utf-8")
        try:
            os.rename(staging, entry)  # atomic: a reader sees a whole entry or none
        except OSError:  # another process stored the same key first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Run(proc.returncode, proc.stdout, proc.stderr, reused=False)


def summary_lines() -> list[str]:
    return [f"  {kind:<28} {s.hits:>5} reused {s.misses:>5} ran" for kind, s in sorted(STATS.items())]


def export() -> dict[str, list[int]]:
    """The hit and miss counts as plain data, for an xdist worker to hand to the controller."""
    return {kind: [s.hits, s.misses] for kind, s in STATS.items()}


def merge(data: dict[str, list[int]]) -> None:
    for kind, (hits, misses) in data.items():
        stats = STATS.setdefault(kind, CacheStats())
        stats.hits += hits
        stats.misses += misses
