"""JSON files of a checkpoint folder, parsed once: one conversion reads tokenizer.json, tokenizer_config.json
and config.json from several stages (vocabulary, special tokens, synthesis), and a real tokenizer.json is
tens of MB. Parsed values are cached by (path, size, mtime) and must be treated as read-only.

Errors are the callers': :func:`read_json` raises ``OSError``, ``UnicodeDecodeError`` or ``ValueError``
(``json.JSONDecodeError``), and each stage turns them into its own message and exit code.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=16)
def _parse(path: str, size: int, mtime_ns: int) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_json(path: Path) -> Any:
    """The parsed content of ``path`` (shared, do not mutate)."""
    st = Path(path).stat()
    return _parse(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
