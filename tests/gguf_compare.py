"""Compare two GGUF files key by key and tensor by tensor (used by the parity tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from dflash_gguf.convert.constants import PROVENANCE_PREFIX

# general.* keys b11434 derives from the drafter dir with gguf-py's Metadata heuristics (README YAML,
# directory name, parameter count). They carry no runtime meaning; we write our own.
NAMING_KEYS = {"general.name", "general.size_label", "general.license", "general.tags", "general.basename",
               "general.finetune", "general.version", "general.languages", "general.datasets",
               "general.base_model.count", "general.organization", "general.quantized_by", "general.repo_url"}


def read_kv(path: Path) -> dict[str, tuple[list[str], Any]]:
    r = GGUFReader(path)
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


def read_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    r = GGUFReader(path)
    return {t.name: (t.tensor_type.name, [int(x) for x in t.shape], np.asarray(t.data).tobytes()) for t in r.tensors}


def diff(ours: Path, ref: Path) -> list[str]:
    """Every difference except naming keys and our provenance keys; empty when the files match."""
    problems: list[str] = []
    a, b = read_kv(ours), read_kv(ref)
    skip = lambda k: k in NAMING_KEYS or k.startswith(PROVENANCE_PREFIX) or k.startswith("general.base_model")  # noqa: E731
    for key in sorted(set(a) | set(b)):
        if skip(key):
            continue
        if key not in a:
            problems.append(f"missing key {key} (ref: {b[key]!r:.200})")
        elif key not in b:
            problems.append(f"extra key {key} (ours: {a[key]!r:.200})")
        elif a[key] != b[key]:
            problems.append(f"key {key}: ours {a[key]!r:.200} vs ref {b[key]!r:.200}")
    ta, tb = read_tensors(ours), read_tensors(ref)
    if list(ta) != list(tb):
        problems.append(f"tensor names/order differ: {sorted(set(ta) ^ set(tb))} ")
    for name in sorted(set(ta) & set(tb)):
        if ta[name][:2] != tb[name][:2]:
            problems.append(f"tensor {name}: ours {ta[name][:2]} vs ref {tb[name][:2]}")
        elif ta[name][2] != tb[name][2]:
            problems.append(f"tensor {name}: bytes differ")
    return problems
