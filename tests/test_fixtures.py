"""The offline fixtures (tests/fixtures, also written by scripts/make_fixtures.py) are deterministic and real."""

from __future__ import annotations

import ast
import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path

import fixtures as mf
import numpy as np
import pytest
import reference
import safetensors as st
import sentencepiece as spm
from conftest import REFERENCE_COMPARISONS, llama_cpp_src
from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]
QWEN2_CHKHSH = "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea"

# Text without CONTROL strings (SentencePiece never matches those in raw text, tokenizers does).
ROUND_TRIP_CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "def foo(x, y):\n    return x + y  # 🚀🦙\n\n\n",
    "if (a == 3) {\n\tcount += 1;\n}\n",
    "我想在apple工作1314151天～ 日本語のテキスト 한국어",
    "emoji 😶\u200d🌫️ ✅ 🔥🔥 (unseen ones go through byte fallback)",
    "  leading   spaces\t\ttabs\n\n  and\n\n\n\nnewlines   ",
    "12345678901234567890 3.14 1e-6 -42",
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    "<|tool_response>response:ok<tool_response|> <|channel>thought<channel|>",
    "<unused3> [multimodal] </s> <b>bold</b>",
    "ünïcödé Ελληνικά нещо на Български",
    "",
    " ",
    "\n",
    "x" * 64,
]


def _all_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _st_header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 0)
    return n, json.loads(data[8 : 8 + n])


def _st_tensor(path: Path, name: str) -> np.ndarray:
    """Decode one tensor by hand (BF16 -> float32), so no safetensors package is needed."""
    for tname, dtype, shape, raw in mf.read_safetensors_raw(path):
        if tname == name:
            if dtype == "BF16":
                return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
            return np.frombuffer(raw, {"F32": "<f4", "F16": "<f2", "I64": "<i8"}[dtype]).reshape(shape)
    raise KeyError(name)


def _shapes(path: Path) -> dict[str, list[int]]:
    _, header = _st_header(path)
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every fixture and variant; the Qwen ones only with the b11434 sdist (tests needing them use `llama_src`)."""
    root = tmp_path_factory.mktemp("fixtures")
    return mf.make_all(root, llama_cpp_src=llama_cpp_src(), variants=True)


@pytest.fixture
def llama_src() -> Path:
    """The b11434 source tree ($DFLASH_GGUF_CACHE honoured), through the guard: skips locally, fails on CI."""
    return reference.require_llama_cpp_src()


# --------------------------------------------------------------------------------------------------
# determinism
# --------------------------------------------------------------------------------------------------


def test_two_runs_are_byte_identical(tmp_path: Path, fixtures: dict[str, Path]) -> None:
    """A second run in a fresh process (no cached SentencePiece proto) writes the same bytes."""
    first_root = next(iter(fixtures.values())).parents[1]
    cmd = [sys.executable, str(REPO / "scripts" / "make_fixtures.py"), str(tmp_path), "--variants"]
    if (src := llama_cpp_src()) is not None:  # the same set as `fixtures`, which used the same check
        cmd += ["--llama-cpp-src", str(src)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    assert sorted(Path(p).name for p in out) == sorted(fixtures)
    first, second = _all_files(first_root), _all_files(tmp_path)
    assert first.keys() == second.keys()
    assert [k for k in first if first[k] != second[k]] == []


def test_rerun_overwrites_own_dir_but_refuses_foreign_dir(tmp_path: Path) -> None:
    a = mf.make_drafter(tmp_path, target="gemma4")
    before = _all_files(a)
    assert mf.make_drafter(tmp_path, target="gemma4") == a
    assert _all_files(a) == before
    (a / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        mf.make_drafter(tmp_path, target="gemma4")


# --------------------------------------------------------------------------------------------------
# Gemma tokenizers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["gemma4", "gemma3"])
def test_sentencepiece_and_tokenizer_json_agree(flavor: str) -> None:
    proto = mf._sentencepiece_proto_bytes(flavor)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    tok = Tokenizer.from_str(mf._gemma_tokenizer_json(proto))
    assert sp.get_piece_size() == tok.get_vocab_size() == mf.SIZES["vocab"]
    for text in ROUND_TRIP_CORPUS:
        ids = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False).ids == ids, text
        assert sp.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_sentencepiece_and_tokenizer_json_agree_on_random_strings() -> None:
    """Fuzz the merge order: HF BPE ranks pairs, SentencePiece ranks pieces by score."""
    proto = mf.gemma4_sentencepiece_proto_bytes()
    sp = spm.SentencePieceProcessor(model_proto=proto)
    tok = Tokenizer.from_str(mf._gemma_tokenizer_json(proto))
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789\n\t.,;:!?'\"(){}[]<>|=+-_#") + [
        "  ", "   ", "\n\n", "model", "return", "the ", "我想", "日本語", "🚀", "🦙", "😶\u200d🌫️", "é", "Ж",
        "\u00a0", "<|tool_call>", '<|"|>', "<channel|>", "<unused3>", "[multimodal]",
    ]  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(1500):
        text = "".join(alphabet[j] for j in rng.integers(0, len(alphabet), size=int(rng.integers(1, 40))))
        assert tok.encode(text, add_special_tokens=False).ids == sp.encode(text), repr(text)


def test_gemma4_tokenizer_json_specials(fixtures: dict[str, Path]) -> None:
    tj = json.loads((fixtures["gemma-4-tiny-it"] / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    expected = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>"}
    expected.update({i: piece for i, (piece, _) in mf.GEMMA4_SPECIALS.items()})
    for i, piece in expected.items():
        assert vocab[piece] == i, piece
    assert vocab["\n"] == 107
    assert vocab["<unused0>"] == 6 and vocab["<unused39>"] == 45 and vocab["<unused40>"] == 53
    assert vocab["<0x00>"] == 108 and vocab["<0xFF>"] == 363
    added = {t["id"]: t for t in tj["added_tokens"]}
    for i in (0, 1, 2, 3, 4, 46, 47, 48, 49, 50, 51, 52, 98, 100, 101, 105, 106):
        assert added[i]["content"] == expected[i] and added[i]["special"] and not added[i]["normalized"]
    # NORMAL in the real vocab: not added tokens
    assert not {5, 6, 107} & added.keys()
    assert tj["model"]["type"] == "BPE" and tj["model"]["byte_fallback"] and tj["model"]["fuse_unk"]
    assert tj["decoder"]["type"] == "Sequence"
    assert tj["normalizer"] == {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}

    tok = Tokenizer.from_str(json.dumps(tj))
    assert tok.encode("hi").ids[0] == 2  # post-processor prepends <bos>
    ids = tok.encode("<|turn>model\n<|think|>x<turn|>", add_special_tokens=False).ids
    assert ids[0] == 105 and ids[-1] == 106 and 98 in ids and 107 in ids


def test_gemma4_proto_piece_types() -> None:
    model = pb.ModelProto()
    model.ParseFromString(mf.gemma4_sentencepiece_proto_bytes())
    SP = pb.ModelProto.SentencePiece
    types = {i: model.pieces[i].type for i in range(len(model.pieces))}
    assert [types[i] for i in (0, 1, 2)] == [SP.CONTROL] * 3 and types[3] == SP.UNKNOWN
    for i, (piece, kind) in mf.GEMMA4_SPECIALS.items():
        assert model.pieces[i].piece == piece
        assert types[i] == getattr(SP, kind), piece
    assert model.pieces[6].piece == "<unused0>" and types[6] == SP.NORMAL
    assert all(types[i] == SP.BYTE for i in range(108, 364))
    assert sum(t == SP.NORMAL for t in types.values()) > 100
    assert model.trainer_spec.byte_fallback and not model.normalizer_spec.add_dummy_prefix
    assert mf.gemma4_sentencepiece_proto_bytes() is mf.gemma4_sentencepiece_proto_bytes()  # cached


def test_gemma3_is_the_wrong_donor(fixtures: dict[str, Path]) -> None:
    g3 = fixtures["gemma-3-tiny-it"]
    g4 = fixtures["gemma-4-tiny-it"]
    assert (g3 / "tokenizer.model").is_file() and not (g4 / "tokenizer.model").exists()
    assert (g3 / "tokenizer.model").read_bytes() == mf.gemma3_sentencepiece_proto_bytes()
    v3 = json.loads((g3 / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    v4 = json.loads((g4 / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    assert len(v3) == len(v4)
    assert v3["<start_of_turn>"] == 105 and v3["<end_of_turn>"] == 106 and v3["\n"] == 107
    for piece in (
        "<|turn>",
        "<turn|>",
        "<|channel>",
        "<|tool_call>",
        "<|tool_response>",
        "<|think|>",
        '<|"|>',
    ):
        assert piece not in v3
    inv3 = {i: p for p, i in v3.items()}
    assert inv3[46] == "<unused40>" and inv3[104] == "<unused98>"
    cfg = json.loads((g3 / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert "language_model.model.embed_tokens.weight" in _shapes(g3 / "model.safetensors")


# --------------------------------------------------------------------------------------------------
# Gemma-4 targets
# --------------------------------------------------------------------------------------------------


def test_gemma4_target_layout(fixtures: dict[str, Path]) -> None:
    d = fixtures["gemma-4-tiny-it"]
    names = {p.name for p in d.iterdir()}
    assert names == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "README.md", "model.safetensors",
    }  # fmt: skip
    cfg = json.loads((d / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["architectures"] == ["Gemma4UnifiedForConditionalGeneration"]
    assert tc["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert tc["rope_parameters"]["full_attention"]["rope_type"] == "proportional"
    assert (
        tc["attention_k_eq_v"] and tc["num_kv_shared_layers"] == 0 and tc["final_logit_softcapping"] == 30.0
    )
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [1, 106]
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tcfg["mask_token"] == "<mask>" and tcfg["add_bos_token"] is True
    assert "<|turn>" in (d / "chat_template.jinja").read_text()

    shapes = _shapes(d / "model.safetensors")
    p = "model.language_model"
    assert shapes[f"{p}.embed_tokens.weight"] == [512, 64]
    assert shapes[f"{p}.layers.0.self_attn.q_proj.weight"] == [64, 64]
    assert shapes[f"{p}.layers.0.self_attn.v_proj.weight"] == [32, 64]
    assert shapes[f"{p}.layers.5.self_attn.q_proj.weight"] == [128, 64]
    assert shapes[f"{p}.layers.5.self_attn.k_proj.weight"] == [32, 64]
    assert f"{p}.layers.5.self_attn.v_proj.weight" not in shapes
    assert shapes[f"{p}.layers.5.self_attn.q_norm.weight"] == [32]
    assert shapes[f"{p}.layers.3.layer_scalar"] == [1]
    assert shapes[f"{p}.norm.weight"] == [64]
    assert len([k for k in shapes if ".layers.0." in k]) == 14


def test_qat_twin_differs_only_in_weights_and_card(fixtures: dict[str, Path]) -> None:
    van, qat = fixtures["gemma-4-tiny-it"], fixtures["gemma-4-tiny-it-qat-q4_0-unquantized"]
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (van / f).read_bytes() == (qat / f).read_bytes(), f
    assert _shapes(van / "model.safetensors") == _shapes(qat / "model.safetensors")
    name = "model.language_model.embed_tokens.weight"
    a, b = _st_tensor(van / "model.safetensors", name), _st_tensor(qat / "model.safetensors", name)
    assert not np.array_equal(a, b) and np.abs(a - b).max() < 0.02
    assert "base_model: google/gemma-4-12B-it\n" in (qat / "README.md").read_text()
    assert "base_model: google/gemma-4-12B-it\n" not in (van / "README.md").read_text()


# --------------------------------------------------------------------------------------------------
# Qwen3 target
# --------------------------------------------------------------------------------------------------


def _chktxt(llama_src: Path) -> str:
    """The probe string of b11434's ``get_vocab_base_pre`` (read, not copied)."""
    tree = ast.parse((llama_src / "conversion" / "base.py").read_text(encoding="utf-8"))
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "get_vocab_base_pre":
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "chktxt":
                    return ast.literal_eval(node.value)
    raise AssertionError("chktxt not found")


@pytest.mark.reference
def test_qwen_tokenizer_passes_the_pre_tokenizer_check(llama_src: Path, fixtures: dict[str, Path]) -> None:
    """b11434's get_vocab_base_pre fingerprints our Qwen fixture tokenizer as its qwen2 pre-tokenizer."""
    tok = Tokenizer.from_file(str(fixtures["qwen3-tiny"] / "tokenizer.json"))
    ids = tok.encode(_chktxt(llama_src)).ids
    assert hashlib.sha256(str(ids).encode()).hexdigest() == QWEN2_CHKHSH
    assert f'if chkhsh == "{QWEN2_CHKHSH}"' in (llama_src / "conversion" / "base.py").read_text(encoding="utf-8")
    assert tok.get_vocab_size() == 151646
    assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        151643,
        151644,
        151645,
    ]
    REFERENCE_COMPARISONS.append("qwen3 fixture tokenizer vs get_vocab_base_pre")


def test_qwen_target_files(llama_src: Path, fixtures: dict[str, Path]) -> None:
    d = fixtures["qwen3-tiny"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["vocab_size"] == 151936
    assert cfg["tie_word_embeddings"] is False
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["bos_token"] is None
    assert set(tcfg["added_tokens_decoder"]) == {"151643", "151644", "151645"}
    shapes = _shapes(d / "model.safetensors")
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == [151936, 64]
    assert shapes["model.layers.5.self_attn.k_norm.weight"] == [16]
    assert len(json.loads((d / "vocab.json").read_text(encoding="utf-8"))) == 151643


def test_qwen_target_without_weights(llama_src: Path, tmp_path: Path) -> None:
    d = mf.make_qwen3_target(tmp_path, llama_cpp_src=llama_src, weights=False)
    assert not list(d.glob("*.safetensors")) and (d / "tokenizer.json").is_file()


# --------------------------------------------------------------------------------------------------
# drafters
# --------------------------------------------------------------------------------------------------

DRAFTER_TENSORS_PER_LAYER = [
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]  # fmt: skip


@pytest.mark.parametrize("target", ["gemma4", "qwen3"])
def test_default_drafter(tmp_path: Path, target: str) -> None:
    d = mf.make_drafter(tmp_path, target=target)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3] and cfg["num_target_layers"] == 6
    shapes = _shapes(d / "model.safetensors")
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in DRAFTER_TENSORS_PER_LAYER}
    assert set(shapes) == expected  # 11 L + 3, no model. prefix
    assert shapes["fc.weight"] == [64, 128]
    _, header = _st_header(d / "model.safetensors")
    assert header["__metadata__"] == {"format": "pt"}
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    if target == "gemma4":
        assert cfg["dflash_config"] == {"block_size": 16, "mask_token_id": 4, "target_layer_ids": [1, 3]}
        assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 1e6
        assert cfg["use_sliding_window"] and cfg["layer_types"] == ["sliding_attention", "full_attention"]
        assert {p.name for p in d.iterdir()} == {"config.json", "model.safetensors"}
    else:
        assert cfg["block_size"] == 16 and "block_size" not in cfg["dflash_config"]
        assert cfg["dflash_config"]["mask_token_id"] == 151669 and cfg["vocab_size"] == 151936
        assert cfg["rope_theta"] == 1e6 and cfg["rope_scaling"] is None and "rope_parameters" not in cfg
        assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
        readme = (d / "README.md").read_text()
        assert "license: mit" in readme and "base_model" not in readme and "- dflash" in readme
        with pytest.raises(RuntimeError, match="never"):
            exec(compile((d / "dflash.py").read_text(), str(d / "dflash.py"), "exec"), {})


VARIANT_CHECKS = {
    "block_size_nested": lambda c, s: c["dflash_config"]["block_size"] == 16 and "block_size" not in c,
    "block_size_top": lambda c, s: c["block_size"] == 16 and "block_size" not in c["dflash_config"],
    "rope_flat": lambda c, s: c["rope_theta"] == 1e6 and "rope_parameters" not in c,
    "rope_parameters": lambda c, s: c["rope_parameters"]["rope_theta"] == 1e6 and "rope_theta" not in c,
    "more_taps_than_layers": lambda c, s: (
        c["dflash_config"]["target_layer_ids"] == [0, 2, 4] and s["fc.weight"] == [64, 192]
    ),
    "swa_layer_types": lambda c, s: c["use_sliding_window"] and c["layer_types"][0] == "sliding_attention",
    "no_taps": lambda c, s: "target_layer_ids" not in c["dflash_config"] and "target_layer_ids" not in c,
    "mask_top_level_only": lambda c, s: "mask_token_id" not in c["dflash_config"] and "mask_token_id" in c,
    "no_mask": lambda c, s: "mask_token_id" not in c["dflash_config"] and "mask_token_id" not in c,
    "fc_width_wrong": lambda c, s: (
        s["fc.weight"] == [64, 192] and len(c["dflash_config"]["target_layer_ids"]) == 2
    ),
    "hidden_mismatch": lambda c, s: (
        c["hidden_size"] == 96
        and s["fc.weight"] == [96, 192]
        and s["layers.0.self_attn.q_proj.weight"] == [64, 96]
        and s["norm.weight"] == [96]
    ),
    "tap_out_of_range": lambda c, s: c["dflash_config"]["target_layer_ids"] == [1, 6],
    "tap_last_layer": lambda c, s: c["dflash_config"]["target_layer_ids"] == [1, 5],
    "missing_tensor": lambda c, s: "layers.1.mlp.down_proj.weight" not in s and len(s) == 24,
    "unexpected_tensor": lambda c, s: "layers.0.self_attn.gate.weight" in s and len(s) == 26,
    "attention_bias": lambda c, s: (
        c["attention_bias"] is True and s["layers.1.self_attn.k_proj.bias"] == [32]
    ),
    "embed_and_lm_head": lambda c, s: (
        s["embed_tokens.weight"] == s["lm_head.weight"] == [c["vocab_size"], 64]
    ),
    "d2t": lambda c, s: s["t2d"] == [c["vocab_size"]] and "d2t" in s,
    "gelu": lambda c, s: c["hidden_act"] == "gelu",
    "swa_without_layer_types": lambda c, s: (
        c["use_sliding_window"] and c["sliding_window"] == 32 and "layer_types" not in c
    ),
    "sliding_types_but_swa_off": lambda c, s: (
        not c["use_sliding_window"] and "sliding_attention" in c["layer_types"]
    ),
    "is_causal_false": lambda c, s: c["is_causal"] is False,
    "wrong_arch": lambda c, s: c["architectures"] == ["LlamaForCausalLM"],
    "torch_dtype_old": lambda c, s: c["torch_dtype"] == "bfloat16" and "dtype" not in c,
}


def test_every_variant_has_a_check() -> None:
    assert set(mf.VARIANTS) - {"default", "no_readme_no_automap"} == set(VARIANT_CHECKS)


# Not generated for qwen3 + embed_and_lm_head: two 151936-row tensors, covered by the gemma4 drafter.
DRAFTER_VARIANT_CASES = [(target, variant) for variant in sorted(VARIANT_CHECKS) for target in ("gemma4", "qwen3")
                         if (target, variant) != ("qwen3", "embed_and_lm_head")]


@pytest.mark.parametrize(("target", "variant"), DRAFTER_VARIANT_CASES)
def test_drafter_variant(tmp_path: Path, target: str, variant: str) -> None:
    d = mf.make_drafter(tmp_path, target=target, variant=variant)
    assert d.name == f"{mf.DRAFTER_NAMES[target]}-{variant}"
    cfg = json.loads((d / "config.json").read_text())
    assert VARIANT_CHECKS[variant](cfg, _shapes(d / "model.safetensors"))


def test_d2t_tensors_are_int64(tmp_path: Path) -> None:
    d = mf.make_drafter(tmp_path, target="gemma4", variant="d2t")
    _, header = _st_header(d / "model.safetensors")
    assert header["d2t"]["dtype"] == header["t2d"]["dtype"] == "I64"
    assert list(_st_tensor(d / "model.safetensors", "d2t")[:3]) == [0, 1, 2]


def test_no_readme_no_automap(tmp_path: Path) -> None:
    d = mf.make_drafter(tmp_path, target="qwen3", variant="no_readme_no_automap")
    assert {p.name for p in d.iterdir()} == {"config.json", "model.safetensors"}
    assert "auto_map" not in json.loads((d / "config.json").read_text())


def test_drafter_overrides(tmp_path: Path) -> None:
    extra = np.ones((3,), dtype=np.float32)
    d = mf.make_drafter(
        tmp_path,
        target="gemma4",
        variant="block_size_top",
        name="custom",
        config_overrides={"dflash_config.block_size": 8, "num_target_layers": 7},
        drop_config_keys=["dflash_config.mask_token_id", "pad_token_id"],
        extra_tensors={"extra.weight": extra},
        drop_tensors=["norm.weight"],
        tensor_overrides={"fc.weight": np.zeros((64, 64), dtype=np.float32)},
        readme=True,
        auto_map=True,
    )
    assert d.name == "custom"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dflash_config"] == {"block_size": 8, "target_layer_ids": [1, 3]} and cfg["block_size"] == 16
    assert cfg["num_target_layers"] == 7 and "pad_token_id" not in cfg and "auto_map" in cfg
    assert (d / "README.md").is_file() and (d / "dflash.py").is_file()
    shapes = _shapes(d / "model.safetensors")
    assert shapes["fc.weight"] == [64, 64] and shapes["extra.weight"] == [3] and "norm.weight" not in shapes
    assert np.array_equal(_st_tensor(d / "model.safetensors", "extra.weight"), extra)
    with pytest.raises(KeyError):
        mf.make_drafter(tmp_path, target="gemma4", name="x", drop_tensors=["no.such.weight"])
    with pytest.raises(ValueError):
        mf.make_drafter(tmp_path, target="gemma4", variant="no_such_variant")


def test_drafter_dtype_option(tmp_path: Path) -> None:
    d = mf.make_drafter(tmp_path, target="gemma4", dtype="F32")
    _, header = _st_header(d / "model.safetensors")
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F32"}
    np.testing.assert_array_equal(
        _st_tensor(d / "model.safetensors", "fc.weight"), mf._randn("gemma4-drafter", "fc", (64, 128))
    )


# --------------------------------------------------------------------------------------------------
# safetensors files
# --------------------------------------------------------------------------------------------------


def test_safetensors_header_layout(fixtures: dict[str, Path]) -> None:
    for d in fixtures.values():
        for f in d.glob("*.safetensors"):
            n, header = _st_header(f)
            assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
            spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
            assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert 8 + n + spans[-1][1] == f.stat().st_size


def test_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 1e-3], dtype=np.float32)
    got = (np.frombuffer(mf._bf16_bytes(x), "<u2").astype(np.uint32) << 16).view(np.float32)
    assert list(got[:4]) == [1.0, 1.0, 1.0 + 2**-6, -2.5]
    assert abs(got[4] - 1e-3) < 1e-5


def test_safetensors_package_reads_fixtures(fixtures: dict[str, Path]) -> None:
    for d in fixtures.values():
        for f in d.glob("*.safetensors"):
            with st.safe_open(str(f), "np") as fh:
                assert fh.metadata() == {"format": "pt"}
                assert {k: fh.get_slice(k).get_shape() for k in fh.keys()} == _shapes(f)


def test_make_sharded(tmp_path: Path) -> None:
    d = mf.make_drafter(tmp_path, target="gemma4")
    before = {e[0]: e for e in mf.read_safetensors_raw(d / "model.safetensors")}
    mf.make_sharded(d)
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    after = {e[0]: e for f in files for e in mf.read_safetensors_raw(d / f)}
    assert after == before and set(index["weight_map"]) == set(before)
    assert index["metadata"]["total_size"] == sum(len(e[3]) for e in before.values())
    for f in files:
        with st.safe_open(str(d / f), "np") as fh:
            assert set(fh.keys()) == {k for k, v in index["weight_map"].items() if v == f}


def test_broken_safetensors_helpers(tmp_path: Path) -> None:
    a = mf.make_drafter(tmp_path, target="gemma4", name="trunc")
    size = (a / "model.safetensors").stat().st_size
    mf.truncate_safetensors(a)
    assert (a / "model.safetensors").stat().st_size < size
    b = mf.make_drafter(tmp_path, target="gemma4", name="badjson")
    mf.corrupt_safetensors_header(b)
    c = mf.make_drafter(tmp_path, target="gemma4", name="badlen")
    mf.corrupt_safetensors_header(c, how="length")
    for d in (a, b, c):
        with pytest.raises(Exception):  # noqa: B017 - safetensors raises its own error types
            st.safe_open(str(d / "model.safetensors"), "np")


def test_make_all_without_llama_src(tmp_path: Path) -> None:
    made = mf.make_all(tmp_path, llama_cpp_src=None)
    assert set(made) == {
        "gemma-4-tiny-it", "gemma-4-tiny-it-qat-q4_0-unquantized", "gemma-3-tiny-it", "gemma4-tiny-it-DFlash",
    }  # fmt: skip
    assert made["gemma4-tiny-it-DFlash"].parent == tmp_path / "drafters"
