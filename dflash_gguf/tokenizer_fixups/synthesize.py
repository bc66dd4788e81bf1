"""Build a SentencePiece ``tokenizer.model`` from a Hugging Face ``tokenizer.json``.

Gemma-4 ships only tokenizer.json; SentencePiece-first tools need tokenizer.model. Copying Gemma-3's
file "fixes" the error but puts other strings in the chat slots, so we rebuild the
file from the target's own tokenizer.json instead. Only the SentencePiece-derived layout converts
exactly: BPE with byte fallback, spaces turned into U+2581 by the normalizer, no other pre-tokenizer.

How each field is chosen (the inverse of transformers' ``SpmConverter``, which wrote these files):

* piece: the string at that id (base vocab, then ``added_tokens``).
* type: SentencePiece must encode text as tokenizers does. With default settings (the HF chat path:
  ``apply_chat_template`` renders text, then encodes it with ``add_special_tokens=False``) tokenizers
  matches every added token in text, flagged ``special`` or not; SentencePiece matches USER_DEFINED
  pieces (leftmost-longest, never merged with neighbours) and never CONTROL ones. So every added
  token is USER_DEFINED: ``<|turn>``, ``<|tool_call>``, ``<|"|>``, ``<|channel>``, ``<mask>``... encode to
  the same ids, as in Gemma's own tokenizer.model files. Exceptions: the model's ``unk_token`` is
  UNKNOWN, and the added tokens tokenizer_config.json names ``bos_token``/``eos_token``/``pad_token``
  are CONTROL, also as in Gemma's files (SentencePiece refuses a bos/eos/pad id that is not CONTROL;
  ``add_bos``/``add_eos`` emit them and decoding drops them). Without tokenizer_config.json no token is
  known as bos/eos/pad: all added tokens are USER_DEFINED and the file has no bos id. ``<0xNN>`` pieces
  are BYTE; the rest NORMAL. Added tokens SentencePiece cannot match alike (lstrip/rstrip/single_word,
  spaces, or the Llama ``Prepend`` normalizer, which tokenizers reapplies after each one) get a note.
* type, literal ``<bos>`` (or ``<eos>``, ``<pad>``, ``<unk>``) in text: the one deliberate divergence.
  tokenizers turns the string into the token, SentencePiece spells it out as text (``<``, ``bos``,
  ``>``), like ``encode_special_tokens``. Matching it would need a non-CONTROL bos piece, which
  SentencePiece refuses, and would let a literal "<bos>" in user content act as a sequence start.
  Chat templates render ``{{ bos_token }}`` first: a SentencePiece caller drops that prefix and encodes
  the rest with ``add_bos=True``, which gives exactly the ids tokenizers gives for the rendered prompt.
* type, as llama.cpp b11434 reads it (``TextModel._create_vocab_sentencepiece``): UNKNOWN, CONTROL and
  BYTE pieces keep their type in the GGUF; USER_DEFINED pieces become NORMAL (it has no USER_DEFINED
  branch). Then each token listed in tokenizer_config.json's ``added_tokens_decoder`` is re-typed:
  CONTROL if flagged ``special`` or shaped like a special (``<|...|>``, ``<mask>``, ``<unused...>``), else
  USER_DEFINED. The overlay copies the target's tokenizer_config.json, so added tokens get the types
  it gives them whatever this file says, exactly as with Gemma's own tokenizer.model (whose chat pieces
  are USER_DEFINED too); for a table flagging every added token ``special`` (the Gemma-4 fixture's),
  CONTROL for bos/eos/pad/unk and for every chat/tool marker. b11434's Gemma-4 architecture never reads
  this file: it reads tokenizer.json and forces seven chat/tool markers (``<|tool_call>``, ``<|"|>``,
  ``<|channel>``...) to USER_DEFINED, which no tokenizer.model can reproduce through this path.
* score: SentencePiece BPE merges the adjacent pair whose *result* has the highest score, tokenizers
  the pair with the lowest merge rank; so a piece scores ``-rank`` of the first merge producing it.
  Pieces no merge produces score below all merges (``-(n_merges + id)``); only merge results matter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb

from ..errors import TokenizerError
from ..hf_configs import parse_tokenizer_json
from ..jsonfile import array_runs, read_json

WS = "\u2581"  # SentencePiece's visible space
# SentencePiece names its byte-fallback pieces <0xAB>, upper case only (a lower-case one is an ordinary piece).
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")

# tokenizer.json model types we refuse, each with the reason a tokenizer.model cannot stand in for it.
_REFUSED_MODELS = {
    "Unigram": "a Unigram model needs SentencePiece's unigram lattice and its log-probability scores; only BPE "
               "is supported here",
    "WordPiece": "WordPiece (BERT-style) has no SentencePiece equivalent",
    "WordLevel": "WordLevel (whole-word lookup) has no SentencePiece equivalent",
}


@dataclass(frozen=True)
class TokenizerJsonVocab:
    """What a tokenizer.json says about each id, in SentencePiece terms."""

    path: Path
    pieces: tuple[str, ...]
    types: tuple[str, ...]  # NORMAL / CONTROL / USER_DEFINED / BYTE / UNKNOWN
    scores: tuple[float, ...]
    add_dummy_prefix: bool
    special_ids: dict[str, int] = field(default_factory=dict)  # unk/bos/eos/pad -> id
    notes: tuple[str, ...] = ()

    @property
    def n_tokens(self) -> int:
        return len(self.pieces)


def load_tokenizer_json(path: Path) -> dict[str, Any]:
    """Parse tokenizer.json, the source tokenizer.model is rebuilt from.

    Raises:
        TokenizerError: missing, truncated, not JSON, or not a tokenizers file.
    """
    return parse_tokenizer_json(path, missing=f"{path} does not exist. Download the target's tokenizer.json; it is "
                               "the source tokenizer.model is rebuilt from and compared against.")


def _normalizer_dummy_prefix(path: Path, normalizer: dict[str, Any] | None) -> bool:
    """True for Llama-style ``Prepend("▁") + Replace(" ", "▁")``, False for Gemma's bare Replace."""
    def is_replace(n: dict[str, Any]) -> bool:
        return n.get("type") == "Replace" and n.get("pattern") == {"String": " "} and n.get("content") == WS

    if normalizer is not None:
        if is_replace(normalizer):
            return False
        steps = normalizer.get("normalizers") if normalizer.get("type") == "Sequence" else None
        if steps and len(steps) == 1 and is_replace(steps[0]):
            return False
        if steps and len(steps) == 2 and steps[0] == {"type": "Prepend", "prepend": WS} and is_replace(steps[1]):
            return True
    raise TokenizerError(
        f"{path}: normalizer {json.dumps(normalizer)[:200]} is not the SentencePiece layout (Replace(' ', '{WS}'), "
        "optionally after Prepend('{WS}')). Other normalizers need a compiled SentencePiece charsmap that cannot be "
        "derived from tokenizer.json; no tokenizer.model is synthesized for this target."
    )


def _check_pre_tokenizer(path: Path, pre: dict[str, Any] | None) -> None:
    # After Replace(" ", "▁") no plain space is left, so Gemma's Split(" ") never fires: a no-op.
    if pre is None or (pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}):
        return
    raise TokenizerError(
        f"{path}: pre-tokenizer {pre.get('type')!r} splits text before BPE (e.g. byte-level GPT-2 style), which "
        "SentencePiece cannot reproduce. Such models are read from tokenizer.json directly (llama.cpp b11434 does); "
        "no tokenizer.model is synthesized."
    )


def _merge_results(path: Path, merges: Any) -> Iterator[list[str]]:
    """What each merge produces (left + right), in rank order, a run of the array at a time."""
    for run in array_runs(merges):
        if all(type(m) is str and " " in m for m in run):  # "left right": drop the first space
            yield [m.replace(" ", "", 1) for m in run]
            continue
        for m in run:
            if isinstance(m, str):
                if " " not in m:
                    raise TokenizerError(f"{path}: merge {m!r} is not 'left right'. Re-download tokenizer.json.")
            elif not (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)):
                raise TokenizerError(f"{path}: merge {m!r} is not a pair of strings. Re-download tokenizer.json.")
        yield [m.replace(" ", "", 1) if isinstance(m, str) else m[0] + m[1] for m in run]


def _named_special(tok_dir: Path, pieces: dict[str, int]) -> dict[str, int]:
    """bos/eos/pad ids from tokenizer_config.json (plain or {"content": ...} values), if present there."""
    found: dict[str, int] = {}
    cfg_path = tok_dir / "tokenizer_config.json"
    if not cfg_path.is_file():
        return found
    try:
        cfg = read_json(cfg_path)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{cfg_path} is corrupt ({e!r}). Re-download it.") from None
    for name in ("bos", "eos", "pad"):
        value = cfg.get(f"{name}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value in pieces:
            found[name] = pieces[value]
    return found


def _pieces_by_id(path: Path, data: dict[str, Any]) -> tuple[list[str], dict[int, dict[str, Any]], int]:
    """(piece per id, {added id: its ``added_tokens`` entry}, base vocab size), refusing gaps and duplicates."""
    by_id: dict[int, str] = {}
    try:
        for piece, i in data["model"]["vocab"].items():
            by_id[int(i)] = piece
        n_base = len(by_id)
        added: dict[int, dict[str, Any]] = {}
        for tok in data.get("added_tokens") or []:
            i, content = int(tok["id"]), tok["content"]
            if by_id.get(i, content) != content:
                raise TokenizerError(f"{path}: added token {content!r} reuses id {i} of {by_id[i]!r}. "
                                     "Re-download it.")
            by_id[i] = content
            added[i] = tok
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise TokenizerError(f"{path}: vocabulary is malformed ({e!r}). Re-download tokenizer.json.") from None
    n = max(by_id) + 1 if by_id else 0
    missing = [i for i in range(n) if i not in by_id]
    if not n or missing:
        raise TokenizerError(f"{path}: token ids are not contiguous (first missing id {missing[:1] or [0]}); "
                             "a SentencePiece model needs one piece per id. Re-download tokenizer.json.")
    pieces = [by_id[i] for i in range(n)]
    seen: dict[str, int] = {}
    for i, p in enumerate(pieces):
        if p in seen or not isinstance(p, str) or not p:
            raise TokenizerError(f"{path}: piece {p!r} appears at ids {seen.get(p)} and {i} (or is empty); "
                                 "SentencePiece needs unique pieces. Re-download tokenizer.json.")
        seen[p] = i
    return pieces, added, n_base


def _matching_notes(added: dict[int, dict[str, Any]], user_defined: list[int], add_dummy_prefix: bool) -> list[str]:
    """Where SentencePiece's USER_DEFINED matching (exact piece, leftmost-longest, in the normalized text)
    cannot follow tokenizers' added-token matching; text near such tokens may tokenize differently."""
    notes = []
    odd = [added[i]["content"] for i in user_defined
           if any(added[i].get(k) for k in ("lstrip", "rstrip", "single_word"))
           or " " in added[i]["content"] or (WS in added[i]["content"] and not added[i].get("normalized"))]
    if odd:
        notes.append(f"{len(odd)} added tokens (first {odd[0]!r}) use lstrip/rstrip/single_word or spaces, which "
                     "SentencePiece cannot match as tokenizers does: text around them may tokenize differently")
    if add_dummy_prefix and user_defined:
        notes.append(f"the Prepend('{WS}') normalizer: tokenizers also prepends {WS} after each added token it "
                     "matches in text, SentencePiece only at the start: text with added tokens inline differs")
    return notes


def tokenizer_json_pieces(path: Path) -> list[str]:
    """The string at every id of tokenizer.json (base vocab plus added tokens), for id-by-id checks.

    Raises:
        TokenizerError: corrupt file, gaps or duplicate pieces.
    """
    return _pieces_by_id(Path(path), load_tokenizer_json(path))[0]


def read_tokenizer_json(path: Path) -> TokenizerJsonVocab:
    """Read what tokenizer.json implies for every id, refusing layouts SentencePiece cannot mirror.

    Raises:
        TokenizerError: corrupt file, refused model type or normalizer, ids with gaps or duplicates.
    """
    path = Path(path)
    data = load_tokenizer_json(path)
    model = data["model"]
    kind = model.get("type", "BPE" if "merges" in model else None)
    if kind in _REFUSED_MODELS:
        raise TokenizerError(f"{path}: model type {kind}: {_REFUSED_MODELS[kind]}. No tokenizer.model is synthesized.")
    if kind != "BPE":
        raise TokenizerError(f"{path}: unknown model type {kind!r}; only BPE with byte_fallback is supported.")
    if not model.get("byte_fallback"):
        raise TokenizerError(
            f"{path}: BPE without byte_fallback (byte-level GPT-2/Qwen/Llama-3 style) has no SentencePiece "
            "equivalent; those models need no tokenizer.model (llama.cpp b11434 reads tokenizer.json)."
        )
    if model.get("dropout") or model.get("ignore_merges") or model.get("continuing_subword_prefix") \
            or model.get("end_of_word_suffix"):
        raise TokenizerError(f"{path}: BPE options dropout/ignore_merges/continuing_subword_prefix/end_of_word_suffix "
                             "change tokenization in ways SentencePiece cannot express; refusing to synthesize.")
    add_dummy_prefix = _normalizer_dummy_prefix(path, data.get("normalizer"))
    _check_pre_tokenizer(path, data.get("pre_tokenizer"))

    pieces, added, n_base = _pieces_by_id(path, data)
    index = {p: i for i, p in enumerate(pieces)}
    unk = model.get("unk_token")
    if unk not in index:
        raise TokenizerError(f"{path}: unk_token {unk!r} is not in the vocabulary; SentencePiece requires one "
                             "UNKNOWN piece. Re-download tokenizer.json.")

    first_rank = [-1] * len(pieces)  # by id: the rank of the first merge producing the piece, -1 for none
    n_merges = 0
    for results in _merge_results(path, model.get("merges")):
        for rank, i in enumerate(map(index.get, results), start=n_merges):
            if i is not None and first_rank[i] < 0:
                first_rank[i] = rank
        n_merges += len(results)
    named = _named_special(path.parent, index)  # bos/eos/pad, as tokenizer_config.json names them
    reserved = {i for i in named.values() if i in added and i != index[unk]}
    types: list[str] = []
    scores: list[float] = []
    unreachable = 0
    for i, p in enumerate(pieces):
        if i == index[unk]:
            types.append("UNKNOWN")
        elif i in reserved:
            types.append("CONTROL")
        elif i in added:
            types.append("USER_DEFINED")  # special or not: tokenizers matches it in text, so must SentencePiece
        elif i < n_base and _BYTE_PIECE.fullmatch(p):
            types.append("BYTE")
        else:
            types.append("NORMAL")
        if types[-1] != "NORMAL":
            scores.append(0.0)
        elif first_rank[i] >= 0:
            scores.append(-float(first_rank[i]))
        else:
            unreachable += len(p) > 1
            scores.append(-float(n_merges + i))
    n_bytes = types.count("BYTE")
    if n_bytes != 256:
        raise TokenizerError(f"{path}: byte_fallback is on but {n_bytes} of the 256 <0xNN> pieces exist. "
                             "Re-download tokenizer.json.")
    notes = [f"{unreachable} multi-character NORMAL pieces are produced by no merge (scored below every merge)"] \
        if unreachable else []
    notes += _matching_notes(added, [i for i, t in enumerate(types) if t == "USER_DEFINED"], add_dummy_prefix)
    special = {"unk": index[unk], **named}
    return TokenizerJsonVocab(path, tuple(pieces), tuple(types), tuple(scores), add_dummy_prefix, special,
                              tuple(notes))


def build_model_proto(vocab: TokenizerJsonVocab) -> bytes:
    """Serialize ``vocab`` as a SentencePiece ModelProto (BPE, byte fallback, identity normalization).

    Raises:
        TokenizerError: SentencePiece rejects the result.
    """
    m = pb.ModelProto()
    SP = pb.ModelProto.SentencePiece
    for piece, kind, score in zip(vocab.pieces, vocab.types, vocab.scores, strict=True):
        m.pieces.add(piece=piece, score=score, type=getattr(SP, kind))
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE
    t.vocab_size = vocab.n_tokens
    t.byte_fallback = True
    t.split_digits = False
    t.allow_whitespace_only_pieces = True
    t.treat_whitespace_as_suffix = False
    ids = vocab.special_ids
    t.unk_id, t.unk_piece = ids["unk"], vocab.pieces[ids["unk"]]
    for name in ("bos", "eos", "pad"):
        i = ids.get(name, -1)
        # SentencePiece only accepts CONTROL pieces for bos/eos/pad; otherwise leave the slot unset.
        if i >= 0 and vocab.types[i] != "CONTROL":
            i = -1
        setattr(t, f"{name}_id", i)
        if i >= 0:
            setattr(t, f"{name}_piece", vocab.pieces[i])
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.precompiled_charsmap = b""
    ns.add_dummy_prefix = vocab.add_dummy_prefix
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    data = m.SerializeToString()
    try:
        spm.SentencePieceProcessor(model_proto=data)
    except (RuntimeError, OSError) as e:
        raise TokenizerError(f"SentencePiece rejected the model synthesized from {vocab.path}: {e}") from None
    return data


def synthesize_tokenizer_model(tokenizer_json: Path) -> tuple[bytes, TokenizerJsonVocab]:
    """tokenizer.json -> (tokenizer.model bytes, what was read). Writes nothing.

    Raises:
        TokenizerError: see ``read_tokenizer_json`` and ``build_model_proto``.
    """
    vocab = read_tokenizer_json(tokenizer_json)
    return build_model_proto(vocab), vocab
