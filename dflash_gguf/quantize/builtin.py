"""The built-in quantizer: llama-quantize b11434's output for Q4_0/Q8_0/F16/BF16/F32, without llama.cpp.

Bit-exactness rests on three things: the per-tensor types of ``rules.py`` (including the Q6_K output /
tied-embedding rule of a q4_0 or q8_0 file), the kernels of ``kernels.py`` (compiled ``_kernels.c`` when it
was built, else numpy; both bit-identical to ggml's reference ``quantize_row_q4_0_ref``/``q8_0_ref``/
``q6_K_ref``, which is what ``ggml_quantize_chunk`` calls; gguf-py's quantizers are not, for blocks of
signed zeros, and are several times slower), and the file layout of ``llama_model_quantize_impl``: input KVs in
order minus ``general.quantization_version``/``general.file_type``/``split.*``, those two appended,
tensors sorted by ``weight_name_comparer``, data 32-byte aligned.

Streaming: tensors are read with ``os.pread`` in row chunks (not through the mmap, so the page
cache of a multi-GB input never counts against our RSS) and quantized by a small thread pool; the
compiled kernels release the GIL for a whole chunk, numpy inside its array loops, so two threads use two cores.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

from .. import __version__, arrivals
from ..atomic import atomic_output, check_free_space
from ..cores import machine_cores
from ..errors import InputError, QuantizeError
from ..ggufio import GGUFPlan, Written, layout
from ..ggufio.filecopy import copy_range
from ..ggufio.hashing import FollowingHasher
from ..ggufio.layout import ALIGNMENT, pad, row_bytes
from ..ggufio.readahead import ByteRange, DropBehind
from ..ggufio.reader import raw_kv_bytes, read_gguf, tensor_nbytes
from ..provenance import PROVENANCE_PREFIX
from . import ahead, kernels
from .imatrix import Importance
from .recipes import TensorTypeRule
from .rules import (
    FTYPES,
    OVERRIDE_TYPES,
    SUPPORTED_TYPES,
    Mixture,
    ModelFacts,
    ggml_n_dims,
    is_quantized,
    layer_sort_key,
)

log = logging.getLogger(__name__)
Q = GGMLQuantizationType
VT = GGUFValueType

BUILTIN_VERSION = f"dflash-gguf {__version__} builtin (llama.cpp b11434 rules)"
KEY_QUANTIZER = PROVENANCE_PREFIX + "quantizer"
KEY_QUANTIZER_VERSION = PROVENANCE_PREFIX + "quantizer_version"
# llama-quantize's per-tensor flags the file was made with (Overrides.args(), in order); absent: the type's own rules
KEY_QUANTIZE_FLAGS = PROVENANCE_PREFIX + "quantize_flags"
_OUR_QUANTIZE_KEYS = (KEY_QUANTIZER, KEY_QUANTIZER_VERSION, KEY_QUANTIZE_FLAGS)
# Keys llama-quantize drops (split.*) or re-appends at the end (the other two): llama-quant.cpp.
_MOVED_KEYS = ("general.quantization_version", "general.file_type", "split.no", "split.count",
               "split.tensors.count")
CHUNK_ELEMENTS = 1 << 20  # ~4 MB of f32 per work item: big enough for numpy, small for memory
# A head start's chunk: its thread waits for the GIL once per chunk while the main thread runs Python, so a chunk
# is ~10 ms of Q6_K kernel time, above the interpreter's 5 ms switch interval (4 Mi pushed peak RSS to 256 MB).
AHEAD_CHUNK_ELEMENTS = 2 << 20
DEPTH_PER_THREAD = 3  # chunks in flight per worker thread


@dataclass(frozen=True)
class InputTensor:
    """One input tensor: ``ne`` in ggml order, ``offset`` absolute in ``path`` (None: the input GGUF itself).

    A tensor of a converter's plan (one-pass convert + quantize) may have no bytes on disk yet: ``spool``
    then writes them (e.g. a permuted or widened tensor), straight into the output when the tensor is
    copied, else into a scratch file that the quantizer reads like any other input.
    """

    name: str
    ne: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int
    path: Path | None = None
    spool: Callable[[BinaryIO], object] | None = None
    reads: tuple[Path, ...] = ()  # the checkpoint files its bytes come from (waited for while they stream in)


@dataclass(frozen=True)
class InputGGUF:
    """Metadata (key -> raw KV bytes, file order), values, and the tensors of the file to quantize.

    Why raw bytes: llama-quantize copies every key/value pair unchanged (``gguf_set_kv``), so the built-in
    copies each KV's exact encoding instead of decoding and re-encoding it.
    """

    path: Path
    kv_raw: dict[str, bytes]
    values: dict[str, object]
    tensors: tuple[InputTensor, ...]
    alignment: int


def read_input(path: Path) -> InputGGUF:
    """The header of ``path`` for re-writing it; tensor data is not touched.

    Raises:
        InputError: missing, unreadable, or not a valid GGUF.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"Input GGUF {path} does not exist. Check the path (the BF16/F16 conversion output).")
    try:
        meta = read_gguf(path)
    except InputError as e:
        raise InputError(f"Cannot read {path} as a GGUF file: {e} Re-run the conversion that produced it.") from e
    # a split GGUF (read by its first shard): each tensor from its own shard, the KVs the first shard's, as
    # llama-quantize's loader reads it (and it writes no split.* key: _MOVED_KEYS)
    tensors = tuple(InputTensor(t.name, t.ne, t.qtype, offset, tensor_nbytes(t, path),
                                path=where if where != meta.path else None)
                    for t in meta.tensors.values() for where, offset in (meta.locate(t),))
    return InputGGUF(path, raw_kv_bytes(meta), {k: kv.value for k, kv in meta.kv.items()}, tensors,
                     int(meta.get("general.alignment", ALIGNMENT)))


@dataclass(frozen=True)
class TensorJob:
    """One output tensor: where its input is, which type it becomes, and why if not the default."""

    src: InputTensor
    dst_type: GGMLQuantizationType
    dst_nbytes: int
    reason: str = ""
    fallback: bool = False
    # the importance matrix's weights for it (one float32 per column, per expert for a stack), when it has some and
    # its type is one ggml_quantize_chunk weights (kernels.WEIGHTED_TYPES)
    importance: np.ndarray | None = field(default=None, compare=False)

    @property
    def copy(self) -> bool:
        return self.dst_type == self.src.qtype


def input_from_plan(plan: GGUFPlan, label: Path) -> InputGGUF:
    """A converter's plan seen as the GGUF it would write, without writing it (one-pass convert + quantize).

    Quantizing this equals converting to ``label`` and quantizing that file: the KVs are packed exactly as
    the converter packs them, and every tensor reads the very bytes the converter would have written.
    """
    tensors = tuple(InputTensor(t.name, t.ne, int(t.qtype), t.source[1], t.nbytes, path=t.source[0], reads=t.reads)
                    if t.source is not None else
                    InputTensor(t.name, t.ne, int(t.qtype), 0, t.nbytes, spool=t.write, reads=t.reads)
                    for t in plan.tensors)
    return InputGGUF(Path(label), {k: layout.pack_kv(k, kv.vtype, kv.value, kv.subtype) for k, kv in plan.kv.items()},
                     {k: kv.value for k, kv in plan.kv.items()}, tensors, ALIGNMENT)


@dataclass(frozen=True)
class Overrides:
    """llama-quantize's ``--output-tensor-type``, ``--token-embedding-type`` (type names, None: not given),
    ``--pure`` (no mixture rules: every quantizable tensor at the file's type) and the ``--tensor-type`` recipe (its
    rules in order, a ``--tensor-type-file``'s included where it was given)."""

    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    pure: bool = False
    tensor_types: tuple[TensorTypeRule, ...] = ()

    @property
    def given(self) -> bool:
        return bool(self.output_tensor_type or self.token_embedding_type or self.pure or self.tensor_types)

    def args(self) -> list[str]:
        """The same flags for llama-quantize."""
        return [*(["--output-tensor-type", self.output_tensor_type] if self.output_tensor_type else []),
                *(["--token-embedding-type", self.token_embedding_type] if self.token_embedding_type else []),
                *(["--pure"] if self.pure else []),
                *(arg for rule in self.tensor_types for arg in ("--tensor-type", rule.arg))]

    @property
    def builtin_makes(self) -> bool:
        """Whether every type these flags name is one the built-in quantizer makes."""
        named = [self.output_tensor_type, self.token_embedding_type, *(r.type_name for r in self.tensor_types)]
        return all(name.lower() in OVERRIDE_TYPES for name in named if name is not None)

    def parsed(self) -> tuple[GGMLQuantizationType | None, GGMLQuantizationType | None]:
        """The two types, refusing what the built-in cannot make (the recipe's types too)."""
        out = []
        for flag, value in (("--output-tensor-type", self.output_tensor_type),
                            ("--token-embedding-type", self.token_embedding_type)):
            if value is not None and value.lower() not in OVERRIDE_TYPES:
                raise QuantizeError(f"{flag} {value}: the built-in quantizer makes {', '.join(OVERRIDE_TYPES)}; "
                                    "other types need --quantizer llama-quantize.")
            out.append(None if value is None else OVERRIDE_TYPES[value.lower()])
        for rule in self.tensor_types:
            if rule.type_name not in OVERRIDE_TYPES:
                raise QuantizeError(f"--tensor-type {rule.arg}: the built-in quantizer makes "
                                    f"{', '.join(OVERRIDE_TYPES)}; other types need --quantizer llama-quantize.")
        return out[0], out[1]


NO_OVERRIDES = Overrides()


def requantize_refusal(path: Path, name: str, stored: GGMLQuantizationType) -> str:
    """Why a quantized tensor is not quantized again, and the way out (MXFP4 experts: the type that keeps them)."""
    if stored == Q.MXFP4:
        return (f"{path}: tensor {name} is MXFP4 (the checkpoint's own expert blocks), and llama-quantize b11434 does "
                "not requantize MXFP4 ('requantizing from type mxfp4 is disabled'). Quantize to MXFP4_MOE, which keeps "
                "them and makes every other matrix Q8_0; --allow-requantize converts them anyway (dequantize, then "
                "quantize again).")
    return (f"{path} is already quantized (tensor {name} is {stored.name}). Quantize from the BF16/F16 conversion "
            "instead; --allow-requantize converts it anyway (dequantize, then quantize again), which loses quality "
            "twice.")


@dataclass(frozen=True)
class TensorPlan:
    """Every tensor's job in llama-quantize's order, and the ``--tensor-type`` rules no tensor took (llama-quantize
    says nothing of them; the built-in reports them)."""

    jobs: list[TensorJob]
    unused_rules: tuple[TensorTypeRule, ...] = ()

    def notes(self) -> tuple[str, ...]:
        """The row-length fallbacks llama-quantize warns about, then the unused rules."""
        return (*(f"{j.src.name}: {j.reason}" for j in self.jobs if j.fallback),
                *(f"--tensor-type {rule.arg}: no tensor took this rule (its pattern matches no quantizable tensor's "
                  "name, or an earlier rule matches first)" for rule in self.unused_rules))


def plan_tensors(gguf: InputGGUF, type_name: str, *, allow_requantize: bool = False,
                 overrides: Overrides = NO_OVERRIDES, importance: Importance | None = None) -> TensorPlan:
    """Per-tensor output types in llama-quantize's order, each with its importance weights when ``importance`` has
    some for it (llama-quantize's rules with an importance matrix).

    Raises:
        QuantizeError: unknown type, quantized input without ``allow_requantize``, a tensor type the
            built-in cannot read, an override type it cannot make or that does not fit the tensor's rows.
    """
    if type_name not in FTYPES:
        raise QuantizeError(f"Unknown quantization type {type_name!r}. The built-in quantizer supports: "
                            f"{', '.join(SUPPORTED_TYPES)}; other types need --quantizer llama-quantize.")
    output_type, token_embd_type = overrides.parsed()
    facts = ModelFacts.of(gguf.values, [t.name for t in gguf.tensors])
    mixture = Mixture(facts, type_name, output_type=output_type, token_embd_type=token_embd_type,
                      pure=overrides.pure, has_imatrix=importance is not None, tensor_types=overrides.tensor_types)
    jobs = []
    for t in sorted(gguf.tensors, key=lambda t: layer_sort_key(t.name)):
        stored = Q(t.qtype)
        choice = mixture.choose(t.name, t.ne, stored)
        block = GGML_QUANT_SIZES[choice.qtype][0]
        if choice.override and t.ne[0] % block:
            raise QuantizeError(f"{choice.reason} {choice.qtype.name} does not fit tensor {t.name} of {gguf.path}: "
                                f"its rows have {t.ne[0]} values, not a multiple of {block}; llama-quantize would "
                                "abort. Choose a type with a smaller block (q8_0, f16).")
        if choice.qtype != stored and is_quantized(stored) and not allow_requantize:
            raise QuantizeError(requantize_refusal(gguf.path, t.name, stored))
        if choice.qtype != stored and stored not in (Q.F32, Q.F16, Q.BF16) and not is_quantized(stored):
            raise QuantizeError(f"Tensor {t.name} in {gguf.path} has type {stored.name}, which cannot be converted "
                                f"to {choice.qtype.name}.")
        n_rows = 1
        for d in t.ne[1:]:
            n_rows *= d
        weights = importance.for_tensor(t.name, t.ne) if importance is not None and choice.qtype != stored \
            and choice.qtype in kernels.WEIGHTED_TYPES else None
        jobs.append(TensorJob(t, choice.qtype, n_rows * row_bytes(choice.qtype, t.ne[0]), choice.reason,
                              choice.fallback, weights))
    unused = tuple(rule for rule in overrides.tensor_types if rule not in mixture.matched)
    return TensorPlan(jobs, unused if is_quantized(FTYPES[type_name][1]) else ())


def _header(gguf: InputGGUF, jobs: list[TensorJob], type_name: str,
            importance: Importance | None = None, flags: Sequence[str] = ()) -> list[bytes]:
    """The output's header as pieces (the input's KV encodings are shared, never joined into one copy). With an
    importance matrix, llama-quantize's own keys for it follow the file type (its kv_overrides, in its order);
    ``flags``: the per-tensor flags it was made with, recorded in our keys."""
    recorded = _importance_kvs(importance)
    kvs = [raw for key, raw in gguf.kv_raw.items() if key not in _MOVED_KEYS and key not in _OUR_QUANTIZE_KEYS]
    kvs = [raw for raw in kvs if _kv_key(raw) not in recorded] if recorded else kvs
    kvs.append(layout.pack_kv("general.quantization_version", VT.UINT32, layout.GGML_QUANT_VERSION))
    kvs.append(layout.pack_kv("general.file_type", VT.UINT32, int(FTYPES[type_name][0])))
    kvs += recorded.values()
    kvs.append(layout.pack_kv(KEY_QUANTIZER, VT.STRING, "builtin"))
    kvs.append(layout.pack_kv(KEY_QUANTIZER_VERSION, VT.STRING, BUILTIN_VERSION))
    if flags:
        kvs.append(layout.pack_kv(KEY_QUANTIZE_FLAGS, VT.ARRAY, list(flags), VT.STRING))
    infos, offset = [], 0
    for j in jobs:
        # llama-quantize writes each tensor's ne up to ggml_n_dims: a [64, 1] tensor is written as [64]
        infos.append(layout.pack_tensor_info(j.src.name, j.src.ne[:ggml_n_dims(j.src.ne)], j.dst_type, offset))
        offset += pad(j.dst_nbytes)
    return layout.header_parts(kvs, infos)


def _importance_kvs(importance: Importance | None) -> dict[str, bytes]:
    """What llama-quantize b11434 writes of the matrix (quantize.cpp's kv_overrides): its file and first text as given
    (127 bytes at most), its entries and, when known, its chunks (as UINT32)."""
    if importance is None:
        return {}
    out = {"quantize.imatrix.file": layout.pack_kv("quantize.imatrix.file", VT.STRING, _c127(importance.file))}
    if importance.dataset is not None:
        out["quantize.imatrix.dataset"] = layout.pack_kv("quantize.imatrix.dataset", VT.STRING,
                                                         _c127(importance.dataset))
    out["quantize.imatrix.entries_count"] = layout.pack_kv("quantize.imatrix.entries_count", VT.UINT32,
                                                           len(importance.weights))
    if importance.chunks > 0:
        out["quantize.imatrix.chunks_count"] = layout.pack_kv("quantize.imatrix.chunks_count", VT.UINT32,
                                                              importance.chunks)
    return out


def _c127(text: str) -> str:
    """strncpy into llama_model_kv_override's 128-byte val_str: the first 127 bytes."""
    return text.encode("utf-8")[:127].decode("utf-8", "ignore")


def _kv_key(raw: bytes) -> str:
    """The key of a packed KV (uint64 length, then the name)."""
    (n,) = struct.unpack_from("<Q", raw, 0)
    return raw[8:8 + n].decode("utf-8")


def _to_f32(raw: bytes | memoryview, qtype: GGMLQuantizationType, n_per_row: int) -> np.ndarray:
    """Decode rows to float32 exactly as ggml's to_float does (BF16/F16 widen exactly)."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return layout.float_to_f32(raw, qtype).reshape(-1, n_per_row)
    data = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes(qtype, n_per_row))
    return quants.dequantize(data, qtype).astype(np.float32, copy=False).reshape(-1, n_per_row)


def _refuse_nonfinite(data: np.ndarray, qtype: GGMLQuantizationType, name: str, result: bool) -> None:
    """llama-quantize loads its input with check_tensors on and checks every tensor it re-types
    (ggml_validate_row_data): a NaN or infinite value or block scale in what it reads, copied tensors included
    ('tensor ... has invalid data'), or in a ``result`` ('quantized data validation failed') fails the run. So
    does ours, naming the tensor."""
    if qtype not in kernels.CHECKED_TYPES or not (bad := kernels.count_nonfinite(data, qtype)):
        return
    what = "block scales" if qtype in kernels.QUANT_TYPES else "values"
    if not result:
        raise QuantizeError(f"Tensor {name} of the input has {bad} NaN or infinite {what} ({qtype.name}); "
                            "llama-quantize b11434 refuses such input too ('tensor has invalid data'). Check the "
                            "checkpoint for corrupt weights (download it again, or convert it afresh).")
    fix = " F16 holds nothing beyond +-65504: convert to bf16 or f32 instead, or" if qtype == Q.F16 else ""
    raise QuantizeError(f"Tensor {name}: {bad} {what} would be NaN or infinite in {qtype.name} (an input "
                        "value is NaN or infinite, or too large for the type); llama-quantize b11434 refuses it too "
                        f"('quantized data validation failed').{fix} Check the input for corrupt weights.")


_SCRATCH = threading.local()


def _read_rows(fd: int, length: int, start: int, copy: bool) -> bytes | memoryview:
    """``length`` bytes at ``start``: new bytes when they are passed on as they are (``copy``), else a view of the
    worker's own scratch buffer, valid until its next chunk. Why: a fresh multi-MB ``bytes`` per chunk is fresh
    memory the kernel must fault in and zero each time (glibc hands large blocks back to the system when they are
    freed), which on a machine whose memory is full of page cache cost the workers more time than the kernels."""
    if copy:
        return os.pread(fd, length, start)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or len(buf) < length:
        buf = _SCRATCH.buf = bytearray(length)
    view = memoryview(buf)[:length]
    return view[:os.preadv(fd, [view], start)]


def _convert_rows(job: TensorJob, fd: int, row0: int, n_rows: int) -> ahead.Chunk:
    """A chunk of ``job``'s rows, converted (the work ahead's unit)."""
    return _convert_chunk(fd, job.src.offset, (job,), row0, n_rows)[0]


def _convert_chunk(fd: int, offset: int, jobs: tuple[TensorJob, ...], row0: int, n_rows: int
                   ) -> tuple[ahead.Chunk, ...]:
    """Rows of one input tensor, read once and made into each output's type (``jobs``: the tensor's job in every
    output written from this read)."""
    src = jobs[0].src
    n = src.ne[0]
    src_row = row_bytes(Q(src.qtype), n)
    copied = any(job.copy for job in jobs)
    raw = _read_rows(fd, n_rows * src_row, offset + row0 * src_row, copied)
    if len(raw) != n_rows * src_row:
        raise QuantizeError(f"Short read in tensor {src.name}: the input changed or is truncated.")
    src_type = Q(src.qtype)
    _refuse_nonfinite(np.frombuffer(raw, np.uint8), src_type, src.name, result=False)
    return tuple(raw if job.copy else _made(job, raw, row0) for job in jobs)


def _made(job: TensorJob, raw: bytes | memoryview, row0: int) -> ahead.Chunk:
    """Rows of ``job``'s input (``raw``, as stored; its first row ``row0``) in its output type."""
    n = job.src.ne[0]
    src_type = Q(job.src.qtype)
    if src_type in kernels.SOURCE_DTYPES:  # read as stored: the kernels widen exactly, fused into their loop
        values, values_type = np.frombuffer(raw, dtype=kernels.SOURCE_DTYPES[src_type]), src_type
    else:  # a quantized input (--allow-requantize), dequantized first
        values, values_type = _to_f32(raw, src_type, n).reshape(-1), Q.F32
    if job.importance is not None:
        out = _weighted(job, values, values_type, row0)
    elif job.dst_type in kernels.QUANT_TYPES:
        out = kernels.quantize_rows(values, values_type, job.dst_type)
    elif job.dst_type in kernels.UNWEIGHTED_TOO:  # Q4_1 / IQ4_NL / IQ4_XS: compiled kernels only
        if kernels.kernel_path() != "compiled":
            raise QuantizeError(f"The built-in quantizer makes {Q(job.dst_type).name} (tensor {job.src.name}) with its "
                                "compiled kernels only, which are not active; use --quantizer llama-quantize.")
        out = kernels.quantize_weighted(values, values_type, job.dst_type, n, None)
    elif job.dst_type in kernels.FLOAT_TYPES:  # ggml's roundings (numpy's astype keeps NaN payloads)
        out = kernels.round_floats(values, values_type, job.dst_type).view(np.uint8)
    elif job.dst_type == Q.F32:
        out = values if values_type == Q.F32 else _to_f32(raw, src_type, n).reshape(-1)
    else:  # the rules only plan the types above (rules.OVERRIDE_TYPES)
        raise QuantizeError(f"The built-in quantizer cannot make {Q(job.dst_type).name} (tensor {job.src.name}); "
                            "use --quantizer llama-quantize.")
    _refuse_nonfinite(out, Q(job.dst_type), job.src.name, result=True)
    return out


def _weighted(job: TensorJob, values: np.ndarray, values_type: GGMLQuantizationType, row0: int) -> np.ndarray:
    """Rows quantized with their importance weights: each expert's rows of a stack with that expert's
    (llama_tensor_quantize_impl's imatrix_for_row: row / rows per expert)."""
    assert job.importance is not None
    n = job.src.ne[0]
    per_expert = job.src.ne[1] if len(job.src.ne) > 2 else None
    rows = values.size // n
    if per_expert is None:
        return kernels.quantize_weighted(values, values_type, job.dst_type, n, job.importance)
    parts = []
    row = 0
    while row < rows:
        expert = (row0 + row) // per_expert
        take = min(rows - row, (expert + 1) * per_expert - (row0 + row))
        parts.append(kernels.quantize_weighted(values[row * n:(row + take) * n], values_type, job.dst_type, n,
                                               job.importance[expert * n:(expert + 1) * n]))
        row += take
    return np.concatenate(parts)


class _Sources:
    """Open read descriptors by path, and scratch files for spooled tensors (removed once written out)."""

    def __init__(self, gguf: InputGGUF, scratch_dir: Path) -> None:
        self.gguf, self.scratch_dir = gguf, scratch_dir
        self.fds: dict[Path, int] = {}
        self.scratch: dict[str, Path] = {}
        self._spooled = itertools.count()  # never reused: a released name must not name a file still being read

    def open(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def locate(self, t: InputTensor) -> tuple[int, int]:
        """(fd, offset) of ``t``'s bytes, spooling them into a scratch file first when they exist nowhere."""
        if t.spool is None:
            return self.open(t.path or self.gguf.path), t.offset
        path = self.scratch_dir / f".{self.gguf.path.name}.{next(self._spooled)}.spool"
        with open(path, "wb", buffering=0) as f:
            t.spool(f)
        self.scratch[t.name] = path
        return self.open(path), 0

    def release(self, t: InputTensor) -> None:
        path = self.scratch.pop(t.name, None)
        if path is not None:
            os.close(self.fds.pop(path))
            path.unlink(missing_ok=True)

    def forget(self, path: Path) -> None:
        """``path`` is read no more (a streamed shard removed): its descriptor closed, so its space is freed."""
        fd = self.fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        for path in self.scratch.values():
            path.unlink(missing_ok=True)


def _streamed(job: TensorJob) -> bool:
    """Whether the job's input streams from the page cache: bytes already on disk (a spooled tensor is made when its
    turn comes, in a scratch file deleted after it)."""
    return job.src.spool is None and job.src.nbytes > 0


def _job_key(job: TensorJob) -> tuple[object, ...]:
    """What a head start's rows must match: the input bytes (file, place, size, type, shape) and the output type."""
    src = job.src
    return (str(src.path), src.offset, src.nbytes, src.qtype, src.ne, int(job.dst_type))


def ahead_jobs(jobs: list[TensorJob], default_path: Path) -> list[ahead.AheadJob]:
    """The jobs a :class:`~.ahead.HeadStart` can begin, in the writer's order: those quantized from bytes already
    on disk (a copied or spooled tensor, small and cheap, is made when its turn comes)."""
    out = []
    for job in jobs:
        if job.copy or not _streamed(job) or job.dst_type not in kernels.QUANT_TYPES or job.importance is not None:
            continue
        n = job.src.ne[0]
        in_row = row_bytes(Q(job.src.qtype), n)
        out.append(ahead.AheadJob(_job_key(job), job.src.path or default_path, job.src.offset, in_row,
                                  job.src.nbytes // in_row, max(1, AHEAD_CHUNK_ELEMENTS // n),
                                  row_bytes(job.dst_type, n),
                                  functools.partial(_convert_rows, job)))
    return out


@dataclass(frozen=True)
class OutputPlan:
    """One file a read of the input writes: its jobs (one per input tensor, in the same order as every other
    output's), its type, and where it is written."""

    jobs: list[TensorJob]
    type_name: str
    tmp: Path
    importance: Importance | None = None  # the matrix the jobs' weights come from (its keys go in the header)
    flags: tuple[str, ...] = ()  # the per-tensor flags the jobs' types come from (recorded in the header)


class _Writing:
    """One output being written: its file, the hasher following it, and the bytes of its current tensor."""

    def __init__(self, gguf: InputGGUF, out: OutputPlan, stack: contextlib.ExitStack) -> None:
        self.plan = out
        self.f = stack.enter_context(open(out.tmp, "wb"))
        self.hasher = stack.enter_context(FollowingHasher(out.tmp))
        self.written = 0
        self.f.writelines(_header(gguf, out.jobs, out.type_name, out.importance, out.flags))

    def end_tensor(self, job: TensorJob) -> None:
        if self.written != job.dst_nbytes:
            raise QuantizeError(f"Internal error: tensor {job.src.name} produced {self.written} bytes, "
                                f"expected {job.dst_nbytes}.")
        self.f.write(bytes(pad(self.written) - self.written))
        self.written = 0
        self.f.flush()  # the follower reads the file: hand it only bytes that are in it
        self.hasher.advance(self.f.tell())

    def finish(self) -> Written:
        self.f.flush()
        size = self.f.tell()
        return Written(size, self.hasher.finish(size))


def write_quantized(gguf: InputGGUF, jobs: list[TensorJob], type_name: str, tmp: Path, threads: int | None,
                    on_progress: Callable[[int, int], None] | None = None) -> Written:
    """Write the output to ``tmp`` tensor by tensor; return its size in bytes and its sha256, hashed by a thread
    that follows the writer (see ``ggufio.hashing``), so the pipeline need not read the output again."""
    return write_outputs(gguf, [OutputPlan(jobs, type_name, tmp)], threads, on_progress)[0]


def write_outputs(gguf: InputGGUF, outputs: Sequence[OutputPlan], threads: int | None,
                  on_progress: Callable[[int, int], None] | None = None) -> list[Written]:
    """Write every output from one read of the input: each chunk of rows is read once and made into each output's
    type (several quant tags cost one read of the source, not one per tag). Returns each output's size and sha256.
    ``threads``: quantizing workers (None: this machine's cores)."""
    threads = max(1, threads or machine_cores())
    jobs_by_tensor = list(zip(*(o.jobs for o in outputs), strict=True))
    if any(len({j.src.name for j in tensor}) != 1 for tensor in jobs_by_tensor):
        raise AssertionError("every output's jobs list the input tensors in one order (llama-quantize's)")
    total = sum(tensor[0].src.nbytes for tensor in jobs_by_tensor)
    done = 0
    one = len(outputs) == 1
    # One pipeline across tensor boundaries (no drain, and so no idle worker, at the end of each
    # tensor): up to DEPTH_PER_THREAD * threads chunks in flight, written back in submission order.
    pending: deque[tuple[int, Future[tuple[ahead.Chunk, ...]] | None, bool]] = deque()
    sources = _Sources(gguf, Path(outputs[0].tmp).parent)
    reading = arrivals.Reading([tensor[0].src.reads for tensor in jobs_by_tensor])
    # dropped behind once read: the bytes already on disk (a shard still streaming in is opened when it is here)
    behind = [_streamed(t[0]) and not any(map(arrivals.pending, t[0].src.reads)) for t in jobs_by_tensor]
    try:
        ranges = [ByteRange(sources.open(t[0].src.path or gguf.path), t[0].src.offset, t[0].src.nbytes)
                  for t, drop in zip(jobs_by_tensor, behind, strict=True) if drop]
        with contextlib.ExitStack() as stack:
            files = [_Writing(gguf, o, stack) for o in outputs]
            pool = stack.enter_context(ThreadPoolExecutor(max_workers=threads))
            dropped = DropBehind(ranges)  # each input byte is read once: keep the page cache from filling

            def write_next() -> None:
                nonlocal done
                index, fut, last = pending.popleft()
                tensor = jobs_by_tensor[index]
                if fut is not None:
                    for out, chunk in zip(files, fut.result(), strict=True):
                        out.written += out.f.write(ahead.byte_view(chunk))
                if not last:
                    return
                for out, job in zip(files, tensor, strict=True):
                    out.end_tensor(job)
                src = tensor[0].src
                done += src.nbytes
                if behind[index]:
                    dropped.consumed(src.nbytes)
                sources.release(src)
                for path in reading.done(index):
                    sources.forget(path)
                if on_progress is not None:
                    on_progress(done, total)

            def drain() -> None:
                while pending:
                    write_next()

            try:
                for index, tensor in enumerate(jobs_by_tensor):
                    job = tensor[0]
                    if reading.pending(index):  # the shards behind it written out (and let go) before it waits
                        drain()
                    reading.wait(index)
                    if one and job.copy and job.src.spool is not None:  # produced straight into the output
                        drain()
                        out = files[0]
                        out.f.flush()
                        start = out.f.tell()
                        job.src.spool(out.f)
                        out.f.seek(0, os.SEEK_END)
                        out.written = out.f.tell() - start
                        pending.append((index, None, True))
                        write_next()
                        continue
                    rows_total = job.src.nbytes // max(1, row_bytes(Q(job.src.qtype), job.src.ne[0]))
                    step = max(1, CHUNK_ELEMENTS // job.src.ne[0])
                    first = 0
                    if one and _streamed(job) and (early := ahead.claim(_job_key(job))) is not None:
                        drain()
                        out = files[0]
                        out.f.flush()
                        out.written += copy_range(early.fd, 0, early.nbytes, out.f.fileno())
                        out.f.seek(0, os.SEEK_END)
                        first = early.rows
                    if first == rows_total:
                        pending.append((index, None, True))
                        if rows_total:  # a tensor the head start made whole
                            write_next()
                        continue
                    fd, offset = sources.locate(job.src)
                    for row0 in range(first, rows_total, step):
                        n_rows = min(step, rows_total - row0)
                        pending.append((index, pool.submit(_convert_chunk, fd, offset, tensor, row0, n_rows),
                                        row0 + n_rows == rows_total))
                        if len(pending) >= DEPTH_PER_THREAD * threads:  # bounded memory
                            write_next()
                drain()
            finally:
                for _, fut, _ in pending:
                    if fut is not None:
                        fut.cancel()
            return [out.finish() for out in files]
    finally:
        sources.close()


@dataclass(frozen=True)
class BuiltinOutcome:
    """What the built-in wrote: size, per-type counts and the fallbacks llama-quantize would warn about."""

    n_bytes: int
    types: dict[str, int]
    fallbacks: tuple[str, ...]
    seconds: float
    sha256: str | None = None  # of the file written, hashed while writing (None for a dry run)


def run_builtin(gguf: InputGGUF, outfile: Path, type_name: str, *, threads: int | None = None,
                allow_requantize: bool = False,
                overrides: Overrides = NO_OVERRIDES, dry_run: bool = False,
                on_progress: Callable[[int, int], None] | None = None,
                importance: Importance | None = None) -> BuiltinOutcome:
    """Plan, check space, and write ``outfile`` atomically (``<out>.partial`` renamed on success).

    Raises:
        QuantizeError: see :func:`plan_tensors`; also a GGUF alignment other than 32.
        OutputError: no space, or the output folder is missing.
    """
    return run_builtin_outputs(gguf, [(Path(outfile), type_name)], threads=threads, allow_requantize=allow_requantize,
                               overrides=overrides, dry_run=dry_run, on_progress=on_progress,
                               importance=importance)[0]


# One output of a read: (file, type), or (file, type, its own per-tensor flags) where they differ from the run's.
QuantOutput = tuple[Path, str] | tuple[Path, str, Overrides]


@dataclass(frozen=True)
class _Planned:
    """One output of :func:`run_builtin_outputs`, planned: its file, type, jobs, what it holds and its flags."""

    outfile: Path
    type_name: str
    jobs: list[TensorJob]
    types: dict[str, int]
    fallbacks: tuple[str, ...]
    size: int
    flags: tuple[str, ...]


def run_builtin_outputs(gguf: InputGGUF, outputs: Sequence[QuantOutput], *, threads: int | None = None,
                        allow_requantize: bool = False, overrides: Overrides = NO_OVERRIDES, dry_run: bool = False,
                        on_progress: Callable[[int, int], None] | None = None,
                        importance: Importance | None = None) -> list[BuiltinOutcome]:
    """:func:`run_builtin` for several (file, type) outputs from one read of the input, each the bytes a run of its
    own would write; all are written or none (each atomically, renamed once all are complete). ``importance``: the
    importance matrix, as llama-quantize --imatrix uses it (compiled kernels only). ``overrides``: every output's
    per-tensor flags, but for an output that names its own (a named recipe tag).

    Raises:
        QuantizeError, OutputError: as :func:`run_builtin`.
    """
    t0 = time.monotonic()
    if gguf.alignment != ALIGNMENT:
        raise QuantizeError(f"{gguf.path} uses general.alignment={gguf.alignment}; the built-in quantizer writes "
                            "32-byte alignment only. Use --quantizer llama-quantize.")
    planned: list[_Planned] = []
    for outfile, type_name, *own in outputs:
        rules = own[0] if own else overrides
        tensor_plan = plan_tensors(gguf, type_name, allow_requantize=allow_requantize, overrides=rules,
                                   importance=importance)
        jobs = tensor_plan.jobs
        types: dict[str, int] = {}
        for j in jobs:
            types[j.dst_type.name] = types.get(j.dst_type.name, 0) + 1
        fallbacks = tensor_plan.notes()
        for msg in fallbacks:
            log.warning("%s", msg)
        flags = tuple(rules.args())
        size = sum(map(len, _header(gguf, jobs, type_name, importance, flags))) + sum(pad(j.dst_nbytes) for j in jobs)
        planned.append(_Planned(Path(outfile), type_name, jobs, types, tuple(fallbacks), size, flags))
    if dry_run:
        return [BuiltinOutcome(p.size, p.types, p.fallbacks, time.monotonic() - t0) for p in planned]
    for folder in {p.outfile.parent for p in planned}:  # all of a folder's outputs at once
        check_free_space(next(p.outfile for p in planned if p.outfile.parent == folder),
                         sum(p.size for p in planned if p.outfile.parent == folder))
    with contextlib.ExitStack() as stack:
        plans = [OutputPlan(p.jobs, p.type_name, stack.enter_context(atomic_output(p.outfile)), importance, p.flags)
                 for p in planned]
        written = write_outputs(gguf, plans, threads, on_progress)
    seconds = time.monotonic() - t0
    return [BuiltinOutcome(w.n_bytes, p.types, p.fallbacks, seconds, w.sha256)
            for p, w in zip(planned, written, strict=True)]


def quantize_plan(plan: GGUFPlan, outfile: Path, type_name: str, *, threads: int | None = None,
                  overrides: Overrides = NO_OVERRIDES, dry_run: bool = False,
                  on_progress: Callable[[int, int], None] | None = None,
                  more: Sequence[QuantOutput] = (), importance: Importance | None = None) -> list[BuiltinOutcome]:
    """Convert and quantize in one pass: the bytes of converting ``plan`` and then quantizing that file, to
    ``outfile`` and to each further (file, type) of ``more`` from the same read.

    No intermediate GGUF is written; only a tensor that exists nowhere on disk in its converted form (and
    must be quantized) is spooled to a scratch file beside ``outfile``, one at a time.

    Raises:
        QuantizeError, OutputError: as :func:`run_builtin`.
    """
    return run_builtin_outputs(input_from_plan(plan, Path(outfile)), [(Path(outfile), type_name), *more],
                               threads=threads, overrides=overrides, dry_run=dry_run, on_progress=on_progress,
                               importance=importance)
