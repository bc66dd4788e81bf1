"""JSON files of a checkpoint folder, parsed once: one conversion reads tokenizer.json, tokenizer_config.json
and config.json from several stages (vocabulary, special tokens, synthesis), and a real tokenizer.json is
tens of MB. Parsed values are cached by (path, size, mtime) and must be treated as read-only.

A parsed 262k-token tokenizer.json holds ~130 MB of Python objects, so two more rules keep peak memory down: a
file with the same bytes under another path (the pipeline's tokenizer overlay copies tokenizer.json) shares the
parse, and :func:`forget` drops the cache between pipeline stages, which need it only within themselves.

A tokenizers file's ``model.merges`` (515k pairs in Gemma-4's) is the bulk of it: parsed whole, its text alone is a
113 MB Python string. :func:`read_json` therefore leaves that one array as its validated UTF-8 text, a
:class:`JsonArrayText` that :func:`array_runs` decodes a few thousand elements at a time.

Every JSON file read from a repo, a folder or a manifest goes through the same bounds (:func:`parse_bounded`): at
most ``MAX_JSON_BYTES`` (a 262k-token tokenizer.json is tens of MB), nesting no deeper than the decoder's
recursion limit, and no ``NaN``/``Infinity`` (not JSON; a NaN norm epsilon would be written into a GGUF). A file
outside them raises :class:`JsonLimitError` (a ``json.JSONDecodeError``).

Errors: :func:`read_json` and :func:`load_json` raise ``OSError`` or :class:`~dflash_gguf.errors.UnreadableJson`
(an ``InputError`` naming the file, and a ``json.JSONDecodeError``): a stage that catches decoding errors turns it
into its own message and exit code, and one that does not lets a clear error reach the CLI. A
:class:`JsonArrayText` was checked when it was read, so decoding it later cannot fail.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UnreadableJson

_BY_CONTENT: OrderedDict[tuple[int, bytes], Any] = OrderedDict()
_CONTENT_ENTRIES = 16
MAX_JSON_BYTES = 256 << 20  # several times the largest real tokenizer.json (262k-token vocabularies: tens of MB)


class JsonLimitError(json.JSONDecodeError):
    """A JSON file outside the bounds every reader applies: too large, nested too deep, or NaN/Infinity."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "", 0)
        self.message = message

    def __str__(self) -> str:
        return self.message


_CONSTANT_FIELD = re.compile(r'"([^"\\]{1,200})"\s*:\s*(-?Infinity|NaN)\b')


def _check_size(n_bytes: int) -> None:
    if n_bytes > MAX_JSON_BYTES:
        raise JsonLimitError(f"it is {n_bytes / 1e6:.0f} MB, more than the {MAX_JSON_BYTES >> 20} MiB any Hugging "
                             "Face JSON file needs")


def _no_constant(name: str) -> Any:
    raise JsonLimitError(f"it holds {name}, which is not a JSON number (a value such as a norm epsilon must be "
                         "finite)")


def parse_bounded(text: str | bytes) -> Any:
    """``json.loads`` within the bounds above.

    Raises:
        UnicodeDecodeError: bytes that are not UTF-8.
        json.JSONDecodeError: not JSON, or outside the bounds (:class:`JsonLimitError`).
    """
    _check_size(len(text))
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except JsonLimitError:
        field = _CONSTANT_FIELD.search(text)
        if field is None:
            raise
        raise JsonLimitError(f"its field {field.group(1)!r} is {field.group(2)}, which is not a JSON number (a size "
                             "or a norm epsilon must be finite)") from None
    except RecursionError:
        raise JsonLimitError("it is nested deeper than a JSON reader follows (about 1000 levels); no real "
                             "config or tokenizer file is") from None


def _why(e: UnicodeDecodeError | json.JSONDecodeError) -> str:
    if isinstance(e, UnicodeDecodeError):
        return f"it is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start})"
    return str(e)


def load_json(path: Path) -> Any:
    """``path`` parsed afresh (a value the caller may change), within the bounds of :func:`parse_bounded`.

    Raises:
        OSError: it cannot be read.
        UnreadableJson: not UTF-8, not JSON or outside the bounds (a ``json.JSONDecodeError`` too).
    """
    size = Path(path).stat().st_size
    try:
        _check_size(size)  # before a byte of it is read
        return parse_bounded(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnreadableJson(path, _why(e)) from None


@functools.lru_cache(maxsize=16)
def _parse(path: str, size: int, mtime_ns: int) -> Any:
    _check_size(size)  # before a byte of it is read
    raw = Path(path).read_bytes()
    key = (len(raw), hashlib.sha256(raw).digest())
    if key in _BY_CONTENT:
        _BY_CONTENT.move_to_end(key)
        return _BY_CONTENT[key]
    value = _parse_lean(raw)
    if value is None:
        text = raw.decode("utf-8")
        del raw  # the bytes and the decoded text would otherwise both live through the parse
        value = parse_bounded(text)
        del text
    _BY_CONTENT[key] = value
    while len(_BY_CONTENT) > _CONTENT_ENTRIES:
        _BY_CONTENT.popitem(last=False)
    return value


def read_json(path: Path) -> Any:
    """The parsed content of ``path`` (shared, do not mutate), within the bounds of :func:`parse_bounded`.

    Raises:
        OSError: it cannot be read.
        UnreadableJson: not UTF-8, not JSON or outside the bounds (a ``json.JSONDecodeError`` too).
    """
    st = Path(path).stat()
    try:
        return _parse(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnreadableJson(path, _why(e)) from None


class JsonArrayText:
    """A JSON array kept as its UTF-8 text, cut into runs of whole elements that each decode on their own.

    Holds a view of the file's bytes (~25 MB for Gemma-4's merges) instead of ~100 MB of parsed strings and the
    113 MB text they were parsed from; each run was matched by a strict JSON grammar and decoded as UTF-8 once
    when read, so :meth:`runs` cannot fail later."""

    __slots__ = ("_spans", "_text")

    def __init__(self, text: memoryview, spans: tuple[tuple[int, int], ...]) -> None:
        self._text, self._spans = text, spans

    def __bool__(self) -> bool:
        return bool(self._spans)

    def runs(self) -> Iterator[list[Any]]:
        for start, end in self._spans:
            yield json.loads("[" + str(self._text[start:end], "utf-8") + "]")


def array_runs(value: Any) -> Iterator[list[Any]]:
    """A JSON array's elements, a run (a list of up to a few thousand) at a time, whether it was read whole (a
    list) or left as text (:class:`JsonArrayText`); nothing for any other value."""
    if isinstance(value, JsonArrayText):
        yield from value.runs()
    elif isinstance(value, list):
        for start in range(0, len(value), _RUN_ELEMENTS):
            yield value[start:start + _RUN_ELEMENTS]


# The strict JSON grammar of a merges array's elements (RFC 8259 strings; "a b" or ["a", "b"]), possessive so a
# 30 MB array is matched in a fraction of a second; a run is up to _RUN_ELEMENTS elements.
_RUN_ELEMENTS = 4096
_STRING = rb'"[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9A-Fa-f]{4})[^"\\\x00-\x1f]*+)*+"'
_WS = rb"[ \t\n\r]*+"  # JSON's whitespace, narrower than \s
_ELEMENT = rb"(?:%s|\[%s%s%s,%s%s%s\])" % (_STRING, _WS, _STRING, _WS, _WS, _STRING, _WS)
_RUN = re.compile(rb"%s%s(?:%s,%s%s){0,%d}+" % (_WS, _ELEMENT, _WS, _WS, _ELEMENT, _RUN_ELEMENTS - 1))
# An unescaped quote can only follow "{" or "," outside a string, so this is a "merges" key somewhere in the
# document; which one is settled by parsing the rest with a sentinel in its place.
_MERGES_KEY = re.compile(rb'[{,]%s"merges"%s:%s(?=\[)' % (_WS, _WS, _WS))
_AFTER_RUN = re.compile(rb"%s([,\]])" % _WS)
_EMPTY_REST = re.compile(rb"%s\]" % _WS)
_SENTINEL = "\x00merges kept as text"


def _array_spans(raw: bytes, start: int) -> tuple[tuple[tuple[int, int], ...], int] | None:
    """Spans of the runs of elements of the array whose "[" is at ``start`` (each a JSON array once bracketed) and
    the offset after its "]"; None when it is not an array of strings or string pairs."""
    spans: list[tuple[int, int]] = []
    pos = start + 1
    if (empty := _EMPTY_REST.match(raw, pos)) is not None:
        return (), empty.end()
    while (run := _RUN.match(raw, pos)) is not None and (after := _AFTER_RUN.match(raw, run.end())) is not None:
        spans.append((run.start(), run.end()))
        pos = after.end()
        if after.group(1) == b"]":
            return tuple(spans), pos
    return None


def _parse_lean(raw: bytes) -> Any:
    """``raw`` parsed with its tokenizers ``model.merges`` left as text, or None when it has none to leave."""
    for key in _MERGES_KEY.finditer(raw):
        found = _array_spans(raw, key.end())
        if found is None or not found[0]:
            continue
        spans, end = found
        try:
            value = parse_bounded((raw[:key.end()] + json.dumps(_SENTINEL).encode() + raw[end:]).decode("utf-8"))
        except ValueError:  # UnicodeDecodeError too: the whole file is then read (and refused) as it is
            return None
        model = value.get("model") if isinstance(value, dict) else None
        if not isinstance(model, dict) or model.get("merges") != _SENTINEL:
            continue
        view = memoryview(raw)
        try:
            for start, stop in spans:
                str(view[start:stop], "utf-8")
        except UnicodeDecodeError:
            return None
        model["merges"] = JsonArrayText(view, spans)
        return value
    return None


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
