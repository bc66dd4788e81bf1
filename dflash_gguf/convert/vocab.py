"""The target's vocabulary, embedded in the drafter GGUF as llama.cpp b11434 embeds it.

b11434's DFlash converter runs the *target* architecture's ``set_vocab`` on the target dir with
the *drafter's* hparams (convert_hf_to_gguf.py DFlashModel.set_vocab). Which path an architecture takes is
the target families' rows (``convert.targets``); the paths are mirrored here without transformers:

* Gemma-4 (``Gemma4Model.set_vocab``): tokenizer.json only (BPE + byte fallback), model
  ``gemma4``, scores -1000, CONTROL for the tokenizer's declared special tokens, BYTE for
  ``<0xNN>``, seven chat/tool markers forced USER_DEFINED, no padding.
* GPT-2 BPE (``_set_vocab_gpt2``, for Qwen2/Qwen3/Qwen3.5/Llama-3 and the other ``TextModel.set_vocab``
  targets of those rows): model ``gpt2``, ``pre`` from b11434's whole fingerprint table
  (``pre_tokenizers``), ``[PAD{i}]`` rows up to the drafter's ``vocab_size``.
* SentencePiece (``_set_vocab_sentencepiece``) when a Qwen2/Qwen3/Llama target ships a tokenizer.model.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFValueType, TokenType
from sentencepiece import SentencePieceProcessor
from tokenizers import Tokenizer

from ..errors import NotCoveredError, TokenizerError
from ..ggufio import GGUFPlan, StringArray
from ..ggufio.writer import KeyValue
from ..hf_configs import parse_tokenizer_json
from ..jsonfile import read_json, release_freed_memory
from ..vocab_hash import vocab_sha256
from .configs import TargetConfig
from .pre_tokenizers import PRE_TOKENIZERS
from .special_vocab import read_special_tokens, source_files

# Tokens b11434 forces to USER_DEFINED for Gemma-4 so the chat parser sees them (conversion/gemma.py).
GEMMA4_VISIBLE = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", '<|"|>'}

# The fixed text b11434 tokenizes to fingerprint a BPE pre-tokenizer (TextModel.get_vocab_base_pre).
CHKTXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
# A byte token as b11434 recognises one in a vocabulary (either case; conversion/xverse.py and the tokenizers
# BPE byte fallback). SentencePiece's own byte pieces are upper case only (tokenizer_fixups.synthesize).
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class VocabInfo:
    """What was embedded, for the summary and the provenance keys."""

    model: str
    n_tokens: int
    sha256: str  # of the token list, types and merges, for pairing checks


def _load_tokenizer_json(tok_dir: Path) -> dict[str, Any]:
    has_model = (tok_dir / "tokenizer.model").is_file()
    return parse_tokenizer_json(tok_dir / "tokenizer.json", missing=(
        f"Target {tok_dir} has no tokenizer.json{' (only tokenizer.model)' if has_model else ''}. The drafter "
        "GGUF embeds the target's vocabulary, which llama.cpp b11434 reads from tokenizer.json for this "
        "architecture. Download the target's tokenizer files (tokenizer.json, tokenizer_config.json)."))


def _declared_specials(tok_dir: Path) -> set[str]:
    """Strings transformers reports in ``all_special_tokens`` for this dir (the named tokens plus
    additional/extra special tokens from tokenizer_config.json and special_tokens_map.json)."""
    found: set[str] = set()

    def collect(value: Any) -> None:
        if isinstance(value, str):
            found.add(value)
        elif isinstance(value, dict):
            if isinstance(value.get("content"), str):
                found.add(value["content"])
            else:
                for v in value.values():
                    collect(v)
        elif isinstance(value, list):
            for v in value:
                collect(v)

    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = tok_dir / name
        if not path.is_file():
            continue
        cfg = read_json(path)
        for key in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
            collect(cfg.get(f"{key}_token"))
        collect(cfg.get("additional_special_tokens"))
        collect(cfg.get("extra_special_tokens"))
    return found


@dataclass(frozen=True)
class _BuiltVocab:
    """A vocabulary's metadata as a builder added it, and what it was built from."""

    key: tuple[Any, ...]  # the builder, its parameters, and the digest of the files it read
    kvs: tuple[tuple[str, KeyValue], ...]
    info: VocabInfo


_last_built: _BuiltVocab | None = None


def _inputs_digest(tok_dir: Path) -> bytes:
    """sha256 over the names and bytes of every file a vocabulary builder reads (see ``source_files``)."""
    h = hashlib.sha256()
    for path in source_files(tok_dir):
        h.update(path.name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"\0absent")
        h.update(b"\0")
    return h.digest()


def _built_once(build: Callable[..., VocabInfo], plan: GGUFPlan, tok_dir: Path, *params: Any) -> VocabInfo:
    """Run ``build(plan, tok_dir, *params)``, or add what its last run with the same files and parameters added.

    Why: one pipeline run builds the target's vocabulary three times (the drafter check, the target, the drafter
    embedding it), the first from the target folder and the others from the tokenizer overlay's copy; at Gemma-4's
    262k tokens and 515k merges each build is seconds of one core with the disk waiting. The last build is kept
    (its string arrays packed, ~35 MB at that size), keyed by the bytes of the files it read, so an edited or
    different tokenizer is built afresh; errors are never kept."""
    global _last_built
    key = (build.__name__, params, _inputs_digest(tok_dir))
    if _last_built is None or _last_built.key != key:
        _last_built = None  # the old one's memory goes before the new one is built
        scratch = GGUFPlan("")
        info = build(scratch, tok_dir, *params)
        kvs = tuple((k, _packed(kv)) for k, kv in scratch.kv.items() if k != "general.architecture")
        _last_built = _BuiltVocab(key, kvs, info)
    for k, kv in _last_built.kvs:  # lists copied: a plan may edit its own, never the kept one
        plan.add(k, kv.vtype, list(kv.value) if isinstance(kv.value, list) else kv.value, kv.subtype)
    return _last_built.info


def _packed(kv: KeyValue) -> KeyValue:
    """A string array kept as its GGUF encoding (the same bytes when written, a fifth of the memory)."""
    if kv.vtype == GGUFValueType.ARRAY and kv.subtype == GGUFValueType.STRING:
        return KeyValue(kv.vtype, StringArray.of(kv.value), kv.subtype)
    return kv


def forget_built() -> None:
    """Drop the kept vocabulary (the run that needed it is over)."""
    global _last_built
    _last_built = None


def add_gemma4_vocab(plan: GGUFPlan, tok_dir: Path) -> VocabInfo:
    """b11434 ``Gemma4Model.set_vocab`` (built once per set of files, see :func:`_built_once`)."""
    return _built_once(_build_gemma4_vocab, plan, tok_dir)


def _build_gemma4_vocab(plan: GGUFPlan, tok_dir: Path) -> VocabInfo:
    tj = _load_tokenizer_json(tok_dir)
    model = tj["model"]
    decoder = (tj.get("decoder") or {}).get("type")
    if model.get("type") != "BPE" or not model.get("byte_fallback") or decoder != "Sequence":
        raise TokenizerError(f"{tok_dir / 'tokenizer.json'}: a Gemma-4 tokenizer must be BPE with byte_fallback "
                             "and a Sequence decoder, as llama.cpp b11434's Gemma-4 path requires. Re-download it.")
    base: dict[str, int] = model["vocab"]
    n_base = len(base)
    full = {**base, **{t["content"]: t["id"] for t in tj.get("added_tokens", [])}}
    reverse = {i: s for s, i in full.items()}
    names = _declared_specials(tok_dir)
    special_ids = {full[s] for s in names if s in full}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_base):
        text = reverse.get(i)
        if text is None:
            raise TokenizerError(f"{tok_dir / 'tokenizer.json'}: id {i} has no token. Re-download it.")
        tokens.append(text)
        if _BYTE_PIECE.fullmatch(text):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.CONTROL if i in special_ids else TokenType.NORMAL)
    del full, reverse  # ~20 MB at 262k tokens, not needed while the merges are packed
    for t in sorted((t for t in tj.get("added_tokens", []) if t["id"] >= n_base), key=lambda t: t["id"]):
        tokens.append(t["content"])
        types.append(TokenType.CONTROL if t["content"] in names else TokenType.USER_DEFINED)
    types = [TokenType.USER_DEFINED if tok in GEMMA4_VISIBLE else ty for tok, ty in zip(tokens, types, strict=True)]

    plan.add_string("tokenizer.ggml.model", "gemma4")
    plan.add_array("tokenizer.ggml.tokens", tokens)
    plan.add_array("tokenizer.ggml.scores", [-1000.0] * len(tokens))
    plan.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    read_special_tokens(tok_dir).add_to(plan)
    plan.add_bool("tokenizer.ggml.add_space_prefix", False)
    plan.add_bool("tokenizer.ggml.add_bos_token", True)
    return VocabInfo("gemma4", len(tokens), vocab_sha256(plan.get))


def _looks_special(token: str) -> bool:
    """Added tokens b11434 types CONTROL even when not flagged special (TextModel.does_token_look_special)."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def add_bpe_vocab(plan: GGUFPlan, tok_dir: Path, vocab_size: int) -> VocabInfo:
    """b11434 ``_set_vocab_gpt2`` padded to ``vocab_size`` (built once per set of files, see :func:`_built_once`)."""
    return _built_once(_build_bpe_vocab, plan, tok_dir, vocab_size)


@dataclass(frozen=True)
class _TokenizerFacts:
    """What b11434's BPE vocabulary needs from a running tokenizer (``AutoTokenizer`` there, ``tokenizers`` here)."""

    vocab: dict[str, int]  # get_vocab(with_added_tokens=True)
    chkhsh: str  # get_vocab_base_pre's fingerprint: sha256 of the ids of CHKTXT
    round_trips: dict[int, str]  # each added token's text as decode(encode(text)) gives it back


def _tokenizer_facts(tok_dir: Path) -> _TokenizerFacts:
    """Load the tokenizer.json with ``tokenizers``, take what the vocabulary needs, and drop it. Why alone: the
    loaded tokenizer holds ~125 MB at 152k tokens and the parsed tokenizer.json ~85 MB; made one after the other
    (the freed heap handed back in between), a run's peak is the larger of the two, not their sum."""
    path = tok_dir / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        _load_tokenizer_json(tok_dir)  # a missing or damaged file: its own message
        raise TokenizerError(f"{path} cannot be loaded by tokenizers: {e}. Re-download it.") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    added = set(tok.get_added_tokens_decoder())
    facts = _TokenizerFacts(
        vocab, hashlib.sha256(str(tok.encode(CHKTXT).ids).encode()).hexdigest(),
        {i: tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
         for text, i in vocab.items() if i in added})
    del tok
    release_freed_memory()
    return facts


def _build_bpe_vocab(plan: GGUFPlan, tok_dir: Path, vocab_size: int) -> VocabInfo:
    facts = _tokenizer_facts(tok_dir)
    full = facts.vocab
    biggest = max(full.values())
    if biggest >= vocab_size:
        raise TokenizerError(
            f"Target tokenizer {tok_dir / 'tokenizer.json'} has token id {biggest}, beyond the drafter's "
            f"vocab_size {vocab_size}. The drafter was not made for this tokenizer: check --target."
        )
    chkhsh = facts.chkhsh
    pre = PRE_TOKENIZERS.get(chkhsh)
    if pre is None:
        raise TokenizerError(
            f"Target tokenizer {tok_dir / 'tokenizer.json'} has pre-tokenizer fingerprint {chkhsh}, which is not in "
            f"llama.cpp b11434's table of {len(PRE_TOKENIZERS)} (TextModel.get_vocab_base_pre): b11434's converter "
            "stops on it too ('BPE pre-tokenizer was not recognized'), and llama.cpp would not know how to split "
            "text for it. Re-download the target's tokenizer.json (a modified pre_tokenizer or normalizer changes "
            "the fingerprint), or use a llama.cpp build that lists this tokenizer."
        )
    tj = _load_tokenizer_json(tok_dir)
    added = {t["id"]: dict(t) for t in tj.get("added_tokens", [])}
    cfg_path = tok_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        for sid, entry in (read_json(cfg_path).get("added_tokens_decoder") or {}).items():
            if int(sid) in added:
                added[int(sid)].update({k: entry[k] for k in ("special", "normalized") if k in entry})
    reverse = {i: s for s, i in full.items()}
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        text = reverse.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
            continue
        info = added.get(i)
        if info is None:
            types.append(TokenType.NORMAL)
        else:
            if not info.get("normalized", True):
                text = facts.round_trips.get(i, text)
            if info.get("special") or _looks_special(text):
                types.append(TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types.append(TokenType.USER_DEFINED)
        tokens.append(text)

    plan.add_string("tokenizer.ggml.model", "gpt2")
    plan.add_string("tokenizer.ggml.pre", pre)
    plan.add_array("tokenizer.ggml.tokens", tokens)
    plan.add_array("tokenizer.ggml.token_type", [int(t) for t in types])
    read_special_tokens(tok_dir).add_to(plan)
    return VocabInfo(f"gpt2/{pre}", len(tokens), vocab_sha256(plan.get))


# SentencePieceTokenTypes in b11434 conversion/base.py (same values as gguf.TokenType)
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER_DEFINED, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6


def add_sentencepiece_vocab(plan: GGUFPlan, tok_dir: Path, vocab_size: int) -> VocabInfo:
    """b11434 ``_set_vocab_sentencepiece``: tokenizer.model pieces, added tokens, [PAD] rows to vocab_size."""
    path = tok_dir / "tokenizer.model"
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise TokenizerError(f"{path} is not a valid SentencePiece model ({e}). Re-download it, or remove it if "
                             "it was copied in from another model.") from None
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-10000.0] * n
    types = [_SP_UNUSED] * n
    for i in range(min(sp.vocab_size(), n)):
        tokens[i], scores[i] = sp.IdToPiece(i), sp.GetScore(i)
        types[i] = (_SP_UNKNOWN if sp.IsUnknown(i) else _SP_CONTROL if sp.IsControl(i) else
                    _SP_UNUSED if sp.IsUnused(i) else _SP_BYTE if sp.IsByte(i) else _SP_NORMAL)
    added = tok_dir / "added_tokens.json"
    if added.is_file():
        for text, tid in read_json(added).items():
            if tid < n:
                tokens[tid], scores[tid], types[tid] = text, -1000.0, _SP_USER_DEFINED
    cfg = tok_dir / "tokenizer_config.json"
    if cfg.is_file():
        for sid, entry in (read_json(cfg).get("added_tokens_decoder") or {}).items():
            tid, text = int(sid), entry["content"]
            if tid >= n:
                continue
            if entry.get("special") or _looks_special(text):
                types[tid] = _SP_CONTROL
            else:
                text = text.replace("\u2581", " ")
                types[tid] = _SP_USER_DEFINED
            scores[tid], tokens[tid] = -1000.0, text
    plan.add_string("tokenizer.ggml.model", "llama")
    plan.add_string("tokenizer.ggml.pre", "default")
    plan.add_array("tokenizer.ggml.tokens", tokens)
    plan.add_array("tokenizer.ggml.scores", scores)
    plan.add_array("tokenizer.ggml.token_type", types)
    read_special_tokens(tok_dir, n_vocab=len(tokens), load_merges=False).add_to(plan)
    return VocabInfo("llama/sentencepiece", len(tokens), vocab_sha256(plan.get))


def add_target_vocab(plan: GGUFPlan, tok_dir: Path, target: TargetConfig, drafter_vocab_size: int) -> VocabInfo:
    """Embed the target's tokenizer the way b11434's DFlash converter does.

    Raises:
        TokenizerError: tokenizer files missing, corrupt, or not matching the drafter.
        NotCoveredError: a tokenizer layout b11434 would read by a path we do not mirror.
    """
    path = target.vocab_path
    if path is None:
        raise NotCoveredError(f"{target.path}: target architecture {target.arch!r}: dflash-gguf does not mirror the "
                              "way llama.cpp b11434 reads its vocabulary. Use llama.cpp's own converter.")
    if path == "gemma4":
        return add_gemma4_vocab(plan, tok_dir)  # reads tokenizer.json only, whatever else is there
    llama = target.arch_facts is not None and target.arch_facts.gguf == "llama"
    if llama:
        cfg = tok_dir / "tokenizer_config.json"
        if cfg.is_file() and (prefix := read_json(cfg).get("add_prefix_space")) \
                is not None:
            plan.add_bool("tokenizer.ggml.add_space_prefix", bool(prefix))
    if path == "sentencepiece-or-gpt2" and (tok_dir / "tokenizer.model").is_file():
        return add_sentencepiece_vocab(plan, tok_dir, drafter_vocab_size)
    if llama:
        model = _load_tokenizer_json(tok_dir)["model"]
        if not (model.get("type") == "BPE" and model.get("ignore_merges") and not model.get("byte_fallback", True)):
            raise NotCoveredError(
                f"{tok_dir / 'tokenizer.json'}: a Llama target whose tokenizer is not Llama-3 style BPE; llama.cpp "
                "b11434 would read it through a path (LlamaHfVocab) dflash-gguf does not mirror. Use llama.cpp's own "
                "converter (the pipeline's --llama-cpp DIR)."
            )
    return add_bpe_vocab(plan, tok_dir, drafter_vocab_size)
