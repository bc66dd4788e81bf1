"""A quantization-robust fingerprint of a target's token embedding, small enough for one GGUF string key.

Why: QAT and other re-trained targets share config and tokenizer with the model a drafter was trained
on, so only the weights tell them apart. The converter records the fingerprint of the target it was
given (key ``dflash_gguf.target.embd_fingerprint``); verify recomputes it from the target GGUF's
``token_embd`` (only the sampled rows are read) and compares row by row with cosine similarity,
which Q8_0/Q4_0/Q6_K rounding barely moves.

Format ``efp1:<n_vocab>x<n_embd>:r<rows>:p<proj>:<base64 of float16 LE [rows, proj]>``: rows are
``sample_rows(n_vocab, rows)``; each row is L2-normalised, then projected on ``proj`` pseudo-random
+-1/sqrt(proj) vectors from a fixed integer hash (no RNG whose stream could change between numpy versions).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

import numpy as np

PREFIX = "efp1"
N_ROWS = 32
N_PROJ = 64
_RE = re.compile(r"^efp1:(\d+)x(\d+):r(\d+):p(\d+):([A-Za-z0-9+/=]+)$")


@dataclass(frozen=True)
class Fingerprint:
    n_vocab: int
    n_embd: int
    values: np.ndarray  # float32 [rows, proj]


def sample_rows(n_vocab: int, n_rows: int = N_ROWS) -> list[int]:
    """Evenly spread row ids, away from both ends (special tokens cluster there)."""
    n = min(n_rows, n_vocab)
    return sorted({(2 * i + 1) * n_vocab // (2 * n) for i in range(n)})


def _signs(n_embd: int, n_proj: int) -> np.ndarray:
    """[n_embd, n_proj] of +-1/sqrt(n_proj) from splitmix64 of the element index."""
    x = np.arange(n_embd * n_proj, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    bits = (x & np.uint64(1)).astype(np.float32)
    return ((bits * 2 - 1) / np.sqrt(n_proj)).reshape(n_embd, n_proj)


def compute(rows: np.ndarray, n_vocab: int, n_proj: int = N_PROJ) -> Fingerprint:
    """Fingerprint of the sampled embedding ``rows`` ([len(sample_rows(n_vocab)), n_embd], any float)."""
    rows = np.asarray(rows, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    unit = rows / np.where(norms > 0, norms, 1)
    return Fingerprint(n_vocab, rows.shape[1], (unit @ _signs(rows.shape[1], n_proj)).astype(np.float32))


def encode(fp: Fingerprint) -> str:
    """The string the converter stores under ``dflash_gguf.target.embd_fingerprint``."""
    r, p = fp.values.shape
    payload = base64.b64encode(fp.values.astype("<f2").tobytes()).decode()
    return f"{PREFIX}:{fp.n_vocab}x{fp.n_embd}:r{r}:p{p}:{payload}"


def decode(text: str) -> Fingerprint | None:
    """Parse a stored fingerprint; None when it is not one we understand."""
    m = _RE.match(text.strip()) if isinstance(text, str) else None
    if not m:
        return None
    n_vocab, n_embd, r, p = (int(g) for g in m.groups()[:4])
    try:
        raw = base64.b64decode(m.group(5), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) != r * p * 2 or r == 0 or p == 0:
        return None
    return Fingerprint(n_vocab, n_embd, np.frombuffer(raw, dtype="<f2").astype(np.float32).reshape(r, p))


def row_cosines(a: Fingerprint, b: Fingerprint) -> np.ndarray:
    """Cosine similarity per sampled row (the projections preserve angles up to ~1/sqrt(proj))."""
    na = np.linalg.norm(a.values, axis=1)
    nb = np.linalg.norm(b.values, axis=1)
    denom = np.where(na * nb > 0, na * nb, 1)
    return (a.values * b.values).sum(axis=1) / denom
