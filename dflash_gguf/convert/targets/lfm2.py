"""LFM2 targets: tappable in b11434 (lfm2.cpp); ``LFM2Model`` inherits TextModel.set_vocab. The built-in converter
does not convert them (llama.cpp's converter does)."""

from __future__ import annotations

from ..configs import TargetArch

ARCHS = (TargetArch("lfm2", ("Lfm2ForCausalLM", "LFM2ForCausalLM"), True, "gpt2", graph="lfm2.cpp"),)
