"""GGUF v3 byte layout, in one place: magic, versions, alignment, value encodings, tensor sizes.

As llama.cpp b11434 defines them in ``ggml/src/gguf.cpp`` (and gguf-py ``gguf_writer.py``, whose byte
layout our writer reproduces): little-endian, strings as u64 length + UTF-8 bytes, arrays as element type +
u64 count + elements, tensor data aligned to ``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, chain
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSION = 3  # what we write
SUPPORTED_VERSIONS = (2, 3)  # what llama.cpp b11434 reads
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
GGML_QUANT_VERSION = 2  # general.quantization_version: GGML_QNT_VERSION in ggml/include/ggml.h

VT = GGUFValueType
# value type -> (struct format, size, numpy dtype); BOOL is one byte
SCALARS: dict[int, tuple[str, int, str]] = {
    VT.UINT8: ("<B", 1, "<u1"),
    VT.INT8: ("<b", 1, "<i1"),
    VT.UINT16: ("<H", 2, "<u2"),
    VT.INT16: ("<h", 2, "<i2"),
    VT.UINT32: ("<I", 4, "<u4"),
    VT.INT32: ("<i", 4, "<i4"),
    VT.FLOAT32: ("<f", 4, "<f4"),
    VT.UINT64: ("<Q", 8, "<u8"),
    VT.INT64: ("<q", 8, "<i8"),
    VT.FLOAT64: ("<d", 8, "<f8"),
    VT.BOOL: ("<?", 1, "<u1"),
}
_SHORT_NAMES: dict[int, str] = {VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32",
                VT.INT32: "i32", VT.FLOAT32: "f32", VT.BOOL: "bool", VT.STRING: "str", VT.UINT64: "u64",
                VT.INT64: "i64", VT.FLOAT64: "f64"}


def pad(n: int, align: int = ALIGNMENT) -> int:
    """``n`` rounded up to the alignment (GGML_PAD)."""
    return (n + align - 1) // align * align


def type_name(vtype: int, subtype: int | None = None) -> str:
    """``u32``, ``f32``, ``arr[i32]``... as llama.cpp prints types in its loader errors."""
    if vtype == VT.ARRAY:
        return f"arr[{_SHORT_NAMES.get(subtype if subtype is not None else -1, '?')}]"
    return _SHORT_NAMES.get(vtype, f"type{vtype}")


_U64 = struct.Struct("<Q")


def pack_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _pack_strings(values: Sequence[str | bytes]) -> bytes:
    """A string array's elements as GGUF encodes them (see :meth:`StringArray.of`)."""
    return StringArray.of(values).encoded


class StringArray(Sequence[str]):
    """A GGUF string array kept as its encoded elements, each decoded when asked for.

    Why: a 262k-token vocabulary and its 515k merges as Python strings are ~780k objects (~100 MB per file, and
    verify reads two), where their encoding is ~30 MB and is what a writer needs anyway. Two arrays are equal when
    their encodings are."""

    __slots__ = ("_encoded", "_starts")

    def __init__(self, encoded: bytes, starts: array[int]) -> None:
        self._encoded, self._starts = encoded, starts  # element i: u64 length at starts[i] - 8, then its bytes

    @classmethod
    def from_runs(cls, runs: Iterable[Sequence[str | bytes]]) -> StringArray:
        """Encode strings a run at a time: they never all exist as Python objects at once, nor as one list of
        encoded elements next to the strings, and no Python-level loop runs per element."""
        encoded, starts = bytearray(), array("q")
        for run in runs:
            raws = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in run]
            if raws:  # element k starts after its own length and every earlier element with its length
                starts.extend(accumulate((8 + len(r) for r in raws[:-1]), initial=len(encoded) + 8))
                encoded += b"".join(chain.from_iterable(zip(map(_U64.pack, map(len, raws)), raws, strict=True)))
        return cls(bytes(encoded), starts)

    @classmethod
    def of(cls, values: Sequence[str | bytes], chunk: int = 1 << 16) -> StringArray:
        """``values`` itself when it is one already, else its elements encoded a slice at a time."""
        if isinstance(values, StringArray):
            return values
        return cls.from_runs(values[start:start + chunk] for start in range(0, len(values), chunk))

    @property
    def encoded(self) -> bytes:
        """The elements as a GGUF string array encodes them (each a u64 length, then UTF-8), without the count."""
        return self._encoded

    def __len__(self) -> int:
        return len(self._starts)

    def _decoded(self, lo: int, hi: int) -> list[str]:
        """Elements ``lo`` to ``hi - 1`` (0 <= lo <= hi <= len), decoded in one tight loop."""
        encoded, starts = self._encoded, self._starts
        ends = [start - 8 for start in starts[lo + 1:hi + 1]]
        if hi == len(starts) and hi > lo:
            ends.append(len(encoded))
        return [encoded[a:b].decode("utf-8", errors="replace") for a, b in zip(starts[lo:hi], ends, strict=True)]

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            lo, hi, step = index.indices(len(self))
            if step == 1:
                return self._decoded(lo, max(lo, hi))
            return [self[i] for i in range(lo, hi, step)]
        i = range(len(self._starts))[index]  # negative indices, and IndexError past the end
        return self._decoded(i, i + 1)[0]

    def __iter__(self) -> Iterator[str]:
        for lo in range(0, len(self._starts), 1 << 16):
            yield from self._decoded(lo, min(len(self._starts), lo + (1 << 16)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._encoded == other._encoded
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


def pack_value(value: Any, vtype: int, subtype: int | None = None) -> bytes:
    """The encoding of one value (without its key and type tag)."""
    if vtype == VT.STRING:
        return pack_string(value)
    if vtype == VT.ARRAY:
        assert subtype is not None
        head = struct.pack("<IQ", subtype, len(value))
        if subtype == VT.STRING:
            return head + _pack_strings(value)
        fmt = SCALARS[subtype][0]
        return head + struct.pack(f"<{len(value)}{fmt[-1]}", *value)
    return struct.pack(SCALARS[vtype][0], value)


def pack_kv(key: str, vtype: int, value: Any, subtype: int | None = None) -> bytes:
    """The encoding of one key/value pair: key, type tag, value."""
    return pack_string(key) + struct.pack("<I", vtype) + pack_value(value, vtype, subtype)


def header_parts(kv_bytes: Sequence[bytes], tensor_infos: Sequence[bytes]) -> list[bytes]:
    """The whole header as pieces to write one after another: magic, version, counts, the already-encoded KV pairs
    and tensor infos, and the padding up to the data section. Why pieces: a 262k vocabulary's KV pairs are ~35 MB,
    and joined, then copied into a buffer, they were a third of a conversion's peak memory."""
    head = MAGIC + struct.pack("<IQQ", VERSION, len(tensor_infos), len(kv_bytes))
    size = len(head) + sum(map(len, kv_bytes)) + sum(map(len, tensor_infos))
    return [head, *kv_bytes, *tensor_infos, bytes(pad(size) - size)]


def pack_tensor_info(name: str, ne: Sequence[int], qtype: int, offset: int) -> bytes:
    """One tensor info: name, dims, ``ne`` (ggml order), type, offset inside the data section."""
    return pack_string(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, qtype, offset)


def row_bytes(qtype: int, n_per_row: int) -> int:
    """Bytes of one row of ``n_per_row`` elements (a multiple of the type's block size)."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return n_per_row // block * type_size


def tensor_nbytes(ne: Sequence[int], qtype: int) -> int:
    """Bytes of a tensor's data (ggml_nbytes).

    Raises:
        ValueError: unknown type, or a row length that is not a multiple of the type's block size.
    """
    qt = GGMLQuantizationType(qtype)
    block = GGML_QUANT_SIZES[qt][0]
    if ne[0] % block:
        raise ValueError(f"row length {ne[0]} is not a multiple of the {qt.name} block size {block}")
    n_rows = 1
    for d in ne[1:]:
        n_rows *= d
    return n_rows * row_bytes(qt, ne[0])


def float_to_f32(raw: bytes | bytearray | memoryview | np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """F32, F16 or BF16 little-endian bytes as float32, widened exactly (as ggml's to_float does)."""
    if qtype == GGMLQuantizationType.F32:
        return np.frombuffer(raw, dtype="<f4")
    if qtype == GGMLQuantizationType.F16:
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if qtype == GGMLQuantizationType.BF16:
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise ValueError(f"{qtype.name} is not a float type")
