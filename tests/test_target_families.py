"""Every target architecture's facts in one place: its family module under ``convert/targets``. The registry finds
each module by itself, each Hugging Face class has one row, each fact is written once in the package, and what
the built-in converter covers follows from the rows."""

from __future__ import annotations

import pkgutil
from collections import Counter
from pathlib import Path

from package_strings import string_constants

import dflash_gguf
from dflash_gguf.convert import targets
from dflash_gguf.convert.targets import SUPPORTED_ARCHITECTURES, TARGET_ARCHS, by_gguf, by_hf

PACKAGE = Path(dflash_gguf.__file__).parent


def _family_modules() -> dict[str, object]:
    return {m.name: module for m in pkgutil.iter_modules(targets.__path__)
            if hasattr(module := __import__(f"{targets.__name__}.{m.name}", fromlist=["ARCHS"]), "ARCHS")}


def test_every_family_module_is_found_and_each_class_and_arch_has_one_row() -> None:
    modules = _family_modules()
    assert {arch for module in modules.values() for arch in module.ARCHS} == set(TARGET_ARCHS)  # type: ignore[attr-defined]
    assert len(TARGET_ARCHS) == len({a.gguf for a in TARGET_ARCHS})
    hf = [name for arch in TARGET_ARCHS for name in arch.hf]
    assert len(hf) == len(set(hf))
    assert all(by_gguf(a.gguf) is a and all(by_hf(name) is a for name in a.hf) for a in TARGET_ARCHS)


def test_what_the_builtin_converter_covers_follows_from_the_rows() -> None:
    modules = _family_modules()
    converted = {name: module for name, module in modules.items() if hasattr(module, "FAMILY")}
    assert set(SUPPORTED_ARCHITECTURES.values()) == set(converted)
    for name, module in converted.items():
        rows = module.ARCHS  # type: ignore[attr-defined]
        assert {hf for arch in rows for hf in arch.hf} == {h for h, m in SUPPORTED_ARCHITECTURES.items() if m == name}
        assert all(arch.tappable and arch.drafter_vocab for arch in rows), name  # converted targets serve drafters


def test_each_target_fact_is_written_once_in_the_package() -> None:
    """A Hugging Face class name or a b11434 graph file spelled outside its row is a second copy waiting to diverge
    (the GGUF names are not counted: "llama", "qwen2" or "gemma4" also name tokenizer models and pre-tokenizers;
    nor the graph file "llama.cpp", which names the project too)."""
    counts = Counter(s for path in PACKAGE.rglob("*.py") for s in string_constants(path))
    facts = {fact for arch in TARGET_ARCHS for fact in (*arch.hf, arch.graph) if fact} - {"llama.cpp"}
    assert {fact: counts[fact] for fact in facts} == dict.fromkeys(facts, 1)
