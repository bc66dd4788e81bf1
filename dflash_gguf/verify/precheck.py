"""Config-level precheck: drafter config.json + target config.json + repo ids/model cards, before any download.

Why: the pipeline fetches only configs and cards first; hidden size, tap range, mask id and lineage
(QAT/derived targets) can all be judged from them in seconds, before gigabytes of weights arrive. The drafter's
own rules and its rules against the target are its family's (``dflash_gguf.drafters``), the same the converter
applies; this module adds the target architecture and the lineage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import drafters
from ..drafters import TargetFacts
from ..drafters.findings import Report
from .lineage import card_paired_target, identity_from_card, intended_from_identity, judge, report_lineage


def _load(cfg: dict[str, Any] | Path | str, what: str) -> tuple[dict[str, Any], Path]:
    if isinstance(cfg, dict):
        return cfg, Path("config.json")
    path = Path(cfg)
    return drafters.read_config(path, what), path


def precheck(
    drafter_config: dict[str, Any] | Path | str,
    target_config: dict[str, Any] | Path | str,
    *,
    drafter_repo: str | None = None,
    target_repo: str | None = None,
    drafter_card: str | None = None,
    target_card: str | None = None,
    allow_derived_target: bool = False,
    drafter_by_llama_cpp: bool = False,
) -> Report:
    """Judge a pair from configs and cards only; same check ids as the GGUF checks. ``drafter_by_llama_cpp``: the
    drafter is to be converted by llama.cpp's own converter (our vocabulary coverage is then no error).

    Raises:
        ConfigError: a config cannot be read (the message the converter gives for it).
    """
    d, d_path = _load(drafter_config, "Drafter config")
    t_root, t_path = _load(target_config, "Target config")
    target = TargetFacts.from_config(t_root, t_path)
    r = Report(inputs={"drafter": drafter_repo or "", "target": target_repo or "", "stage": "precheck"})

    reading = drafters.interpret(d, d_path)
    for finding in (*drafters.target_findings(target), *reading.findings, *drafters.pair_findings(reading, target)):
        if finding.id == "pair.target_vocab" and finding.blocking and drafter_by_llama_cpp:
            r.info(finding.id, "llama.cpp's own converter (--llama-cpp) converts the drafter: " + finding.message)
        else:
            r.add(finding)
    if reading.spec is not None and reading.family is not None:
        r.info("pair.block_size", drafters.family_named(reading.family).draft_length_note(reading.spec))

    drafter_ident = identity_from_card(drafter_repo, drafter_card)
    intended, source = intended_from_identity(drafter_ident) or (None, "")
    if intended is None and (named := card_paired_target(drafter_card)):
        intended, source = named, "the drafter's model card text"
    if intended:
        r.info("lineage.intended_target", f"drafter was trained for {intended!r} (from {source})")
    else:
        r.fail("lineage.intended_target", "warning", "cannot tell which target the drafter was trained for (not a "
               "known published drafter; its card names no base_model or paired target). Only derivation markers "
               "in the target's own names and tags can be judged.", "Check the drafter's model card by hand.")
    target_ident = identity_from_card(target_repo, target_card)
    report_lineage(r, judge(intended, target_ident), intended, allow_derived_target)
    return r
