"""The records every drafter family's rules speak in: a finding (one rule's verdict), a family's reading of a
config (spec plus findings), and what the rules need to know of the target.

Apart from the registry so that family modules can import them while the registry imports the families.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

from ..errors import ConfigError, DflashGgufError
from ..hf_configs import section

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


class DrafterSpec(Protocol):
    """What every family's reading of a drafter config (its spec) says, whatever else it holds."""

    @property
    def path(self) -> Path:
        """The config.json it was read from."""
        ...

    @property
    def block_size(self) -> int | None:
        """The block drafted per step (None: one token per step)."""
        ...

    @property
    def n_max_limit(self) -> int | None:
        """The largest --spec-draft-n-max llama.cpp keeps (None: it clamps none)."""
        ...


SpecT = TypeVar("SpecT", bound=DrafterSpec, covariant=True)


@dataclass(frozen=True)
class Interpretation(Generic[SpecT]):
    """A drafter config as one family reads it: the spec (None when an error finding blocks it) and findings."""

    family: str | None
    spec: SpecT | None
    findings: tuple[Finding, ...] = field(default=())

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.blocking]

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(f.message for f in self.findings if f.note)

    def require(self) -> SpecT:
        """The spec, or the first error finding raised as its exception."""
        if self.errors:
            raise self.errors[0].exception()
        assert self.spec is not None, "a reading without a spec carries the error that blocked it"
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
        text = section(raw, "text_config")
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


def first_error(findings: Iterable[Finding]) -> None:
    """Raise the first blocking finding as its exception (the converter's way of reading findings)."""
    for f in findings:
        if f.blocking:
            raise f.exception()
