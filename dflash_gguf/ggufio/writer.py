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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGMLQuantizationType, GGUFValueType

from .. import arrivals
from .hashing import FollowingHasher
from .layout import StringArray, header_parts, pack_kv, pack_tensor_info, pad, tensor_nbytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Written:
    """What :meth:`GGUFPlan.write_hashed` wrote: the size and the sha256 of the file's bytes."""

    n_bytes: int
    sha256: str


@dataclass(frozen=True)
class KeyValue:
    vtype: GGUFValueType
    value: Any
    subtype: GGUFValueType | None = None


@dataclass
class TensorOut:
    """One tensor to write: ``ne`` is ggml order (reverse of the PyTorch shape).

    ``source`` (file, offset) says the bytes ``write`` produces are exactly the ``nbytes`` found there, so a
    consumer that only reads them (the one-pass quantizer) can ``pread`` them instead of spooling them. ``reads``:
    the checkpoint files ``write`` reads (a streamed shard is waited for before, see ``arrivals``).
    """

    name: str
    ne: tuple[int, ...]
    qtype: GGMLQuantizationType
    write: Callable[[BinaryIO], object]
    source: tuple[Path, int] | None = None
    reads: tuple[Path, ...] = ()

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
        self.add(key, GGUFValueType.ARRAY, values if isinstance(values, StringArray) else list(values), sub)

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
        return sum(pad(t.nbytes) for t in self.tensors)

    # -- output -----------------------------------------------------------------------------
    def header_bytes(self) -> bytes:
        infos, offset = [], 0
        for t in self.tensors:
            infos.append(pack_tensor_info(t.name, t.ne, t.qtype, offset))
            offset += pad(t.nbytes)
        return b"".join(header_parts([pack_kv(k, kv.vtype, kv.value, kv.subtype) for k, kv in self.kv.items()],
                                     infos))

    def write(self, path: Path, on_tensor: Callable[[TensorOut], None] | None = None,
              header: bytes | None = None) -> int:
        """Write the whole file to ``path`` (callers pass a ``.partial`` path); return its size.

        ``header`` is :meth:`header_bytes`, when the caller already packed it (e.g. to size the output).
        """
        return self._write(path, on_tensor, header, None)

    def write_hashed(self, path: Path, on_tensor: Callable[[TensorOut], None] | None = None,
                     header: bytes | None = None) -> Written:
        """:meth:`write`, hashing the file as it is written (a thread follows the writer through the page
        cache), so whoever records the output's sha256 need not read it again."""
        with open(path, "wb", buffering=0) as f, FollowingHasher(path) as hasher:
            size = self._write_to(f, on_tensor, header, hasher)
            return Written(size, hasher.finish(size))

    def _write(self, path: Path, on_tensor: Callable[[TensorOut], None] | None, header: bytes | None,
               hasher: FollowingHasher | None) -> int:
        with open(path, "wb", buffering=0) as f:
            return self._write_to(f, on_tensor, header, hasher)

    def _write_to(self, f: BinaryIO, on_tensor: Callable[[TensorOut], None] | None, header: bytes | None,
                  hasher: FollowingHasher | None) -> int:
        f.write(header if header is not None else self.header_bytes())
        reading = arrivals.Reading([t.reads for t in self.tensors])
        for i, t in enumerate(self.tensors):
            reading.wait(i)
            start = f.tell()
            t.write(f)
            written = f.tell() - start
            if written != t.nbytes:
                raise RuntimeError(f"tensor {t.name} wrote {written} bytes, expected {t.nbytes}")
            f.write(bytes(pad(written) - written))
            if hasher is not None:
                hasher.advance(f.tell())
            reading.done(i)
            if on_tensor is not None:
                on_tensor(t)
        return f.tell()
