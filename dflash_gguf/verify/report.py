"""Check results and the report that collects them; the exit code follows from the worst failure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from ..drafters import Finding

Severity = Literal["error", "warning", "info"]
Status = Literal["pass", "fail", "skip"]



@dataclass(frozen=True)
class CheckResult:
    """One check: a stable ``id``, the severity it has when it fails, what was found and what to do."""

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
        """0 servable, 1 must not be served (unreadable inputs raise VerifyError, exit 2, before this)."""
        return 1 if self.errors else 0

    def result(self, id: str) -> CheckResult | None:
        return next((r for r in self.results if r.id == id), None)

    def to_dict(self) -> dict[str, object]:
        return {"inputs": self.inputs, "servable": not self.errors, "errors": len(self.errors),
                "warnings": len(self.warnings), "checks": [asdict(r) for r in self.results]}
