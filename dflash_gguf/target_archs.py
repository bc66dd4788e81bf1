"""Target architectures, in one table: the GGUF name llama.cpp writes, the Hugging Face class names, whether
b11434's graph publishes the layer inputs a drafter taps, and which vocabulary path the drafter converter mirrors.

Sources: ``src/models/*.cpp`` of b11434 (the graphs that set ``res->t_layer_inp`` for DFlash extraction; the
Gemma 1-3 graphs do not: "layer input tensor is null"), ``conversion/*.py`` (``set_vocab`` of each class).
The built-in *target* converter's own coverage is its family registry (``convert/targets``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetArch:
    gguf: str  # general.architecture
    hf: tuple[str, ...] = ()  # config.json architectures[0] values
    tappable: bool | None = True  # None: not known either way
    drafter_vocab: str | None = None  # "gemma4" | "bpe": the target vocabulary the drafter converter embeds


TARGET_ARCHS: tuple[TargetArch, ...] = (
    TargetArch("gemma4", ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
                          "Gemma4ForCausalLM"), True, "gemma4"),
    TargetArch("qwen3", ("Qwen3ForCausalLM",), True, "bpe"),
    TargetArch("qwen3moe", ("Qwen3MoeForCausalLM",), True, "bpe"),
    TargetArch("qwen2", ("Qwen2ForCausalLM",), None, "bpe"),
    TargetArch("llama", ("LlamaForCausalLM",), True, "bpe"),
    *(TargetArch(name) for name in ("qwen35", "qwen35moe", "qwen3next", "gpt-oss", "nemotron_h", "minimax-m2",
                                    "deepseek4", "lfm2")),
    TargetArch("gemma", ("GemmaForCausalLM",), False),
    TargetArch("gemma2", ("Gemma2ForCausalLM",), False),
    TargetArch("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3TextModel"), False),
    TargetArch("gemma3n", ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration"), False),
)

_BY_GGUF = {a.gguf: a for a in TARGET_ARCHS}
_BY_HF = {hf: a for a in TARGET_ARCHS for hf in a.hf}


def by_gguf(name: str | None) -> TargetArch | None:
    return _BY_GGUF.get(name or "")


def by_hf(name: str | None) -> TargetArch | None:
    return _BY_HF.get(name or "")


def drafter_vocab_archs() -> tuple[str, ...]:
    """HF class names whose vocabulary the drafter converter embeds."""
    return tuple(hf for a in TARGET_ARCHS if a.drafter_vocab for hf in a.hf)
