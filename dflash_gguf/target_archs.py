"""Target architectures, in one table: the GGUF name llama.cpp writes, the Hugging Face class names, the b11434 graph
that runs it, whether that graph publishes the layer inputs a drafter taps, whether it has an MTP draft graph (what
still speculates where no drafter can), and which vocabulary path the drafter converter mirrors.

Sources: ``src/models/*.cpp`` of b11434 (the graphs that set ``res->t_layer_inp`` for DFlash extraction; the
Gemma 1-3, GLM and DeepSeek-V2/V3 graphs do not: "layer input tensor is null"; the graphs that build
``LLM_GRAPH_TYPE_DECODER_MTP``), ``conversion/*.py`` (``set_vocab`` of each class, which architecture each Hugging
Face class is converted to, and whether its nextn layers are written).
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
    """One target architecture as llama.cpp b11434 converts and runs it: a drafter needs ``tappable``; where it is
    False, ``mtp_graph`` says whether the target's own MTP head is the way to speculate in llama-server instead."""

    gguf: str  # general.architecture
    hf: tuple[str, ...] = ()  # config.json architectures[0] values
    tappable: bool | None = True  # the graph sets t_layer_inp; None: not known either way
    drafter_vocab: VocabPath | None = None  # the target vocabulary path the drafter converter mirrors
    drafter_note: str | None = None  # where b11434's drafter conversion for this target differs (recorded)
    graph: str | None = None  # the src/models/*.cpp file whose graph b11434 builds for this arch
    mtp_graph: bool = False  # that graph builds LLM_GRAPH_TYPE_DECODER_MTP: --spec-type draft-mtp runs its nextn head
    mtp_dropped: tuple[str, ...] = ()  # HF classes b11434's converter writes without their nextn layers


TARGET_ARCHS: tuple[TargetArch, ...] = (
    TargetArch("gemma4", ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration",
                          "Gemma4ForCausalLM"), True, "gemma4", graph="gemma4.cpp"),
    TargetArch("qwen3", ("Qwen3ForCausalLM",), True, "sentencepiece-or-gpt2", graph="qwen3.cpp"),
    TargetArch("qwen3moe", ("Qwen3MoeForCausalLM",), True, "gpt2", (
        "llama.cpp b11434's converter cannot convert a DFlash drafter for a Qwen3-MoE target: Qwen3MoeModel.set_vocab "
        "calls super().set_vocab() on the drafter's converter object, which is no Qwen3MoeModel (TypeError). This "
        "file embeds what the GPT-2 path that call leads to (TextModel.set_vocab) writes."), graph="qwen3moe.cpp"),
    TargetArch("qwen2", ("Qwen2ForCausalLM",), False, "sentencepiece-or-gpt2", graph="qwen2.cpp"),
    TargetArch("llama", ("LlamaForCausalLM",), True, "sentencepiece-or-gpt2", graph="llama.cpp"),
    # Qwen3_5TextModel / Qwen3_5MoeTextModel / Qwen3NextModel inherit TextModel.set_vocab (conversion/qwen.py)
    TargetArch("qwen35", ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"), True, "gpt2",
               graph="qwen35.cpp", mtp_graph=True),
    TargetArch("qwen35moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), True, "gpt2",
               graph="qwen35moe.cpp", mtp_graph=True),
    TargetArch("qwen3next", ("Qwen3NextForCausalLM",), True, "gpt2", graph="qwen3next.cpp", mtp_graph=True),
    # GptOssModel.set_vocab: _set_vocab_gpt2; MiniMaxM2Model and LFM2Model: TextModel's
    TargetArch("gpt-oss", ("GptOssForCausalLM",), True, "gpt2", graph="openai-moe.cpp"),
    TargetArch("minimax-m2", ("MiniMaxM2ForCausalLM",), True, "gpt2", graph="minimax-m2.cpp"),
    TargetArch("lfm2", ("Lfm2ForCausalLM", "LFM2ForCausalLM"), True, "gpt2", graph="lfm2.cpp"),
    # NemotronHModel reads its tokenizer through transformers with remote code; DeepSeek-V4 targets are FP8.
    TargetArch("nemotron_h", graph="nemotron-h.cpp"),
    TargetArch("deepseek4", graph="deepseek4.cpp", mtp_graph=True),
    # z-lab publishes DFlash drafters for GLM-5.1 and Kimi-K2.6, but b11434's graphs for them (and for GLM-4.5/4.6,
    # GLM-4.7-Flash, DeepSeek-V3) never set t_layer_inp, so llm_graph_result::set_outputs asserts on the first draft.
    # Their MTP draft graphs do run; b11434's converter keeps the nextn layers (unless --no-mtp) except in
    # DeepseekV2Model, whose skip_mtp drops them ("remove this when we support MTP for deepseek models").
    TargetArch("glm4moe", ("Glm4MoeForCausalLM", "Glm4vMoeForConditionalGeneration", "SolarOpenForCausalLM"), False,
               graph="glm4-moe.cpp", mtp_graph=True),
    TargetArch("deepseek2", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
                             "KimiVLForConditionalGeneration", "KimiK25ForConditionalGeneration"), False,
               graph="deepseek2.cpp", mtp_graph=True, mtp_dropped=(
                   "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiVLForConditionalGeneration",
                   "KimiK25ForConditionalGeneration")),
    TargetArch("deepseek32", ("DeepseekV32ForCausalLM",), False, graph="deepseek32.cpp", mtp_graph=True),
    TargetArch("glm-dsa", ("GlmMoeDsaForCausalLM",), False, graph="glm-dsa.cpp", mtp_graph=True),
    TargetArch("glm5-next", ("Glm5NextForConditionalGeneration",), False, graph="glm5-next.cpp", mtp_graph=True),
    TargetArch("gemma", ("GemmaForCausalLM",), False, graph="gemma.cpp"),
    TargetArch("gemma2", ("Gemma2ForCausalLM",), False, graph="gemma2.cpp"),
    TargetArch("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Gemma3TextModel"), False,
               graph="gemma3.cpp"),
    TargetArch("gemma3n", ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration"), False, graph="gemma3n.cpp"),
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


def what_serves_instead(arch: TargetArch, hf: str | None = None) -> str:
    """What speculates on a target no drafter can tap, in words: its own MTP head through llama-server where b11434
    has an MTP draft graph for it and its GGUF keeps the nextn layers, otherwise another runtime. ``hf``: the
    target's HF class, when known (b11434's converter drops the nextn layers of some classes)."""
    elsewhere = "another runtime, such as vLLM or SGLang, where z-lab's DFlash drafters run"
    if not arch.mtp_graph:
        return f"What works instead: {elsewhere} (b11434 has no MTP draft graph for {arch.gguf})."
    own = (f"its own MTP head, `llama-server -m TARGET.gguf --spec-type draft-mtp` (b11434's {arch.graph} has an MTP "
           "draft graph; the target GGUF must keep its nextn layers")
    if hf is not None and hf in arch.mtp_dropped:
        return (f"b11434's {arch.graph} has an MTP draft graph, but b11434's converter drops {hf}'s nextn layers, "
                f"so a GGUF it writes has no head for --spec-type draft-mtp: serve it with {elsewhere}.")
    if arch.mtp_dropped and hf is None:
        return (f"What works instead: {own}, which b11434's converter writes for {arch.gguf} targets except "
                f"{', '.join(arch.mtp_dropped)}), or {elsewhere}.")
    return f"What works instead: {own}, as llama.cpp's converter writes them), or {elsewhere}."
