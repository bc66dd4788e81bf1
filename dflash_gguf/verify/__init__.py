"""Verify a DFlash drafter/target pair before it is served: format, pair and lineage checks.

Reads GGUF headers and configs only (never imports ``dflash_gguf.convert``); see ``verify_files`` and
``precheck``.
"""

from __future__ import annotations

from pathlib import Path

from ..drafters.gemma4_assistant import GGUF_ARCH as ASSISTANT_ARCH
from ..ggufio.reader import read_gguf
from ..provenance import TARGET_FILE, key
from ..sidecar import is_sidecar, sidecars_beside, target_beside
from .assistant_checks import check_assistant_format, check_assistant_pair
from .eagle3_checks import ARCH as EAGLE3_ARCH
from .eagle3_checks import check_format as check_eagle3_format
from .eagle3_checks import check_pair as check_eagle3_pair
from .format_checks import check_format, is_drafter_like
from .pair_checks import check_lineage, check_pair, check_target_alone
from .precheck import precheck
from .report import CheckResult, Report

TARGET_FILE_KEY = key(TARGET_FILE)


def verify_files(drafter: Path, target: Path | None = None, *, allow_derived_target: bool = False) -> Report:
    """Run every check on ``drafter`` (and ``target``, or the target file it records beside itself, or the one
    target beside a ``dflash-*.gguf`` sidecar; a target given alone with a sidecar beside it is judged with it).

    A single file that is not a drafter is judged as a target alone: can it feed a DFlash drafter, and
    do its names mark it as a QAT, abliterated or merged derivative.

    Raises:
        VerifyError: an input cannot be read (exit 2).
    """
    d = read_gguf(Path(drafter))
    head = d.arch in (ASSISTANT_ARCH, EAGLE3_ARCH)  # drafters with their own format and pair checks
    found = None
    if target is None and not is_drafter_like(d) and not head and \
            (sidecars := sidecars_beside(Path(drafter))):
        # a target given alone, with llama.cpp's sidecar beside it: judge the pair llama-server would serve
        drafter, target, d = sidecars[0], Path(drafter), read_gguf(sidecars[0])
        found = f"drafter {sidecars[0].name} found beside the target (llama.cpp's sidecar name)"
    if target is None:
        name = d.get(TARGET_FILE_KEY)
        beside = Path(drafter).parent / name if isinstance(name, str) and name else None
        if (beside is None or not beside.is_file()) and is_sidecar(drafter):
            beside = target_beside(Path(drafter))  # a sidecar nobody here wrote: the folder's one target
            found = f"target {beside.name} found beside the sidecar (the folder's one target)" if beside else None
        target = beside if beside is not None and beside.is_file() else None
    t = read_gguf(Path(target)) if target is not None else None
    if t is None and not is_drafter_like(d) and not head:
        # one file that is not a drafter: judge it as a target (arch, QAT/derived names)
        report = Report(inputs={"drafter": "", "target": str(drafter)})
        report.extend(check_target_alone(d, allow_derived_target))
        return report
    report = Report(inputs={"drafter": str(drafter), "target": str(target) if target else ""})
    if found:
        report.info("pair.found", found)
    if d.arch == ASSISTANT_ARCH:  # a Gemma-4 MTP assistant: its own format and pair checks
        report.extend(check_assistant_format(d))
        if t is not None and not report.errors:
            report.extend(check_assistant_pair(d, t))
        elif t is None:
            report.skip("pair.target", "no target GGUF given: pair checks (vocabulary, hidden size, KV geometry) "
                        "not run", "error")
        report.extend(check_lineage(d, t, allow_derived_target))
        return report
    if d.arch == EAGLE3_ARCH:  # an EAGLE-3 head: its own format and pair checks
        report.extend(check_eagle3_format(d))
        if t is not None:
            report.extend(check_eagle3_pair(d, t))
        else:
            report.skip("pair.target", "no target GGUF given: pair checks (vocabulary, target hidden size, taps, d2t) "
                        "not run", "error")
        report.extend(check_lineage(d, t, allow_derived_target))
        return report
    fmt = check_format(d)
    report.extend(fmt)
    arch = fmt.result("format.arch")
    if arch is not None and arch.status == "pass":
        if t is not None:
            report.extend(check_pair(d, t))
        else:
            report.skip("pair.target", "no target GGUF given: pair checks (hidden size, taps, vocabulary, mask id, "
                        "embedding scale) not run", "error")
        report.extend(check_lineage(d, t, allow_derived_target))
    return report


__all__ = ["CheckResult", "Report", "precheck", "read_gguf", "verify_files"]
