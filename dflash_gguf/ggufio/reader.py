"""A defensive GGUF header reader: metadata and tensor infos, never the tensor data (verify and quantize).

Why our own and not ``gguf.GGUFReader``: that reader maps the whole file, builds a numpy view per array
element (seconds on a 150k-token vocabulary) and trusts the lengths it reads. A file under verification
may be truncated or hostile, so here every count and length is checked against the bytes that remain
before anything is allocated, absurd counts are refused, and every failure is an :class:`InputError`
(exit 2) naming the file and the offset. Each KV keeps its byte span, so the quantizer can copy it
unchanged as llama-quantize does. Layout as in llama.cpp b11434 ``ggml/src/gguf.cpp``.
"""

from __future__ import annotations

import mmap
import re
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from ..errors import InputError
from . import layout
from .layout import ALIGNMENT, MAGIC, SCALARS, SUPPORTED_VERSIONS, StringArray, float_to_f32, type_name

MAX_TENSORS = 1 << 20  # a 1T-parameter MoE has < 100k tensors
MAX_KV = 1 << 16  # real files have < 100 keys; token lists are one key each
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_STRING = 1 << 24  # a single key or value string above 16 MiB is not a model file
MAX_ARRAY = 1 << 24  # the largest vocabularies have ~260k tokens; 16M elements is far beyond any real key
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class KV:
    """One metadata value; arrays of numbers stay numpy arrays (cheap for 150k-entry token types), string arrays
    are :class:`StringArray`."""

    vtype: int
    value: Any
    subtype: int | None = None
    span: tuple[int, int] = (0, 0)  # file offsets of the whole pair (key included)

    @property
    def type_name(self) -> str:
        return type_name(self.vtype, self.subtype)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]
    qtype: int
    offset: int  # relative to the data section (of its shard's file)
    shard: int = 0  # which file of a split GGUF holds its data (GGUFMeta.shards)

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type{self.qtype}"


@dataclass
class GGUFMeta:
    """What the header of one GGUF file says."""

    path: Path
    version: int
    file_size: int
    kv: dict[str, KV] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    data_offset: int = 0
    # A split GGUF read by its first shard: every shard's file and data offset, in order (one file: just itself).
    shards: tuple[tuple[Path, int], ...] = ()

    def locate(self, t: TensorInfo) -> tuple[Path, int]:
        """The file holding a tensor's data and the tensor's absolute offset in it."""
        path, data_offset = self.shards[t.shard] if self.shards else (self.path, self.data_offset)
        return path, data_offset + t.offset

    @property
    def files(self) -> tuple[Path, ...]:
        """Every file of the model (the shards of a split GGUF, in order)."""
        return tuple(p for p, _ in self.shards) if self.shards else (self.path,)

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kv.get(key)
        return default if kv is None else kv.value

    @property
    def arch(self) -> str | None:
        value = self.get("general.architecture")
        return value if isinstance(value, str) else None


class _Cursor:
    """Bounds-checked little-endian reads over a memory map."""

    def __init__(self, buf: Any, size: int, path: Path) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def fail(self, what: str) -> InputError:
        return InputError(f"{self.path}: {what} (at byte {self.pos} of {self.size}). The file is truncated, damaged "
                           "or not a GGUF; re-download or re-convert it.")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt, n, _ = SCALARS[vtype]
        self.need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return bool(value) if vtype == GGUFValueType.BOOL else value

    def u32(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT32, what))

    def u64(self, what: str) -> int:
        return int(self.scalar(GGUFValueType.UINT64, what))

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > MAX_STRING:
            raise self.fail(f"{what} claims {n} bytes, more than any GGUF string")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def _strings(self, count: int, what: str) -> StringArray:
        """A string array, every length checked in a tight loop, kept encoded (see :class:`StringArray`)."""
        unpack, buf, size, pos = _U64.unpack_from, self.buf, self.size, self.pos
        first = pos
        starts = array("q")
        append = starts.append
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"element {i} of {what} is cut off")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                raise self.fail(f"element {i} of {what} claims {n} bytes but only {size - pos} remain")
            append(pos - first)
            pos += n
        self.pos = pos
        return StringArray(bytes(buf[first:pos]), starts)

    def value(self, vtype: int, what: str) -> KV:
        if vtype in SCALARS:
            return KV(vtype, self.scalar(vtype, what))
        if vtype == GGUFValueType.STRING:
            return KV(vtype, self.string(what))
        if vtype != GGUFValueType.ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        sub = self.u32(f"element type of {what}")
        count = self.u64(f"length of {what}")
        if count > MAX_ARRAY:
            raise self.fail(f"{what} claims {count} elements, more than any GGUF array")
        if sub in SCALARS:
            n = count * SCALARS[sub][1]
            self.need(n, f"{count} elements of {what}")
            arr = np.frombuffer(self.buf, dtype=SCALARS[sub][2], count=count, offset=self.pos).copy()
            self.pos += n
            return KV(vtype, arr.astype(bool) if sub == GGUFValueType.BOOL else arr, sub)
        if sub == GGUFValueType.STRING:
            self.need(count * 8, f"{count} strings of {what}")  # every string has an 8-byte length
            return KV(vtype, self._strings(count, what), sub)
        raise self.fail(f"{what} is an array of type {sub}; llama.cpp reads no nested or unknown arrays")


# llama.cpp's split naming (llama_split_path: "%s-%05d-of-%05d.gguf"), what -hf and llama-gguf-split use
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_name(prefix: str, no: int, count: int) -> str:
    """Shard ``no`` (from 1) of ``count`` of the GGUF named ``prefix`` (without .gguf), as llama.cpp names it."""
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def split_siblings(path: Path) -> list[Path] | None:
    """Every shard of the split GGUF whose first shard is ``path`` (by llama.cpp's names), None for another name."""
    m = SPLIT_NAME.match(Path(path).name)
    if m is None:
        return None
    count = int(m["count"])
    return [Path(path).with_name(shard_name(m["prefix"], k, count)) for k in range(1, count + 1)]


def read_gguf(path: Path) -> GGUFMeta:
    """Read the header (metadata + tensor infos) of ``path``; a split GGUF by its first shard, as llama.cpp loads
    it: the metadata is the first shard's, the tensors are every shard's (each located in its own file).

    Raises:
        InputError: missing, empty, truncated, non-GGUF or hostile file, a split GGUF given by a later shard or
            missing one; the message names file and offset.
    """
    meta = read_header(Path(path))
    count, no = int_key(meta, "split.count"), int_key(meta, "split.no")
    if count is None or count <= 1:
        return meta
    if no != 0:
        raise InputError(f"{path} is shard {(no or 0) + 1} of a {count}-way split GGUF. Pass its first shard "
                         "(...-00001-of-...gguf): llama.cpp reads the others from it.")
    names = split_siblings(meta.path)
    if names is None or len(names) != count:
        raise InputError(f"{path} is the first of {count} shards (split.count), but its name is not "
                         f"<name>-00001-of-{count:05d}.gguf, so the others cannot be found. Keep the names "
                         "llama-gguf-split gave them.")
    shards = [(meta.path, meta.data_offset)]
    for k, name in enumerate(names[1:], start=1):
        if not name.is_file():
            raise InputError(f"{path} is split in {count} files and {name.name} is missing beside it. Download "
                             "every shard into one folder.")
        part = read_header(name)
        if int_key(part, "split.no") != k or int_key(part, "split.count") != count:
            raise InputError(f"{name}: its split.no/split.count say it is not shard {k + 1} of {count}; the "
                             "shards are from different splits.")
        for t in part.tensors.values():
            if t.name in meta.tensors:
                raise InputError(f"{name}: tensor {t.name!r} is also in an earlier shard; the split is damaged.")
            meta.tensors[t.name] = TensorInfo(t.name, t.ne, t.qtype, t.offset, k)
        shards.append((name, part.data_offset))
    meta.shards = tuple(shards)
    return meta


def read_header(path: Path) -> GGUFMeta:
    """The header of one file (a shard of a split GGUF as itself: its own metadata and tensors)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise InputError(f"{path}: the file is empty. Re-download or re-convert it.")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return _parse(mm, size, path)
    except InputError:
        raise
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read it ({e}). Check the path and permissions.") from e


def _parse(buf: Any, size: int, path: Path) -> GGUFMeta:
    c = _Cursor(buf, size, path)
    c.need(4, "magic")
    magic = bytes(buf[0:4])
    if magic != MAGIC:
        raise InputError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF'). "
                          "Pass the .gguf files produced by dflash-convert or llama.cpp.")
    c.pos = 4
    version = c.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise c.fail(f"GGUF version {version} is not supported (llama.cpp b11434 reads 2 and 3)")
    n_tensors = c.u64("tensor count")
    n_kv = c.u64("metadata count")
    # each KV takes >= 8 (key len) + 4 (type) + 1 bytes, each tensor info >= 8 + 4 + 8 + 4 + 8
    if n_tensors > MAX_TENSORS or n_tensors * 32 > size:
        raise c.fail(f"tensor count {n_tensors} is absurd for a {size}-byte file")
    if n_kv > MAX_KV or n_kv * 13 > size:
        raise c.fail(f"metadata count {n_kv} is absurd for a {size}-byte file")
    meta = GGUFMeta(path=path, version=version, file_size=size)
    for i in range(n_kv):
        start = c.pos
        key = c.string(f"key #{i}")
        vtype = c.u32(f"type of {key!r}")
        kv = c.value(vtype, f"value of {key!r}")
        meta.kv[key] = KV(kv.vtype, kv.value, kv.subtype, (start, c.pos))  # duplicates: keep the last, as gguf-py
    for i in range(n_tensors):
        name = c.string(f"tensor name #{i}")
        n_dims = c.u32(f"dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions (ggml allows 1..{MAX_DIMS})")
        ne = tuple(c.u64(f"shape of tensor {name!r}") for _ in range(n_dims))
        qtype = c.u32(f"type of tensor {name!r}")
        offset = c.u64(f"offset of tensor {name!r}")
        if name in meta.tensors:
            raise c.fail(f"tensor {name!r} appears twice")
        meta.tensors[name] = TensorInfo(name, ne, qtype, offset)
    align = meta.get("general.alignment", ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise c.fail(f"general.alignment {align!r} is not a power of two")
    meta.data_offset = (c.pos + align - 1) // align * align
    for t in meta.tensors.values():
        end = meta.data_offset + t.offset + tensor_nbytes(t, path)
        if end > size:
            raise InputError(f"{path}: tensor {t.name!r} ends at byte {end} but the file has {size} bytes. "
                              "The file is truncated; re-download or re-convert it.")
    return meta


def tensor_nbytes(t: TensorInfo, path: Path) -> int:
    """Bytes of a tensor's data; unknown types or ragged rows are a damaged file."""
    try:
        GGMLQuantizationType(t.qtype)
    except ValueError:
        raise InputError(f"{path}: tensor {t.name!r} has unknown ggml type {t.qtype}; the file is damaged "
                          "or from a newer llama.cpp than b11434.") from None
    try:
        return layout.tensor_nbytes(t.ne, t.qtype)
    except ValueError as e:
        raise InputError(f"{path}: tensor {t.name!r}: {e}; the file is damaged.") from None


def raw_kv_bytes(meta: GGUFMeta) -> dict[str, bytes]:
    """Every KV pair's exact encoding, in file order (llama-quantize copies KVs unchanged)."""
    with open(meta.path, "rb") as f:
        out = {}
        for key, kv in meta.kv.items():
            f.seek(kv.span[0])
            out[key] = f.read(kv.span[1] - kv.span[0])
    return out


def read_rows(meta: GGUFMeta, name: str, rows: list[int]) -> np.ndarray:
    """Dequantized rows of a 2-D tensor as float32 [len(rows), ne0]; reads only those rows.

    Raises:
        InputError: the tensor is missing, not 2-D, of a type we cannot dequantize, or a row is out of range.
    """
    t = meta.tensors.get(name)
    if t is None or len(t.ne) != 2:
        raise InputError(f"{meta.path}: no 2-D tensor {name!r} to sample.")
    qtype = GGMLQuantizationType(t.qtype)
    row_bytes = layout.row_bytes(qtype, t.ne[0])
    out = np.empty((len(rows), t.ne[0]), dtype=np.float32)
    where, start = meta.locate(t)
    with open(where, "rb") as f:
        for i, r in enumerate(rows):
            if not 0 <= r < t.ne[1]:
                raise InputError(f"{meta.path}: row {r} outside tensor {name!r} with {t.ne[1]} rows.")
            f.seek(start + r * row_bytes)
            raw = np.frombuffer(f.read(row_bytes), dtype=np.uint8)
            if raw.size != row_bytes:
                raise InputError(f"{meta.path}: tensor {name!r} is truncated.")
            try:
                if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
                    out[i] = float_to_f32(raw, qtype)
                else:
                    out[i] = gguf_quants.dequantize(raw, qtype).reshape(-1)
            except (NotImplementedError, ValueError, TypeError) as e:
                raise InputError(f"{meta.path}: cannot dequantize {name!r} of type {qtype.name} ({e}).") from e
    return out


def int_key(meta: GGUFMeta, key: str) -> int | None:
    """An integer key only if stored with an integer type (a wrong type is for the caller's checks to report)."""
    kv = meta.kv.get(key)
    if kv is None or kv.vtype not in (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64,
                                      GGUFValueType.INT64, GGUFValueType.UINT16, GGUFValueType.UINT8):
        return None
    return int(kv.value)


def read_i64(meta: GGUFMeta, name: str) -> np.ndarray | None:
    """An I64 tensor's values (None when the file is cut short)."""
    t = meta.tensors[name]
    n = int(np.prod(t.ne))
    where, start = meta.locate(t)
    with open(where, "rb") as f:
        f.seek(start)
        raw = f.read(8 * n)
    return np.frombuffer(raw, dtype="<i8") if len(raw) == 8 * n else None
