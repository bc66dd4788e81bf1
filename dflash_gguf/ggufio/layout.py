"""GGUF v3 byte layout, in one place: magic, versions, alignment, value encodings, tensor sizes.

As llama.cpp b11434 defines them in ``ggml/src/gguf.cpp`` (and gguf-py ``gguf_writer.py``, whose byte
layout our writer reproduces): little-endian, strings as u64 length + UTF-8 bytes, arrays as element type +
u64 count + elements, tensor data aligned to ``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import chain
from typing import Any

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
_SHORT_NAMES = {VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32",
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


def _pack_strings(values: Sequence[str | bytes], chunk: int = 1 << 16) -> bytearray:
    """A string array's elements, packed a slice at a time: a 262k-token vocabulary and its 515k merges never
    exist as one list of encoded elements next to the strings, and no Python-level loop runs per element."""
    out = bytearray()
    for start in range(0, len(values), chunk):
        encoded = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values[start:start + chunk]]
        out += b"".join(chain.from_iterable(zip(map(_U64.pack, map(len, encoded)), encoded, strict=True)))
    return out


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


def pack_header(n_tensors: int, kv_bytes: Sequence[bytes]) -> bytes:
    """Magic, version, counts and the already-encoded KV pairs."""
    return MAGIC + struct.pack("<IQQ", VERSION, n_tensors, len(kv_bytes)) + b"".join(kv_bytes)


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


def float_to_f32(raw: bytes | bytearray | memoryview, qtype: GGMLQuantizationType) -> np.ndarray:
    """F32, F16 or BF16 little-endian bytes as float32, widened exactly (as ggml's to_float does)."""
    if qtype == GGMLQuantizationType.F32:
        return np.frombuffer(raw, dtype="<f4")
    if qtype == GGMLQuantizationType.F16:
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if qtype == GGMLQuantizationType.BF16:
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise ValueError(f"{qtype.name} is not a float type")
