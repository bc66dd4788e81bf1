"""Nemotron-H targets: b11434's ``NemotronHModel`` reads its tokenizer through transformers with remote code, which
this tool never runs, so neither the target nor a drafter's vocabulary is converted here."""

from __future__ import annotations

from ..configs import TargetArch

ARCHS = (TargetArch("nemotron_h", graph="nemotron-h.cpp", output_tap=True),)
