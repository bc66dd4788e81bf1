"""Target architectures, in one table: the GGUF name llama.cpp writes, the Hugging Face class names, whether
b11434's graph publishes the layer inputs a drafter taps, and which vocabulary path the drafter converter mirrors.

Sources: ``src/models/*.cpp`` of b11434 (the graphs that set ``res->t_layer_inp`` for DFlash extraction; the
Gemma 1-3, GLM and DeepSeek-V2/V3 graphs do not: "layer input tensor is null"), ``conversion/*.py`` (``set_vocab``
of each class, and which architecture each Hugging Face class is converted to).
The built-in *target* converter's own coverage is its family registry (``convert/targets``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The vocabulary paths of b11434's ``set_vocab`` the drafter converter mirrors (b11434's DFlashModel.set_vocab runs
# the *target* class's set_vocab): Gemma4Model's own tokenizer.json reader; Qwen2Model/LlamaModel's
# SentencePiece-first (``_set_vocab_sentencepiece``, then ``_set_vocab_gpt2`` without a tokenizer.model); and
# TextModel's plain ``_set_vocab_gpt2``.
VocabPath = Literal["gemma4", "sentencepiece-or-gpt2", "gpt2"]


@dataclass(frozen=True)
class TargetArch:
    gguf: str  # general.architecture
    hf: tuple[str, ...] = ()  # config.json architectures[0] values
    tappable: bool | None = True  # None: not known either way
    drafter_vocab: VocabPath | None = None  # the target vocabulary path the drafter converter mirrors
    drafter_note: str | None = None  # where b11434's drafter conversion for this target differs (recorded)


TARGET_ARCHS: tuple[TargetArch, ...] = (
    TargetArch("gemma4", ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
                          "Gemma4ForCausalLM"), True, "gemma4"),
    TargetArch("qwen3", ("Qwen3ForCausalLM",), True, "sentencepiece-or-gpt2"),
    TargetArch("qwen3moe", ("Qwen3MoeForCausalLM",), True, "gpt2", (
        "llama.cpp b11434's converter cannot convert a DFlash drafter for a Qwen3-MoE target: Qwen3MoeModel.set_vocab "
        "calls super().set_vocab() on the drafter's converter object, which is no Qwen3MoeModel (TypeError). This "
        "file embeds what the GPT-2 path that call leads to (TextModel.set_vocab) writes.")),
    TargetArch("qwen2", ("Qwen2ForCausalLM",), None, "sentencepiece-or-gpt2"),
    TargetArch("llama", ("LlamaForCausalLM",), True, "sentencepiece-or-gpt2"),
    # Qwen3_5TextModel / Qwen3_5MoeTextModel / Qwen3NextModel inherit TextModel.set_vocab (conversion/qwen.py)
    TargetArch("qwen35", ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"), True, "gpt2"),
    TargetArch("qwen35moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), True, "gpt2"),
    TargetArch("qwen3next", ("Qwen3NextForCausalLM",), True, "gpt2"),
    TargetArch("gpt-oss", ("GptOssForCausalLM",), True, "gpt2"),  # GptOssModel.set_vocab: _set_vocab_gpt2
    TargetArch("minimax-m2", ("MiniMaxM2ForCausalLM",), True, "gpt2"),  # MiniMaxM2Model: TextModel's
    TargetArch("lfm2", ("Lfm2ForCausalLM", "LFM2ForCausalLM"), True, "gpt2"),  # LFM2Model: TextModel's
    # NemotronHModel reads its tokenizer through transformers with remote code; DeepSeek-V4 targets are FP8.
    *(TargetArch(name) for name in ("nemotron_h", "deepseek4")),
    # z-lab publishes DFlash drafters for GLM-5.1 and Kimi-K2.6, but b11434's graphs for them (and for GLM-4.5/4.6,
    # GLM-4.7-Flash, DeepSeek-V3) never set t_layer_inp, so llm_graph_result::set_outputs asserts on the first draft.
    TargetArch("glm4moe", ("Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration", "SolarOpenForCausalLM"), False),
    TargetArch("deepseek2", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
                             "KimiVLForConditionalGeneration", "KimiK25ForConditionalGeneration"), False),
    TargetArch("deepseek32", ("DeepseekV32ForCausalLM",), False),
    TargetArch("glm-dsa", ("GlmMoeDsaForCausalLM",), False),
    TargetArch("glm5-next", ("Glm5NextForConditionalGeneration",), False),
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
