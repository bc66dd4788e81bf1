"""Gemma 1, 2, 3 and 3n targets: b11434's graphs for them publish no layer inputs ("layer input tensor is null"),
so no drafter can run on them; Gemma-4 (``gemma4``) is the Gemma a drafter taps."""

from __future__ import annotations

from ..configs import TargetArch

ARCHS = (
    TargetArch("gemma", ("GemmaForCausalLM",), False, graph="gemma.cpp"),
    TargetArch("gemma2", ("Gemma2ForCausalLM",), False, graph="gemma2.cpp"),
    TargetArch("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3TextModel"), False,
               graph="gemma3.cpp"),
    TargetArch("gemma3n", ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration"), False, graph="gemma3n.cpp"),
)
