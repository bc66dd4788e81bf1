"""The records a target is described by: its architecture's row of facts (:class:`TargetArch`, declared by its
family module under ``convert/targets``), its config.json read raw as b11434 does (:class:`TargetConfig`), and what
drafter rules need of it (:class:`TargetFacts`).

Low in the package so that the converters, the drafter families and verify can all import them; the registry that
finds a target's row is ``convert.targets``. Config files are read and normalised by ``dflash_gguf.hf_configs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from ..hf_configs import read_config, section

# The vocabulary paths of b11434's ``set_vocab`` the drafter converter mirrors (b11434's DFlashModel.set_vocab runs
# the *target* class's set_vocab): Gemma4Model's own tokenizer.json reader; Qwen2Model/LlamaModel's
# SentencePiece-first (``_set_vocab_sentencepiece``, then ``_set_vocab_gpt2`` without a tokenizer.model); and
# TextModel's plain ``_set_vocab_gpt2``.
VocabPath = Literal["gemma4", "sentencepiece-or-gpt2", "gpt2"]


@dataclass(frozen=True)
class ProjectorType:
    """One kind of projector (mmproj) tower b11434's mtmd runs, as a target family's checkpoints make it: the
    ``clip.projector_type`` value, what it encodes, and the text mtmd wraps each image or clip in (``img_beg`` /
    ``aud_beg`` and their ends in tools/mtmd/mtmd.cpp), which the target's vocabulary must hold as tokens."""

    name: str
    modality: Literal["vision", "audio"]
    markers: tuple[str, ...] = ()


@dataclass(frozen=True)
class TargetArch:
    """One target architecture as llama.cpp b11434 converts and runs it: a drafter needs ``tappable``; where it is
    False, ``mtp_graph`` says whether the target's own MTP head is the way to speculate in llama-server instead.

    Sources: ``src/models/*.cpp`` of b11434 (the graphs that set ``res->t_layer_inp`` for DFlash extraction; the
    graphs that build ``LLM_GRAPH_TYPE_DECODER_MTP``) and ``conversion/*.py`` (``set_vocab`` of each class, which
    architecture each Hugging Face class is converted to, and whether its nextn layers are written).
    """

    gguf: str  # general.architecture
    hf: tuple[str, ...] = ()  # config.json architectures[0] values
    tappable: bool | None = True  # the graph sets t_layer_inp; None: not known either way
    drafter_vocab: VocabPath | None = None  # the target vocabulary path the drafter converter mirrors
    drafter_note: str | None = None  # where b11434's drafter conversion for this target differs (recorded)
    graph: str | None = None  # the src/models/*.cpp file whose graph b11434 builds for this arch
    mtp_graph: bool = False  # that graph builds LLM_GRAPH_TYPE_DECODER_MTP: --spec-type draft-mtp runs its nextn head
    mtp_dropped: tuple[str, ...] = ()  # HF classes b11434's converter writes without their nextn layers
    # The graph publishes the hidden state after its last layer (``t_h_nextn``), so an EAGLE-3 tap equal to the
    # layer count can be read (common_speculative_impl_draft_eagle3 uses llama_get_embeddings_nextn for it).
    output_tap: bool = False
    projectors: tuple[ProjectorType, ...] = ()  # the projector towers its image-text checkpoints have

    def what_serves_instead(self, hf: str | None = None) -> str:
        """What speculates on a target no drafter can tap, in words: its own MTP head through llama-server where
        b11434 has an MTP draft graph for it and its GGUF keeps the nextn layers, otherwise another runtime. ``hf``:
        the target's HF class, when known (b11434's converter drops the nextn layers of some classes)."""
        elsewhere = "another runtime, such as vLLM or SGLang, where z-lab's DFlash drafters run"
        if not self.mtp_graph:
            return f"What works instead: {elsewhere} (b11434 has no MTP draft graph for {self.gguf})."
        own = (f"its own MTP head, `llama-server -m TARGET.gguf --spec-type draft-mtp` (b11434's {self.graph} has an "
               "MTP draft graph; the target GGUF must keep its nextn layers")
        if hf is not None and hf in self.mtp_dropped:
            return (f"b11434's {self.graph} has an MTP draft graph, but b11434's converter drops {hf}'s nextn layers, "
                    f"so a GGUF it writes has no head for --spec-type draft-mtp: serve it with {elsewhere}.")
        if self.mtp_dropped and hf is None:
            return (f"What works instead: {own}, which b11434's converter writes for {self.gguf} targets except "
                    f"{', '.join(self.mtp_dropped)}), or {elsewhere}.")
        return f"What works instead: {own}, as llama.cpp's converter writes them), or {elsewhere}."


@dataclass(frozen=True)
class TargetFacts:
    """What drafter rules need to know of the target, from its config.json (``text_config`` merged in)."""

    arch: str | None
    hidden_size: int | None
    n_layers: int | None
    vocab_size: int | None
    path: Path | None = None
    # attention geometry (Gemma-4: sliding layers' head_dim / num_key_value_heads, full layers' global_*), for
    # drafters that attend over the target's own KV cache
    head_dim: int | None = None
    kv_heads: int | None = None
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    layer_types: tuple[str, ...] | None = None

    @classmethod
    def from_config(cls, raw: dict[str, Any], path: Path | None = None) -> TargetFacts:
        text = section(raw, "text_config")
        merged = {**raw, **text}
        archs = text.get("architectures") or raw.get("architectures") or [None]
        types = merged.get("layer_types")
        return cls(archs[0] if isinstance(archs[0], str) else None, _int(merged.get("hidden_size")),
                   _int(merged.get("num_hidden_layers")), _int(merged.get("vocab_size")), path,
                   _int(merged.get("head_dim")), _int(merged.get("num_key_value_heads")),
                   _int(merged.get("global_head_dim")), _int(merged.get("num_global_key_value_heads")),
                   tuple(str(t) for t in types) if isinstance(types, list) else None)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class TargetConfig:
    """What the drafter conversion needs from the target's config.json (read raw, as b11434 does)."""

    path: Path
    raw: dict[str, Any]
    arch: str
    hidden_size: int
    n_layer: int
    vocab_size: int | None
    arch_facts: TargetArch | None = None  # the architecture's row, from the target registry (None: unknown arch)

    @property
    def is_gemma(self) -> bool:
        return self.arch.startswith("Gemma")

    @property
    def vocab_path(self) -> VocabPath | None:
        """How b11434 reads this architecture's vocabulary, when the converters mirror it (its row of facts)."""
        return self.arch_facts.drafter_vocab if self.arch_facts is not None else None

    def facts(self) -> TargetFacts:
        return TargetFacts(self.arch, self.hidden_size, self.n_layer, self.vocab_size, self.path)

    @property
    def uses_mrope(self) -> bool:
        cfg = self.raw.get("text_config", self.raw)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        return "mrope_section" in rope


def parse_target_config(target_dir: Path, facts_of: Callable[[str], TargetArch | None]) -> TargetConfig:
    """Read the target's config.json; ``facts_of`` finds its architecture's row (``convert.targets.by_hf``: pass
    it from above, as this module sits below the registry). Whether the architecture can be served is
    ``drafters.target_findings``.

    Raises:
        ConfigError: missing or unparsable config, no architecture or hidden size.
    """
    path = target_dir / "config.json"
    raw = read_config(path, "Target config")
    text = raw.get("text_config") or {}
    arch = (text.get("architectures") or raw.get("architectures") or [None])[0]
    if arch is None:
        raise ConfigError(f"{path}: no 'architectures' field, so the target's tokenizer path is unknown. "
                          "Use the config.json published with the target model.")
    merged = {**raw, **text}
    try:
        hidden, layers = int(merged["hidden_size"]), int(merged["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{path}: 'hidden_size' or 'num_hidden_layers' missing (also under text_config). "
                          "Use the config.json published with the target model.") from None
    vocab = merged.get("vocab_size")
    return TargetConfig(path, raw, arch, hidden, layers, int(vocab) if vocab is not None else None, facts_of(arch))
