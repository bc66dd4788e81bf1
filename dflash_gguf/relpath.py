"""File names a repo or a manifest gives for files beside it: plain relative paths that stay inside its folder.

Why: a safetensors index or a pair.json names other files, and a name like ``../other-repo/x.safetensors`` or
``/home/me/private.gguf`` would make a conversion read, or a verify vouch for, a file outside the folder the
user named (in the Hugging Face cache: another repo's). The rule is on the name as written; symbolic links
inside the folder keep working (the Hugging Face cache is made of them).
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

_DRIVE = re.compile(r"^[A-Za-z]:")


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a plain relative path inside its folder, or None when it is."""
    if not isinstance(name, str) or not name:
        return f"{name!r} is not a file name"
    if "\\" in name or _DRIVE.match(name):
        return f"{name!r} is a Windows path (a backslash or a drive); names are relative with '/'"
    if name.startswith("/") or PurePosixPath(name).is_absolute():
        return f"{name!r} is an absolute path"
    if any(part in ("..", "") for part in name.split("/")) or "\x00" in name:
        return f"{name!r} leaves its folder or has an empty part ('..', '//')"
    return None


def inside(folder: Path, name: object) -> Path | None:
    """``folder / name`` when ``name`` is a plain relative path, else None (the caller says why it refuses)."""
    return None if name_problem(name) is not None else Path(folder) / str(name)
