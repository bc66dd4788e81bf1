"""What a conversion returns, and the one place a planned GGUF is written (drafter and target alike).

Writing is the same for every converter: size the file, check free space, stream the tensors into
``<out>.partial`` with byte progress, fsync and rename (``atomic.atomic_output``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import atomic_output, check_free_space
from ..ggufio import GGUFPlan, TensorOut
from .vocab import VocabInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConvertResult:
    outfile: Path
    n_tensors: int
    n_bytes: int
    outtype: str
    vocab: VocabInfo
    notes: tuple[str, ...]
    seconds: float
    dry_run: bool = False
    provenance: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready description for ``--json``."""
        return {"outfile": str(self.outfile), "tensors": self.n_tensors, "bytes": self.n_bytes,
                "outtype": self.outtype, "vocab": {"model": self.vocab.model, "tokens": self.vocab.n_tokens,
                "sha256": self.vocab.sha256}, "notes": list(self.notes), "seconds": round(self.seconds, 3),
                "dry_run": self.dry_run, "provenance": self.provenance}


def write_plan(plan: GGUFPlan, outfile: Path, on_progress: Callable[[int, int], None] | None = None) -> int:
    """Write ``plan`` atomically to ``outfile``; return the file size.

    Raises:
        OutputError: the folder is missing, there is not enough free space, or the disk fills up.
    """
    outfile = Path(outfile)
    header = plan.header_bytes()
    total = plan.data_bytes
    check_free_space(outfile, total + len(header))
    done = 0

    def tick(t: TensorOut) -> None:
        nonlocal done
        done += t.nbytes
        if on_progress is not None:
            on_progress(done, total)

    with atomic_output(outfile) as tmp:
        size = plan.write(tmp, on_tensor=tick, header=header)
    log.info("wrote %s: %d tensors, %d bytes", outfile, len(plan.tensors), size)
    return size
