"""A pipeline run builds the target's vocabulary once: a second build from the same files (in the same folder or a
copy of it) adds what the first added, and any change to those files builds it afresh."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fixtures as mf
import pytest

from dflash_gguf.convert import vocab
from dflash_gguf.convert.special_vocab import source_files
from dflash_gguf.convert.vocab import add_gemma4_vocab, forget_built
from dflash_gguf.ggufio import GGUFPlan


def _fresh(tok_dir: Path) -> tuple[bytes, vocab.VocabInfo]:
    """The header a build from nothing kept gives, and its info."""
    forget_built()
    plan = GGUFPlan("gemma4")
    info = add_gemma4_vocab(plan, tok_dir)
    return plan.header_bytes(), info


def _again(tok_dir: Path) -> tuple[bytes, vocab.VocabInfo]:
    plan = GGUFPlan("gemma4")
    info = add_gemma4_vocab(plan, tok_dir)
    return plan.header_bytes(), info


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return mf.make_gemma4_target(tmp_path / "targets")


def test_a_copy_of_the_tokenizer_reuses_the_build(target: Path, tmp_path: Path) -> None:
    first = _fresh(target)
    kept = vocab._last_built
    overlay = tmp_path / "overlay"  # as the pipeline's tokenizer overlay: the same files under another path
    overlay.mkdir()
    for path in source_files(target):
        if path.is_file():
            shutil.copy(path, overlay / path.name)
    assert _again(overlay) == first
    assert vocab._last_built is kept  # reused, not rebuilt
    forget_built()
    assert vocab._last_built is None


@pytest.mark.parametrize("edit", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"])
def test_an_edited_tokenizer_file_is_built_afresh(target: Path, edit: str) -> None:
    before = _fresh(target)
    path = target / edit
    if edit == "tokenizer.json":  # one more added token past the base vocabulary
        tj = json.loads(path.read_text(encoding="utf-8"))
        tj["added_tokens"].append({"id": len(tj["model"]["vocab"]) + len(tj["added_tokens"]), "content": "<extra>",
                                   "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                                   "special": True})
        path.write_text(json.dumps(tj), encoding="utf-8")
    elif edit == "tokenizer_config.json":  # a chat template of its own, over chat_template.jinja
        cfg = json.loads(path.read_text(encoding="utf-8"))
        cfg["chat_template"] = "{{ messages }}"
        path.write_text(json.dumps(cfg), encoding="utf-8")
    elif edit == "chat_template.jinja":
        path.write_text(path.read_text(encoding="utf-8") + "{# edited #}", encoding="utf-8")
    else:  # a separator id, which only config.json names
        cfg = json.loads(path.read_text(encoding="utf-8"))
        cfg["sep_token_id"] = 7
        path.write_text(json.dumps(cfg), encoding="utf-8")
    after = _again(target)
    assert after != before
    assert after == _fresh(target)


def test_a_plan_editing_its_lists_leaves_the_kept_build_alone(target: Path) -> None:
    first = _fresh(target)
    plan = GGUFPlan("gemma4")
    add_gemma4_vocab(plan, target)
    plan.get("tokenizer.ggml.token_type")[0] = 99
    plan.get("tokenizer.ggml.scores")[0] = 1.0
    assert _again(target) == first


def test_a_failed_build_is_not_kept(target: Path) -> None:
    _fresh(target)
    (target / "tokenizer.json").write_text("{", encoding="utf-8")
    with pytest.raises(Exception, match="tokenizer.json"):
        add_gemma4_vocab(GGUFPlan("gemma4"), target)
    assert vocab._last_built is None
