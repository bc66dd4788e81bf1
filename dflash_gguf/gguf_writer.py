"""A streaming GGUF v3 writer: metadata first, then each tensor's bytes from a callback.

Why not gguf-py's ``GGUFWriter``: it wants every tensor as an in-memory array. Here a tensor is
a size plus a function that writes exactly that many bytes, so a converter can copy ranges of a
safetensors file with ``copy_file_range`` or convert them chunk by chunk, and peak memory does
not grow with the model. The byte layout matches gguf-py (llama.cpp b11434,
``gguf-py/gguf/gguf_writer.py``): header, KV pairs in insertion order, tensor infos with ``ne``
dims, 32-byte aligned data, every tensor zero-padded to the alignment.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "?",
}


def _pad(n: int, align: int = ALIGNMENT) -> int:
    return (n + align - 1) // align * align


def tensor_nbytes(ne: Sequence[int], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in ne:
        n *= d
    if ne[0] % block:
        raise ValueError(f"row length {ne[0]} is not a multiple of the {qtype.name} block size {block}")
    return n // block * type_size


@dataclass(frozen=True)
class KeyValue:
    vtype: GGUFValueType
    value: Any
    subtype: GGUFValueType | None = None


@dataclass
class TensorOut:
    """One tensor to write: ``ne`` is ggml order (reverse of the PyTorch shape)."""

    name: str
    ne: tuple[int, ...]
    qtype: GGMLQuantizationType
    write: Callable[[BinaryIO], None]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ne, self.qtype)


class GGUFPlan:
    """Metadata and tensor list of one GGUF file, written by :meth:`write` in one pass."""

    def __init__(self, arch: str) -> None:
        self.kv: dict[str, KeyValue] = {}
        self.tensors: list[TensorOut] = []
        self.add_string("general.architecture", arch)

    # -- metadata ---------------------------------------------------------------------------
    def add(self, key: str, vtype: GGUFValueType, value: Any, subtype: GGUFValueType | None = None) -> None:
        """Set a key. Re-setting keeps the first position and the last value, as gguf-py does."""
        if key in self.kv:
            log.debug("key %s set twice; keeping the new value %r", key, value)
        self.kv[key] = KeyValue(vtype, value, subtype)

    def add_uint32(self, key: str, value: int) -> None:
        self.add(key, GGUFValueType.UINT32, int(value))

    def add_float32(self, key: str, value: float) -> None:
        self.add(key, GGUFValueType.FLOAT32, float(value))

    def add_bool(self, key: str, value: bool) -> None:
        self.add(key, GGUFValueType.BOOL, bool(value))

    def add_string(self, key: str, value: str) -> None:
        if value:  # gguf-py silently skips empty strings; so do we
            self.add(key, GGUFValueType.STRING, value)

    def add_array(self, key: str, values: Sequence[Any], subtype: GGUFValueType | None = None) -> None:
        """Add an array; element type inferred like gguf-py unless given. Empty arrays are skipped."""
        if len(values) == 0:
            return
        sub = subtype or GGUFValueType.get_type(values[0])  # gguf-py's own inference: ints INT32
        self.add(key, GGUFValueType.ARRAY, list(values), sub)

    def get(self, key: str) -> Any:
        kv = self.kv.get(key)
        return None if kv is None else kv.value

    # -- tensors ----------------------------------------------------------------------------
    def add_tensor(self, tensor: TensorOut) -> None:
        if any(t.name == tensor.name for t in self.tensors):
            raise ValueError(f"duplicated tensor name {tensor.name!r}")
        self.tensors.append(tensor)

    @property
    def data_bytes(self) -> int:
        return sum(_pad(t.nbytes) for t in self.tensors)

    # -- output -----------------------------------------------------------------------------
    def header_bytes(self) -> bytes:
        out = bytearray()
        out += GGUF_MAGIC
        out += struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kv))
        for key, kv in self.kv.items():
            out += _pack_string(key)
            out += struct.pack("<I", kv.vtype)
            out += _pack_value(kv.value, kv.vtype, kv.subtype)
        offset = 0
        for t in self.tensors:
            out += _pack_string(t.name)
            out += struct.pack("<I", len(t.ne))
            out += struct.pack(f"<{len(t.ne)}Q", *t.ne)
            out += struct.pack("<IQ", t.qtype, offset)
            offset += _pad(t.nbytes)
        out += bytes(_pad(len(out)) - len(out))
        return bytes(out)

    def write(self, path: Path, on_tensor: Callable[[TensorOut], None] | None = None,
              header: bytes | None = None) -> int:
        """Write the whole file to ``path`` (callers pass a ``.partial`` path); return its size.

        ``header`` is :meth:`header_bytes`, when the caller already packed it (e.g. to size the output).
        """
        with open(path, "wb", buffering=0) as f:
            f.write(header if header is not None else self.header_bytes())
            for t in self.tensors:
                start = f.tell()
                t.write(f)
                written = f.tell() - start
                if written != t.nbytes:
                    raise RuntimeError(f"tensor {t.name} wrote {written} bytes, expected {t.nbytes}")
                f.write(bytes(_pad(written) - written))
                if on_tensor is not None:
                    on_tensor(t)
            return f.tell()


def _pack_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _pack_value(value: Any, vtype: GGUFValueType, subtype: GGUFValueType | None) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _pack_string(value)
    if vtype == GGUFValueType.ARRAY:
        assert subtype is not None
        head = struct.pack("<IQ", subtype, len(value))
        if subtype == GGUFValueType.STRING:
            return head + b"".join(_pack_string(v) for v in value)
        fmt = _SCALAR_FORMATS[subtype]
        return head + struct.pack(f"<{len(value)}{fmt[-1]}", *value)
    return struct.pack(_SCALAR_FORMATS[vtype], value)
