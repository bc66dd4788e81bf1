"""tokenizer_fixups: a synthesized tokenizer.model tokenizes as tokenizer.json does; wrong donors are
refused with the id diff; the target (and HF cache) stays byte-identical; bad input fails cleanly."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import make_fixtures
import pytest
from click.testing import CliRunner
from conftest import REFERENCE_COMPARISONS
from gguf_compare import diff, read_kv

from dflash_gguf.cli import main
from dflash_gguf.convert.constants import PROVENANCE_PREFIX
from dflash_gguf.convert.drafter import convert_drafter
from dflash_gguf.errors import InputError, OutputError, TokenizerError
from dflash_gguf.tokenizer_fixups import fix_tokenizer, read_tokenizer_json, synthesize_tokenizer_model
from dflash_gguf.tokenizer_fixups.repair import OVERLAY_MARKER

spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")
pytest.importorskip("google.protobuf", reason="protobuf is not installed (sentencepiece_model_pb2 needs it)")

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
    "<bos><eos><pad><unk><mask>[multimodal]<unused3>",
    "Ÿ€𝔘 ΑΒΓ нещо на Български 🦙",
    "",
    " ",
]


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
    donor.write_bytes(make_fixtures.gemma4_sentencepiece_proto_bytes())
    return {
        "gemma4": make_fixtures.make_gemma4_target(root),
        "gemma3": make_fixtures.make_gemma3_target(root),
        "good_donor": donor,
    }


@pytest.fixture
def gemma4(fx: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of the Gemma-4 target a test may damage."""
    return Path(shutil.copytree(fx["gemma4"], tmp_path / "gemma-4-tiny-it"))


@pytest.fixture(scope="module")
def synthesized(fx: dict[str, Path]) -> bytes:
    return synthesize_tokenizer_model(fx["gemma4"] / "tokenizer.json")[0]


# ------------------------------------------------------------------------------------------ synthesis


def test_every_id_has_the_tokenizer_json_piece_and_type(fx: dict[str, Path], synthesized: bytes) -> None:
    sp = spm.SentencePieceProcessor(model_proto=synthesized)
    tok = tokenizers.Tokenizer.from_file(str(fx["gemma4"] / "tokenizer.json"))
    assert sp.get_piece_size() == tok.get_vocab_size(with_added_tokens=True) == 512
    for i in range(sp.get_piece_size()):
        assert sp.id_to_piece(i) == tok.id_to_token(i), i
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (3, 2, 1, 0)
    assert sp.is_unknown(3) and sp.is_control(105) and sp.is_control(106)
    assert all(sp.is_byte(sp.piece_to_id(f"<0x{b:02X}>")) for b in range(256))
    assert not sp.is_control(107) and sp.id_to_piece(107) == "\n"
    # Same ids as the SentencePiece model the fixture's tokenizer.json was generated from.
    original = spm.SentencePieceProcessor(model_proto=make_fixtures.gemma4_sentencepiece_proto_bytes())
    assert [original.id_to_piece(i) for i in range(512)] == [sp.id_to_piece(i) for i in range(512)]


def test_settings_make_sentencepiece_tokenize_like_tokenizer_json(synthesized: bytes) -> None:
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(synthesized)
    assert m.trainer_spec.model_type == pb.TrainerSpec.BPE and m.trainer_spec.byte_fallback
    ns = m.normalizer_spec
    assert (ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces, ns.escape_whitespaces) == \
        ("identity", False, False, True)
    assert ns.precompiled_charsmap == b""


def _spm_with_specials(sp: spm.SentencePieceProcessor, specials: list[str], text: str) -> list[int]:
    """SentencePiece never matches CONTROL pieces in text; tokenizers does. Split them out like callers do."""
    if not specials:
        return sp.encode(text)
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    ids: list[int] = []
    for part in re.split(pattern, text):
        if part in specials:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids.extend(sp.encode(part))
    return ids


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_sentencepiece_ids_equal_tokenizers_ids(fx: dict[str, Path], synthesized: bytes, text: str) -> None:
    sp = spm.SentencePieceProcessor(model_proto=synthesized)
    tok = tokenizers.Tokenizer.from_file(str(fx["gemma4"] / "tokenizer.json"))
    # Special-token strings as plain text (tokenizers' encode_special_tokens = SentencePiece CONTROL rules).
    tok.encode_special_tokens = True
    assert sp.encode(text) == tok.encode(text, add_special_tokens=False).ids
    # Special-token strings matched as tokens (tokenizers' default).
    tok.encode_special_tokens = False
    specials = [t.content for t in tok.get_added_tokens_decoder().values()]
    assert _spm_with_specials(sp, specials, text) == tok.encode(text, add_special_tokens=False).ids
    assert sp.decode(sp.encode(text)) == text


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
    assert read_tokenizer_json(path).add_dummy_prefix is True
    sp = spm.SentencePieceProcessor(model_proto=synthesize_tokenizer_model(path)[0])
    tok = tokenizers.Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    for text in CORPUS[:8]:
        assert sp.encode(text) == tok.encode(text, add_special_tokens=False).ids, text


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

    drafter = make_fixtures.make_drafter(tmp_path / "drafters", target="gemma4")
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

# Runs b11434's own TextModel._create_vocab_sentencepiece (the body of _set_vocab_sentencepiece) on a dir.
_REF_SCRIPT = """
import json, sys, types
from pathlib import Path
src, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion import base
cfg = json.loads((model_dir / "config.json").read_text())
size = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
stub = types.SimpleNamespace(dir_model=model_dir)
stub.find_hparam = lambda keys, optional=False: size
stub.does_token_look_special = lambda t: base.TextModel.does_token_look_special(stub, t)
tokens, scores, types_ = base.TextModel._create_vocab_sentencepiece(stub)
print(json.dumps({"tokens": [t.decode() for t in tokens], "scores": scores, "types": [int(t) for t in types_]}))
"""


def test_llama_cpp_sentencepiece_path_accepts_the_synthesized_file(fx: dict[str, Path], tmp_path: Path,
                                                                   synthesized: bytes) -> None:
    import subprocess

    import reference

    from dflash_gguf.convert.vocab import GEMMA4_VISIBLE

    reason = reference.reference_available()
    if reason is not None:
        print(f"skipping: llama.cpp b11434 reference venv not available ({reason})")
        pytest.skip(reason)
    fix_tokenizer(fx["gemma4"], out=tmp_path / "overlay")
    proc = subprocess.run(
        [str(reference.env.venv_python(reference.env.ref_venv_dir())), "-c", _REF_SCRIPT,
         str(reference.env.llama_cpp_src()), str(tmp_path / "overlay")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref = json.loads(proc.stdout.strip().splitlines()[-1])

    drafter = make_fixtures.make_drafter(tmp_path / "drafters", target="gemma4")
    ours = read_kv(convert_drafter(drafter, fx["gemma4"], tmp_path / "d.gguf").outfile)
    tokens = ours["tokenizer.ggml.tokens"][1]
    types = ours["tokenizer.ggml.token_type"][1]
    assert ref["tokens"] == tokens
    # b11434's Gemma-4 path forces seven chat/tool markers to USER_DEFINED; its SentencePiece path
    # keeps tokenizer_config's "special" flag (CONTROL). Every other id has the same type.
    forced = {i for i, t in enumerate(tokens) if t in GEMMA4_VISIBLE}
    assert len(forced) == 7
    assert [t for i, t in enumerate(ref["types"]) if i not in forced] == \
        [t for i, t in enumerate(types) if i not in forced]
    # Scores: the Gemma-4 path writes -1000 everywhere; the SentencePiece path reads the file's own
    # scores (-1000 for tokenizer_config's added tokens), which are the merge ranks we synthesized.
    sp = spm.SentencePieceProcessor(model_proto=synthesized)
    special = {int(k) for k in json.loads((fx["gemma4"] / "tokenizer_config.json").read_text())["added_tokens_decoder"]}
    assert ref["scores"] == [-1000.0 if i in special else sp.get_score(i) for i in range(len(tokens))]
    assert set(ours["tokenizer.ggml.scores"][1]) == {-1000.0}
    REFERENCE_COMPARISONS.append("synthesized tokenizer.model via _set_vocab_sentencepiece")


def _hub_env(tmp_path: Path, endpoint: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


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
