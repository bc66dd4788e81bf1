"""Byte writers for planned target tensors: copied, converted in chunks, permuted, stacked or generated.

Plain tensors reuse the drafter's ``tensor_io`` (``copy_file_range`` when the type is unchanged,
bounded chunks otherwise). A row permutation or a value transform reads whole source rows in bounded
chunks (each contiguous run with one ``pread``), applies it in F32, and encodes the result, so memory
stays at one chunk whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGMLQuantizationType

from ..safetensors import TensorRef
from ..tensor_io import CHUNK_BYTES, byte_source, encode, read_tensor_bytes, tensor_writer, to_f32
from .base import TensorSpec


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """(first row, count) of each run of consecutive source rows."""
    out: list[tuple[int, int]] = []
    for r in rows.tolist():
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out


def _streamed_writer(spec: TensorSpec, qtype: GGMLQuantizationType) -> Callable[[BinaryIO], object]:
    ref = spec.ref
    assert ref is not None
    n_rows = spec.shape[0] if spec.shape else 1
    row_elems = int(np.prod(spec.shape[1:], dtype=np.int64)) if len(spec.shape) > 1 else 1
    row_bytes = ref.nbytes // max(1, n_rows)
    order = spec.row_order if spec.row_order is not None else np.arange(n_rows)
    per_chunk = max(1, CHUNK_BYTES // max(1, row_bytes))
    row_len = spec.shape[-1] if spec.shape else 1

    def write(out: BinaryIO) -> None:
        with open(ref.path, "rb", buffering=0) as f:
            fd = f.fileno()
            for start in range(0, n_rows, per_chunk):
                raw = bytearray()
                for first, count in _runs(order[start:start + per_chunk]):
                    raw += read_tensor_bytes(fd, ref, count * row_bytes, first * row_bytes)
                x = to_f32(raw, ref.dtype).reshape(-1, row_elems)
                if spec.transform is not None:
                    x = np.ascontiguousarray(spec.transform(x), dtype=np.float32)
                out.write(encode(x.reshape(-1), qtype, row_len).tobytes())

    return write


def _stacked_writer(parts: tuple[TensorRef, ...], qtype: GGMLQuantizationType) -> Callable[[BinaryIO], object]:
    """Tensors stacked along a new first axis: each written whole, in turn (copied or converted on its own; every
    part is whole rows, so the block quantizers see the rows they would see in the stacked tensor)."""
    writers = [tensor_writer(part, qtype) for part in parts]

    def write(out: BinaryIO) -> None:
        for part_writer in writers:
            part_writer(out)

    return write


def spec_writer(spec: TensorSpec, qtype: GGMLQuantizationType
                ) -> tuple[Callable[[BinaryIO], object], tuple[Path, int] | None]:
    """(writer, byte source) of one planned tensor; the source is set only when its bytes are copied as-is."""
    if spec.writer is not None:
        return spec.writer(qtype), None
    if spec.data is not None:
        payload = encode(np.ascontiguousarray(spec.data, dtype=np.float32).reshape(-1), qtype,
                         spec.shape[-1] if spec.shape else 1).tobytes()
        return (lambda out: out.write(payload)), None
    if spec.parts:
        return _stacked_writer(spec.parts, qtype), None
    assert spec.ref is not None
    if spec.row_order is None and spec.transform is None:
        return tensor_writer(spec.ref, qtype), byte_source(spec.ref, qtype)
    return _streamed_writer(spec, qtype), None
