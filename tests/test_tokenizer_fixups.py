"""tokenizer_fixups: a synthesized tokenizer.model tokenizes as tokenizer.json does; wrong donors are
refused with the id diff; the target (and HF cache) stays byte-identical; bad input fails cleanly."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import fixtures as mf
import pytest
import sentencepiece as spm
import tokenizers
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS
from gguf_compare import diff, read_kv
from sentencepiece import sentencepiece_model_pb2 as pb

from dflash_gguf.cli import main
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.errors import InputError, OutputError, TokenizerError
from dflash_gguf.provenance import PROVENANCE_PREFIX
from dflash_gguf.tokenizer_fixups import fix_tokenizer, read_tokenizer_json, synthesize_tokenizer_model
from dflash_gguf.tokenizer_fixups.repair import OVERLAY_MARKER

SP = pb.ModelProto.SentencePiece
# Reserved ids of the Gemma fixture: SentencePiece's own pad/eos/bos/unk (CONTROL/UNKNOWN in its files).
RESERVED = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}

# Plain text, unicode, added tokens inline (chat, tool, thinking markup), whitespace runs, emoji. No
# literal <bos>/<eos>/<pad>/<unk>: those are the one deliberate divergence (RESERVED_LITERALS).
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog. 12345 3.14159",
    "🚀 rocket ✅ done 🦙🦙 😶\u200d🌫️ 👍🏽",
    "我想在工作 模型数据 日本語のテキスト 한국어 문장",
    "def check(x, y):\n    return x + y  # sum\n\n\tif (a == 1) {\n\t\tcount += 1;\n\t}\n",
    '{"name": "value", "list": [1, 2, 3]}',
    "  two leading spaces",
    "trailing spaces    ",
    "runs of     spaces      and\n\n\n\nnewlines\r\n\r\n",
    " \n \n\n \t \t\t \t\n  \n   \n    \n     \n",
    "<|turn>user\nwhat is 2+2?<turn|>\n<|turn>model\n4<turn|>",
    '<|tool_call>call:check{value:<|"|>42<|"|>}<tool_call|>',
    "<mask>[multimodal]<unused3> <|think|>\n<|channel>thought\nhmm 🤔\n<channel|>done",
    "<|tool>declaration:f{}<tool|><|tool_response>response:f{value:1}<tool_response|>",
    "a<|turn>b<turn|>c  <|\"|>  <|\"|><|\"|>\t<mask><mask>",
    "<|turn <turn| |turn> <|tool_call <tool_call|>> <<|turn>>",  # near misses around real markers
    "Ÿ€𝔘 ΑΒΓ нещо на Български 🦙",
    "",
    " ",
]
RESERVED_LITERALS = ["<bos>", "<bos>hi", "say <eos> now", "<pad><unk>", "\n<bos><|turn>user\nhi<turn|><eos>"]

# Conversations rendered with the fixture's chat template: turns, a system prompt, tool declarations,
# tool calls with quoted arguments, tool responses, a thought channel, thinking on and off.
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city."}}]
_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
CHATS: dict[str, dict[str, Any]] = {
    "turns": {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello! 🦙"},
                           {"role": "user", "content": "what is 2+2?\n\n  spaces   inside"}],
              "add_generation_prompt": True},
    "system": {"messages": [{"role": "system", "content": "You are terse. 我想"},
                            {"role": "user", "content": "check value"}], "add_generation_prompt": False},
    "tools": {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the tool.", "tool_calls": [_CALL]},
        {"role": "tool", "name": "get_weather", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "Sunny, 21 C. ✅"},
        {"role": "user", "content": "and tomorrow?"}],
        "tools": _TOOLS, "add_generation_prompt": True},
    "thinking": {"messages": [{"role": "user", "content": "think about it"}], "enable_thinking": True,
                 "add_generation_prompt": True},
}


def _render_chat(target: Path, chat: dict[str, Any]) -> str:
    """The prompt text transformers' apply_chat_template renders (same jinja2 settings), before encoding."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        pytest.fail("jinja2 is needed to render the chat template: pip install -e '.[test]'", pytrace=False)
    cfg = json.loads((target / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = (target / "chat_template.jinja").read_text(encoding="utf-8")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(bos_token=cfg["bos_token"], eos_token=cfg["eos_token"], **chat)


def _hash_tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``: symlinks by target, files by content (symlinks followed for files)."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokfx")
    donor = root / "donor-gemma4" / "tokenizer.model"
    donor.parent.mkdir()
    donor.write_bytes(mf.gemma4_sentencepiece_proto_bytes())
    return {
        "gemma4": mf.make_gemma4_target(root),
        "gemma3": mf.make_gemma3_target(root),
        "good_donor": donor,
    }


@pytest.fixture
def gemma4(fx: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the Gemma-4 target a test may damage."""
    return Path(shutil.copytree(fx["gemma4"], tmp_path / "gemma-4-tiny-it"))


@pytest.fixture(scope="module")
def synthesized(fx: dict[str, Path]) -> bytes:
    return synthesize_tokenizer_model(fx["gemma4"] / "tokenizer.json")[0]


@pytest.fixture(scope="module")
def sp(synthesized: bytes) -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_proto=synthesized)


@pytest.fixture(scope="module")
def tok(fx: dict[str, Path]) -> tokenizers.Tokenizer:
    """tokenizer.json with the library's default settings (added tokens matched in text, special or not)."""
    return tokenizers.Tokenizer.from_file(str(fx["gemma4"] / "tokenizer.json"))


def _types(model: bytes) -> list[int]:
    m = pb.ModelProto()
    m.ParseFromString(model)
    return [p.type for p in m.pieces]


def _assert_same_encoding(sp: spm.SentencePieceProcessor, tok: tokenizers.Tokenizer, text: str) -> None:
    """Same ids and pieces from both libraries, and both decode them back to ``text``."""
    enc = tok.encode(text, add_special_tokens=False)
    assert sp.encode(text) == enc.ids
    assert sp.encode(text, out_type=str) == enc.tokens
    assert sp.decode(enc.ids) == text
    assert tok.decode(enc.ids, skip_special_tokens=False) == text


# ------------------------------------------------------------------------------------------ synthesis


def test_every_id_has_the_tokenizer_json_piece_and_type(fx: dict[str, Path], synthesized: bytes,
                                                        sp: spm.SentencePieceProcessor,
                                                        tok: tokenizers.Tokenizer) -> None:
    assert sp.get_piece_size() == tok.get_vocab_size(with_added_tokens=True) == 512
    for i in range(sp.get_piece_size()):
        assert sp.id_to_piece(i) == tok.id_to_token(i), i
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (3, 2, 1, 0)
    types = _types(synthesized)
    # SentencePiece's reserved pieces keep Gemma's types; every other added token is matched in text.
    assert [types[i] for i in range(4)] == [SP.CONTROL, SP.CONTROL, SP.CONTROL, SP.UNKNOWN]
    added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
    assert set(added) >= {"<|turn>", "<turn|>", "<|tool_call>", '<|"|>', "<|think|>", "<|channel>", "<mask>"}
    for piece, i in added.items():
        if piece not in RESERVED:
            assert types[i] == SP.USER_DEFINED, piece
    assert all(sp.is_byte(sp.piece_to_id(f"<0x{b:02X}>")) for b in range(256))
    assert types[107] == SP.NORMAL and sp.id_to_piece(107) == "\n"
    assert sum(t == SP.CONTROL for t in types) == 3 and sum(t == SP.USER_DEFINED for t in types) == len(added) - 4
    # Same ids as the SentencePiece model the fixture's tokenizer.json was generated from.
    original = spm.SentencePieceProcessor(model_proto=mf.gemma4_sentencepiece_proto_bytes())
    assert [original.id_to_piece(i) for i in range(512)] == [sp.id_to_piece(i) for i in range(512)]


def test_settings_make_sentencepiece_tokenize_like_tokenizer_json(synthesized: bytes) -> None:
    m = pb.ModelProto()
    m.ParseFromString(synthesized)
    assert m.trainer_spec.model_type == pb.TrainerSpec.BPE and m.trainer_spec.byte_fallback
    ns = m.normalizer_spec
    assert (ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces, ns.escape_whitespaces) == \
        ("identity", False, False, True)
    assert ns.precompiled_charsmap == b""


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_sentencepiece_encodes_like_tokenizers(sp: spm.SentencePieceProcessor, tok: tokenizers.Tokenizer,
                                               text: str) -> None:
    _assert_same_encoding(sp, tok, text)


def test_chat_markup_is_single_tokens_not_bytes(sp: spm.SentencePieceProcessor) -> None:
    assert sp.encode("<|turn>user\nhi<turn|>", out_type=str)[:3] == ["<|turn>", "user", "\n"]
    assert sp.encode("<|turn>user\nhi<turn|>")[0] == 105 and sp.encode("x<turn|>")[-1] == 106
    assert not any(p.startswith("<0x") for p in sp.encode('<|tool_call>call:f{a:<|"|>b<|"|>}<tool_call|>',
                                                          out_type=str))


@pytest.mark.parametrize("name", list(CHATS))
def test_chat_template_prompts_encode_like_tokenizers(fx: dict[str, Path], sp: spm.SentencePieceProcessor,
                                                      tok: tokenizers.Tokenizer, name: str) -> None:
    prompt = _render_chat(fx["gemma4"], CHATS[name])
    assert prompt.startswith("<bos><|turn>")
    if name == "tools":
        for marker in ("<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>",
                       "<tool_response|>", "<|channel>", "<channel|>"):
            assert marker in prompt, marker
    if name == "thinking":
        assert "<|think|>" in prompt
    # What transformers' apply_chat_template(tokenize=True) encodes: the rendered text, no extra specials.
    enc = tok.encode(prompt, add_special_tokens=False)
    assert enc.ids[0] == 2 and 105 in enc.ids and not any(t.startswith("<0x3C>") for t in enc.tokens)
    body = prompt.removeprefix("<bos>")  # the template's leading bos_token: SentencePiece adds it itself
    _assert_same_encoding(sp, tok, body)
    assert sp.encode(body, add_bos=True) == enc.ids
    assert sp.encode(body, add_bos=True, out_type=str) == enc.tokens
    assert sp.decode(enc.ids) == body  # decoding drops the CONTROL <bos>, like skip_special_tokens
    assert tok.decode(enc.ids, skip_special_tokens=False) == prompt


@pytest.mark.parametrize("text", RESERVED_LITERALS, ids=range(len(RESERVED_LITERALS)))
def test_literal_reserved_tokens_are_text_to_sentencepiece(sp: spm.SentencePieceProcessor,
                                                           tok: tokenizers.Tokenizer, text: str) -> None:
    """The documented divergence: tokenizers matches a literal "<bos>" in text, SentencePiece (whose bos/
    eos/pad/unk must be CONTROL/UNKNOWN) spells it out; everything else still encodes the same."""
    ids = sp.encode(text)
    assert not set(ids) & set(RESERVED.values())
    assert sp.decode(ids) == text
    assert set(tok.encode(text, add_special_tokens=False).ids) & set(RESERVED.values())
    # SentencePiece = tokenizers with the reserved strings as plain text and every other added token matched.
    parts = re.split("(" + "|".join(map(re.escape, RESERVED)) + ")", text)
    literal = tokenizers.Tokenizer.from_str(tok.to_str())
    literal.encode_special_tokens = True
    expected = [i for part in parts if part
                for i in (literal if part in RESERVED else tok).encode(part, add_special_tokens=False).ids]
    assert ids == expected


def test_added_tokens_not_flagged_special_are_matched_too(fx: dict[str, Path], tmp_path: Path) -> None:
    """tokenizers matches added tokens in text whether flagged ``special`` or not: the type ignores the flag."""
    data = json.loads((fx["gemma4"] / "tokenizer.json").read_text(encoding="utf-8"))
    for t in data["added_tokens"]:
        if t["content"] in ('<|"|>', "<|channel>", "<turn|>", "<eos>"):
            t["special"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    shutil.copyfile(fx["gemma4"] / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    model, vocab = synthesize_tokenizer_model(tmp_path / "tokenizer.json")
    assert vocab.types[1] == "CONTROL" and vocab.types[52] == vocab.types[100] == vocab.types[106] == "USER_DEFINED"
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok.encode_special_tokens = True  # no longer matches the special-flagged ones, still the unflagged ones
    assert tok.encode('<|"|>x<turn|>', add_special_tokens=False).ids[::2] == [52, 106]
    tok.encode_special_tokens = False
    for text in CORPUS:
        _assert_same_encoding(sp, tok, text)


def test_without_tokenizer_config_every_added_token_is_matched(fx: dict[str, Path], tmp_path: Path) -> None:
    """No tokenizer_config.json names bos/eos/pad: nothing is CONTROL, no bos id, and even "<bos>" encodes alike."""
    shutil.copyfile(fx["gemma4"] / "tokenizer.json", tmp_path / "tokenizer.json")
    model, vocab = synthesize_tokenizer_model(tmp_path / "tokenizer.json")
    assert "CONTROL" not in vocab.types and vocab.types[2] == "USER_DEFINED" and vocab.special_ids == {"unk": 3}
    sp = spm.SentencePieceProcessor(model_proto=model)
    assert (sp.bos_id(), sp.eos_id(), sp.pad_id()) == (-1, -1, -1)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in [*CORPUS, *[t for t in RESERVED_LITERALS if "<unk>" not in t]]:
        _assert_same_encoding(sp, tok, text)


def test_notes_for_added_tokens_sentencepiece_cannot_match_alike(fx: dict[str, Path], tmp_path: Path) -> None:
    assert not any("added token" in n for n in read_tokenizer_json(fx["gemma4"] / "tokenizer.json").notes)
    data = json.loads((fx["gemma4"] / "tokenizer.json").read_text(encoding="utf-8"))
    next(t for t in data["added_tokens"] if t["content"] == "<|turn>")["lstrip"] = True
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    notes = read_tokenizer_json(tmp_path / "tokenizer.json").notes
    assert any("lstrip/rstrip/single_word" in n and "'<|turn>'" in n for n in notes), notes


def _mutated_tokenizer_json(src: Path, dst_dir: Path, edit: dict[str, object]) -> Path:
    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    for dotted, value in edit.items():
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            node = node[key]
        node[last] = value
    dst_dir.mkdir(parents=True, exist_ok=True)
    (dst_dir / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return dst_dir / "tokenizer.json"


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ({"model.type": "Unigram"}, "Unigram"),
        ({"model.type": "WordPiece"}, "WordPiece"),
        ({"model.byte_fallback": False}, "without byte_fallback"),
        ({"normalizer": {"type": "NFKC"}}, "compiled SentencePiece charsmap"),
        ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}}, "pre-tokenizer 'ByteLevel'"),
        ({"model.dropout": 0.1}, "dropout"),
        ({"model.unk_token": None}, "UNKNOWN piece"),
    ],
)
def test_refuses_tokenizer_json_sentencepiece_cannot_mirror(fx: dict[str, Path], tmp_path: Path,
                                                            edit: dict[str, object], reason: str) -> None:
    path = _mutated_tokenizer_json(fx["gemma4"], tmp_path, edit)
    with pytest.raises(TokenizerError, match=re.escape(reason)):
        synthesize_tokenizer_model(path)


def test_llama_style_prepend_normalizer_sets_dummy_prefix(fx: dict[str, Path], tmp_path: Path) -> None:
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    path = _mutated_tokenizer_json(fx["gemma4"], tmp_path, {"normalizer": {
        "type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, replace]}})
    vocab = read_tokenizer_json(path)
    assert vocab.add_dummy_prefix is True
    # tokenizers prepends ▁ after every added token it matches too; SentencePiece only at the start.
    assert any("Prepend" in n and "inline" in n for n in vocab.notes), vocab.notes
    sp = spm.SentencePieceProcessor(model_proto=synthesize_tokenizer_model(path)[0])
    tok = tokenizers.Tokenizer.from_file(str(path))
    for text in CORPUS[:9]:
        enc = tok.encode(text, add_special_tokens=False)
        assert (sp.encode(text), sp.encode(text, out_type=str)) == (enc.ids, enc.tokens), text
        assert sp.decode(enc.ids) == text  # (this tokenizer.json has no Strip decoder for the prefix)


# ----------------------------------------------------------------------------------- donors, overlays


def test_wrong_donor_is_refused_with_the_id_diff(fx: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "overlay"
    with pytest.raises(TokenizerError) as err:
        fix_tokenizer(fx["gemma4"], donor=str(fx["gemma3"] / "tokenizer.model"), out=out)
    msg = str(err.value)
    assert msg.startswith(f"tokenizer.model from {(fx['gemma3'] / 'tokenizer.model').resolve()} does not match ")
    assert "105: '<start_of_turn>' (donor) vs '<|turn>' (target)" in msg
    assert "106: '<end_of_turn>' (donor) vs '<turn|>' (target)" in msg
    assert re.search(r"\b\d+ ids differ\b", msg) and "--force-donor" in msg
    assert not out.exists() and not (tmp_path / "overlay.partial").exists()


def test_matching_donor_is_accepted(fx: dict[str, Path], tmp_path: Path) -> None:
    result = fix_tokenizer(fx["gemma4"], donor=str(fx["good_donor"]), out=tmp_path / "overlay")
    assert result.donor_diff is not None and result.donor_diff.matches
    assert result.origin == f"donor {fx['good_donor'].resolve()}"
    assert (tmp_path / "overlay" / "tokenizer.model").read_bytes() == fx["good_donor"].read_bytes()


def test_force_donor_uses_a_wrong_donor_and_says_so(fx: dict[str, Path], tmp_path: Path) -> None:
    result = fix_tokenizer(fx["gemma4"], donor=str(fx["gemma3"]), force_donor=True, out=tmp_path / "o")
    assert result.origin.startswith("donor ") and any("--force-donor" in n for n in result.notes)


def test_foreign_tokenizer_model_in_target_is_reported_then_repaired(gemma4: Path, fx: dict[str, Path],
                                                                     tmp_path: Path, synthesized: bytes) -> None:
    shutil.copyfile(fx["gemma3"] / "tokenizer.model", gemma4 / "tokenizer.model")
    before = _hash_tree(gemma4)
    with pytest.raises(TokenizerError, match=r"105: '<start_of_turn>' \(existing\) vs '<\|turn>' \(target\)"):
        fix_tokenizer(gemma4)
    result = fix_tokenizer(gemma4, repair=True, out=tmp_path / "overlay")
    assert (result.existing, result.origin) == ("foreign", "synthesized")
    assert (tmp_path / "overlay" / "tokenizer.model").read_bytes() == synthesized
    assert _hash_tree(gemma4) == before


def test_matching_tokenizer_model_in_target_is_original(fx: dict[str, Path]) -> None:
    result = fix_tokenizer(fx["gemma3"])  # Gemma-3's own file matches Gemma-3's tokenizer.json
    assert (result.existing, result.origin, result.overlay) == ("matches", "original", None)


def _fake_hf_cache(src: Path, cache: Path) -> Path:
    """An HF-cache-shaped copy of ``src``: blobs by sha256, snapshot files symlinked to them."""
    repo = cache / "models--google--gemma-4-tiny-it"
    snap = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, repo / "blobs" / digest)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snap


def test_overlay_leaves_cache_identical_and_converts_the_same_drafter(fx: dict[str, Path], tmp_path: Path,
                                                                      synthesized: bytes) -> None:
    cache = tmp_path / "hub"
    snap = _fake_hf_cache(fx["gemma4"], cache)
    before = _hash_tree(cache)
    result = fix_tokenizer(snap, out=tmp_path / "overlay")
    overlay = tmp_path / "overlay"
    assert result.overlay == overlay and result.origin == "synthesized"
    assert (overlay / "tokenizer.model").read_bytes() == synthesized
    assert json.loads((overlay / OVERLAY_MARKER).read_text())["tokenizer.origin"] == "synthesized"
    assert (overlay / "tokenizer.json").read_bytes() == (snap / "tokenizer.json").read_bytes()
    assert _hash_tree(cache) == before
    assert not (snap / "tokenizer.model").exists()

    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    direct = convert_drafter(drafter, snap, tmp_path / "direct.gguf")
    via = convert_drafter(drafter, snap, tmp_path / "overlay.gguf", tokenizer_dir=overlay,
                          provenance=result.provenance())
    assert diff(via.outfile, direct.outfile) == []  # every tensor and every non-provenance key
    kv_direct, kv_via = read_kv(direct.outfile), read_kv(via.outfile)
    assert kv_direct[PROVENANCE_PREFIX + "tokenizer.origin"][1] == "original"
    assert kv_via[PROVENANCE_PREFIX + "tokenizer.origin"][1] == "synthesized"
    assert kv_via[PROVENANCE_PREFIX + "target.vocab_sha256"] == kv_direct[PROVENANCE_PREFIX + "target.vocab_sha256"]
    assert _hash_tree(cache) == before


def test_rerun_replaces_its_own_overlay_but_not_a_foreign_dir(fx: dict[str, Path], tmp_path: Path) -> None:
    fix_tokenizer(fx["gemma4"], out=tmp_path / "overlay")
    fix_tokenizer(fx["gemma4"], out=tmp_path / "overlay")  # ours: replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep", encoding="utf-8")
    with pytest.raises(OutputError, match="is not an overlay dflash-gguf wrote"):
        fix_tokenizer(fx["gemma4"], out=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text(encoding="utf-8") == "keep"


@pytest.mark.parametrize("inside", ["target", "cache"])
def test_never_writes_into_target_or_hf_cache(gemma4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              inside: str) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    out = gemma4 / "fixed" if inside == "target" else tmp_path / "models--x" / "fixed"
    out.parent.mkdir(exist_ok=True)
    before = _hash_tree(gemma4)
    with pytest.raises(OutputError, match="must stay untouched"):
        fix_tokenizer(gemma4, out=out)
    assert _hash_tree(gemma4) == before and not out.exists()


# ------------------------------------------------------------------------------------------ bad input


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_truncated_tokenizer_json(gemma4: Path, tmp_path: Path) -> None:
    _truncate(gemma4 / "tokenizer.json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is corrupt, truncated or not a Hugging Face"):
        fix_tokenizer(gemma4, out=tmp_path / "overlay")
    assert not (tmp_path / "overlay").exists() and not (tmp_path / "overlay.partial").exists()


def test_truncated_tokenizer_model_in_target(gemma4: Path, fx: dict[str, Path], tmp_path: Path) -> None:
    shutil.copyfile(fx["good_donor"], gemma4 / "tokenizer.model")
    _truncate(gemma4 / "tokenizer.model")
    with pytest.raises(TokenizerError, match=r"tokenizer\.model is corrupt, truncated or not a SentencePiece model"):
        fix_tokenizer(gemma4, out=tmp_path / "overlay")
    assert not (tmp_path / "overlay").exists()
    result = fix_tokenizer(gemma4, repair=True, out=tmp_path / "overlay")  # --repair replaces it
    assert (result.existing, result.origin) == ("corrupt", "synthesized")


@pytest.mark.parametrize("content", [b"", b"not a sentencepiece model at all \xff\xfe"], ids=["empty", "garbage"])
def test_corrupt_donor(fx: dict[str, Path], tmp_path: Path, content: bytes) -> None:
    donor = tmp_path / "tokenizer.model"
    donor.write_bytes(content)
    with pytest.raises(TokenizerError, match="is corrupt, truncated or not a SentencePiece model"):
        fix_tokenizer(fx["gemma4"], donor=str(donor), out=tmp_path / "overlay")
    assert not (tmp_path / "overlay").exists()


def test_tokenizer_larger_than_config_vocab_size(gemma4: Path) -> None:
    cfg = json.loads((gemma4 / "config.json").read_text(encoding="utf-8"))
    cfg["text_config"]["vocab_size"] = 500
    (gemma4 / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"has 512 tokens but .*config\.json vocab_size is 500"):
        fix_tokenizer(gemma4)


def test_embedding_rows_past_the_tokenizer_are_fine(gemma4: Path) -> None:
    cfg = json.loads((gemma4 / "config.json").read_text(encoding="utf-8"))
    cfg["text_config"]["vocab_size"] = 640  # padded embedding table, as Qwen and some Gemma exports have
    (gemma4 / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    result = fix_tokenizer(gemma4)
    assert result.config_vocab_size == 640 and any("padding rows" in n for n in result.notes)


def test_donor_path_that_does_not_exist(fx: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InputError, match="neither an existing file nor a Hub repo id"):
        fix_tokenizer(fx["gemma4"], donor=str(tmp_path / "nope" / "tokenizer.model"))


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_text_report(fx: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["fix-tokenizer", str(fx["gemma4"]), "--out", str(tmp_path / "ov")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"target: {fx['gemma4']} (tokenizer.json: 512 tokens, config vocab_size 512)"
    assert lines[1:3] == ["tokenizer.model in target: missing", "tokenizer origin: synthesized"]
    assert lines[3].startswith(f"wrote overlay {tmp_path / 'ov'} (tokenizer.model sha256 ")


def test_cli_json(fx: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["fix-tokenizer", str(fx["gemma4"]), "--donor", str(fx["good_donor"]),
                                       "--out", str(tmp_path / "ov"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["origin"] == f"donor {fx['good_donor'].resolve()}" and doc["donor_diff"]["matches"] is True
    assert doc["provenance"]["tokenizer.origin"] == doc["origin"] and doc["overlay"] == str(tmp_path / "ov")


@pytest.mark.parametrize(
    ("args", "exit_code", "message"),
    [
        (["--donor", "{gemma3}/tokenizer.model"], 7,
         "105: '<start_of_turn>' (donor) vs '<|turn>' (target)"),
        (["--force-donor"], 2, "Error: --force-donor needs --donor."),
        (["--donor", "./missing/tokenizer.model"], 2, "neither an existing file nor a Hub repo id"),
    ],
)
def test_cli_errors(fx: dict[str, Path], args: list[str], exit_code: int, message: str) -> None:
    args = [a.format(gemma3=fx["gemma3"]) for a in args]
    result = CliRunner().invoke(main, ["fix-tokenizer", str(fx["gemma4"]), *args])
    assert result.exit_code == exit_code, result.output
    assert message in result.output


# ------------------------------------------------------------------------- llama.cpp b11434 reference

# Runs b11434's own TextModel._create_vocab_sentencepiece (the body of _set_vocab_sentencepiece) on each dir.
_REF_SCRIPT = """
import json, sys, types
from pathlib import Path
src = Path(sys.argv[1])
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion import base
for model_dir in map(Path, sys.argv[2:]):
    cfg = json.loads((model_dir / "config.json").read_text())
    size = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    stub = types.SimpleNamespace(dir_model=model_dir)
    stub.find_hparam = lambda keys, optional=False: size
    stub.does_token_look_special = lambda t: base.TextModel.does_token_look_special(stub, t)
    tokens, scores, types_ = base.TextModel._create_vocab_sentencepiece(stub)
    print(json.dumps({"tokens": [t.decode() for t in tokens], "scores": scores, "types": [int(t) for t in types_]}))
"""
# gguf TokenType values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


@pytest.mark.reference
def test_llama_cpp_sentencepiece_path_types_the_synthesized_file_as_a_gemma_one(
        fx: dict[str, Path], tmp_path: Path, synthesized: bytes) -> None:
    import subprocess

    import reference

    from dflash_gguf.convert.vocab import GEMMA4_VISIBLE

    reference.require_or_skip(reference.reference_available())
    overlay, gemma_file, bare = tmp_path / "overlay", tmp_path / "gemma-file", tmp_path / "bare"
    fix_tokenizer(fx["gemma4"], out=overlay)
    # The same dir holding the fixture's Gemma SentencePiece model (Gemma-typed pieces) instead of ours.
    shutil.copytree(overlay, gemma_file)
    shutil.copyfile(fx["good_donor"], gemma_file / "tokenizer.model")
    # Our file without tokenizer_config.json's added_tokens_decoder: the types b11434 takes from the file alone.
    shutil.copytree(overlay, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text(encoding="utf-8"))
    del cfg["added_tokens_decoder"]
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    proc = subprocess.run(
        [str(reference.env.venv_python(reference.env.ref_venv_dir())), "-c", _REF_SCRIPT,
         str(reference.env.llama_cpp_src()), str(overlay), str(gemma_file), str(bare)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref, ref_gemma, ref_bare = (json.loads(line) for line in proc.stdout.strip().splitlines()[-3:])

    drafter = mf.make_drafter(tmp_path / "drafters", target="gemma4")
    ours = read_kv(convert_drafter(drafter, fx["gemma4"], tmp_path / "d.gguf").outfile)
    tokens = ours["tokenizer.ggml.tokens"][1]
    types = ours["tokenizer.ggml.token_type"][1]
    assert ref["tokens"] == ref_gemma["tokens"] == ref_bare["tokens"] == tokens
    # tokenizer_config.json's added_tokens_decoder decides every added token's type (its "special" flag,
    # here set on all of them): the same GGUF types as from a Gemma-typed SentencePiece file.
    assert ref["types"] == ref_gemma["types"]
    added = {tokens.index(c) for c in (*RESERVED, "<mask>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|think|>",
                                       *GEMMA4_VISIBLE)}
    assert {ref["types"][i] for i in added} == {CONTROL}
    # b11434's Gemma-4 path (ours mirrors it) reads tokenizer.json and forces seven chat/tool markers to
    # USER_DEFINED; no tokenizer.model can make its SentencePiece path do that. Every other id agrees.
    forced = {i for i, t in enumerate(tokens) if t in GEMMA4_VISIBLE}
    assert len(forced) == 7 and {types[i] for i in forced} == {USER_DEFINED}
    assert [t for i, t in enumerate(ref["types"]) if i not in forced] == \
        [t for i, t in enumerate(types) if i not in forced]
    # From the file alone: CONTROL/UNKNOWN/BYTE kept, USER_DEFINED read as NORMAL (no branch for it).
    file_types = _types(synthesized)
    expected = {SP.CONTROL: CONTROL, SP.UNKNOWN: UNKNOWN, SP.BYTE: BYTE, SP.NORMAL: NORMAL, SP.USER_DEFINED: NORMAL}
    assert ref_bare["types"] == [expected[t] for t in file_types]
    assert ref_bare["types"][:4] == [CONTROL, CONTROL, CONTROL, UNKNOWN]
    # Scores: the Gemma-4 path writes -1000 everywhere; the SentencePiece path reads the file's own
    # scores (-1000 for tokenizer_config's added tokens), which are the merge ranks we synthesized.
    sp = spm.SentencePieceProcessor(model_proto=synthesized)
    special = {int(k) for k in json.loads((fx["gemma4"] / "tokenizer_config.json").read_text())["added_tokens_decoder"]}
    assert ref["scores"] == [-1000.0 if i in special else sp.get_score(i) for i in range(len(tokens))]
    assert ref_bare["scores"] == [sp.get_score(i) for i in range(len(tokens))]
    assert set(ours["tokenizer.ggml.scores"][1]) == {-1000.0}
    REFERENCE_COMPARISONS.append("synthesized tokenizer.model via _set_vocab_sentencepiece")


def _hub_env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    from hub_server import client_env

    return client_env(endpoint, tmp_path / "hf-home") | {"HF_HUB_DISABLE_TELEMETRY": "1"}


def test_donor_from_the_hub_through_the_real_client(fx: dict[str, Path], tmp_path: Path) -> None:
    """The real huggingface_hub client fetches the donor from a loopback Hub; the wrong donor is refused
    with the id diff and the right one is recorded as REPO@COMMIT; the HF cache is only ever read."""
    import subprocess
    import sys

    from hub_server import FakeRepo, fake_hub

    cli = Path(sys.executable).parent / "dflash-gguf"
    wrong = FakeRepo({"tokenizer.model": (fx["gemma3"] / "tokenizer.model").read_bytes(), "config.json": b"{}"})
    right = FakeRepo({"tokenizer.model": fx["good_donor"].read_bytes(), "config.json": b"{}"})
    with fake_hub({"google/gemma-3-12b-it": wrong, "me/gemma-4-tokenizer": right}) as url:
        env = _hub_env(tmp_path, url)
        run = lambda *args: subprocess.run([str(cli), "fix-tokenizer", str(fx["gemma4"]), *args],  # noqa: E731
                                           env=env, capture_output=True, text=True, timeout=120)
        refused = run("--donor", "google/gemma-3-12b-it", "--out", str(tmp_path / "ov1"))
        assert refused.returncode == 7, refused.stdout + refused.stderr
        assert "105: '<start_of_turn>' (donor) vs '<|turn>' (target)" in refused.stdout + refused.stderr
        assert not (tmp_path / "ov1").exists()
        accepted = run("--donor", "me/gemma-4-tokenizer", "--out", str(tmp_path / "ov2"), "--json")
        assert accepted.returncode == 0, accepted.stdout + accepted.stderr
        assert json.loads(accepted.stdout)["origin"] == f"donor me/gemma-4-tokenizer@{right.sha}"
        missing = run("--donor", "nobody/nothing", "--out", str(tmp_path / "ov3"))
        assert missing.returncode == 9 and "Cannot fetch tokenizer.model from nobody/nothing" in missing.stderr
        assert not (tmp_path / "ov3").exists()
