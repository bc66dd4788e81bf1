"""A 262k-token vocabulary without hundreds of MB of Python objects, and without changing a byte.

tokenizer.json's ``model.merges`` is read as text and decoded a run at a time (``jsonfile``); GGUF string arrays
are kept encoded (``StringArray``), read and written; the vocabulary hash is computed in pieces. Each must give
exactly what the plain ways give: ``json.loads`` of the whole file, a list of decoded strings, ``json.dumps``.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import fixtures as mf
import pytest
from gguf import GGUFValueType

from dflash_gguf import jsonfile
from dflash_gguf.errors import UnreadableJson
from dflash_gguf.ggufio import GGUFPlan, StringArray, read_gguf
from dflash_gguf.ggufio.layout import pack_value
from dflash_gguf.vocab_hash import vocab_sha256

# Strings that exercise JSON escapes, non-BMP characters, brackets and commas inside strings, and spaces.
AWKWARD = ["a", "b c", '"', "\\", "\\\"", "],[", "[\"x\", \"y\"]", "\u0120the", "\U0001F680", "é", "\t\n", "\u2581",
           "<0x0A>", "merges", '"merges": [', "\u0000", "/", "\ud7ff", "x" * 300]


def _merges(n: int, pairs: bool, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    out: list[Any] = []
    for i in range(n):
        left, right = rng.choice(AWKWARD) + str(i % 7), rng.choice(AWKWARD)
        out.append([left, right] if pairs else f"{left.replace(' ', '')} {right.replace(' ', '')}")
    return out


def _tokenizer(merges: Any, **extra: Any) -> dict[str, Any]:
    vocab = {f"tok{i}": i for i in range(50)}
    return {"version": "1.0", "added_tokens": [{"id": 0, "content": "merges", "special": True}],
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
            "model": {"type": "BPE", "byte_fallback": True, "vocab": vocab, "merges": merges}, **extra}


def _read_both(path: Path) -> tuple[Any, Any]:
    jsonfile.forget()
    lean = jsonfile.read_json(path)
    return lean, json.loads(path.read_text(encoding="utf-8"))


def _decoded(doc: Any) -> Any:
    """``doc`` with a merges array left as text decoded in full, to compare with json.loads."""
    model = doc.get("model") if isinstance(doc, dict) else None
    if isinstance(model, dict) and isinstance(model.get("merges"), jsonfile.JsonArrayText):
        merges = [m for run in jsonfile.array_runs(model["merges"]) for m in run]
        return {**doc, "model": {**model, "merges": merges}}
    return doc


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("indent", [None, 2])
def test_merges_left_as_text_decode_to_the_same_document(tmp_path: Path, pairs: bool, indent: int | None) -> None:
    doc = _tokenizer(_merges(10_000, pairs))  # more than two runs
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc, indent=indent, ensure_ascii=indent is None), encoding="utf-8")
    lean, full = _read_both(path)
    assert isinstance(lean["model"]["merges"], jsonfile.JsonArrayText)
    assert _decoded(lean) == full == doc


@pytest.mark.parametrize("case", ["not-an-array-of-strings", "empty", "absent", "other-merges-key", "key-in-string"])
def test_unusual_merges_fall_back_to_a_whole_parse(tmp_path: Path, case: str) -> None:
    merges: Any = {"not-an-array-of-strings": ["a b", 3], "empty": []}.get(case, ["a b", "c d"])
    doc = _tokenizer(merges)
    if case == "absent":
        del doc["model"]["merges"]
    if case == "other-merges-key":  # a "merges" array elsewhere must not be taken for the model's
        doc = {"post_processor": {"merges": ["x y"]}, **doc}
    if case == "key-in-string":
        doc["added_tokens"][0]["content"] = ',"merges":["q r"]'
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    lean, full = _read_both(path)
    assert _decoded(lean) == full == doc
    if case in ("other-merges-key", "key-in-string"):
        assert isinstance(lean["model"]["merges"], jsonfile.JsonArrayText)
        assert lean.get("post_processor", {}).get("merges", ["x y"]) == ["x y"]


def test_damaged_merges_are_refused_as_json_loads_refuses_them(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    text = json.dumps(_tokenizer(["a b", "c d"]))
    for bad in (text.replace('"c d"', '"c \\q"'), text.replace('"c d"', '"c\x01d"'), text[:-5]):
        path.write_text(bad, encoding="utf-8")
        jsonfile.forget()
        with pytest.raises(ValueError):
            json.loads(bad)
        with pytest.raises(ValueError):
            jsonfile.read_json(path)
    path.write_bytes(text.replace('"c d"', '"c \x00d"').encode().replace(b"\x00", b"\xff"))
    jsonfile.forget()
    with pytest.raises(UnreadableJson, match="not UTF-8 text"):  # a ValueError (JSONDecodeError) naming the file
        jsonfile.read_json(path)


def test_string_array_reads_writes_and_compares_like_a_list(tmp_path: Path) -> None:
    strings = [s for m in _merges(3000, False, seed=1) for s in m.split(" ")] + AWKWARD
    packed = StringArray.from_runs([strings[:1000], strings[1000:], []])
    assert len(packed) == len(strings) and list(packed) == strings and packed == strings and strings == packed
    assert packed[-1] == strings[-1] and packed[5:9] == strings[5:9] and packed[::-7] == strings[::-7]
    with pytest.raises(IndexError):
        packed[len(strings)]  # noqa: B018
    assert packed != strings[:-1] and packed != [*strings[:-1], "other"]
    # the same GGUF bytes as a list of strings, and read back as an equal StringArray
    assert pack_value(packed, GGUFValueType.ARRAY, GGUFValueType.STRING) == \
        pack_value(strings, GGUFValueType.ARRAY, GGUFValueType.STRING)
    plan = GGUFPlan("llama")
    plan.add_array("tokenizer.ggml.merges", packed)
    plan.add_array("tokenizer.ggml.tokens", strings)
    plan.add_array("tokenizer.ggml.token_type", [1] * len(strings))
    plan.write(tmp_path / "v.gguf")
    meta = read_gguf(tmp_path / "v.gguf")
    back = meta.get("tokenizer.ggml.merges")
    assert isinstance(back, StringArray) and back == packed and back == strings
    assert vocab_sha256(meta.get) == vocab_sha256(plan.get)
    h = hashlib.sha256()
    for value in (strings, [1] * len(strings), strings):  # tokens, token types, merges
        h.update(json.dumps(value, ensure_ascii=False).encode())
    assert vocab_sha256(plan.get) == h.hexdigest()  # the recorded hash is still json.dumps of each list


def test_gemma4_vocab_and_synthesized_tokenizer_model_unchanged_by_lean_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vocabulary embedded from a real-layout Gemma-4 tokenizer.json, read lean, is the one read whole."""
    from dflash_gguf.convert.vocab import add_gemma4_vocab, forget_built
    from dflash_gguf.tokenizer_fixups import read_tokenizer_json

    target = mf.make_gemma4_target(tmp_path / "targets")
    forget_built()
    lean_plan = GGUFPlan("gemma4")
    jsonfile.forget()
    lean_info = add_gemma4_vocab(lean_plan, target)
    lean_sp = read_tokenizer_json(target / "tokenizer.json")
    assert isinstance(jsonfile.read_json(target / "tokenizer.json")["model"]["merges"], jsonfile.JsonArrayText)

    monkeypatch.setattr(jsonfile, "_parse_lean", lambda raw: None)  # the whole-document parse, as before
    jsonfile.forget()
    forget_built()  # built afresh from the whole parse, not the kept lean build
    whole_plan = GGUFPlan("gemma4")
    whole_info = add_gemma4_vocab(whole_plan, target)
    whole_sp = read_tokenizer_json(target / "tokenizer.json")
    jsonfile.forget()
    assert lean_info == whole_info
    assert lean_plan.header_bytes() == whole_plan.header_bytes()
    assert lean_sp == whole_sp
