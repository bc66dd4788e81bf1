"""Compare two GGUF files the way the parity tests define "identical" (docs/parity.md, 'What "identical" means').

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
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from dflash_gguf.provenance import PROVENANCE_PREFIX

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

# ------------------------------------------------------------------------------------------- reading
# A GGUF reader of the tests' own, written from the GGUF specification (ggml's docs/gguf.md), independent of the
# code under test. gguf-py's GGUFReader gives the same fields (``test_gguf_compare.py`` checks it on b11434's own
# files) but builds a numpy view per element: on a 151k-token vocabulary that is some 20 s a file.

_SCALARS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1), GGUFValueType.INT8: ("<b", 1), GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2), GGUFValueType.UINT32: ("<I", 4), GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4), GGUFValueType.BOOL: ("<?", 1), GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8), GGUFValueType.FLOAT64: ("<d", 8),
}
_NUMPY: dict[int, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class Parsed:
    """One GGUF file: version, keys in file order -> (value type names, value), tensors in file order."""

    version: int
    kv: dict[str, tuple[list[str], Any]]
    tensors: dict[str, tuple[str, list[int], bytes]]


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str, size: int) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q", 8)
        raw = self.buf[self.pos:self.pos + n]
        if len(raw) != n:
            raise ValueError(f"string of {n} bytes runs past the end of the file at {self.pos}")
        self.pos += n
        return raw.decode("utf-8")

    def value(self, vtype: int) -> tuple[list[str], Any]:
        if vtype == GGUFValueType.STRING:
            return [GGUFValueType.STRING.name], self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.take("<I", 4), self.take("<Q", 8)
            if etype in _NUMPY:
                width = _SCALARS[etype][1]
                data = np.frombuffer(self.buf, _NUMPY[etype], count, self.pos)
                self.pos += count * width
                return [GGUFValueType.ARRAY.name, GGUFValueType(etype).name], data.tolist()
            items = [self.value(etype) for _ in range(count)]
            inner = items[0][0] if items else [GGUFValueType(etype).name]
            return [GGUFValueType.ARRAY.name, *inner], [v for _, v in items]
        fmt, size = _SCALARS[GGUFValueType(vtype)]
        return [GGUFValueType(vtype).name], self.take(fmt, size)


def _tensor_bytes(qtype: GGMLQuantizationType, ne: list[int]) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    count = int(np.prod(ne, dtype=np.int64))
    return count // block * type_size


@dataclass(frozen=True)
class _Layout:
    """A GGUF file's header: version, keys, and each tensor's (ggml type, shape, start and size of its data)."""

    version: int
    kv: dict[str, tuple[list[str], Any]]
    tensors: dict[str, tuple[GGMLQuantizationType, list[int], int, int]]


def _layout(buf: Any, path: Path) -> _Layout:
    """The header of the GGUF file whose bytes are ``buf`` (bytes or a memory map: only the header is read)."""
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {buf[:4]!r})")
    cur = _Cursor(buf)
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("<I", 4), cur.take("<Q", 8), cur.take("<Q", 8)
    kv: dict[str, tuple[list[str], Any]] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in kv:
            raise ValueError(f"{path}: duplicate key {key}")
        kv[key] = cur.value(cur.take("<I", 4))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        ne = [cur.take("<Q", 8) for _ in range(cur.take("<I", 4))]
        qtype, offset = GGMLQuantizationType(cur.take("<I", 4)), cur.take("<Q", 8)
        infos.append((name, qtype, ne, offset))
    alignment = int(kv.get("general.alignment", ([], DEFAULT_ALIGNMENT))[1])
    start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, tuple[GGMLQuantizationType, list[int], int, int]] = {}
    for name, qtype, ne, offset in infos:
        if name in tensors:
            raise ValueError(f"{path}: duplicate tensor {name}")
        size = _tensor_bytes(qtype, ne)
        if start + offset + size > len(buf):
            raise ValueError(f"{path}: tensor {name} data runs past the end of the file")
        tensors[name] = (qtype, ne, start + offset, size)
    return _Layout(version, kv, tensors)


def parse(path: Path) -> Parsed:
    """Parse a whole GGUF file (magic, version, keys, tensor infos, aligned tensor data)."""
    buf = Path(path).read_bytes()
    layout = _layout(buf, path)
    return Parsed(layout.version, layout.kv, {name: (qtype.name, ne, buf[at:at + size])
                                              for name, (qtype, ne, at, size) in layout.tensors.items()})


@functools.lru_cache(maxsize=4)
def _parsed(path: Path, mtime_ns: int, size: int) -> Parsed:
    return parse(path)


def parsed(path: Path) -> Parsed:
    """The file parsed once per version of it (path, mtime and size)."""
    st = Path(path).stat()
    return _parsed(Path(path).resolve(), st.st_mtime_ns, st.st_size)


def read_kv(path: Path) -> dict[str, tuple[list[str], Any]]:
    """Every key in file order -> (value type names, value); the values as gguf-py's ``contents()`` gives them."""
    return dict(parsed(path).kv)


def read_version(path: Path) -> int:
    return parsed(path).version


def read_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Tensor name in file order -> (ggml type name, shape as stored (ne), data bytes)."""
    return dict(parsed(path).tensors)


def read_tensors_fast(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """:func:`read_tensors` through our header reader (gguf-py's is slow on a 150k-token vocabulary)."""
    from dflash_gguf.ggufio.reader import read_gguf, tensor_nbytes

    meta = read_gguf(path)
    out = {}
    with open(path, "rb") as f:
        for t in meta.tensors.values():
            f.seek(meta.data_offset + t.offset)
            out[t.name] = (t.type_name, list(t.ne), f.read(tensor_nbytes(t, path)))
    return out


def _order_problem(what: str, ours: list[str], ref: list[str]) -> str | None:
    """None when both lists (of the same names) are in the same order, else where they part."""
    if ours == ref:
        return None
    i = next(i for i, (x, y) in enumerate(zip(ours, ref, strict=True)) if x != y)
    return f"{what} order differs from position {i}: ours {ours[i:i + 3]} vs ref {ref[i:i + 3]}"


_CHUNK = 1 << 26  # bytes of tensor data compared at a time


def diff(ours: Path, ref: Path) -> list[str]:
    """Every difference outside the ignored keys; empty when the files are identical in the sense above. Reads the
    headers through memory maps and the tensor data a chunk at a time, so files of any size compare in little
    memory."""
    with open(ours, "rb") as fa, open(ref, "rb") as fb, \
            mmap.mmap(fa.fileno(), 0, access=mmap.ACCESS_READ) as ma, \
            mmap.mmap(fb.fileno(), 0, access=mmap.ACCESS_READ) as mb:
        la, lb = _layout(ma, ours), _layout(mb, ref)
        problems: list[str] = []
        if la.version != lb.version:
            problems.append(f"GGUF version: ours {la.version} vs ref {lb.version}")
        a, b = la.kv, lb.kv
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
        ta, tb = la.tensors, lb.tensors
        if set(ta) != set(tb):
            problems.append(f"tensor names differ: only in ours {sorted(set(ta) - set(tb))}, "
                            f"only in ref {sorted(set(tb) - set(ta))}")
        elif order := _order_problem("tensor", list(ta), list(tb)):
            problems.append(order)
        for name in sorted(set(ta) & set(tb)):
            (qa, nea, at_a, size), (qb, neb, at_b, _) = ta[name], tb[name]
            if (qa.name, nea) != (qb.name, neb):
                problems.append(f"tensor {name}: ours {(qa.name, nea)} vs ref {(qb.name, neb)}")
            elif any(os.pread(fa.fileno(), min(_CHUNK, size - i), at_a + i)
                     != os.pread(fb.fileno(), min(_CHUNK, size - i), at_b + i) for i in range(0, size, _CHUNK)):
                problems.append(f"tensor {name}: bytes differ")
        return problems


def ulp_apart(a: bytes, b: bytes) -> bool:
    """Two F32 tensors whose values differ by at most one ulp each."""
    x, y = np.frombuffer(a, "<i4").astype(np.int64), np.frombuffer(b, "<i4").astype(np.int64)
    return len(x) == len(y) and bool(np.abs(x - y).max(initial=0) <= 1)


def diff_within_one_ulp(ours: Path, ref: Path, suffixes: tuple[str, ...]) -> list[str]:
    """``diff``, with the F32 tensors whose names end in ``suffixes`` allowed one ulp per value: those b11434
    computes with torch's vectorised exp / softplus, which are not correctly rounded and depend on the CPU."""
    problems = diff(ours, ref)
    if not problems:
        return []
    ta, tb = read_tensors(ours), read_tensors(ref)
    return [p for p in problems if not (
        p.startswith("tensor ") and p.endswith("bytes differ") and (name := p.split()[1].rstrip(":")).endswith(suffixes)
        and ta[name][0] == tb[name][0] == "F32" and ulp_apart(ta[name][2], tb[name][2]))]
