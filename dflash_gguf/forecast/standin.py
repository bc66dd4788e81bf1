"""Stand-in checkpoints: a repo as the pipeline reads it, without its weights.

A stand-in folder holds the repo's small files as they are (config, tokenizer, processor settings, the safetensors
index, a drafter family's own small files) and, for each safetensors file, one with the same header (tensor names,
dtypes, shapes and offsets, in the file's order) whose values are random and finite. The pipeline converts it as it
converts the repo, so its GGUFs have the keys, tensor names, order, shapes and types of the real ones; only the
tensor data differs. Why random values and not zeros: a MoE router given zeros sends every token to the same experts,
which a CPU serves from cache faster than a trained router's spread.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_output
from ..drafters import FAMILIES
from ..errors import UnsupportedModelError
from ..hub import (
    CARD_AND_CONFIG,
    INDEX,
    PROCESSOR_PATTERNS,
    TOKENIZER_PATTERNS,
    WEIGHT_PATTERNS,
    Resolved,
    fetch,
    list_files,
    safetensors_header,
)

# Everything but the weights: what a stand-in copies from the repo as it is.
SMALL_PATTERNS = tuple(dict.fromkeys((*CARD_AND_CONFIG, *TOKENIZER_PATTERNS, *PROCESSOR_PATTERNS, INDEX,
                                      *(name for family in FAMILIES for name in family.fetch_files))))
_BLOCK = 1 << 22  # bytes of random values drawn once per dtype and written round and round
_SEED = 20260206  # fixed: the same repo gives the same stand-in


def _block(dtype: str) -> bytes:
    """``_BLOCK`` bytes of finite values of a safetensors dtype (normal, sigma 0.02, for floats); integer and bool
    tensors (MXFP4 blocks and scales, indices) get zeros, which every converter reads as valid."""
    rng = np.random.default_rng(_SEED)
    normal = (rng.standard_normal(_BLOCK // 2) * 0.02).astype(np.float32)
    if dtype == "F32":
        return normal.tobytes()[:_BLOCK]
    if dtype == "F64":
        return normal.astype(np.float64).tobytes()[:_BLOCK]
    if dtype == "F16":
        return normal.astype(np.float16).tobytes()[:_BLOCK]
    if dtype == "BF16":
        return (normal.view(np.uint32) >> 16).astype(np.uint16).tobytes()[:_BLOCK]
    if dtype in ("F8_E4M3", "F8_E5M2"):
        raw = rng.integers(0, 256, _BLOCK, dtype=np.uint8)
        exponent_all_ones = (raw & 0x7F) == 0x7F if dtype == "F8_E4M3" else (raw & 0x7C) == 0x7C
        raw[exponent_all_ones] = 0  # NaN (and, in E5M2, infinity)
        return raw.tobytes()
    return bytes(_BLOCK)


def _write_data(f: Any, header: dict[str, Any], blocks: dict[str, bytes]) -> None:
    """Each tensor's bytes at its offsets, taken round and round from its dtype's block."""
    entries = sorted((v["data_offsets"], v["dtype"]) for k, v in header.items() if k != "__metadata__")
    pos = 0
    for (start, end), dtype in entries:
        if start > pos:
            f.write(bytes(start - pos))
        block = blocks.setdefault(dtype, _block(dtype))
        left = end - start
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        pos = max(pos, end)


def write_safetensors(path: Path, header: dict[str, Any], blocks: dict[str, bytes] | None = None) -> None:
    """A safetensors file with ``header`` and stand-in values, written atomically."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        _write_data(f, header, {} if blocks is None else blocks)


def make_standin(resolved: Resolved, dest: Path, on_file: Callable[[str], None] | None = None) -> Path:
    """The stand-in of ``resolved`` (a Hub repo at its pinned commit, or a local folder) in ``dest``: its small files
    fetched and copied, each safetensors file written from its header alone (read by range request on the Hub: no
    tensor data is downloaded). Returns ``dest``.

    Raises:
        ResolveError: the Hub refused or could not be reached.
        UnsupportedModelError: the repo has no safetensors weights, or a header is unreadable.
    """
    small = fetch(resolved, SMALL_PATTERNS, progress=False) if resolved.repo else resolved
    weights = [f for f in list_files(resolved, WEIGHT_PATTERNS) if f.path.endswith(".safetensors")]
    if not weights:
        raise UnsupportedModelError(f"{resolved.label}: no safetensors weights, so no stand-in can be made of it.")
    dest.mkdir(parents=True, exist_ok=True)
    for repo_file in _small_files(small.path):
        (dest / repo_file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(small.path / repo_file, dest / repo_file)
    blocks: dict[str, bytes] = {}
    for weight in weights:
        if on_file is not None:
            on_file(weight.path)
        (dest / weight.path).parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(dest / weight.path, safetensors_header(resolved, weight.path), blocks)
    return dest


def _small_files(folder: Path) -> list[str]:
    """The small files a folder holds, as SMALL_PATTERNS selects them (top level only, as the Hub fetch does)."""
    return [p.name for p in sorted(folder.iterdir())
            if p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in SMALL_PATTERNS)]
