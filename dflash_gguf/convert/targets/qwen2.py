"""Qwen2 targets: known to b11434 (``Qwen2Model``), but its qwen2.cpp graph publishes no layer inputs, so no drafter
can run on them; the built-in converter does not convert them."""

from __future__ import annotations

from ..configs import TargetArch

ARCHS = (TargetArch("qwen2", ("Qwen2ForCausalLM",), False, "sentencepiece-or-gpt2", graph="qwen2.cpp"),)
