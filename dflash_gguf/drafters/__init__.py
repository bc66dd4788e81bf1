"""Drafter families and the registry that finds them: one package per family, one record per package.

Each family package (``dflash``, ``dspark``, ``gemma4_assistant``, ``eagle3``) holds its config rules, its
converter, the checks verify runs on its files, and a ``FAMILY`` record (``family.DrafterFamily``) with its serving
facts. Everything else asks this registry: by config class (``interpret``), by GGUF header (``family_of_gguf``), by
sidecar kind (``family_of_kind``). A new family is a package with those parts; the registry finds it.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

from ..errors import NotCoveredError, UnsupportedModelError
from ..ggufio.reader import GGUFMeta
from ..hf_configs import read_config
from ..target_archs import by_hf, drafter_vocab_archs, what_serves_instead
from .family import Drafter, DrafterFamily
from .findings import DrafterSpec, Finding, Interpretation, TargetFacts, failed, first_error, noted, passed

# Drafter kinds b11434 reads that no family here converts yet (named in the refusal).
KNOWN_UNSUPPORTED_DRAFTER_ARCHS: tuple[str, ...] = ()
# Every subpackage is a family. A family with a marker tensor is asked before one without on the same GGUF
# architecture (a DSpark file is a dflash file with a Markov head).
_PACKAGES = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)
FAMILIES: tuple[DrafterFamily, ...] = tuple(sorted(
    (importlib.import_module(f"{__name__}.{name}").FAMILY for name in _PACKAGES),
    key=lambda family: (family.marker_tensor is None, family.name)))
_BY_CONFIG_ARCH = {arch: family for family in FAMILIES for arch in family.config_architectures}
_BY_NAME = {family.name: family for family in FAMILIES}
SUPPORTED_DRAFTER_ARCHS: tuple[str, ...] = tuple(_BY_CONFIG_ARCH)
DRAFTER_GGUF_ARCHS: tuple[str, ...] = tuple(dict.fromkeys(family.gguf_arch for family in FAMILIES))
SIDECAR_PREFIXES: tuple[str, ...] = tuple(dict.fromkeys(family.sidecar_prefix for family in FAMILIES))


def family_named(name: str) -> DrafterFamily:
    """The family of an ``Interpretation.family`` name."""
    return _BY_NAME[name]


def family_of_config(arch: str | None) -> DrafterFamily | None:
    """The family that reads configs of this ``architectures[0]``."""
    return _BY_CONFIG_ARCH.get(arch) if isinstance(arch, str) else None


def family_of_gguf(meta: GGUFMeta) -> DrafterFamily | None:
    """The family whose file this GGUF header is (its architecture, and a marker tensor where two share one)."""
    return next((family for family in FAMILIES if family.matches(meta)), None)


def family_of_spec_type(spec_type: str | None) -> DrafterFamily | None:
    """The family a served drafter's ``--spec-type`` names (each family has its own)."""
    return next((family for family in FAMILIES if family.spec_type == spec_type), None)


def family_of_kind(kind: str) -> DrafterFamily | None:
    """The family of a sidecar kind (``dflash``, ``dspark``, ``mtp``, ``eagle3``; pair.json's ``kind``)."""
    return next((family for family in FAMILIES if family.sidecar_kind == kind), None)


def interpret(raw: dict[str, Any], path: Path) -> Interpretation[DrafterSpec]:
    """The drafter config ``raw`` (read from ``path``) as its family reads it."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    family = family_of_config(arch)
    if family is None:
        extra = (" llama.cpp b11434 reads that checkpoint kind too, but this version of dflash-gguf does not "
                 "convert it yet; use llama.cpp's convert_hf_to_gguf.py." if arch in KNOWN_UNSUPPORTED_DRAFTER_ARCHS
                 else "")
        return Interpretation(None, None, (failed(
            "format.arch", f"{path}: field 'architectures' is {archs!r}, not a DFlash drafter. Supported: "
            f"{', '.join(SUPPORTED_DRAFTER_ARCHS)}.{extra}", "Check that --drafter points at the DFlash repo (e.g. "
            "z-lab/Qwen3-8B-DFlash-b16) and --target at the model it drafts for.", UnsupportedModelError),))
    return family.interpret(raw, path)


def interpret_folder(drafter: Path) -> Interpretation[DrafterSpec]:
    """``interpret`` on a drafter folder's (or file's) config.json.

    Raises:
        ConfigError: config.json missing or unreadable.
    """
    path = Path(drafter) if Path(drafter).suffix == ".json" else Path(drafter) / "config.json"
    return interpret(read_config(path, "Drafter config"), path)


def pair_findings(interpretation: Interpretation, target: TargetFacts) -> tuple[Finding, ...]:
    """The family's rules for this drafter with this target (empty when the drafter itself is refused)."""
    if interpretation.spec is None or interpretation.family is None:
        return ()
    return family_named(interpretation.family).pair_findings(interpretation.spec, target)


def target_findings(target: TargetFacts) -> tuple[Finding, ...]:
    """What every drafter family needs of the target's architecture: a b11434 graph that publishes the layer
    inputs a drafter taps (``pair.target_arch``), and a vocabulary path the converter mirrors
    (``pair.target_vocab``: b11434's DFlashModel.set_vocab runs the target class's own ``set_vocab``)."""
    arch = by_hf(target.arch)
    where = f"{target.path}: " if target.path else ""
    if arch is not None and arch.tappable is False:
        return (failed("pair.target_arch", f"{where}target architecture {target.arch} publishes no layer inputs in "
                       "llama.cpp b11434 ('layer input tensor is null'), so no drafter can run on it.",
                       "Pick a drafter made for a target llama.cpp can tap (Gemma-4, Qwen3, Qwen3.5, Llama-3...); "
                       "llama.cpp's own converter would make the files, but the pair aborts at its first draft. "
                       + what_serves_instead(arch, target.arch), UnsupportedModelError),)
    out = [passed("pair.target_arch", f"target architecture {target.arch or '?'}"
                  + (f" (llama.cpp {arch.gguf})" if arch is not None else ""))]
    if arch is not None and arch.drafter_vocab is not None:
        out.append(passed("pair.target_vocab", f"target vocabulary read as llama.cpp b11434 reads a {arch.gguf} "
                          f"target's ({arch.drafter_vocab})"))
        if arch.drafter_note:
            out.append(noted("pair.target_vocab.b11434", arch.drafter_note))
    else:
        known = "" if arch is not None else " (an architecture dflash-gguf does not know)"
        out.append(failed(
            "pair.target_vocab", f"{where}target architecture {target.arch!r}{known}: the drafter GGUF embeds the "
            "target's vocabulary the way llama.cpp b11434 reads that architecture's tokenizer (DFlashModel.set_vocab "
            "runs the target class's own set_vocab), and dflash-gguf mirrors that path only for "
            f"{', '.join(drafter_vocab_archs())}.",
            "Convert the drafter with llama.cpp's own converter (convert_hf_to_gguf.py DRAFTER --target-model-dir "
            "TARGET); the pipeline does so when given --llama-cpp DIR.", NotCoveredError))
    return tuple(out)


__all__ = ["FAMILIES", "SUPPORTED_DRAFTER_ARCHS", "Drafter", "DrafterFamily", "Finding", "Interpretation",
           "TargetFacts", "failed", "family_named", "family_of_config", "family_of_gguf", "family_of_kind",
           "family_of_spec_type", "first_error", "interpret", "interpret_folder", "noted", "pair_findings", "passed",
           "read_config", "target_findings"]
