"""Drafter families and the registry that finds them: one package per family, one record per package.

Each family package (``dflash``, ``dspark``, ``gemma4_assistant``, ``eagle3``) holds its config rules, its
converter, the checks verify runs on its files, and a ``FAMILY`` record (``family.DrafterFamily``) with its serving
facts. Everything else asks this registry: by config class (``interpret``), by GGUF header (``family_of_gguf``), by
sidecar kind (``family_of_kind``). A new family is a package with those parts; the registry finds it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..convert.configs import TargetFacts
from ..convert.result import ConvertResult
from ..convert.targets import by_gguf, by_hf, drafter_vocab_archs
from ..errors import NotCoveredError, UnsupportedModelError
from ..ggufio.reader import GGUFMeta
from ..hf_configs import read_config
from .family import Drafter, DrafterFamily
from .findings import PICK, DrafterSpec, Finding, Interpretation, Report, failed, first_error, noted, passed

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
# The family that judges a file that only looks like a drafter, and names a sidecar of unknown kind (DFlash).
DEFAULT_FAMILY: DrafterFamily = next(family for family in FAMILIES if family.default)
# The family whose spec type also runs a target's own MTP head (tune's "draft-mtp (target's own head)").
OWN_MTP_FAMILY: DrafterFamily = next(family for family in FAMILIES if family.own_mtp_max_n_max is not None)


def family_named(name: str) -> DrafterFamily:
    """The family of an ``Interpretation.family`` name."""
    return _BY_NAME[name]


def family_of_config(arch: str | None) -> DrafterFamily | None:
    """The family that reads configs of this ``architectures[0]``."""
    return _BY_CONFIG_ARCH.get(arch) if isinstance(arch, str) else None


def family_of_gguf(meta: GGUFMeta) -> DrafterFamily | None:
    """The family whose file this GGUF header is (its architecture, and a marker tensor where two share one)."""
    return next((family for family in FAMILIES if family.matches(meta)), None)


def family_judging(meta: GGUFMeta) -> DrafterFamily | None:
    """The family whose checks judge a header: its own family, else the default family when the header only looks
    like one of its files (a fork's layout, an older converter's, no architecture), which say what is wrong."""
    claims = DEFAULT_FAMILY.claims
    return family_of_gguf(meta) or (DEFAULT_FAMILY if claims is not None and claims(meta) else None)


def reads_target_weights(drafter_dir: Path) -> bool:
    """Whether converting this drafter checkpoint reads the target's weights, not only its config and tokenizer
    (a DFlash drafter with ``mask_embedding.pt`` takes the target's embeddings and output head)."""
    return any((Path(drafter_dir) / name).is_file() for family in FAMILIES for name in family.target_weight_files)


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
        return Interpretation(None, None, (failed(
            "format.arch", f"{path}: field 'architectures' is {archs!r}, not a DFlash drafter. Supported: "
            f"{', '.join(SUPPORTED_DRAFTER_ARCHS)}.", "Check that --drafter points at the DFlash repo (e.g. "
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
                       + arch.what_serves_instead(target.arch), UnsupportedModelError),)
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


def check_target_arch(r: Report, tarch: str) -> None:
    """pair.target_arch: can this target's b11434 graph feed a drafter at all (does it publish layer inputs)?"""
    known = by_gguf(tarch)
    if known is not None and known.tappable:
        r.ok("pair.target_arch", f"target architecture {tarch!r} publishes layer inputs in b11434")
    elif (known is not None and known.tappable is False) or tarch in DRAFTER_GGUF_ARCHS:
        r.fail("pair.target_arch", "error", f"target architecture {tarch!r} cannot feed a DFlash drafter in b11434 "
               "(its graph publishes no layer inputs: 'layer input tensor is null').",
               "Pass the target model GGUF second." if tarch in DRAFTER_GGUF_ARCHS or known is None
               else f"{PICK} {known.what_serves_instead()}")
    else:
        r.fail("pair.target_arch", "warning", f"target architecture {tarch!r} is not known to publish layer inputs "
               "in llama.cpp b11434.", "Try a short llama-server run with --spec-type draft-dflash before serving.")


def convert_drafter(
    drafter_dir: Path,
    target_dir: Path,
    outfile: Path,
    outtype: str = "auto",
    *,
    tokenizer_dir: Path | None = None,
    provenance: dict[str, str] | None = None,
    quant: str | None = None,
    dry_run: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Convert the drafter in ``drafter_dir`` for the target in ``target_dir`` into ``outfile``: its family (read
    from config.json) converts it.

    ``tokenizer_dir`` (default: ``target_dir``) is where the target's tokenizer files are read, so a repaired
    overlay can stand in for a read-only snapshot. ``provenance`` adds our own keys. ``quant`` ("q4_0", "q8_0",
    ...) quantizes in the same pass, giving the bytes of converting to ``outtype`` and then running
    llama-quantize, with no intermediate file.

    Raises:
        ConfigError, UnsupportedModelError, TensorError, IncompatiblePairError, TokenizerError,
        InputError, OutputError: each with a message naming the file, the field and the fix.
    """
    reading = interpret_folder(Path(drafter_dir))
    if reading.family is None:
        reading.require()  # not a drafter any family reads: its error finding says so
    family = family_named(str(reading.family))
    return family.converter().convert(reading, Path(drafter_dir), Path(target_dir), outfile, outtype,
                                      tokenizer_dir=tokenizer_dir, provenance=provenance, quant=quant,
                                      dry_run=dry_run, on_progress=on_progress)


__all__ = ["DEFAULT_FAMILY", "FAMILIES", "OWN_MTP_FAMILY", "SUPPORTED_DRAFTER_ARCHS", "Drafter", "DrafterFamily",
           "Finding", "Interpretation", "TargetFacts", "check_target_arch", "convert_drafter", "failed",
           "family_judging", "family_named", "family_of_config", "family_of_gguf", "family_of_kind",
           "family_of_spec_type", "first_error", "interpret", "interpret_folder", "noted", "pair_findings", "passed",
           "read_config", "reads_target_weights", "target_findings"]
