"""Tensor bytes from a safetensors range into the GGUF output, copied or converted in chunks.

Same-type tensors (the common BF16 -> BF16 case) are copied with ``copy_file_range``: the kernel
moves the bytes, nothing is mapped into this process, so RSS stays flat however large the model.
Type changes read bounded chunks with ``pread`` and convert them with numpy exactly as b11434's
``prepare_tensors`` does (cast to F32 first, then F16 by numpy rounding, BF16 by round-to-nearest-
even with quiet NaNs, Q8_0 by gguf-py's bit-exact quantizer).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGMLQuantizationType, quants

from ..errors import InputError
from ..ggufio.filecopy import copy_range
from ..ggufio.layout import float_to_f32
from .safetensors import TensorRef

CHUNK_BYTES = 16 * 1024 * 1024
_NATIVE = {"BF16": GGMLQuantizationType.BF16, "F16": GGMLQuantizationType.F16, "F32": GGMLQuantizationType.F32}


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round F32 to BF16 bits (nearest even; NaNs kept quiet), as ggml's fp32->bf16 does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    is_nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    u = np.where(is_nan, (u & np.uint32(0xFFFF0000)) | np.uint32(0x00400000), u)
    rounded = (u.astype(np.uint64) + np.uint64(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint64(16)
    return rounded.astype(np.uint16)


def to_f32(raw: bytes | bytearray | memoryview, dtype: str) -> np.ndarray:
    """A safetensors float tensor's bytes (``dtype`` BF16, F16 or F32) as float32."""
    if dtype not in ("BF16", "F16", "F32"):
        raise ValueError(f"cannot convert {dtype} tensors")
    return float_to_f32(raw, GGMLQuantizationType[dtype])


def encode(x: np.ndarray, qtype: GGMLQuantizationType, row: int) -> np.ndarray:
    """F32 values -> the bytes of ``qtype`` (rows of ``row`` elements for block types)."""
    if qtype == GGMLQuantizationType.F32:
        return x
    if qtype == GGMLQuantizationType.F16:
        return x.astype(np.float16)
    if qtype == GGMLQuantizationType.BF16:
        return f32_to_bf16(x)
    return quants.quantize(x.reshape(-1, row), qtype)


def read_tensor_bytes(fd: int, src: TensorRef, n: int, at: int = 0) -> bytes:
    """``n`` bytes of tensor ``src`` from ``at`` bytes into it (``fd``: its file, open); the file shrinking under
    us (checked once already) is an input error."""
    data = os.pread(fd, n, src.offset + at)
    if len(data) != n:
        raise InputError(f"{src.path} changed while it was being read (tensor {src.name!r} is cut short). "
                         "Make sure nothing is rewriting the checkpoint, then retry.")
    return data


def _copy_range(src: TensorRef, out: BinaryIO) -> None:
    out.flush()
    with open(src.path, "rb", buffering=0) as f:
        if copy_range(f.fileno(), src.offset, src.nbytes, out.fileno()) != src.nbytes:
            raise InputError(f"{src.path} changed while it was being read (tensor {src.name!r} is cut short). "
                             "Make sure nothing is rewriting the checkpoint, then retry.")


def byte_source(src: TensorRef, qtype: GGMLQuantizationType) -> tuple[Path, int] | None:
    """Where the output bytes of ``src`` as ``qtype`` already sit, when :func:`tensor_writer` copies them."""
    return (src.path, src.offset) if _NATIVE.get(src.dtype) == qtype else None


def tensor_writer(src: TensorRef, qtype: GGMLQuantizationType) -> Callable[[BinaryIO], object]:
    """A callback writing ``src`` as ``qtype`` into an unbuffered output file."""
    if _NATIVE.get(src.dtype) == qtype:
        return lambda out: _copy_range(src, out)

    row = src.shape[-1] if src.shape else 1
    elem = src.nbytes // max(1, int(np.prod(src.shape, dtype=np.int64)))
    rows_per_chunk = max(1, CHUNK_BYTES // max(1, row * elem))
    step = rows_per_chunk * row * elem

    def write(out: BinaryIO) -> None:
        with open(src.path, "rb", buffering=0) as f:
            fd = f.fileno()
            for start in range(0, src.nbytes, step):
                raw = read_tensor_bytes(fd, src, min(step, src.nbytes - start), start)
                out.write(encode(to_f32(raw, src.dtype), qtype, row).tobytes())

    return write


def _rows(src: TensorRef, start: int, stop: int) -> TensorRef:
    row_bytes = src.nbytes // src.shape[0]
    return TensorRef(src.name, src.dtype, (stop - start, *src.shape[1:]), src.path, src.offset + start * row_bytes,
                     (stop - start) * row_bytes)


def patched_writer(src: TensorRef, qtype: GGMLQuantizationType, row: int,
                   row_raw: bytes) -> Callable[[BinaryIO], object]:
    """A callback writing ``src`` as ``qtype`` with row ``row`` replaced by ``row_raw`` (in ``src``'s dtype):
    the rows before and after are streamed as :func:`tensor_writer` streams them."""
    before, after = _rows(src, 0, row), _rows(src, row + 1, src.shape[0])
    row_len = src.shape[-1] if len(src.shape) > 1 else 1

    def write(out: BinaryIO) -> None:
        if before.shape[0]:
            tensor_writer(before, qtype)(out)
        out.write(row_raw if _NATIVE.get(src.dtype) == qtype else
                  encode(to_f32(row_raw, src.dtype), qtype, row_len).tobytes())
        if after.shape[0]:
            tensor_writer(after, qtype)(out)

    return write
