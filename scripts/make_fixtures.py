#!/usr/bin/env python3
"""Tiny, deterministic, offline Hugging Face repos that mirror the real DFlash formats.

Why: the converter must be tested against the *file formats* of z-lab drafters and their targets
(Gemma-4, its QAT twin, the Gemma-3 "wrong donor", Qwen3) without downloading gigabytes or
committing binaries. Every file here is generated from fixed seeds, so two runs give the same
bytes, and everything is built in a few seconds with numpy, sentencepiece, tokenizers and protobuf
only (no torch, transformers or safetensors: safetensors files are written by hand).

Layout written by ``make_all`` (see /work/shared/reference/hf-checkpoint-formats.md, section 5)::

    root/targets/gemma-4-tiny-it                         google/gemma-4-12B-it
    root/targets/gemma-4-tiny-it-qat-q4_0-unquantized    google/gemma-4-12B-it-qat-q4_0-unquantized
    root/targets/gemma-3-tiny-it                         google/gemma-3-12b-it (the wrong donor)
    root/targets/qwen3-tiny                              Qwen/Qwen3-8B (needs the llama.cpp source)
    root/drafters/gemma4-tiny-it-DFlash                  z-lab/gemma4-12B-it-DFlash
    root/drafters/qwen3-tiny-DFlash-b16                  z-lab/Qwen3-8B-DFlash-b16

Usage: ``python scripts/make_fixtures.py OUTDIR [--llama-cpp-src DIR] [--variants]``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import json
import re
import shutil
import struct
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

SIZES: dict[str, Any] = {
    "vocab": 512,  # tokenizer pieces of the Gemma fixtures (= embedding rows)
    "hidden": 64,  # H, shared by target and drafter
    "target_layers": 6,  # Gemma-4: 5 sliding + 1 full
    "drafter_layers": 2,
    "taps": 2,  # len(target_layer_ids) -> fc.weight [H, 2H]
    "target_layer_ids": [1, 3],
    "intermediate": 128,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,  # Gemma-4 full-attention layers
    "global_kv_heads": 1,
    "block_size": 16,
    "sliding_window": 32,
    "qwen_vocab": 151936,  # padded embedding rows of Qwen3 (tokenizer has 151643 + 3 specials)
    "qwen_mask_token_id": 151669,
    "gemma_mask_token_id": 4,
}

H = SIZES["hidden"]
NH, NKV, HD = SIZES["heads"], SIZES["kv_heads"], SIZES["head_dim"]
FF = SIZES["intermediate"]

# Files a fixture dir may contain; ``_fresh_dir`` only wipes dirs made of these (safety net).
_FIXTURE_FILE_RE = re.compile(
    r"(config\.json|generation_config\.json|model.*\.safetensors(\.index\.json)?|tokenizer(_config)?\.json"
    r"|tokenizer\.model|chat_template\.jinja|README\.md|dflash\.py|vocab\.json|merges\.txt)"
)


# --------------------------------------------------------------------------------------------------
# small file helpers
# --------------------------------------------------------------------------------------------------


def _fresh_dir(path: Path) -> Path:
    """Create ``path`` empty; wipe it first only if it looks like one of our fixtures (re-runs)."""
    if path.exists():
        foreign = [p.name for p in path.iterdir() if not _FIXTURE_FILE_RE.fullmatch(p.name)]
        if foreign:
            raise FileExistsError(f"{path} exists and holds non-fixture files: {sorted(foreign)[:5]}")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _write_json(path: Path, obj: Any, *, sort_keys: bool = True) -> None:
    """Pretty JSON like transformers' ``to_json_file`` (sorted keys, indent 2, trailing newline)."""
    path.write_text(
        json.dumps(obj, indent=2, sort_keys=sort_keys, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _set_dotted(cfg: dict, key: str, value: Any) -> None:
    """``a.b`` sets ``cfg["a"]["b"]`` (HF config keys never contain dots, so this is unambiguous)."""
    *parents, leaf = key.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {})
    cfg[leaf] = value


def _drop_dotted(cfg: dict, key: str) -> None:
    *parents, leaf = key.split(".")
    for p in parents:
        cfg = cfg.get(p, {})
    cfg.pop(leaf, None)


# --------------------------------------------------------------------------------------------------
# deterministic weights
# --------------------------------------------------------------------------------------------------


def _seed(namespace: str, name: str) -> int:
    """A seed per (namespace, tensor name): stable across runs, Python versions and dict orders."""
    return int.from_bytes(hashlib.sha256(f"{namespace}/{name}".encode()).digest()[:8], "little")


def _randn(namespace: str, name: str, shape: tuple[int, ...], scale: float = 0.02) -> np.ndarray:
    rng = np.random.default_rng(_seed(namespace, name))
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


def _norm(namespace: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Norm weights near 1 (not exactly 1, so a missing or swapped norm changes outputs)."""
    return (np.float32(1.0) + _randn(namespace, name, shape)).astype(np.float32)


def _fake_quant_q4_0(x: np.ndarray) -> np.ndarray:
    """Snap to a Q4_0 grid (blocks of 32 along the last axis), like QAT-trained weights.

    Why: a QAT checkpoint is close to, but not equal to, the vanilla one; fingerprinting tests need
    exactly that (same layout and magnitudes, different bytes).
    """
    if x.ndim == 0 or x.shape[-1] % 32:
        return x
    blocks = x.reshape(-1, 32)
    idx = np.abs(blocks).argmax(axis=1)
    d = blocks[np.arange(len(blocks)), idx] / np.float32(-8.0)
    d[d == 0] = 1.0
    q = np.clip(np.round(blocks / d[:, None]) + 8, 0, 15)
    return ((q - 8) * d[:, None]).astype(np.float32).reshape(x.shape)


# --------------------------------------------------------------------------------------------------
# safetensors, written and read by hand
# --------------------------------------------------------------------------------------------------

_NP_TO_ST = {
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
_ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def _bf16_bytes(x: np.ndarray) -> bytes:
    """float32 -> bfloat16 with round-to-nearest-even (what torch's ``.to(torch.bfloat16)`` does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def _encode_tensor(x: np.ndarray, float_dtype: str) -> tuple[str, bytes]:
    """float32 arrays are stored as ``float_dtype`` (BF16 for z-lab files); other dtypes as themselves."""
    if x.dtype == np.float32:
        if float_dtype == "BF16":
            return "BF16", _bf16_bytes(x)
        if float_dtype == "F16":
            return "F16", x.astype("<f2").tobytes()
        if float_dtype == "F32":
            return "F32", x.astype("<f4").tobytes()
        raise ValueError(f"unsupported float dtype {float_dtype!r}")
    st = _NP_TO_ST.get(x.dtype)
    if st is None:
        raise ValueError(f"no safetensors dtype for numpy {x.dtype}")
    return st, np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<")).tobytes()


def _pack_safetensors(entries: list[tuple[str, str, tuple[int, ...], bytes]]) -> bytes:
    """entries = (name, dtype, shape, raw bytes), written in the given order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + b"".join(raw for *_, raw in entries)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], *, float_dtype: str = "BF16") -> Path:
    """Write ``tensors`` like ``safetensors.save_file`` would: larger dtypes first, then by name."""
    encoded = []
    for name, x in tensors.items():
        dtype, raw = _encode_tensor(x, float_dtype)
        encoded.append((name, dtype, tuple(int(d) for d in x.shape), raw))
    encoded.sort(key=lambda e: (-_ST_ITEMSIZE[e[1]], e[0]))
    path.write_bytes(_pack_safetensors(encoded))
    return path


def read_safetensors_raw(path: Path) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """(name, dtype, shape, raw bytes) in file order; enough to re-shard without decoding."""
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [
        (
            name,
            info["dtype"],
            tuple(info["shape"]),
            data[base + info["data_offsets"][0] : base + info["data_offsets"][1]],
        )
        for name, info in items
    ]


def make_sharded(dir: Path, n_shards: int = 2) -> Path:
    """Split ``dir/model.safetensors`` into ``model-0000i-of-0000n.safetensors`` + index (HF layout)."""
    src = dir / "model.safetensors"
    entries = read_safetensors_raw(src)
    chunks = np.array_split(np.arange(len(entries)), n_shards)
    weight_map: dict[str, str] = {}
    for i, idx in enumerate(chunks, start=1):
        fname = f"model-{i:05d}-of-{n_shards:05d}.safetensors"
        part = [entries[j] for j in idx]
        (dir / fname).write_bytes(_pack_safetensors(part))
        weight_map.update({e[0]: fname for e in part})
    total = sum(len(e[3]) for e in entries)
    _write_json(
        dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )
    src.unlink()
    return dir


def truncate_safetensors(dir: Path, filename: str = "model.safetensors", keep_fraction: float = 0.5) -> Path:
    """Cut the data section short (an interrupted download): the header still parses, data does not fit."""
    path = dir / filename
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    keep = 8 + n + int((len(data) - 8 - n) * keep_fraction)
    path.write_bytes(data[:keep])
    return path


def corrupt_safetensors_header(
    dir: Path, filename: str = "model.safetensors", how: Literal["json", "length"] = "json"
) -> Path:
    """``json``: same header length, unparseable JSON. ``length``: header length beyond the file size."""
    path = dir / filename
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 0)
    if how == "json":
        data[8 : 8 + n] = (b'{"__metadata__": garbage' + b"#" * n)[:n]
    elif how == "length":
        struct.pack_into("<Q", data, 0, len(data) * 16)
    else:
        raise ValueError(how)
    path.write_bytes(bytes(data))
    return path


# --------------------------------------------------------------------------------------------------
# SentencePiece + tokenizer.json for the Gemma fixtures
# --------------------------------------------------------------------------------------------------

# Real Gemma-4 strings at their real ids (b11434's ggml-vocab-gemma-4.gguf); types as in section 2.
GEMMA4_SPECIALS: dict[int, tuple[str, str]] = {
    4: ("<mask>", "CONTROL"),
    5: ("[multimodal]", "NORMAL"),
    46: ("<|tool>", "CONTROL"),
    47: ("<tool|>", "CONTROL"),
    48: ("<|tool_call>", "USER_DEFINED"),
    49: ("<tool_call|>", "USER_DEFINED"),
    50: ("<|tool_response>", "USER_DEFINED"),
    51: ("<tool_response|>", "USER_DEFINED"),
    52: ('<|"|>', "USER_DEFINED"),
    98: ("<|think|>", "CONTROL"),
    100: ("<|channel>", "USER_DEFINED"),
    101: ("<channel|>", "USER_DEFINED"),
    105: ("<|turn>", "CONTROL"),
    106: ("<turn|>", "CONTROL"),
    107: ("\n", "NORMAL"),
}
# Gemma-3 at the same ids: [@BOS@] at 5, turn markers at 105/106, <unusedN> in every tool/chat slot.
GEMMA3_SPECIALS: dict[int, tuple[str, str]] = {
    4: ("<mask>", "CONTROL"),
    5: ("[@BOS@]", "CONTROL"),
    105: ("<start_of_turn>", "CONTROL"),
    106: ("<end_of_turn>", "CONTROL"),
    107: ("\n", "NORMAL"),
}
_FIRST_USER_ID = 4  # after <pad> <eos> <bos> <unk>


def _special_table(flavor: Literal["gemma4", "gemma3"]) -> list[tuple[str, str]]:
    """(piece, type) for ids 4..last special; gaps are ``<unusedN>`` (NORMAL, as in the real vocab).

    Gemma-4 numbers its unused pieces consecutively around the real specials (``<unused40>`` sits at
    53); Gemma-3 numbers them ``id - 6``. Both match the shipped vocabularies.
    """
    specials = GEMMA4_SPECIALS if flavor == "gemma4" else GEMMA3_SPECIALS
    out: list[tuple[str, str]] = []
    unused = 0
    for i in range(_FIRST_USER_ID, max(specials) + 1):
        if i in specials:
            out.append(specials[i])
        else:
            n = unused if flavor == "gemma4" else i - 6
            out.append((f"<unused{n}>", "NORMAL"))
            unused += 1
    return out


_WORDS = (
    "the of and to in is that for it with as was on be by this are from at or an have not which but "
    "model token draft target layer block speculative decoding fast small large weight tensor file "
    "hello world quick brown fox jumps over lazy dog check value return print data list name"
).split()
_CODE = [
    "def {w}(x, y):\n    return x + y  # {w}\n",
    "for i in range({n}):\n    print(i, '{w}')\n",
    "if ({w} == {n}) {{\n\tcount += 1;\n}}\n",
    "    {w} = [{n}, {n}, {n}]\n        {w}.append({n})\n",
    'json = {{"{w}": {n}, "ok": true}}\n',
]
_CJK = ["我想在工作", "模型数据", "日本語", "한국어"]
_EMOJI = ["🚀", "✅", "🦙"]


# Chat / tool-call markup per flavor: each vocab only ever sees its own special strings as text, so
# Gemma-3 does not learn pieces such as ``<|"|>`` from Gemma-4 markup.
_MARKUP = {
    "gemma4": ("<|turn>", "<turn|>", '<|tool_call>call:{w}{{{k}:<|"|>{n}<|"|>}}<tool_call|>   {w}\n\n'),
    "gemma3": ("<start_of_turn>", "<end_of_turn>", 'call:{w}({k}="{n}")   {w}\n\n'),
}


def _training_lines(flavor: Literal["gemma4", "gemma3"], seed: int = 1234, n: int = 400) -> Iterator[str]:
    """English, code (indentation, tabs, newlines), CJK, emoji, digits and the flavor's chat markup.

    The character set stays small (~90 code points) so a 512-piece vocab still learns merges.
    """
    rng = np.random.default_rng(seed)
    sot, eot, tool_call = _MARKUP[flavor]

    def pick(seq: list[str] | tuple[str, ...]) -> str:
        return seq[int(rng.integers(len(seq)))]

    for i in range(n):
        kind = i % 5
        w, num = pick(_WORDS), int(rng.integers(0, 100000))
        if kind == 0:
            words = [pick(_WORDS) for _ in range(int(rng.integers(5, 14)))]
            yield " ".join(words).capitalize() + pick([".", "?", "!", ","]) + f" {num}"
        elif kind == 1:
            yield pick(_CODE).format(w=w, n=num)
        elif kind == 2:
            yield f"{pick(_CJK)}{num}{pick(_EMOJI)} {w}  {pick(_CJK)}"
        elif kind == 3:
            reply = f"{pick(_WORDS)} {pick(_EMOJI)}"
            yield f"{sot}user\n{w} {pick(_WORDS)} {num}?{eot}\n{sot}model\n{reply}"
        else:
            yield tool_call.format(w=w, k=pick(_WORDS), n=num)


@functools.lru_cache(maxsize=2)
def _sentencepiece_proto_bytes(flavor: Literal["gemma4", "gemma3"]) -> bytes:
    """Train a 512-piece BPE model offline, then set the piece types the real vocab has.

    Why edit after training: the trainer makes every ``user_defined_symbols`` entry USER_DEFINED,
    but Gemma has CONTROL turn/tool markers and NORMAL ``<unusedN>``/``\\n`` in that range.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    table = _special_table(flavor)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=_training_lines(flavor),
        model_writer=buf,
        model_type="bpe",
        vocab_size=SIZES["vocab"],
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=[piece for piece, _ in table],
        byte_fallback=True,
        add_dummy_prefix=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    model = pb.ModelProto()
    model.ParseFromString(buf.getvalue())
    for j, (piece, kind) in enumerate(table):
        p = model.pieces[_FIRST_USER_ID + j]
        assert p.piece == piece, (p.piece, piece)
        p.type = getattr(pb.ModelProto.SentencePiece, kind)
    assert len(model.pieces) == SIZES["vocab"]
    return model.SerializeToString()


def gemma4_sentencepiece_proto_bytes() -> bytes:
    """The Gemma-4 fixture vocab as a SentencePiece ``ModelProto`` (never written to the Gemma-4 dir:
    the real repo has no ``tokenizer.model``; the tokenizer-repair feature compares against this)."""
    return _sentencepiece_proto_bytes("gemma4")


def gemma3_sentencepiece_proto_bytes() -> bytes:
    """The Gemma-3 fixture vocab (same size, Gemma-3 strings in the chat/tool slots)."""
    return _sentencepiece_proto_bytes("gemma3")


def _gemma_tokenizer_json(proto: bytes) -> str:
    """tokenizer.json equivalent to ``proto`` (recipe of section 5; same ids as SentencePiece)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    model = pb.ModelProto()
    model.ParseFromString(proto)
    SP = pb.ModelProto.SentencePiece
    vocab = {p.piece: i for i, p in enumerate(model.pieces)}
    normal = {p.piece: i for i, p in enumerate(model.pieces) if p.type == SP.NORMAL}
    merges: list[tuple[int, int, int, str, str]] = []
    for piece, pid in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                merges.append((pid, normal[left], normal[right], left, right))
    merges.sort()
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=[(a, b) for *_, a, b in merges],
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    special_types = {SP.CONTROL, SP.UNKNOWN, SP.USER_DEFINED}
    tok.add_special_tokens(
        [AddedToken(p.piece, normalized=False, special=True) for p in model.pieces if p.type in special_types]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B:1", special_tokens=[("<bos>", 2)]
    )
    return tok.to_str(pretty=True) + "\n"


def _added_tokens_decoder(proto: bytes) -> dict[str, dict[str, Any]]:
    """``tokenizer_config.json``'s view of the added tokens (all special, as in the tokenizer.json)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(proto)
    SP = pb.ModelProto.SentencePiece
    return {
        str(i): {
            "content": p.piece,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, p in enumerate(model.pieces)
        if p.type in (SP.CONTROL, SP.UNKNOWN, SP.USER_DEFINED)
    }


def _control_pieces(proto: bytes) -> list[str]:
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(proto)
    return [p.piece for p in model.pieces if p.type == pb.ModelProto.SentencePiece.CONTROL]


# --------------------------------------------------------------------------------------------------
# Gemma targets
# --------------------------------------------------------------------------------------------------

# Gemma-4's chat markup in miniature (the real template is b11434's models/templates/google-gemma-4-31B-it.jinja):
# system turn with <|think|> and <|tool> declarations, model turns with a <|channel> thought, tool calls
# with <|"|>-quoted arguments, <|tool_response> blocks inside the model turn, and the empty thought
# channel the generation prompt opens when thinking is off.
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}\n"
    "{%- set loop_messages = messages -%}\n"
    "{%- if thinking or tools or messages[0]['role'] in ['system', 'developer'] -%}\n"
    "    {{- '<|turn>system\\n' -}}\n"
    "    {%- if thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}\n"
    "    {%- if messages[0]['role'] in ['system', 'developer'] -%}\n"
    "        {{- messages[0]['content'] | trim -}}\n"
    "        {%- set loop_messages = messages[1:] -%}\n"
    "    {%- endif -%}\n"
    "    {%- for tool in tools or [] -%}\n"
    "        {{- '<|tool>declaration:' + tool['function']['name'] + '{description:<|\"|>'"
    " + tool['function']['description'] + '<|\"|>}<tool|>' -}}\n"
    "    {%- endfor -%}\n"
    "    {{- '<turn|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if message['role'] == 'tool' -%}\n"
    "        {{- '<|tool_response>response:' + message['name'] + '{value:<|\"|>' + message['content']"
    " + '<|\"|>}<tool_response|>' -}}\n"
    "    {%- else -%}\n"
    "        {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "        {%- if not (role == 'model' and loop.index0 > 0 and loop_messages[loop.index0 - 1]['role'] == 'tool')"
    " -%}\n"
    "            {{- '<|turn>' + role + '\\n' -}}\n"
    "        {%- endif -%}\n"
    "        {%- if message.get('reasoning_content') -%}\n"
    "            {{- '<|channel>thought\\n' + message['reasoning_content'] + '\\n<channel|>' -}}\n"
    "        {%- endif -%}\n"
    "        {%- for call in message.get('tool_calls') or [] -%}\n"
    "            {{- '<|tool_call>call:' + call['function']['name'] + '{' -}}\n"
    "            {%- for key, value in call['function']['arguments'] | dictsort -%}\n"
    "                {{- key + ':<|\"|>' + value | string + '<|\"|>' + ('' if loop.last else ',') -}}\n"
    "            {%- endfor -%}\n"
    "            {{- '}<tool_call|>' -}}\n"
    "        {%- endfor -%}\n"
    "        {%- if not message.get('tool_calls') -%}\n"
    "            {{- (message['content'] or '') | trim + '<turn|>\\n' -}}\n"
    "        {%- endif -%}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|turn>model\\n' -}}\n"
    "    {%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}\n"
    "{%- endif -%}\n"
)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _gemma4_text_config() -> dict[str, Any]:
    n = SIZES["target_layers"]
    return {
        "model_type": "gemma4_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "enable_moe_block": False,
        "final_logit_softcapping": 30.0,
        "global_head_dim": SIZES["global_head_dim"],
        "head_dim": HD,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": H,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": FF,
        "layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"],
        "max_position_embeddings": 4096,
        "num_attention_heads": NH,
        "num_global_key_value_heads": SIZES["global_kv_heads"],
        "num_hidden_layers": n,
        "num_key_value_heads": NKV,
        "num_kv_shared_layers": 0,
        "moe_intermediate_size": None,  # dense model; b11434's Gemma-4 converter reads the key unconditionally
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": SIZES["sliding_window"],
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": SIZES["vocab"],
    }


def _gemma3_norm(namespace: str, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Gemma-3 RMSNorm computes ``x * (1 + w)``, so its stored weights sit near 0 (converter adds 1)."""
    return _randn(namespace, name, shape)


def _gemma_layer_tensors(ns: str, prefix: str, i: int, *, full: bool, gemma4: bool) -> dict[str, np.ndarray]:
    """One Gemma decoder layer. Gemma-4 full layers: global head dim, 1 KV head, no v_proj (k == v).

    Gemma-4 norms are stored unshifted (near 1), Gemma-3 norms shifted (near 0).
    """
    _norm_fn = _norm if gemma4 else _gemma3_norm
    hd = SIZES["global_head_dim"] if full else HD
    nkv = SIZES["global_kv_heads"] if full else NKV
    p = f"{prefix}.layers.{i}"
    t = {
        f"{p}.self_attn.q_proj.weight": _randn(ns, f"{p}.q", (NH * hd, H)),
        f"{p}.self_attn.k_proj.weight": _randn(ns, f"{p}.k", (nkv * hd, H)),
        f"{p}.self_attn.o_proj.weight": _randn(ns, f"{p}.o", (H, NH * hd)),
        f"{p}.self_attn.q_norm.weight": _norm_fn(ns, f"{p}.qn", (hd,)),
        f"{p}.self_attn.k_norm.weight": _norm_fn(ns, f"{p}.kn", (hd,)),
        f"{p}.mlp.gate_proj.weight": _randn(ns, f"{p}.gate", (FF, H)),
        f"{p}.mlp.up_proj.weight": _randn(ns, f"{p}.up", (FF, H)),
        f"{p}.mlp.down_proj.weight": _randn(ns, f"{p}.down", (H, FF)),
    }
    if not (full and gemma4):
        t[f"{p}.self_attn.v_proj.weight"] = _randn(ns, f"{p}.v", (nkv * hd, H))
    for norm in (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ):
        t[f"{p}.{norm}.weight"] = _norm_fn(ns, f"{p}.{norm}", (H,))
    if gemma4:
        t[f"{p}.layer_scalar"] = _norm(ns, f"{p}.layer_scalar", (1,))
    return t


def _gemma4_tensors(qat: bool) -> dict[str, np.ndarray]:
    prefix = "model.language_model"
    ns = "gemma4-target"
    layer_types = _gemma4_text_config()["layer_types"]
    t: dict[str, np.ndarray] = {f"{prefix}.embed_tokens.weight": _randn(ns, "embed", (SIZES["vocab"], H))}
    for i, kind in enumerate(layer_types):
        t.update(_gemma_layer_tensors(ns, prefix, i, full=kind == "full_attention", gemma4=True))
    t[f"{prefix}.norm.weight"] = _norm(ns, "norm", (H,))
    if qat:
        t = {
            k: _fake_quant_q4_0(v) if v.ndim == 2 else v + _randn("gemma4-qat", k, v.shape, 1e-3)
            for k, v in t.items()
        }
    return t


def _gemma_readme(title: str, base_model: str, relation: str | None) -> str:
    rel = f"base_model_relation: {relation}\n" if relation else ""
    return (
        "---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: image-text-to-text\n"
        f"base_model: {base_model}\n{rel}---\n\n# {title}\n\n"
        "Tiny offline fixture generated by scripts/make_fixtures.py (random weights).\n"
    )


def _gemma_tokenizer_config(proto: bytes, *, chat_template: str | None) -> dict[str, Any]:
    standard = {"<pad>", "<eos>", "<bos>", "<unk>", "<mask>"}
    cfg: dict[str, Any] = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": _added_tokens_decoder(proto),
        "additional_special_tokens": [p for p in _control_pieces(proto) if p not in standard],
        "bos_token": "<bos>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<eos>",
        "mask_token": "<mask>",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<pad>",
        "padding_side": "left",
        "spaces_between_special_tokens": False,
        "tokenizer_class": "GemmaTokenizer",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    return cfg


def make_gemma4_target(dir: Path, *, name_suffix: str = "", qat: bool = False) -> Path:
    """``dir/gemma-4-tiny-it`` (or ``...-qat-q4_0-unquantized``): google/gemma-4-12B-it in miniature.

    No ``tokenizer.model`` (the real release has none); QAT differs only in weight values and the
    card's ``base_model`` (the vanilla ``-it`` repo), exactly the pairing trap the toolkit must catch.
    """
    name = "gemma-4-tiny-it" + ("-qat-q4_0-unquantized" if qat else "") + name_suffix
    out = _fresh_dir(Path(dir) / name)
    proto = gemma4_sentencepiece_proto_bytes()
    text = _gemma4_text_config()
    _write_json(
        out / "config.json",
        {
            "architectures": ["Gemma4UnifiedForConditionalGeneration"],
            "model_type": "gemma4_unified",
            "dtype": "bfloat16",
            "text_config": text,
            "tie_word_embeddings": True,
            "transformers_version": "5.5.0",
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": 2,
            "do_sample": True,
            "eos_token_id": [1, 106],
            "pad_token_id": 0,
            "top_k": 64,
            "top_p": 0.95,
            "transformers_version": "5.5.0",
        },
    )
    (out / "tokenizer.json").write_text(_gemma_tokenizer_json(proto), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json", _gemma_tokenizer_config(proto, chat_template=None), sort_keys=False
    )
    (out / "chat_template.jinja").write_text(GEMMA4_CHAT_TEMPLATE, encoding="utf-8")
    if qat:
        readme = _gemma_readme(name, "google/gemma-4-12B-it", "quantized")
    else:
        readme = _gemma_readme(name, "google/gemma-4-12B", "finetune")
    (out / "README.md").write_text(readme, encoding="utf-8")
    write_safetensors(out / "model.safetensors", _gemma4_tensors(qat))
    return out


def make_gemma3_target(dir: Path) -> Path:
    """``dir/gemma-3-tiny-it``: same vocab size as the Gemma-4 fixture, Gemma-3 strings (wrong donor)."""
    out = _fresh_dir(Path(dir) / "gemma-3-tiny-it")
    proto = gemma3_sentencepiece_proto_bytes()
    n = SIZES["target_layers"]
    text = {
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "head_dim": HD,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FF,
        "max_position_embeddings": 4096,
        "num_attention_heads": NH,
        "num_hidden_layers": n,
        "num_key_value_heads": NKV,
        "query_pre_attn_scalar": HD,
        "rms_norm_eps": 1e-6,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": SIZES["sliding_window"],
        "sliding_window_pattern": n,
        "layer_types": ["sliding_attention"] * (n - 1) + ["full_attention"],
        "use_cache": True,
        "vocab_size": SIZES["vocab"],
    }
    _write_json(
        out / "config.json",
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": text,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.50.0.dev0",
        },
    )
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": 2,
            "cache_implementation": "hybrid",
            "do_sample": True,
            "eos_token_id": [1, 106],
            "pad_token_id": 0,
            "top_k": 64,
            "top_p": 0.95,
            "transformers_version": "4.50.0.dev0",
        },
    )
    (out / "tokenizer.model").write_bytes(proto)
    (out / "tokenizer.json").write_text(_gemma_tokenizer_json(proto), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        _gemma_tokenizer_config(proto, chat_template=GEMMA3_CHAT_TEMPLATE),
        sort_keys=False,
    )
    (out / "README.md").write_text(
        _gemma_readme("gemma-3-tiny-it", "google/gemma-3-12b-pt", "finetune"), encoding="utf-8"
    )
    ns, prefix = "gemma3-target", "language_model.model"
    t: dict[str, np.ndarray] = {f"{prefix}.embed_tokens.weight": _randn(ns, "embed", (SIZES["vocab"], H))}
    for i in range(n):
        t.update(_gemma_layer_tensors(ns, prefix, i, full=False, gemma4=False))
    t[f"{prefix}.norm.weight"] = _gemma3_norm(ns, "norm", (H,))
    write_safetensors(out / "model.safetensors", t)
    return out


# --------------------------------------------------------------------------------------------------
# Qwen3 target (tokenizer rebuilt from llama.cpp's ggml-vocab-qwen2.gguf)
# --------------------------------------------------------------------------------------------------

QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def _qwen_vocab_and_merges(llama_cpp_src: Path) -> tuple[list[str], list[str]]:
    path = Path(llama_cpp_src) / "models" / "ggml-vocab-qwen2.gguf"
    from dflash_gguf.gguf_reader import read_gguf  # bounded and fast (GGUFReader takes ~7 s on this vocab)

    meta = read_gguf(path)
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    assert tokens[151643:151646] == list(QWEN_SPECIALS), tokens[151643:151646]
    return tokens[:151643], meta.get("tokenizer.ggml.merges")


def _qwen_tokenizer_json(tokens: list[str], merges: list[str]) -> str:
    """Qwen2-family tokenizer.json: byte-level BPE + the Qwen2 split regex (pre-tokenizer ``qwen2``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in QWEN_SPECIALS])
    return tok.to_str(pretty=True) + "\n"


def _qwen3_config() -> dict[str, Any]:
    n = SIZES["target_layers"]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": HD,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FF,
        "max_position_embeddings": 40960,
        "max_window_layers": n,
        "model_type": "qwen3",
        "num_attention_heads": NH,
        "num_hidden_layers": n,
        "num_key_value_heads": NKV,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": SIZES["qwen_vocab"],
    }


def _qwen3_tensors() -> dict[str, np.ndarray]:
    ns, V = "qwen3-target", SIZES["qwen_vocab"]
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": _randn(ns, "embed", (V, H))}
    for i in range(SIZES["target_layers"]):
        t.update(_qwen_layer_tensors(ns, f"model.layers.{i}", H))
    t["model.norm.weight"] = _norm(ns, "norm", (H,))
    t["lm_head.weight"] = _randn(ns, "lm_head", (V, H))
    return t


def make_qwen3_target(dir: Path, *, llama_cpp_src: Path, weights: bool = True) -> Path:
    """``dir/qwen3-tiny``: Qwen/Qwen3-8B in miniature with a tokenizer that passes b11434's
    ``get_vocab_base_pre`` check (chkhsh ``e636dc30...`` -> ``qwen2``).

    ``weights=False`` skips the ~40 MB ``model.safetensors`` (drafter conversion reads only the
    target's config and tokenizer).
    """
    out = _fresh_dir(Path(dir) / "qwen3-tiny")
    tokens, merges = _qwen_vocab_and_merges(llama_cpp_src)
    _write_json(out / "config.json", _qwen3_config())
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": 151643,
            "do_sample": True,
            "eos_token_id": [151645, 151643],
            "pad_token_id": 151643,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
            "transformers_version": "4.51.0",
        },
    )
    (out / "tokenizer.json").write_text(_qwen_tokenizer_json(tokens, merges), encoding="utf-8")
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": {
                str(i): {
                    "content": s,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for s, i in QWEN_SPECIALS.items()
            },
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": QWEN_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
        sort_keys=False,
    )
    (out / "vocab.json").write_text(
        json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False, separators=(",", ":")),
        encoding="utf-8",
    )
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    if weights:
        write_safetensors(out / "model.safetensors", _qwen3_tensors())
    return out


# --------------------------------------------------------------------------------------------------
# DFlash drafters
# --------------------------------------------------------------------------------------------------


def _qwen_layer_tensors(ns: str, p: str, hidden: int) -> dict[str, np.ndarray]:
    """One Qwen3 decoder layer (the drafter's block and the Qwen3 target's)."""
    return {
        f"{p}.input_layernorm.weight": _norm(ns, f"{p}.in_norm", (hidden,)),
        f"{p}.post_attention_layernorm.weight": _norm(ns, f"{p}.post_norm", (hidden,)),
        f"{p}.self_attn.q_proj.weight": _randn(ns, f"{p}.q", (NH * HD, hidden)),
        f"{p}.self_attn.k_proj.weight": _randn(ns, f"{p}.k", (NKV * HD, hidden)),
        f"{p}.self_attn.v_proj.weight": _randn(ns, f"{p}.v", (NKV * HD, hidden)),
        f"{p}.self_attn.o_proj.weight": _randn(ns, f"{p}.o", (hidden, NH * HD)),
        f"{p}.self_attn.q_norm.weight": _norm(ns, f"{p}.qn", (HD,)),
        f"{p}.self_attn.k_norm.weight": _norm(ns, f"{p}.kn", (HD,)),
        f"{p}.mlp.gate_proj.weight": _randn(ns, f"{p}.gate", (FF, hidden)),
        f"{p}.mlp.up_proj.weight": _randn(ns, f"{p}.up", (FF, hidden)),
        f"{p}.mlp.down_proj.weight": _randn(ns, f"{p}.down", (hidden, FF)),
    }


@dataclass
class Draft:
    """A drafter repo before it is written; presets edit it in place."""

    target: Literal["gemma4", "qwen3"]
    config: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    readme: bool = False
    auto_map: bool = False

    @property
    def ns(self) -> str:
        return f"{self.target}-drafter"

    def build_tensors(self, hidden: int, n_fc_inputs: int) -> None:
        """z-lab DFlash1 tensor set (no ``model.`` prefix, no embeddings, no LM head)."""
        t: dict[str, np.ndarray] = {
            "fc.weight": _randn(self.ns, "fc", (hidden, n_fc_inputs * hidden)),
            "hidden_norm.weight": _norm(self.ns, "hidden_norm", (hidden,)),
            "norm.weight": _norm(self.ns, "norm", (hidden,)),
        }
        for i in range(self.config["num_hidden_layers"]):
            t.update(_qwen_layer_tensors(self.ns, f"layers.{i}", hidden))
        self.tensors = t

    def set_taps(self, taps: list[int]) -> None:
        """New ``target_layer_ids`` with a matching ``fc`` width (k taps -> [H, k*H])."""
        self.config["dflash_config"]["target_layer_ids"] = list(taps)
        self.tensors["fc.weight"] = _randn(self.ns, "fc", (self.hidden, len(taps) * self.hidden))

    @property
    def hidden(self) -> int:
        return int(self.config["hidden_size"])


def _drafter_config(target: Literal["gemma4", "qwen3"]) -> dict[str, Any]:
    """config.json of z-lab/gemma4-12B-it-DFlash or z-lab/Qwen3-8B-DFlash-b16, scaled down."""
    L = SIZES["drafter_layers"]
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "head_dim": HD,
        "hidden_act": "silu",
        "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": FF,
        "max_position_embeddings": 4096,
        "max_window_layers": L,
        "model_type": "qwen3",
        "num_attention_heads": NH,
        "num_hidden_layers": L,
        "num_key_value_heads": NKV,
        "num_target_layers": SIZES["target_layers"],
        "rms_norm_eps": 1e-6,
        "use_cache": True,
    }
    if target == "gemma4":
        cfg.update(
            {
                "bos_token_id": 2,
                "eos_token_id": 1,
                "pad_token_id": 0,
                "dflash_config": {
                    "block_size": SIZES["block_size"],
                    "mask_token_id": SIZES["gemma_mask_token_id"],
                    "target_layer_ids": list(SIZES["target_layer_ids"]),
                },
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
                "sliding_window": SIZES["sliding_window"],
                "use_sliding_window": True,
                "tie_word_embeddings": True,
                "transformers_version": "5.5.0",
                "vocab_size": SIZES["vocab"],
            }
        )
    elif target == "qwen3":
        cfg.update(
            {
                "bos_token_id": 151643,
                "eos_token_id": 151645,
                "block_size": SIZES["block_size"],
                "dflash_config": {
                    "mask_token_id": SIZES["qwen_mask_token_id"],
                    "target_layer_ids": list(SIZES["target_layer_ids"]),
                },
                "layer_types": ["full_attention"] * L,
                "rope_scaling": None,
                "rope_theta": 1000000.0,
                "sliding_window": None,
                "use_sliding_window": False,
                "tie_word_embeddings": False,
                "transformers_version": "4.57.1",
                "vocab_size": SIZES["qwen_vocab"],
            }
        )
    else:
        raise ValueError(f"unknown drafter target {target!r}")
    return cfg


def _rebuild_hidden(d: Draft, hidden: int) -> None:
    d.config["hidden_size"] = hidden
    d.build_tensors(hidden, len(d.config["dflash_config"]["target_layer_ids"]))


def _set_block_size(d: Draft, *, nested: bool, top: bool) -> None:
    d.config.pop("block_size", None)
    d.config["dflash_config"].pop("block_size", None)
    if nested:
        d.config["dflash_config"]["block_size"] = SIZES["block_size"]
    if top:
        d.config["block_size"] = SIZES["block_size"]


def _rope_flat(d: Draft) -> None:
    d.config.pop("rope_parameters", None)
    d.config.update({"rope_theta": 1000000.0, "rope_scaling": None})


def _rope_parameters(d: Draft) -> None:
    for k in ("rope_theta", "rope_scaling"):
        d.config.pop(k, None)
    d.config["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "default"}


def _sliding(d: Draft, *, use: bool, window: int | None, layer_types: list[str] | None) -> None:
    d.config.update({"use_sliding_window": use, "sliding_window": window})
    if layer_types is None:
        d.config.pop("layer_types", None)
    else:
        d.config["layer_types"] = layer_types


def _no_card_no_remote_code(d: Draft) -> None:
    d.readme = d.auto_map = False


def _add_attention_bias(d: Draft) -> None:
    d.config["attention_bias"] = True
    for i in range(d.config["num_hidden_layers"]):
        for proj, width in (("q", NH * HD), ("k", NKV * HD), ("v", NKV * HD), ("o", d.hidden)):
            name = f"layers.{i}.self_attn.{proj}_proj.bias"
            d.tensors[name] = _randn(d.ns, name, (width,))


def _add_embed_and_lm_head(d: Draft) -> None:
    V = int(d.config["vocab_size"])
    d.tensors["embed_tokens.weight"] = _randn(d.ns, "embed_tokens", (V, d.hidden))
    d.tensors["lm_head.weight"] = _randn(d.ns, "lm_head", (V, d.hidden))


def _add_d2t(d: Draft) -> None:
    """EAGLE3-style vocab maps: ``d2t`` offsets of a 32-token draft vocab, ``t2d`` 0/1 per target token."""
    V, draft_v = int(d.config["vocab_size"]), 32
    d.tensors["d2t"] = np.arange(draft_v, dtype=np.int64)
    t2d = np.zeros(V, dtype=np.int64)
    t2d[:draft_v] = 1
    d.tensors["t2d"] = t2d


_SWA_TYPES = ["sliding_attention", "full_attention"]

# name -> edit. Presets only touch config/tensors/files; each mirrors one shape seen in the wild or
# one malformed checkpoint the converter must reject (section 5 "Variants to generate in tests").
VARIANTS: dict[str, Callable[[Draft], None]] = {
    "default": lambda d: None,
    "block_size_nested": lambda d: _set_block_size(d, nested=True, top=False),
    "block_size_top": lambda d: _set_block_size(d, nested=False, top=True),
    "rope_flat": _rope_flat,
    "rope_parameters": _rope_parameters,
    "more_taps_than_layers": lambda d: d.set_taps([0, 2, 4]),
    "no_readme_no_automap": _no_card_no_remote_code,
    "swa_layer_types": lambda d: _sliding(
        d, use=True, window=SIZES["sliding_window"], layer_types=_SWA_TYPES
    ),
    # malformed or unsupported
    "no_taps": lambda d: d.config["dflash_config"].pop("target_layer_ids"),
    "mask_top_level_only": lambda d: d.config.update(
        mask_token_id=d.config["dflash_config"].pop("mask_token_id")
    ),
    "no_mask": lambda d: d.config["dflash_config"].pop("mask_token_id"),
    "fc_width_wrong": lambda d: d.tensors.update({"fc.weight": _randn(d.ns, "fc", (d.hidden, 3 * d.hidden))}),
    "hidden_mismatch": lambda d: _rebuild_hidden(d, 96),
    "tap_out_of_range": lambda d: d.set_taps([1, SIZES["target_layers"]]),
    "tap_last_layer": lambda d: d.set_taps([1, SIZES["target_layers"] - 1]),
    "missing_tensor": lambda d: d.tensors.pop("layers.1.mlp.down_proj.weight"),
    "unexpected_tensor": lambda d: d.tensors.update(
        {"layers.0.self_attn.gate.weight": _randn(d.ns, "gate", (NH * HD, d.hidden))}
    ),
    "attention_bias": _add_attention_bias,
    "embed_and_lm_head": _add_embed_and_lm_head,
    "d2t": _add_d2t,
    "gelu": lambda d: d.config.update(hidden_act="gelu"),
    "swa_without_layer_types": lambda d: _sliding(
        d, use=True, window=SIZES["sliding_window"], layer_types=None
    ),
    "sliding_types_but_swa_off": lambda d: _sliding(
        d, use=False, window=SIZES["sliding_window"], layer_types=_SWA_TYPES
    ),
    "is_causal_false": lambda d: d.config.update(is_causal=False),
    "wrong_arch": lambda d: d.config.update(architectures=["LlamaForCausalLM"]),
    "torch_dtype_old": lambda d: d.config.update(torch_dtype=d.config.pop("dtype")),
}

DRAFTER_NAMES = {"gemma4": "gemma4-tiny-it-DFlash", "qwen3": "qwen3-tiny-DFlash-b16"}

_DFLASH_PY = '''"""Stand-in for z-lab's remote code. Importing it is a bug: repo code must never run."""

raise RuntimeError("dflash.py from a fixture drafter was imported; remote code must never be executed")
'''


_PAIRED_WITH = {
    "gemma4": ("google/gemma-4-12B-it", "gemma-4-tiny-it"),
    "qwen3": ("Qwen/Qwen3-8B", "qwen3-tiny"),
}


def _drafter_readme(name: str, target: Literal["gemma4", "qwen3"]) -> str:
    """z-lab card: YAML without ``base_model``; the target is named only in prose."""
    repo, fixture = _PAIRED_WITH[target]
    return (
        "---\nlicense: mit\nlibrary_name: transformers\npipeline_tag: text-generation\ntags:\n- dflash\n"
        "- speculative-decoding\n- block-diffusion\n- draft-model\n---\n\n"
        f"# {name}\n\nDFlash drafter fixture. This model must be paired with {repo} "
        f"(here: targets/{fixture}).\n"
    )


def make_drafter(
    dir: Path,
    *,
    target: Literal["gemma4", "qwen3"],
    variant: str = "default",
    config_overrides: dict[str, Any] | None = None,
    drop_config_keys: Iterable[str] = (),
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop_tensors: Iterable[str] = (),
    tensor_overrides: dict[str, np.ndarray] | None = None,
    readme: bool | None = None,
    auto_map: bool | None = None,
    name: str | None = None,
    dtype: Literal["BF16", "F16", "F32"] = "BF16",
) -> Path:
    """A z-lab DFlash1 drafter under ``dir`` (named after the mirrored repo, ``-{variant}`` appended).

    Order of edits: base config/tensors for ``target`` -> ``variant`` preset -> ``config_overrides``
    (dotted keys such as ``"dflash_config.block_size"`` reach nested dicts) -> ``drop_config_keys``
    (dotted too) -> tensor drops/overrides/extras -> ``readme``/``auto_map`` switches. float32
    arrays are stored as ``dtype`` (BF16 like z-lab), int64 as I64.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown drafter variant {variant!r}; known: {sorted(VARIANTS)}")
    d = Draft(
        target=target, config=_drafter_config(target), readme=target == "qwen3", auto_map=target == "qwen3"
    )
    d.build_tensors(H, len(d.config["dflash_config"]["target_layer_ids"]))
    VARIANTS[variant](d)
    for key, value in (config_overrides or {}).items():
        _set_dotted(d.config, key, value)
    for key in drop_config_keys:
        _drop_dotted(d.config, key)
    for tname in drop_tensors:
        del d.tensors[tname]  # KeyError on a typo is deliberate
    d.tensors.update(tensor_overrides or {})
    d.tensors.update(extra_tensors or {})
    d.readme = d.readme if readme is None else readme
    d.auto_map = d.auto_map if auto_map is None else auto_map

    dirname = name or DRAFTER_NAMES[target] + ("" if variant == "default" else f"-{variant}")
    out = _fresh_dir(Path(dir) / dirname)
    config = dict(d.config)
    if d.auto_map:
        config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
        (out / "dflash.py").write_text(_DFLASH_PY, encoding="utf-8")
    _write_json(out / "config.json", config)
    if d.readme:
        (out / "README.md").write_text(_drafter_readme(dirname, target), encoding="utf-8")
    write_safetensors(out / "model.safetensors", d.tensors, float_dtype=dtype)
    return out


# --------------------------------------------------------------------------------------------------
# everything
# --------------------------------------------------------------------------------------------------


def make_all(
    root: Path, *, llama_cpp_src: Path | None, variants: bool = False, qwen_weights: bool = True
) -> dict[str, Path]:
    """The standard set (section 5 table) under ``root/targets`` and ``root/drafters``, keyed by dir name.

    Qwen fixtures need ``llama_cpp_src`` (for ``models/ggml-vocab-qwen2.gguf``) and are skipped
    without it. ``variants=True`` also writes every drafter preset for each available target.
    """
    root = Path(root)
    targets, drafters = root / "targets", root / "drafters"
    made = [
        make_gemma4_target(targets),
        make_gemma4_target(targets, qat=True),
        make_gemma3_target(targets),
        make_drafter(drafters, target="gemma4"),
    ]
    kinds: list[Literal["gemma4", "qwen3"]] = ["gemma4"]
    if llama_cpp_src is not None:
        made.append(make_qwen3_target(targets, llama_cpp_src=Path(llama_cpp_src), weights=qwen_weights))
        made.append(make_drafter(drafters, target="qwen3"))
        kinds.append("qwen3")
    if variants:
        made += [
            make_drafter(drafters, target=k, variant=v) for k in kinds for v in VARIANTS if v != "default"
        ]
    return {p.name: p for p in made}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument(
        "--llama-cpp-src",
        type=Path,
        default=None,
        help="extracted llama.cpp source (for models/ggml-vocab-qwen2.gguf); enables Qwen fixtures",
    )
    ap.add_argument("--variants", action="store_true", help="also write every drafter variant preset")
    ap.add_argument("--no-qwen-weights", action="store_true", help="skip the ~40 MB Qwen3 target weights")
    args = ap.parse_args(argv)
    made = make_all(
        args.outdir,
        llama_cpp_src=args.llama_cpp_src,
        variants=args.variants,
        qwen_weights=not args.no_qwen_weights,
    )
    for path in made.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
