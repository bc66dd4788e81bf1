"""Results that cost CPU-hours and depend only on their inputs (an ``--imatrix auto`` matrix, a base model's logits
for ``quality``), kept by content outside any output folder, so that a later run on the same inputs into another
folder reuses them instead of running llama-imatrix or llama-perplexity again.

Where: ``$XDG_CACHE_HOME/dflash-gguf/made`` (``~/.cache/dflash-gguf/made`` without it), one folder per kind, each
entry named by the sha256 of its key (canonical JSON) with the key written beside it. A key holds what decides the
bytes: the conversion key of the model, the text's sha256 (and its file name when the tool records it), the
settings and the tool's build. Nothing here is published, so a key may hold this machine's labels.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .atomic import atomic_output
from .errors import OutputError

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/dflash-gguf/made``, else ``~/.cache/dflash-gguf/made``."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "dflash-gguf" / "made"


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def entry_path(kind: str, key: Mapping[str, Any], suffix: str) -> Path:
    """Where the result of ``kind`` for ``key`` is (or would be) kept."""
    return cache_root() / kind / (key_digest(key)[:32] + suffix)


@dataclass(frozen=True)
class Kept:
    """A kept result and what was noted of its making (e.g. the hardware it ran on)."""

    path: Path
    about: dict[str, Any]


def _canonical(key: Mapping[str, Any]) -> Any:
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def lookup(kind: str, key: Mapping[str, Any], suffix: str) -> Kept | None:
    """The kept result for ``key``, or None. An entry whose key file is missing or differs is not taken."""
    path = entry_path(kind, key, suffix)
    try:
        recorded = json.loads(path.with_name(path.name + ".key.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not path.is_file() or not isinstance(recorded, dict) or recorded.get("key") != _canonical(key):
        return None
    about = recorded.get("about")
    return Kept(path, about if isinstance(about, dict) else {})


def keep(kind: str, key: Mapping[str, Any], made: Path, suffix: str, *, move: bool = False,
         about: Mapping[str, Any] | None = None) -> Kept | None:
    """Keep ``made`` as the result of ``kind`` for ``key`` (a copy, or moved with ``move``), with ``about`` noted;
    returns the entry, or None when the cache cannot be written (a read-only or full disk: the run goes on without
    it, with a warning, and ``made`` is where it was)."""
    path = entry_path(kind, key, suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path.with_name(path.name + ".key.json")) as tmp:  # first: the data is taken only beside it
            doc = {"key": _canonical(key), "about": dict(about or {})}
            tmp.write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n", encoding="utf-8")
        with atomic_output(path) as tmp:
            if move and os.stat(made).st_dev == os.stat(tmp.parent).st_dev:
                os.replace(made, tmp)
            else:
                shutil.copyfile(made, tmp)
    except (OSError, OutputError) as e:
        log.warning("could not keep the %s in %s (%s): a later run will make it again", kind, cache_root(), e)
        return None
    if move:
        Path(made).unlink(missing_ok=True)
    return Kept(path, dict(about or {}))


def folder_for(kind: str, key: Mapping[str, Any]) -> Path:
    """Where a result that is a folder of files (a stand-in pair) is kept for ``key``."""
    return entry_path(kind, key, "")


def folder_complete(folder: Path, key: Mapping[str, Any]) -> bool:
    """Whether ``folder`` was completed for ``key`` (:func:`mark_complete` wrote its key last)."""
    try:
        recorded = json.loads((folder / "made-for.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return recorded == _canonical(key)


def mark_complete(folder: Path, key: Mapping[str, Any]) -> None:
    """Record that ``folder`` holds the whole result for ``key``: written last, so a folder cut short is made again."""
    with atomic_output(folder / "made-for.json") as tmp:
        tmp.write_text(json.dumps(_canonical(key), sort_keys=True) + "\n", encoding="utf-8")
