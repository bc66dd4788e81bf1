"""Every drafter family against the same contract: the registry finds it by config class and by the GGUF its
converter writes, its checks pass that file, it serves with its own spec type and sidecar prefix, and no family
fact (architecture, marker tensor, spec type) is written twice in the package."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import fixtures as mf
import pytest
import reference
from fixtures.drafters import make_dflash2_drafter, make_dspark_drafter, make_eagle3_drafter, make_gemma4_dspark_drafter
from package_strings import string_constants

import dflash_gguf
from dflash_gguf import drafters
from dflash_gguf.drafters import convert_drafter
from dflash_gguf.ggufio.reader import read_gguf
from dflash_gguf.sidecar import drafter_kind, drafter_kind_of_checkpoint, is_sidecar, sidecar_name
from dflash_gguf.verify.precheck import precheck

PACKAGE = Path(dflash_gguf.__file__).parent


def _gemma(work: Path) -> Path:
    return mf.make_gemma4_target(work / "t")


def _qwen(work: Path) -> Path:
    return mf.make_qwen3_target(work / "t", llama_cpp_src=reference.require_llama_cpp_src())


def _qwen35(work: Path) -> Path:
    return mf.make_qwen35_target(work / "t", llama_cpp_src=reference.require_llama_cpp_src())


def _llama(work: Path) -> Path:
    return mf.make_llama3_target(work / "t", llama_cpp_src=reference.require_llama_cpp_src())


# one checkpoint per family (and per variant of a family that converts another way), with the target it drafts for
CASES: dict[str, tuple[str, Callable[[Path], Path], Callable[[Path], Path]]] = {
    "dflash": ("dflash", lambda d: mf.make_drafter(d, target="gemma4"), _gemma),
    "dflash2": ("dflash", lambda d: make_dflash2_drafter(d), _qwen35),
    "dspark-qwen": ("dspark", lambda d: make_dspark_drafter(d), _qwen),
    "dspark-gemma4": ("dspark", lambda d: make_gemma4_dspark_drafter(d, config_overrides={"final_logit_softcapping":
                                                                                       None}), _gemma),
    "eagle3": ("eagle3", lambda d: make_eagle3_drafter(d), _llama),
    "gemma4-assistant": ("gemma4_assistant", lambda d: mf.make_gemma4_assistant(d), _gemma),
}


def test_every_family_package_is_in_the_registry_once() -> None:
    packages = sorted(p.parent.name for p in (PACKAGE / "drafters").glob("*/__init__.py"))
    assert sorted(f.name for f in drafters.FAMILIES) == packages
    for fact in ("name", "sidecar_kind"):
        values = [getattr(f, fact) for f in drafters.FAMILIES]
        assert len(set(values)) == len(values), (fact, values)
    archs = [a for f in drafters.FAMILIES for a in f.config_architectures]
    assert len(set(archs)) == len(archs), Counter(archs).most_common(3)
    # two families on one GGUF architecture are told apart by a marker tensor
    for arch in drafters.DRAFTER_GGUF_ARCHS:
        sharing = [f for f in drafters.FAMILIES if f.gguf_arch == arch]
        assert sum(f.marker_tensor is None for f in sharing) <= 1, [f.name for f in sharing]
    for family in drafters.FAMILIES:
        assert family.spec_type.startswith("draft-") and family.title
        assert callable(family.checks().check_drafter) and callable(family.converter().convert)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_family_reads_converts_checks_and_serves_its_own_files(case: str, tmp_path: Path) -> None:
    name, make_drafter, make_target = CASES[case]
    family = drafters.family_named(name)
    target, drafter = make_target(tmp_path), make_drafter(tmp_path / "d")

    reading = drafters.interpret_folder(drafter)
    assert reading.family == name and not reading.errors, reading.errors
    assert drafters.family_of_config(_config_arch(drafter)) is family

    out = tmp_path / "d.gguf"
    convert_drafter(drafter, target, out)
    meta = read_gguf(out)
    assert drafters.family_of_gguf(meta) is family  # the file it writes is found as its own
    assert drafter_kind(meta) == drafter_kind_of_checkpoint(drafter) == family.sidecar_kind
    assert is_sidecar(sidecar_name("model", "Q8_0", family.sidecar_kind))

    report = family.checks().check_drafter(meta, None)
    assert not report.errors, [(c.id, c.message) for c in report.errors]

    served = family.served_as(out, meta, "BF16")
    assert served.spec_type == family.spec_type and served.max_n_max >= 1
    if family.drafts == "block":
        assert served.block_size == reading.spec.block_size

    # precheck states the draft length the family allows, from the config alone
    checked = precheck(drafter, target)
    assert checked.result("pair.block_size").message == family.draft_length_note(reading.spec)


def _config_arch(drafter: Path) -> str:
    import json

    return json.loads((drafter / "config.json").read_text())["architectures"][0]


def test_each_family_fact_is_written_once_in_the_package() -> None:
    counts = Counter(s for path in PACKAGE.rglob("*.py") for s in string_constants(path))
    facts = {fact for f in drafters.FAMILIES for fact in (f.gguf_arch, f.spec_type, f.marker_tensor) if fact}
    assert {fact: counts[fact] for fact in facts} == dict.fromkeys(facts, 1)
