"""One file of a repo ``publish`` writes: where it comes from, its size and hash, and what it is (the card names it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class UploadFile:
    """One file of the repo: where it comes from, its size and sha256, and what it is (for the card)."""

    path_in_repo: str
    local: Path | None  # None: generated (the card)
    size: int
    sha256: str
    role: str
    kind: str | None = None  # a drafter's sidecar kind (its family's), the card's tag for it

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path_in_repo, "local": str(self.local) if self.local else None, "size": self.size,
                "sha256": self.sha256, "role": self.role, "kind": self.kind}
