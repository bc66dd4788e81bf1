"""Compare two GGUF files the way the parity tests define "identical" (README: 'What "identical to b11434" means').

Identical means, after dropping the ignored keys below and nothing else:
- the same GGUF version;
- the same keys in the same order, each with the same value type (and element type for arrays) and the
  same value;
- the same tensors in the same order, each with the same name, ggml type, shape and data bytes.

Every ignored key is listed, with its reason, in the README's "Keys that differ by design" table;
``tests/test_convert.py::test_ignored_keys_are_the_documented_ones`` checks the two lists agree.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from dflash_gguf.dflash_format import PROVENANCE_PREFIX

# general.* keys b11434 derives from the drafter dir with gguf-py's Metadata heuristics (README YAML,
# directory name, parameter count). They carry no runtime meaning; we write only general.name, our own.
IGNORED_KEYS = frozenset({
    "general.name", "general.size_label", "general.license", "general.tags", "general.basename",
    "general.finetune", "general.version", "general.languages", "general.datasets", "general.organization",
    "general.quantized_by", "general.repo_url",
})
# general.base_model.*: the card's `base_model` list (count, then name/organization/version/repo_url per
# entry). dflash_gguf.*: our provenance keys.
IGNORED_PREFIXES = ("general.base_model.", PROVENANCE_PREFIX)


def ignored(key: str) -> bool:
    return key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES)


@functools.lru_cache(maxsize=4)
def _reader(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    return GGUFReader(path)


def reader(path: Path) -> GGUFReader:
    """gguf-py's reader, parsed once per file version (it takes seconds on a 128k-token vocabulary)."""
    st = Path(path).stat()
    return _reader(Path(path).resolve(), st.st_mtime_ns, st.st_size)


def read_kv(path: Path) -> dict[str, tuple[list[str], Any]]:
    """Every key in file order -> (value type names, value); the GGUF.* header pseudo-fields are left out."""
    r = reader(path)
    out: dict[str, tuple[list[str], Any]] = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        types = [GGUFValueType(t).name for t in f.types]
        if f.types[0] == GGUFValueType.ARRAY:
            value: Any = [f.contents(i) for i in range(len(f.data))]
        else:
            value = f.contents()
        out[f.name] = (types, value)
    return out


def read_version(path: Path) -> int:
    return int(reader(path).fields["GGUF.version"].contents())


def read_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Tensor name in file order -> (ggml type name, shape, data bytes)."""
    r = reader(path)
    return {t.name: (t.tensor_type.name, [int(x) for x in t.shape], np.asarray(t.data).tobytes()) for t in r.tensors}


def _order_problem(what: str, ours: list[str], ref: list[str]) -> str | None:
    """None when both lists (of the same names) are in the same order, else where they part."""
    if ours == ref:
        return None
    i = next(i for i, (x, y) in enumerate(zip(ours, ref, strict=True)) if x != y)
    return f"{what} order differs from position {i}: ours {ours[i:i + 3]} vs ref {ref[i:i + 3]}"


def diff(ours: Path, ref: Path) -> list[str]:
    """Every difference outside the ignored keys; empty when the files are identical in the sense above."""
    problems: list[str] = []
    va, vb = read_version(ours), read_version(ref)
    if va != vb:
        problems.append(f"GGUF version: ours {va} vs ref {vb}")
    a, b = read_kv(ours), read_kv(ref)
    for key in sorted(set(a) | set(b)):
        if ignored(key):
            continue
        if key not in a:
            problems.append(f"missing key {key} (ref: {b[key]!r:.200})")
        elif key not in b:
            problems.append(f"extra key {key} (ours: {a[key]!r:.200})")
        elif a[key] != b[key]:
            problems.append(f"key {key}: ours {a[key]!r:.200} vs ref {b[key]!r:.200}")
    if (order := _order_problem("key", [k for k in a if not ignored(k) and k in b],
                                [k for k in b if not ignored(k) and k in a])):
        problems.append(order)
    ta, tb = read_tensors(ours), read_tensors(ref)
    if set(ta) != set(tb):
        problems.append(f"tensor names differ: only in ours {sorted(set(ta) - set(tb))}, "
                        f"only in ref {sorted(set(tb) - set(ta))}")
    elif order := _order_problem("tensor", list(ta), list(tb)):
        problems.append(order)
    for name in sorted(set(ta) & set(tb)):
        if ta[name][:2] != tb[name][:2]:
            problems.append(f"tensor {name}: ours {ta[name][:2]} vs ref {tb[name][:2]}")
        elif ta[name][2] != tb[name][2]:
            problems.append(f"tensor {name}: bytes differ")
    return problems
