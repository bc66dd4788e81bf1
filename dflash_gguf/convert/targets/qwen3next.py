"""Qwen3-Next targets: tappable in b11434 (qwen3next.cpp) with an MTP draft graph; ``Qwen3NextModel`` inherits
TextModel.set_vocab. The built-in converter does not convert them (llama.cpp's converter does)."""

from __future__ import annotations

from ..configs import TargetArch

ARCHS = (TargetArch("qwen3next", ("Qwen3NextForCausalLM",), True, "gpt2", graph="qwen3next.cpp", mtp_graph=True,
                    output_tap=True),)
