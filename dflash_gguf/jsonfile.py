"""JSON files of a checkpoint folder, parsed once: one conversion reads tokenizer.json, tokenizer_config.json
and config.json from several stages (vocabulary, special tokens, synthesis), and a real tokenizer.json is
tens of MB. Parsed values are cached by (path, size, mtime) and must be treated as read-only.

A parsed 262k-token tokenizer.json holds ~130 MB of Python objects, so two more rules keep peak memory down: a
file with the same bytes under another path (the pipeline's tokenizer overlay copies tokenizer.json) shares the
parse, and :func:`forget` drops the cache between pipeline stages, which need it only within themselves.

Errors are the callers': :func:`read_json` raises ``OSError``, ``UnicodeDecodeError`` or ``ValueError``
(``json.JSONDecodeError``), and each stage turns them into its own message and exit code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

_BY_CONTENT: OrderedDict[tuple[int, bytes], Any] = OrderedDict()
_CONTENT_ENTRIES = 16


@functools.lru_cache(maxsize=16)
def _parse(path: str, size: int, mtime_ns: int) -> Any:
    raw = Path(path).read_bytes()
    key = (len(raw), hashlib.sha256(raw).digest())
    if key in _BY_CONTENT:
        _BY_CONTENT.move_to_end(key)
        return _BY_CONTENT[key]
    text = raw.decode("utf-8")
    del raw  # the bytes and the decoded text would otherwise both live through the parse
    value = json.loads(text)
    del text
    _BY_CONTENT[key] = value
    while len(_BY_CONTENT) > _CONTENT_ENTRIES:
        _BY_CONTENT.popitem(last=False)
    return value


def read_json(path: Path) -> Any:
    """The parsed content of ``path`` (shared, do not mutate)."""
    st = Path(path).stat()
    return _parse(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def forget() -> None:
    """Drop every cached parse (a stage that is done with its files calls this, so the next one does not carry
    the previous stage's tokenizer.json)."""
    _parse.cache_clear()
    _BY_CONTENT.clear()
    release_freed_memory()


def release_freed_memory() -> None:
    """Give freed heap pages back to the system. Why: glibc keeps the pages of a dropped parse (hundreds of
    thousands of small objects) mapped, so the next stage's peak would stack on top of the previous one's.
    A no-op where there is no glibc ``malloc_trim``."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
