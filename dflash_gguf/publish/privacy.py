"""What must not leave this machine in a published file: absolute paths, the home folder, the user name (as a folder
name) and the host name.

Why a check on top of writing names only: a folder made by an earlier version, a GGUF from llama.cpp's tools
(llama-quantize writes the importance matrix's path as given, llama-imatrix the calibration text's), or a tool we do
not control can still carry one; a published repo is public and permanent, so publish looks before it uploads.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..ggufio.reader import read_header

# An absolute POSIX path of at least two parts, not inside a URL ("https://host/a/b": each slash there follows a
# ':' , '/' or a name character). Counted only when its first part exists here (/home, /tmp, /Users, ...), so an
# API route like /v1/chat/completions in a note is not one.
_ABSOLUTE = re.compile(r"(?<![\w.:/\\~-])/[^\s/\"'`<>|()\[\],;=]+(?:/[^\s/\"'`<>|()\[\],;=]*)+")
_WINDOWS = re.compile(r"\b[A-Za-z]:\\(?:Users|Documents and Settings)\\[^\s\\\"']+")
_MIN_NAME = 4  # a shorter user or host name ("vm", "pi") is a word in too many texts to be told apart


@dataclass(frozen=True)
class Trace:
    """One private string found: the file, where in it (a GGUF key, or a line), and what."""

    file: str
    field: str
    found: str
    why: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field} holds {self.found!r} ({self.why})"


@dataclass(frozen=True)
class Private:
    """The strings of this machine to look for."""

    home: str | None
    user: str | None
    host: str | None

    @classmethod
    def here(cls) -> Private:
        home = str(Path.home())
        try:
            user: str | None = getpass.getuser()
        except (KeyError, OSError):
            user = None
        host = socket.gethostname().split(".")[0] or None
        return cls(home if len(home) > 1 else None, user, host)

    def in_text(self, text: str) -> Iterator[tuple[str, str]]:
        """(what, why) for each private string in ``text``."""
        for m in _ABSOLUTE.finditer(text):
            first = m.group(0).split("/")[1]
            if os.path.lexists("/" + first):
                yield m.group(0), "an absolute path of this machine"
        for m in _WINDOWS.finditer(text):
            yield m.group(0), "a Windows user folder"
        if self.home and self.home in text:
            yield self.home, "the home folder"
        if self.user and len(self.user) >= _MIN_NAME and re.search(rf"[/\\]{re.escape(self.user)}[/\\]", text):
            yield self.user, "the user name, as a folder"
        if self.host and len(self.host) >= _MIN_NAME and re.search(rf"(?<![\w-]){re.escape(self.host)}(?![\w-])",
                                                                     text, re.IGNORECASE):
            yield self.host, "the host name"


# Keys whose strings are the model's data, not a record of where it was made: the vocabulary and its merges.
_DATA_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def gguf_traces(path: Path, name: str, private: Private) -> list[Trace]:
    """Private strings in a GGUF's metadata (every string and string array but the vocabulary)."""
    out: list[Trace] = []
    meta = read_header(path)  # each shard of a split GGUF on its own
    for key, kv in meta.kv.items():
        if key in _DATA_KEYS:
            continue
        values = kv.value if isinstance(kv.value, Sequence) and not isinstance(kv.value, str | bytes) else [kv.value]
        for value in values:
            if isinstance(value, str):
                out += [Trace(name, f"metadata key {key}", found, why) for found, why in private.in_text(value)]
    return out


def text_traces(data: bytes, name: str, private: Private) -> list[Trace]:
    """Private strings in a text file (pair.json, models.ini, the card), by line."""
    text = data.decode("utf-8", errors="replace")
    return [Trace(name, f"line {n}", found, why) for n, line in enumerate(text.splitlines(), 1)
            for found, why in private.in_text(line)]


def traces(files: Iterable[tuple[str, Path | bytes]], private: Private | None = None) -> list[Trace]:
    """Every private string in the files about to be published (a GGUF by its metadata, any other by its text;
    binary files that are neither, such as a legacy importance matrix, are not read)."""
    private = private or Private.here()
    out: list[Trace] = []
    for name, content in files:
        if isinstance(content, bytes):
            out += text_traces(content, name, private)
        elif name.endswith(".gguf"):
            out += gguf_traces(content, name, private)
        elif name.endswith((".json", ".ini", ".md", ".txt")):
            out += text_traces(content.read_bytes(), name, private)
    return out
