"""Safetensors headers read without loading data, validated against the file size.

Tensor bytes are never read here: the converter copies or converts byte ranges later, so a
truncated or corrupt file is refused before any output is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import arrivals
from ..errors import InputError, TensorError
from ..jsonfile import load_json, parse_bounded
from ..relpath import name_problem

# Tensor names b11434's converters drop silently (ModelBase.prepare_tensors), for drafters and targets alike.
IGNORED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")

DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes live."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute file offset
    nbytes: int


def read_raw_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """One safetensors file's JSON header as written (``__metadata__`` included, in the file's order), where its
    data starts, and the file's size; the data is not read.

    Raises:
        InputError: the file is truncated or its header is not valid safetensors.
    """
    fix = f"Re-download {path.name} (for a Hub snapshot: delete it and fetch it again)."
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise InputError(f"{path} is not a safetensors file: it is only {size} bytes long. {fix}")
        n = int.from_bytes(raw_len, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise InputError(
                f"{path} has a corrupt or truncated safetensors header: it declares {n} header bytes "
                f"but the file has {size} bytes. {fix}"
            )
        try:
            header = parse_bounded(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"{path} has a corrupt safetensors header (not JSON: {e}). {fix}") from None
    if not isinstance(header, dict):
        raise InputError(f"{path} has a corrupt safetensors header (not a JSON object). {fix}")
    return header, 8 + n, size


def read_header(path: Path) -> dict[str, TensorRef]:
    """Parse one safetensors file's header; tensors sorted by name as b11434 orders them.

    Raises:
        InputError: the file is truncated or its header is not valid safetensors.
    """
    return _refs(path, *read_raw_header(path))


def _refs(path: Path, header: dict[str, Any], data_start: int, size: int) -> dict[str, TensorRef]:
    """The tensors a safetensors header lists, checked against the file's size; sorted by name."""
    fix = f"Re-download {path.name} (for a Hub snapshot: delete it and fetch it again)."
    tensors: dict[str, TensorRef] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise InputError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}. {fix}") from None
        if dtype not in DTYPE_SIZES:
            raise TensorError(f"{path}: tensor {name!r} has dtype {dtype}, which this converter does not read.")
        count = 1
        for d in shape:
            count *= d
        if end - begin != count * DTYPE_SIZES[dtype] or begin < 0:
            raise InputError(f"{path}: tensor {name!r} byte range {begin}..{end} does not fit its shape "
                             f"{list(shape)} {dtype}. {fix}")
        if data_start + end > size:
            raise InputError(
                f"{path} is truncated: tensor {name!r} ends at byte {data_start + end} but the file has "
                f"{size} bytes. {fix}"
            )
        tensors[name] = TensorRef(name, dtype, shape, path, data_start + begin, end - begin)
    return dict(sorted(tensors.items()))


def index_checkpoint(model_dir: Path) -> dict[str, TensorRef]:
    """All tensors of a checkpoint dir, found the way b11434 finds them (``model*.safetensors``).

    Raises:
        TensorError: no weights found, or the shard index disagrees with the shards.
        InputError: a shard is unreadable.
    """
    index_file = model_dir / "model.safetensors.index.json"
    parts = sorted(p for p in os.listdir(model_dir) if p.startswith("model") and p.endswith(".safetensors"))
    weight_map: dict[str, str] = {}
    if index_file.is_file():
        try:
            weight_map = load_json(index_file)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (KeyError, TypeError, OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            why = f" ({e})" if isinstance(e, ValueError | OSError) else ""
            raise InputError(f"{index_file} has no valid 'weight_map'{why}. Re-download it.") from None
        for shard in set(weight_map.values()):
            if (problem := name_problem(shard)) is not None:
                raise InputError(f"{index_file}: its weight_map names the shard {problem}. A shard is a file "
                                 "beside the index, named by a plain relative path; the checkpoint will not be read "
                                 "from outside its folder. Re-download the index from the model's repo.")
        parts = sorted(set(weight_map.values()))
    if not parts:
        bins = [p for p in os.listdir(model_dir) if p.startswith("pytorch_model") and p.endswith(".bin")]
        hint = (" It has pytorch_model*.bin files, which this torch-free converter does not read; "
                "convert them to safetensors first." if bins else "")
        raise TensorError(f"No weights found in {model_dir}: expected model.safetensors or "
                          f"model-*.safetensors (+ model.safetensors.index.json).{hint}")
    tensors: dict[str, TensorRef] = {}
    for part in parts:
        path = model_dir / part
        if (streamed := arrivals.arriving(path)) is not None:  # its header read ahead, its bytes on the way
            tensors.update(_refs(streamed.path, streamed.header, streamed.data_start, streamed.size))
            continue
        if not path.is_file():
            raise TensorError(f"{model_dir}: shard {part} named in {index_file.name} is missing. "
                              "Download the complete checkpoint.")
        tensors.update(read_header(path))
    if weight_map and set(weight_map) != set(tensors):
        missing = sorted(set(weight_map) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(weight_map))[:5]
        raise TensorError(f"{index_file} disagrees with the shards: missing {missing}, unlisted {extra}. "
                          "Download the complete checkpoint.")
    return tensors
