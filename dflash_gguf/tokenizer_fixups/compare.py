"""Compare a tokenizer.model with the target's tokenizer.json, id by id.

A donor file of the right size can still hold other strings in the chat and tool slots (Gemma-3's
``<start_of_turn>`` where Gemma-4 has ``<|turn>``), so every id is compared, not
just the count. Only pieces are compared: piece types are a SentencePiece-side choice (a faithful
file may call ``<|tool_call>`` CONTROL or USER_DEFINED) and do not change what an id means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2 as pb

from ..errors import TokenizerError

SHOWN_DIFFS = 10
# Ids whose strings differ between Gemma generations (chat, tool, turn markers; b11434 ggml-vocab-gemma-4.gguf):
# always shown when they differ, even past the first SHOWN_DIFFS.
KEY_IDS = frozenset([*range(7), *range(46, 53), 98, 100, 101, 105, 106, 107, 212])


@dataclass(frozen=True)
class PieceDiff:
    """How a tokenizer.model's pieces differ from tokenizer.json's (empty ``first`` = identical)."""

    n_model: int
    n_json: int
    n_differing: int  # ids whose piece differs, counting ids present on one side only
    first: tuple[tuple[int, str | None, str | None], ...]  # (id, model piece, json piece)

    @property
    def matches(self) -> bool:
        return self.n_differing == 0

    def lines(self, label: str = "donor") -> list[str]:
        """``105: '<start_of_turn>' (donor) vs '<|turn>' (target)`` for each shown id."""
        def show(p: str | None) -> str:
            return "(none)" if p is None else repr(p)

        return [f"{i}: {show(a)} ({label}) vs {show(b)} (target)" for i, a, b in self.first]

    def summary(self, label: str = "donor") -> str:
        if self.matches:
            return f"all {self.n_json} ids match"
        sizes = f" ({self.n_model} pieces vs {self.n_json} tokens)" if self.n_model != self.n_json else ""
        return f"{self.n_differing} ids differ{sizes}; first differing ids: " + "; ".join(self.lines(label))


def load_model_pieces(data: bytes, where: str) -> list[str]:
    """Pieces of a serialized SentencePiece model, checked by SentencePiece itself.

    Raises:
        TokenizerError: empty, truncated or not a SentencePiece model.
    """
    model = pb.ModelProto()
    problem = None
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError) as e:
        problem = str(e) or type(e).__name__
    if problem is None and not model.pieces:
        problem = "it holds no pieces"
    if problem is None:
        try:
            spm.SentencePieceProcessor(model_proto=data)
        except (RuntimeError, OSError) as e:
            problem = f"SentencePiece refuses it: {e}"
    if problem is not None:
        raise TokenizerError(f"{where} is corrupt, truncated or not a SentencePiece model ({problem}). "
                             "Re-download it, or omit it to synthesize one from tokenizer.json.")
    return [p.piece for p in model.pieces]


def diff_pieces(model_pieces: list[str], json_pieces: list[str] | tuple[str, ...]) -> PieceDiff:
    """Every id whose piece differs (including ids only one side has)."""
    n = max(len(model_pieces), len(json_pieces))
    differing: list[tuple[int, str | None, str | None]] = []
    count = 0
    for i in range(n):
        a = model_pieces[i] if i < len(model_pieces) else None
        b = json_pieces[i] if i < len(json_pieces) else None
        if a != b:
            count += 1
            if len(differing) < SHOWN_DIFFS or i in KEY_IDS:
                differing.append((i, a, b))
    return PieceDiff(len(model_pieces), len(json_pieces), count, tuple(differing))


def read_model_file(path: Path) -> bytes:
    """Bytes of a tokenizer.model on disk.

    Raises:
        TokenizerError: the file cannot be read.
    """
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise TokenizerError(f"Cannot read {path}: {e.strerror or e}. Check the path and permissions.") from None
