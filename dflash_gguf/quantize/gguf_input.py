"""Read a GGUF's metadata as raw bytes and its tensor table, for re-writing it with other tensor types.

Why raw bytes: llama-quantize copies every key/value pair unchanged (``gguf_set_kv``), so the
built-in copies each KV's exact encoding instead of decoding and re-encoding it (no risk of a
changed value type, string normalisation or float round-trip).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from ..errors import InputError
from ..gguf_reader import read_gguf as read_header
from ..gguf_reader import tensor_nbytes


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


def read_gguf(path: Path) -> InputGGUF:
    """The header of ``path`` (KVs as raw bytes in file order, tensor table); tensor data is not touched.

    Parsing is the shared bounded reader (:mod:`dflash_gguf.gguf_reader`); this only keeps the exact
    bytes of every KV and absolute tensor offsets, which re-writing needs.

    Raises:
        InputError: missing, unreadable, or not a valid GGUF.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"Input GGUF {path} does not exist. Check the path (the BF16/F16 conversion output).")
    try:
        meta = read_header(path)
    except InputError as e:
        raise InputError(f"Cannot read {path} as a GGUF file: {e} Re-run the conversion that produced it.") from e
    with open(path, "rb") as f:
        kv_raw = {}
        for key, kv in meta.kv.items():
            f.seek(kv.span[0])
            kv_raw[key] = f.read(kv.span[1] - kv.span[0])
    tensors = tuple(InputTensor(t.name, t.ne, t.qtype, meta.data_offset + t.offset, tensor_nbytes(t, path))
                    for t in meta.tensors.values())
    alignment = meta.get("general.alignment", 32)
    return InputGGUF(path, kv_raw, {k: kv.value for k, kv in meta.kv.items()}, tensors, int(alignment))


def pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv_uint32(key: str, value: int) -> bytes:
    """The encoding of one UINT32 key/value pair."""
    return pack_string(key) + struct.pack("<II", GGUFValueType.UINT32, value)


def kv_string(key: str, value: str) -> bytes:
    """The encoding of one STRING key/value pair."""
    return pack_string(key) + struct.pack("<I", GGUFValueType.STRING) + pack_string(value)
