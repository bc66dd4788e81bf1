"""Read a GGUF's metadata as raw bytes and its tensor table, for re-writing it with other tensor types.

Why raw bytes: llama-quantize copies every key/value pair unchanged (``gguf_set_kv``), so the
built-in copies each KV's exact encoding instead of decoding and re-encoding it (no risk of a
changed value type, string normalisation or float round-trip).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import InputError


@dataclass(frozen=True)
class InputTensor:
    """One tensor of the input file: ``ne`` in ggml order, ``offset`` absolute in the file."""

    name: str
    ne: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class InputGGUF:
    """Metadata (key -> raw KV bytes, file order), scalar values of interest, and the tensors."""

    path: Path
    kv_raw: dict[str, bytes]
    values: dict[str, object]
    tensors: tuple[InputTensor, ...]
    alignment: int


_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


class _Cursor:
    """A position in the memory-mapped header; every read is bounds-checked by struct."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"string of {n} bytes runs past the end of the file")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def value(self, vtype: int) -> Any:
        """Read (or, for arrays, skip) one value; arrays of numbers are skipped without a Python loop."""
        if vtype == GGUFValueType.STRING:
            return self.string().decode("utf-8", errors="replace")
        if vtype == GGUFValueType.ARRAY:
            sub, n = self.unpack("<I"), self.unpack("<Q")
            if sub in _SCALARS:
                self.pos += n * struct.calcsize(_SCALARS[sub])
                if self.pos > len(self.buf):
                    raise ValueError("array runs past the end of the file")
            else:
                for _ in range(n):
                    self.value(sub)
            return None
        if vtype not in _SCALARS:
            raise ValueError(f"unknown value type {vtype}")
        return self.unpack(_SCALARS[vtype])


def read_gguf(path: Path) -> InputGGUF:
    """Parse the header of ``path`` (KVs as raw bytes, tensor table); tensor data is not touched.

    Why not gguf-py's GGUFReader: it builds numpy views per array element and takes seconds on a
    150k-token vocabulary, which would be most of the wrapper's overhead over llama-quantize.

    Raises:
        InputError: missing, unreadable, or not a valid GGUF.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"Input GGUF {path} does not exist. Check the path (the BF16/F16 conversion output).")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf)
    except InputError:
        raise
    except Exception as e:  # struct.error, ValueError, mmap errors on an empty file, ...
        raise InputError(
            f"Cannot read {path} as a GGUF file ({type(e).__name__}: {e}). It may be truncated or not a "
            "GGUF; re-run the conversion that produced it."
        ) from e


def _parse(path: Path, buf: mmap.mmap) -> InputGGUF:
    c = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise InputError(f"{path} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF').")
    c.pos = 4
    version, n_tensors, n_kv = c.unpack("<I"), c.unpack("<Q"), c.unpack("<Q")
    if version not in (2, 3):
        raise InputError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported.")
    kv_raw: dict[str, bytes] = {}
    values: dict[str, object] = {}
    for _ in range(n_kv):
        start = c.pos
        key = c.string().decode("utf-8", errors="replace")
        values[key] = c.value(c.unpack("<I"))
        if key in kv_raw:
            raise InputError(f"{path} has the key {key} twice; it is not a valid GGUF.")
        kv_raw[key] = bytes(buf[start:c.pos])
    infos = []
    for _ in range(n_tensors):
        name = c.string().decode("utf-8", errors="replace")
        n_dims = c.unpack("<I")
        ne = tuple(c.unpack("<Q") for _ in range(n_dims))
        infos.append((name, ne, c.unpack("<I"), c.unpack("<Q")))
    alignment = values.get("general.alignment") or 32
    if not isinstance(alignment, int) or alignment <= 0:
        raise InputError(f"{path} has an invalid general.alignment {alignment!r}.")
    data_start = (c.pos + alignment - 1) // alignment * alignment
    tensors = []
    for name, ne, qtype, offset in infos:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise InputError(f"{path}: tensor {name} has unknown type {qtype}.") from None
        n = 1
        for d in ne:
            n *= d
        t = InputTensor(name, ne, qtype, data_start + offset, n // block * type_size)
        if t.offset + t.nbytes > len(buf):
            raise InputError(f"{path} is truncated: tensor {name} ends at byte {t.offset + t.nbytes}, the file has "
                             f"{len(buf)}. Re-run the conversion that produced it.")
        tensors.append(t)
    return InputGGUF(path, kv_raw, values, tuple(tensors), int(alignment))


def pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv_uint32(key: str, value: int) -> bytes:
    """The encoding of one UINT32 key/value pair."""
    return pack_string(key) + struct.pack("<II", GGUFValueType.UINT32, value)


def kv_string(key: str, value: str) -> bytes:
    """The encoding of one STRING key/value pair."""
    return pack_string(key) + struct.pack("<I", GGUFValueType.STRING) + pack_string(value)
