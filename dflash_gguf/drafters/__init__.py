"""Drafter families: one module per family, each a pure interpreter of a drafter's ``config.json``.

A raw config goes in; a typed, frozen spec (what the converter writes) and findings (id, status, severity,
message, fix, and the error class the converter raises) come out. The converter raises on an error finding,
precheck and the pipeline report the same findings under the same ids, and nothing else reads a drafter
config, so the commands cannot disagree about a drafter.

A new family is one module here with ``ARCHITECTURES`` (the config's ``architectures[0]`` values),
``interpret(raw, path) -> Interpretation`` and ``pair_findings(spec, target) -> tuple[Finding, ...]``, plus its
name in ``_FAMILY_MODULES``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError, DflashGgufError, NotCoveredError, UnsupportedModelError
from ..hf_configs import read_config
from ..registry import by_architecture
from ..target_archs import by_hf, drafter_vocab_archs

Status = Literal["pass", "fail", "skip"]
Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One rule's verdict on a drafter (or on a drafter with its target), under a check id verify also uses.

    ``error`` is what the converter raises when an error finding fails; ``note`` findings are recorded in the
    converted GGUF (``dflash_gguf.notes``) and printed by ``dflash-convert``.
    """

    id: str
    status: Status
    severity: Severity
    message: str
    fix: str = ""
    error: type[DflashGgufError] | None = None
    note: bool = False

    @property
    def blocking(self) -> bool:
        return self.status == "fail" and self.severity == "error"

    def exception(self) -> DflashGgufError:
        return (self.error or ConfigError)(f"{self.message} {self.fix}".strip())


def passed(id: str, message: str, severity: Severity = "error") -> Finding:
    """A rule that held (``severity``: what a failure of it would have been)."""
    return Finding(id, "pass", severity, message)


def failed(id: str, message: str, fix: str, error: type[DflashGgufError], severity: Severity = "error") -> Finding:
    return Finding(id, "fail", severity, message, fix, error)


def noted(id: str, message: str, severity: Severity = "info") -> Finding:
    """A note the converter records (and, as a warning, precheck shows as one)."""
    return Finding(id, "fail" if severity == "warning" else "pass", severity, message, note=True)


@dataclass(frozen=True)
class Interpretation:
    """A drafter config as one family reads it: the spec (None when an error finding blocks it) and findings."""

    family: str | None
    spec: Any
    findings: tuple[Finding, ...] = field(default=())

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.blocking]

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(f.message for f in self.findings if f.note)

    def require(self) -> Any:
        """The spec, or the first error finding raised as its exception."""
        if self.errors:
            raise self.errors[0].exception()
        return self.spec


@dataclass(frozen=True)
class TargetFacts:
    """What drafter rules need to know of the target, from its config.json (``text_config`` merged in)."""

    arch: str | None
    hidden_size: int | None
    n_layers: int | None
    vocab_size: int | None
    path: Path | None = None
    # attention geometry (Gemma-4: sliding layers' head_dim / num_key_value_heads, full layers' global_*), for
    # drafters that attend over the target's own KV cache
    head_dim: int | None = None
    kv_heads: int | None = None
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    layer_types: tuple[str, ...] | None = None

    @classmethod
    def from_config(cls, raw: dict[str, Any], path: Path | None = None) -> TargetFacts:
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        merged = {**raw, **text}
        archs = text.get("architectures") or raw.get("architectures") or [None]
        types = merged.get("layer_types")
        return cls(archs[0] if isinstance(archs[0], str) else None, _int(merged.get("hidden_size")),
                   _int(merged.get("num_hidden_layers")), _int(merged.get("vocab_size")), path,
                   _int(merged.get("head_dim")), _int(merged.get("num_key_value_heads")),
                   _int(merged.get("global_head_dim")), _int(merged.get("num_global_key_value_heads")),
                   tuple(str(t) for t in types) if isinstance(types, list) else None)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# Drafter kinds b11434 reads that no family here converts yet (named in the refusal).
KNOWN_UNSUPPORTED_DRAFTER_ARCHS: tuple[str, ...] = ()
# Family modules of this package; each declares the ARCHITECTURES it reads.
_FAMILY_MODULES: tuple[str, ...] = ("dflash", "dspark", "gemma4_assistant", "eagle3")


FAMILIES = by_architecture(__name__, _FAMILY_MODULES)  # architectures[0] -> family module
SUPPORTED_DRAFTER_ARCHS: tuple[str, ...] = tuple(FAMILIES)


def interpret(raw: dict[str, Any], path: Path) -> Interpretation:
    """The drafter config ``raw`` (read from ``path``) as its family reads it."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    family = FAMILIES.get(arch) if isinstance(arch, str) else None
    if family is None:
        extra = (" llama.cpp b11434 reads that checkpoint kind too, but this version of dflash-gguf does not "
                 "convert it yet; use llama.cpp's convert_hf_to_gguf.py." if arch in KNOWN_UNSUPPORTED_DRAFTER_ARCHS
                 else "")
        return Interpretation(None, None, (failed(
            "format.arch", f"{path}: field 'architectures' is {archs!r}, not a DFlash drafter. Supported: "
            f"{', '.join(SUPPORTED_DRAFTER_ARCHS)}.{extra}", "Check that --drafter points at the DFlash repo (e.g. "
            "z-lab/Qwen3-8B-DFlash-b16) and --target at the model it drafts for.", UnsupportedModelError),))
    return family.interpret(raw, path)


def interpret_folder(drafter: Path) -> Interpretation:
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
    return FAMILIES_BY_NAME[interpretation.family].pair_findings(interpretation.spec, target)


FAMILIES_BY_NAME = {mod.FAMILY: mod for mod in FAMILIES.values()}


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
                       "llama.cpp's own converter would make the files, but the pair aborts at its first draft.",
                       UnsupportedModelError),)
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


def first_error(findings: Iterable[Finding]) -> None:
    """Raise the first blocking finding as its exception (the converter's way of reading findings)."""
    for f in findings:
        if f.blocking:
            raise f.exception()


__all__ = ["FAMILIES", "SUPPORTED_DRAFTER_ARCHS", "Finding", "Interpretation", "TargetFacts", "first_error",
           "interpret", "interpret_folder", "pair_findings", "read_config", "target_findings"]
