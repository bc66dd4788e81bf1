"""Verify a DFlash drafter/target pair before it is served: format, pair and lineage checks.

Reads GGUF headers and configs only (the target families' facts, never a converter); see ``verify_files`` and
``precheck``.
"""

from __future__ import annotations

from pathlib import Path

from .. import drafters
from ..drafters.findings import CheckResult, Report
from ..ggufio.reader import GGUFMeta, read_gguf
from ..provenance import TARGET_FILE, key
from ..sidecar import is_sidecar, sidecars_beside, target_beside
from .pair_checks import check_lineage, check_target_alone
from .precheck import precheck
from .projector import check_projector, is_projector

TARGET_FILE_KEY = key(TARGET_FILE)


def verify_files(drafter: Path, target: Path | None = None, *, allow_derived_target: bool = False) -> Report:
    """Run every check on ``drafter`` (and ``target``, or the target file it records beside itself, or the one
    target beside a ``dflash-*.gguf`` sidecar; a target given alone with a sidecar beside it is judged with it).

    A single file that is not a drafter is judged as a target alone: can it feed a DFlash drafter, and
    do its names mark it as a QAT, abliterated or merged derivative.

    Raises:
        InputError: an input cannot be read (exit 2).
    """
    d = read_gguf(Path(drafter))
    if is_projector(d):
        return _projector_report(d, target)
    family = _family(d)
    found = None
    if target is None and family is None and (sidecars := sidecars_beside(Path(drafter))):
        # a target given alone, with llama.cpp's sidecar beside it: judge the pair llama-server would serve
        drafter, target, d = sidecars[0], Path(drafter), read_gguf(sidecars[0])
        family, found = _family(d), f"drafter {sidecars[0].name} found beside the target (llama.cpp's sidecar name)"
    if target is None:
        name = d.get(TARGET_FILE_KEY)
        beside = Path(drafter).parent / name if isinstance(name, str) and name else None
        if (beside is None or not beside.is_file()) and is_sidecar(drafter):
            beside = target_beside(Path(drafter))  # a sidecar nobody here wrote: the folder's one target
            found = f"target {beside.name} found beside the sidecar (the folder's one target)" if beside else None
        target = beside if beside is not None and beside.is_file() else None
    t = read_gguf(Path(target)) if target is not None else None
    if t is None and family is None:
        # one file that is not a drafter: judge it as a target (arch, QAT/derived names)
        report = Report(inputs={"drafter": "", "target": str(drafter)})
        report.extend(check_target_alone(d, allow_derived_target))
        return report
    report = Report(inputs={"drafter": str(drafter), "target": str(target) if target else ""})
    if found:
        report.info("pair.found", found)
    report.extend((family or drafters.DEFAULT_FAMILY).checks().check_drafter(d, t))
    arch = report.result("format.arch")
    if arch is None or arch.status == "pass":
        report.extend(check_lineage(d, t, allow_derived_target))
    return report


def _projector_report(p: GGUFMeta, target: Path | None) -> Report:
    """A projector given first: judged with the target given second (a projector alone cannot be judged)."""
    if target is None:
        report = Report(inputs={"projector": str(p.path), "target": ""})
        report.fail("projector.target", "error", f"{p.path.name} is a projector (mmproj): it is judged against "
                    "the target it is served with.",
                    f"Pass the target second: dflash-verify {p.path.name} TARGET.gguf.")
        return report
    return check_projector(p, read_gguf(Path(target)))


def _family(d: GGUFMeta) -> drafters.DrafterFamily | None:
    """The drafter family whose checks judge a header (``drafters.family_judging``)."""
    return drafters.family_judging(d)


__all__ = ["CheckResult", "Report", "precheck", "read_gguf", "verify_files"]
