"""The records every drafter family's rules and checks speak in: a finding (one rule's verdict), a family's reading
of a config (spec plus findings), and the check results and report verify collects from the families' checks.

Apart from the registry so that family modules can import them while the registry imports the families.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Generic, Literal, Protocol, TypeVar

from ..errors import ConfigError, DflashGgufError

Status = Literal["pass", "fail", "skip"]
Severity = Literal["error", "warning", "info"]
# What a check's failure asks of the user (shared by the lineage checks and every family's pair checks).
PICK = "Pick the drafter made for this target (or the target the drafter was made for)."


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


def first_error(findings: Iterable[Finding]) -> None:
    """Raise the first blocking finding as its exception (the converter's way of reading findings)."""
    for f in findings:
        if f.blocking:
            raise f.exception()


@dataclass(frozen=True)
class CheckResult:
    """One check (verify's): a stable ``id``, the severity it has when it fails, what was found and what to do."""

    id: str
    severity: Severity
    status: Status
    message: str
    fix: str = ""

    @property
    def blocking(self) -> bool:
        return self.status == "fail" and self.severity == "error"


@dataclass
class Report:
    """Results in check order, plus the inputs they judged."""

    inputs: dict[str, str] = field(default_factory=dict)
    results: list[CheckResult] = field(default_factory=list)

    def ok(self, id: str, message: str, severity: Severity = "error") -> None:
        self.results.append(CheckResult(id, severity, "pass", message))

    def fail(self, id: str, severity: Severity, message: str, fix: str) -> None:
        self.results.append(CheckResult(id, severity, "fail", message, fix))

    def skip(self, id: str, message: str, severity: Severity = "info") -> None:
        self.results.append(CheckResult(id, severity, "skip", message))

    def info(self, id: str, message: str, fix: str = "") -> None:
        self.results.append(CheckResult(id, "info", "pass", message, fix))

    def add(self, finding: Finding) -> None:
        """A drafter family's finding, under its own id."""
        self.results.append(CheckResult(finding.id, finding.severity, finding.status, finding.message, finding.fix))

    def extend(self, other: Report) -> None:
        self.results += other.results

    @property
    def errors(self) -> list[CheckResult]:
        return [r for r in self.results if r.blocking]

    @property
    def warnings(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail" and r.severity == "warning"]

    @property
    def exit_code(self) -> int:
        """0 servable, 1 must not be served (unreadable inputs raise InputError, exit 2, before this)."""
        return 1 if self.errors else 0

    def result(self, id: str) -> CheckResult | None:
        return next((r for r in self.results if r.id == id), None)

    def to_dict(self) -> dict[str, object]:
        return {"inputs": self.inputs, "servable": not self.errors, "errors": len(self.errors),
                "warnings": len(self.warnings), "checks": [asdict(r) for r in self.results]}
