"""Per-tensor recipes: llama-quantize b11434's ``--tensor-type PATTERN=TYPE`` and ``--tensor-type-file FILE``.

b11434 (``parse_tensor_type`` in tools/quantize/quantize.cpp) splits each argument at its first ``=``, lowercases
the pattern, matches the type name case-insensitively against every ggml type name, and reads a file as
whitespace-separated arguments. ``llama_tensor_get_type`` (src/llama-quant.cpp) then searches each tensor's name with
every pattern in order (``std::regex_search``, ECMAScript grammar) and the first match wins, replacing the file
type's mixture rules for that tensor; the row-length fallback still applies. Python's ``re`` reads the ECMAScript
constructs a recipe uses the same way (classes, ``\\d``, anchors, alternation, groups, counted repeats, lookahead);
the constructs only one of the two grammars reads are refused here rather than matched differently.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from ..errors import QuantizeError

# ggml_type_name() of every type llama-quantize b11434 parses (parse_ggml_type), by lowercased name.
GGML_TYPE_NAMES = {t.name.lower(): t for t in GGMLQuantizationType}

# Python-only syntax (inline flags, named groups, lookbehind, \A \Z) and ECMAScript-only escapes (\cX, \u, \/)
_NOT_SHARED = re.compile(r"\(\?(?![:=!])|\\[AZzGcu/]")


@dataclass(frozen=True)
class TensorTypeRule:
    """One ``PATTERN=TYPE``: the pattern as b11434 keeps it (lowercased) and the type's ggml name."""

    pattern: str
    type_name: str

    @property
    def qtype(self) -> GGMLQuantizationType:
        return GGML_TYPE_NAMES[self.type_name]

    @property
    def arg(self) -> str:
        return f"{self.pattern}={self.type_name}"

    def matches(self, tensor_name: str) -> bool:
        return _compiled(self.pattern).search(tensor_name) is not None


def parse_tensor_type(text: str, source: str = "--tensor-type") -> TensorTypeRule:
    """``PATTERN=TYPE`` as llama-quantize reads it.

    Raises:
        QuantizeError: no ``=``, an empty pattern or type, a type ggml does not know (the message lists them), or a
            pattern that is not a regular expression both grammars read alike.
    """
    pattern, sep, type_name = text.partition("=")
    if not sep or not pattern or not type_name:
        missing = "'='" if not sep else "a tensor name pattern" if not pattern else "a type"
        raise QuantizeError(f"{source} {text!r} has no {missing}: write PATTERN=TYPE, e.g. 'attn_v=q8_0' or "
                            r"'blk\.(1[0-9]|2[0-3])\.ffn_down=q6_k'.")
    if type_name.lower() not in GGML_TYPE_NAMES:
        raise QuantizeError(f"{source} {text!r}: {type_name!r} is not a ggml type; llama-quantize b11434 knows "
                            f"{', '.join(GGML_TYPE_NAMES)}.")
    pattern = pattern.lower()  # as b11434 does, before compiling
    if _NOT_SHARED.search(pattern):
        raise QuantizeError(f"{source} {text!r}: the pattern uses syntax that llama-quantize's ECMAScript regular "
                            "expressions and Python's read differently (inline flags, named groups, lookbehind, "
                            r"\A \Z \G \c \u); write it with classes, anchors (^ $), alternation and groups.")
    try:
        _compiled(pattern)
    except re.error as exc:
        raise QuantizeError(f"{source} {text!r}: the pattern is not a regular expression ({exc}).") from exc
    return TensorTypeRule(pattern, type_name.lower())


def read_tensor_type_file(path: Path) -> tuple[TensorTypeRule, ...]:
    """A ``--tensor-type-file``: whitespace-separated ``PATTERN=TYPE`` arguments, in order.

    Raises:
        QuantizeError: the file cannot be read, or one of its arguments is refused (named with the file).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantizeError(f"--tensor-type-file {path}: cannot read it ({exc}).") from exc
    return tuple(parse_tensor_type(word, f"--tensor-type-file {Path(path).name}:") for word in text.split())


def recipe_from_flags(tensor_types: Sequence[str], tensor_type_file: Path | None) -> tuple[TensorTypeRule, ...]:
    """The rules of ``--tensor-type`` (in order), then those of ``--tensor-type-file``.

    Raises:
        QuantizeError: see :func:`parse_tensor_type` and :func:`read_tensor_type_file`.
    """
    given = tuple(parse_tensor_type(text) for text in tensor_types)
    return given + (read_tensor_type_file(tensor_type_file) if tensor_type_file is not None else ())


# A tag's name as it stands in file names: llama.cpp's -hf REPO:TAG reads the part after a name's last '-' or '.'
# (common/download.cpp get_gguf_split_info: [-.]([A-Z0-9_]+)$).
_TAG_NAME = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True)
class NamedRecipe:
    """``--recipe NAME=BASE_TYPE:FILE``: a tag of its own, ``NAME`` (in its files' names, where ``-hf REPO:NAME``
    finds them), made as ``base`` (a llama-quantize type name, settled by the caller) with the per-tensor ``rules`` of
    the file, recorded by the file's name (never its path)."""

    name: str
    base: str
    file_name: str
    rules: tuple[TensorTypeRule, ...]


def parse_named_recipe(text: str) -> NamedRecipe:
    """``NAME=BASE_TYPE:FILE`` (the file read now, as ``--tensor-type-file`` reads it).

    Raises:
        QuantizeError: the shape is not NAME=TYPE:FILE, the name holds a dash (llama.cpp's -hf would take only its
            last part) or another character a file name tag does not, or the file is refused.
    """
    name, sep, rest = text.partition("=")
    base, colon, file = rest.partition(":")
    if not sep or not colon or not name or not base or not file:
        raise QuantizeError(f"--recipe {text!r}: write NAME=BASE_TYPE:FILE, e.g. 'Q4_K_A8=Q4_K_M:attn-q8.txt' (a tag "
                            "named Q4_K_A8, made as Q4_K_M with the file's PATTERN=TYPE rules).")
    if not _TAG_NAME.match(name):
        raise QuantizeError(f"--recipe {text!r}: the tag name {name!r} may hold letters, digits and '_' only: it ends "
                            "the files' names, and llama.cpp's -hf REPO:TAG reads the part after the last '-' or '.'.")
    path = Path(file).expanduser()
    return NamedRecipe(name, base, path.name, read_tensor_type_file(path))


def first_match(rules: tuple[TensorTypeRule, ...], tensor_name: str) -> TensorTypeRule | None:
    """The rule b11434 applies to ``tensor_name``: the first whose pattern is found in it."""
    return next((rule for rule in rules if rule.matches(tensor_name)), None)


_COMPILED: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    """Compiled once per pattern (b11434 compiles each once too); ASCII classes, as the C++ locale's."""
    found = _COMPILED.get(pattern)
    if found is None:
        found = _COMPILED[pattern] = re.compile(pattern, re.ASCII)
    return found
