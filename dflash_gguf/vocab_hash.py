"""Our vocabulary hash, recorded in every drafter we write (``target.vocab_sha256``) and recomputed by verify on
any GGUF, so a drafter and a target are compared by what their tokenizers say, whoever wrote the files."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

VOCAB_HASH_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")  # gguf Keys.Tokenizer


def vocab_sha256(get: Callable[[str], Any]) -> str:
    """Our vocabulary hash (recorded in ``target.vocab_sha256``): the token list, token types and merges as
    JSON, read through ``get`` (``GGUFPlan.get`` while writing, ``GGUFMeta.get`` while verifying)."""
    h = hashlib.sha256()
    for key in VOCAB_HASH_KEYS:
        for piece in _json_pieces(get(key)):
            h.update(piece.encode())
    return h.hexdigest()


def _json_pieces(value: Any, run: int = 1 << 16) -> Iterator[str]:
    """``json.dumps(value, ensure_ascii=False)`` in pieces: 515k merges never become one 100 MB string."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        yield json.dumps(value, ensure_ascii=False)
        return
    yield "["
    for start in range(0, len(value), run):
        if start:
            yield ", "
        yield json.dumps(value[start:start + run], ensure_ascii=False)[1:-1]
    yield "]"
