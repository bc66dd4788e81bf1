"""A GGUF split into shards as b11434's ``llama-gguf-split --split`` writes them, byte for byte
(``tools/gguf-split/gguf-split.cpp``, ``split_strategy``).

Why: the Hub takes files up to a per-file limit (50 GB recommended, 200 GB at most), so a large model is published
as ``<name>-00001-of-0000N.gguf`` …, which llama.cpp's loader and ``-hf`` (``get_split_files``) read together.

The layout: the first shard holds every metadata pair of the file, then ``split.no`` (u16), ``split.tensors.count``
(i32) and ``split.count`` (u16); the others hold those three only. Tensors keep their order; a new shard starts
before the tensor that would take the shard's tensor bytes (each padded to the alignment, metadata not counted) above
``max_bytes``, or every ``max_tensors`` tensors. Each shard's data is aligned and each tensor padded as in any GGUF.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFValueType

from ..atomic import atomic_output
from ..errors import InputError
from .filecopy import copy_range
from .layout import ALIGNMENT, header_parts, pack_kv, pack_tensor_info, pad
from .reader import GGUFMeta, TensorInfo, raw_kv_bytes, read_gguf, shard_name, tensor_nbytes

SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
_SIZE = re.compile(r"^(?P<n>\d+)(?P<unit>[KMG]?)$")
_UNITS = {"": 1, "K": 1000, "M": 1000 ** 2, "G": 1000 ** 3}  # convert_hf_to_gguf's split_str_to_n_bytes: 1000s


def parse_size(text: str, flag: str = "--split-max-size") -> int:
    """``200K``, ``48G``, ``1000000`` as bytes (llama.cpp's converter's syntax: K, M, G are powers of 1000).

    Raises:
        InputError: not a positive whole number with an optional K, M or G.
    """
    m = _SIZE.match(text.strip().upper())
    if m is None or int(m["n"]) <= 0:
        raise InputError(f"{flag} {text!r}: give a positive size in bytes, or with K, M or G (powers of 1000, as "
                         "llama.cpp's convert_hf_to_gguf.py reads them), e.g. 48G.")
    return int(m["n"]) * _UNITS[m["unit"]]


@dataclass(frozen=True)
class SplitRule:
    """Where shards start: at most ``max_bytes`` of tensor data per shard, or ``max_tensors`` tensors (one of them,
    as llama-gguf-split takes one mode)."""

    max_bytes: int | None = None
    max_tensors: int | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_tensors is not None:
            raise InputError("--split-max-size and --split-max-tensors were both given; llama-gguf-split splits by "
                             "one of them. Pass one.")
        if self.max_tensors is not None and self.max_tensors <= 0:
            raise InputError(f"--split-max-tensors {self.max_tensors}: give a positive number of tensors.")

    @classmethod
    def from_flags(cls, max_size: str | None, max_tensors: int | None) -> SplitRule:
        """From --split-max-size (llama.cpp's size syntax) and --split-max-tensors.

        Raises:
            InputError: a size llama.cpp would not read, or both flags.
        """
        return cls(parse_size(max_size) if max_size else None, max_tensors)

    @property
    def given(self) -> bool:
        return self.max_bytes is not None or self.max_tensors is not None

    def describe(self) -> str:
        return f"at most {self.max_bytes:,} bytes of tensors a shard" if self.max_bytes is not None else \
            f"at most {self.max_tensors} tensors a shard"

    def to_json(self) -> dict[str, int | None]:
        return {"max_bytes": self.max_bytes, "max_tensors": self.max_tensors}


NO_SPLIT = SplitRule()


def plan_shards(tensors: list[TensorInfo], rule: SplitRule, path: Path, *,
                converter: bool = False) -> list[list[TensorInfo]]:
    """The tensors of each shard, as ``split_strategy``'s constructor groups them (padded sizes; a tensor alone
    above the size is refused), or with ``converter`` as b11434's converter does (gguf-py's
    ``GGUFWriter.add_tensor_info``: unpadded sizes, and a shard never left empty).

    Raises:
        InputError: a shard would hold no tensor (one tensor alone is above the size).
    """
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        n_bytes = tensor_nbytes(t, path) if converter else pad(tensor_nbytes(t, path))
        if converter:
            cut = bool(shards[-1]) and (len(shards[-1]) >= rule.max_tensors if rule.max_tensors is not None
                                        else size + n_bytes > (rule.max_bytes or 0))
        elif rule.max_bytes is not None:
            cut = size + n_bytes > rule.max_bytes
        else:
            assert rule.max_tensors is not None
            cut = 0 < i < len(tensors) and i % rule.max_tensors == 0
        if cut:
            if not shards[-1]:
                raise InputError(f"{path}: tensor {t.name!r} alone is larger than --split-max-size "
                                 f"({rule.max_bytes} bytes): a shard would hold no tensor. Give a larger size.")
            shards.append([])
            size = n_bytes
        else:
            size += n_bytes
        shards[-1].append(t)
    return shards


def shard_path(first: Path, no: int, count: int) -> Path:
    """``<name>-0000k-of-0000n.gguf`` beside ``first`` (``<name>.gguf``), as ``llama_split_path`` names them."""
    return first.with_name(shard_name(first.name.removesuffix(".gguf"), no, count))


def split_gguf(path: Path, rule: SplitRule, *, converter: bool = False,
               on_progress: Callable[[int, int], None] | None = None) -> list[tuple[Path, str]]:
    """Write ``path``'s shards beside it (``<name>-00001-of-0000N.gguf`` …), each atomically, and return them with
    their sha256; nothing (an empty list) when it fits in one under ``rule``. ``path`` itself is left for the caller
    to remove. ``converter``: the shards b11434's
    ``convert_hf_to_gguf.py --split-max-size/--split-max-tensors`` writes (its grouping, and ``split.count`` before
    ``split.tensors.count``), for a file the converter makes (an unquantized one); else llama-gguf-split's.

    Raises:
        InputError: unreadable input, or a shard would hold no tensor.
        OutputError: the folder cannot be written.
    """
    meta = read_gguf(path)
    if meta.get("general.alignment", ALIGNMENT) != ALIGNMENT:
        raise InputError(f"{path}: general.alignment is not {ALIGNMENT}; llama-gguf-split's shards use the default.")
    tensors = list(meta.tensors.values())
    shards = plan_shards(tensors, rule, path, converter=converter) if rule.given else [tensors]
    if len(shards) < 2:
        return []
    count, total = len(shards), sum(tensor_nbytes(t, path) for t in tensors)
    kvs = [raw for key, raw in raw_kv_bytes(meta).items() if key not in SPLIT_KEYS]
    out: list[tuple[Path, str]] = []
    done = 0
    # every shard written under .partial first, renamed together at the end (the first last): no partial split
    with contextlib.ExitStack() as renames:
        for no, group in enumerate(shards):
            # split.count goes last: gguf-split sets it twice (a placeholder, then the count), and gguf_set_val
            # removes a key before appending it again
            split_kv = [pack_kv("split.no", GGUFValueType.UINT16, no),
                        pack_kv("split.tensors.count", GGUFValueType.INT32, len(tensors)),
                        pack_kv("split.count", GGUFValueType.UINT16, count)]
            if converter:  # gguf-py's add_shard_kv_data sets them in this order, once
                split_kv[1:] = split_kv[:0:-1]
            infos, offset = [], 0
            for t in group:
                infos.append(pack_tensor_info(t.name, t.ne, t.qtype, offset))
                offset += pad(tensor_nbytes(t, path))
            dest = shard_path(path, no + 1, count)
            tmp = renames.enter_context(atomic_output(dest))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for part in header_parts([*(kvs if no == 0 else []), *split_kv], infos):
                    os.write(fd, part)
                for t in group:
                    done += _copy_tensor(meta, t, path, fd)
                    if on_progress is not None:
                        on_progress(done, total)
            finally:
                os.close(fd)
            out.append((dest, _sha256(tmp)))
    return out


def _copy_tensor(meta: GGUFMeta, t: TensorInfo, path: Path, fd: int) -> int:
    """One tensor's bytes from its file to ``fd``, padded to the alignment; returns its size."""
    where, start = meta.locate(t)
    n = tensor_nbytes(t, path)
    src = os.open(where, os.O_RDONLY)
    try:
        if copy_range(src, start, n, fd) != n:
            raise InputError(f"{where}: tensor {t.name!r} is cut short; the file is truncated.")
    finally:
        os.close(src)
    os.write(fd, bytes(pad(n) - n))
    return n


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()
