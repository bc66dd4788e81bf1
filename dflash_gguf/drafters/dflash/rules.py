"""DFlash (z-lab, DFlashDraftModel): the config rules, read the way llama.cpp b11434 sees them.

b11434 loads a drafter's config through ``transformers.AutoConfig`` (z-lab drafters declare
``model_type: qwen3``), so the values it writes are those of a ``Qwen3Config`` built by transformers 4.57.6:
defaults filled in, ``sliding_window`` dropped when ``use_sliding_window`` is false, ``layer_types``
synthesised from ``max_window_layers``. We read the raw JSON (never importing transformers, never running
``auto_map`` code) and apply the same rules. Where b11434 writes a file that cannot load or run correctly
(no taps, a mask id only at the top level, a sliding window without ``layer_types``, a non-SiLU activation,
attention biases) a finding refuses or notes what was fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...convert.configs import TargetFacts
from ...convert.targets.qwen3 import qwen3_hparams
from ...errors import ConfigError, IncompatiblePairError, UnsupportedModelError
from ..findings import Finding, Interpretation, failed, noted, passed
from .gguf_format import ARCH, DEFAULT_BLOCK_SIZE, hf_taps_outside

NAME = ARCH  # the family is named after its architecture
SPEC_TYPE = "draft-dflash"  # inferred from a dflash file without a Markov head (common_speculative_types_from_gguf)
# The draft's own vector for the mask row of the target's embeddings, shipped by drafters trained on a target whose
# mask embedding is untrained (a pickle: read by a restricted unpickler only).
MASK_EMBEDDING = "mask_embedding.pt"
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")  # b11434 DFlashModel converts both
# DFlash2's dflash_config keys, all written as u32 when conv_kernel_size is present (DFlashModel.set_gguf_parameters)
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
PICK = "Pick the drafter made for this target."

@dataclass(frozen=True)
class DFlash2Params:
    """DFlash2's block convolutions and candidate selector (src/models/dflash.cpp, "DFlash2 conv kernel = ...")."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


# The DSpark parts of a DFlash spec (a DSpark drafter is a DFlash backbone with a Markov head): here, so that
# the DFlash converter and checks, which write and judge DSpark files too, need not import the DSpark family.
@dataclass(frozen=True)
class Gemma4Params:
    """What Gemma4DSparkModel writes beyond DFlashModel's keys and tensors (conversion/gemma.py)."""

    head_count_kv: int  # num_global_key_value_heads
    head_dim: int  # global_head_dim: key/value length and rope dimension count
    embedding_scale: float  # sqrt(hidden_size)
    rope: dict[str, Any]  # the full-attention rope parameters, all its keys are read from
    rope_freqs: tuple[float, ...] | None  # the generated rope_freqs of a proportional rope
    tied: bool  # tie_word_embeddings is true: no lm_head needed


@dataclass(frozen=True)
class DSparkParams:
    """The DSpark part of a drafter spec: what b11434's converter writes for the Markov head."""

    arch: str
    sample_from_anchor: bool
    vocab_size: int  # markov_w1 rows: the target vocabulary
    draft_vocab_size: int  # markov_w2 / output rows; < vocab_size needs a d2t table
    gemma4: Gemma4Params | None = None

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    def n_max_limit(self, block_size: int) -> int:
        return n_max_limit(block_size, self.sample_from_anchor)


def n_max_limit(block_size: int, sample_from_anchor: bool) -> int:
    """The largest --spec-draft-n-max draft-dspark keeps (common_speculative_state_dflash: block_size with
    sample_from_anchor, else block_size - 1)."""
    return max(1, block_size if sample_from_anchor else block_size - 1)


@dataclass(frozen=True)
class DFlashSpec:
    """A DFlash drafter's hyperparameters as b11434 would write them."""

    path: Path
    raw: dict[str, Any]
    hp: dict[str, Any]  # Qwen3Config-normalised view
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    block_size_explicit: bool
    sliding_window: int | None
    swa_pattern: tuple[bool, ...] | None
    causal: bool | None
    dflash2: DFlash2Params | None = None  # the conv/selector parameters of a DFlash2 drafter
    dspark: DSparkParams | None = None  # a DSpark drafter's Markov-head parameters

    @property
    def n_layer(self) -> int:
        return int(self.hp["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.hp["hidden_size"])

    @property
    def dflash(self) -> dict[str, Any]:
        return self.raw.get("dflash_config") or {}

    @property
    def n_max_limit(self) -> int:
        """The largest --spec-draft-n-max llama.cpp keeps: block_size - 1, or the DSpark head's own rule."""
        return self.dspark.n_max_limit(self.block_size) if self.dspark is not None else max(1, self.block_size - 1)


def interpret(raw: dict[str, Any], path: Path) -> Interpretation[DFlashSpec]:
    """Every DFlash config rule; the spec is None when an error finding blocks conversion."""
    if raw.get("model_type", "qwen3") != "qwen3":
        return Interpretation(NAME, None, (failed(
            "format.arch", f"{path}: model_type is {raw.get('model_type')!r}; every published DFlash drafter "
            "declares 'qwen3' and llama.cpp b11434 reads it as a Qwen3 config.",
            "Use the config.json published with the checkpoint.", UnsupportedModelError),))
    return interpret_backbone(raw, path)


def interpret_backbone(raw: dict[str, Any], path: Path, *, hp: dict[str, Any] | None = None, family: str = NAME,
                       findings: list[Finding] | None = None, dspark: DSparkParams | None = None,
                       writes_activation: bool = False) -> Interpretation[DFlashSpec]:
    """The rules of b11434's DFlashModel on ``raw`` (``hp``: its transformers-normalised view, by default the
    Qwen3Config one); DSpark, whose b11434 class derives from DFlashModel, passes its own normalisation.
    ``writes_activation``: the family's converter writes ``dflash.hidden_act`` (Gemma-4 DSpark's GELU), so the
    SiLU rule does not apply."""
    findings = [] if findings is None else findings

    def refuse(id: str, message: str, fix: str, error: type = ConfigError) -> Interpretation[DFlashSpec]:
        return Interpretation(family, None, (*findings, failed(id, message, fix, error)))

    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        return refuse("format.config", f"{path}: field 'dflash_config' must be an object, got "
                      f"{type(dflash).__name__}.", "Use the config.json published with the checkpoint.")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in raw:
            return refuse("format.config", f"{path}: field '{key}' is missing. The drafter's geometry cannot be "
                          "guessed;", "use the config.json published with the checkpoint.")
    hp = qwen3_hparams(raw) if hp is None else hp

    taps = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if not taps:
        return refuse(
            "format.taps", f"{path}: no 'dflash_config.target_layer_ids' (nor top-level 'target_layer_ids'). "
            "llama.cpp b11434 would write a file without dflash.target_layers that cannot load ('DFlash model "
            "requires 'target_layers' in GGUF metadata'), and guessing taps is wrong for most z-lab drafters.",
            "Use the config.json published with the checkpoint, or add the ids it was trained with.")
    if not isinstance(taps, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                             for t in taps):
        return refuse("format.taps", f"{path}: target_layer_ids {taps!r} must be non-negative integers.",
                      "Use the config.json published with the checkpoint.")
    findings.append(passed("format.taps", f"target_layer_ids {taps}"))

    if "mask_token_id" in dflash:
        mask = dflash["mask_token_id"]
    elif "mask_token_id" in raw:
        mask = raw["mask_token_id"]
        findings.append(noted("format.mask_token", "mask_token_id read from the top level of config.json: llama.cpp "
                              "b11434's converter (DFlashModel.set_vocab) reads only dflash_config.mask_token_id, "
                              "writes no tokenizer.ggml.mask_token_id, and llama-server then aborts on the first "
                              "draft"))
    else:
        return refuse(
            "format.mask_token", f"{path}: no 'dflash_config.mask_token_id' (nor top-level 'mask_token_id'). Without "
            "it llama.cpp aborts on the first draft ('get_sub_batch: failed to add embedding').",
            "Use the config.json published with the checkpoint.")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        return refuse("format.mask_token", f"{path}: mask_token_id {mask!r} must be a non-negative integer.",
                      "Use the config.json published with the checkpoint.")

    if not writes_activation and hp["hidden_act"] != "silu":
        return refuse(
            "format.activation", f"{path}: hidden_act is {hp['hidden_act']!r}. llama.cpp b11434 writes no "
            "activation key for DFlash and runs every drafter with SiLU, so this drafter would run with the wrong "
            "activation.", "Only 'silu' drafters can be served.", UnsupportedModelError)
    if hp.get("attention_bias"):
        return refuse(
            "format.bias", f"{path}: attention_bias is true. llama.cpp b11434's DFlash loader has no attention bias "
            "tensors, so the file would fail at load with 'wrong number of tensors'; dropping trained biases would "
            "change the model.", "This drafter cannot be served by llama.cpp b11434.", UnsupportedModelError)
    if not hp.get("rope_is_neox_style", True):
        return refuse("format.rope", f"{path}: rope_is_neox_style is false (interleaved RoPE); dflash-gguf does not "
                      "permute such checkpoints yet.", "Use llama.cpp's convert_hf_to_gguf.py.", UnsupportedModelError)
    if "mrope_section" in (hp.get("rope_parameters") or {}):
        return refuse("format.arch", f"{path}: the drafter's own rope_parameters carry mrope_section (M-RoPE); "
                      "dflash-gguf does not convert such drafters yet.", "Use llama.cpp's convert_hf_to_gguf.py.",
                      UnsupportedModelError)
    block_explicit = "block_size" in dflash or "block_size" in raw
    block = int(dflash.get("block_size", raw.get("block_size", DEFAULT_BLOCK_SIZE)))
    dflash2: DFlash2Params | None = None
    is_v2 = (raw.get("architectures") or [None])[0] == "DFlash2DraftModel"
    if "conv_kernel_size" in dflash or is_v2:
        if "conv_kernel_size" not in dflash:
            return refuse(
                "format.dflash2", f"{path}: a DFlash2DraftModel whose dflash_config has no conv_kernel_size. llama.cpp "
                "b11434's converter then writes no conv/selector keys, and its loader refuses the file ('DFlash2 "
                "model is missing conv/selector metadata').", "Use the config.json published with the checkpoint.")
        if missing := [k for k in DFLASH2_KEYS if k not in dflash]:
            return refuse(
                "format.dflash2", f"{path}: dflash_config has conv_kernel_size but not {', '.join(missing)}. llama.cpp "
                "b11434's converter stops on it with a KeyError, and its loader needs all four of "
                f"{', '.join(DFLASH2_KEYS)}.", "Use the config.json published with the checkpoint.")
        values = {k: dflash[k] for k in DFLASH2_KEYS}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
            return refuse("format.dflash2", f"{path}: dflash_config {values} must be integers.",
                          "Use the config.json published with the checkpoint.")
        dflash2 = DFlash2Params(**values)
        h, top_k, group = int(hp["hidden_size"]), dflash2.selector_top_k, dflash2.conv_group_size
        if min(*values.values(), block) <= 0:
            return refuse("format.dflash2", f"{path}: DFlash2 needs positive {', '.join(DFLASH2_KEYS)} and "
                          f"block_size (got {values}, block_size {block}); llama.cpp b11434's loader refuses the "
                          "file ('DFlash2 model is missing conv/selector metadata').",
                          "Use the config.json published with the checkpoint.")
        if h % group:
            return refuse("format.dflash2", f"{path}: hidden_size {h} is not divisible by conv_group_size {group}; "
                          "llama.cpp b11434's loader refuses it ('DFlash2 hidden size must be divisible by "
                          "conv_group_size').", "Use the config.json published with the checkpoint.")
        if h < top_k * (top_k + 1):
            return refuse("format.dflash2", f"{path}: hidden_size {h} is smaller than selector_top_k x "
                          f"(selector_top_k + 1) = {top_k * (top_k + 1)}; llama.cpp b11434's loader refuses it "
                          "('DFlash2 hidden size is too small for the selector lattice').",
                          "Use the config.json published with the checkpoint.")
        findings.append(passed("format.dflash2", f"DFlash2: conv kernel {dflash2.conv_kernel_size}, group "
                               f"{group}, selector rank {dflash2.selector_rank}, top-k {top_k}"))

    layer_types = raw.get("layer_types")
    if layer_types is not None and len(layer_types) != hp["num_hidden_layers"]:
        return refuse("format.layer_types", f"{path}: layer_types has {len(layer_types)} entries for "
                      f"{hp['num_hidden_layers']} layers.", "Fix config.json so there is one entry per layer.")

    if block_explicit:
        findings.append(passed("format.block_size", f"block_size {block}"))
    else:
        findings.append(noted("format.block_size", f"block_size absent from config.json: wrote {DEFAULT_BLOCK_SIZE}, "
                              "the default of llama.cpp b11434's converter (DFlashModel.set_gguf_parameters); check "
                              "it is the block size the drafter was trained with", "warning"))

    use_swa = bool(raw.get("use_sliding_window", False)) or bool(dflash.get("use_swa", False))
    window = dflash.get("swa_window_size") or hp.get("sliding_window")
    pattern: tuple[bool, ...] | None = None
    if use_swa and window:
        if dflash.get("use_swa", False):
            pattern = (True,) * hp["num_hidden_layers"]
        elif layer_types is None:
            return refuse(
                "format.sliding_window", f"{path}: use_sliding_window is true with sliding_window {window} but "
                "config.json has no 'layer_types'. llama.cpp b11434 would then take a pattern synthesised by "
                "transformers (all full attention, silently) or none (load error).",
                "Add the drafter's per-layer 'layer_types'.")
        else:
            pattern = tuple(t == "sliding_attention" for t in layer_types)
    else:
        window = None
        if layer_types and "sliding_attention" in layer_types:
            findings.append(noted("format.sliding_window", "layer_types contain sliding_attention but "
                                  "use_sliding_window is false: llama.cpp b11434's converter "
                                  "(DFlashModel.set_gguf_parameters) writes no sliding-window pattern, so every "
                                  "layer will use full attention", "warning"))

    causal = raw.get("is_causal")
    if causal is None:
        causal = dflash.get("causal")
    spec = DFlashSpec(path=path, raw=raw, hp=hp, target_layer_ids=tuple(int(t) for t in taps),
                      mask_token_id=int(mask), block_size=block, block_size_explicit=block_explicit,
                      sliding_window=window, swa_pattern=pattern, causal=None if causal is None else bool(causal),
                      dflash2=dflash2, dspark=dspark)
    return Interpretation(family, spec, tuple(findings))


def pair_findings(spec: DFlashSpec, target: TargetFacts) -> tuple[Finding, ...]:
    """Hidden size, tap range, declared target depth, mask id and vocabulary size against the target's config."""
    out: list[Finding] = []
    where = f" {target.path}" if target.path else ""
    if target.hidden_size is None:
        out.append(Finding("pair.hidden_size", "skip", "error", "hidden_size missing on the target side"))
    elif spec.hidden_size != target.hidden_size:
        out.append(failed("pair.hidden_size", f"Drafter {spec.path} has hidden_size {spec.hidden_size} but "
                          f"target{where} has {target.hidden_size}. A DFlash drafter must be trained for its "
                          "target's hidden size (llama.cpp aborts with 'ggml_can_repeat').", PICK,
                          IncompatiblePairError))
    else:
        out.append(passed("pair.hidden_size", f"hidden size {spec.hidden_size} on both sides"))
    ids, n_t = list(spec.target_layer_ids), target.n_layers
    if n_t is not None:
        if bad := hf_taps_outside(ids, n_t):
            out.append(failed("pair.taps", f"Drafter {spec.path} taps target layers {bad} (target_layer_ids {ids}), "
                              f"but target{where} has {n_t} layers: llama.cpp taps the input of layer id+1, so ids "
                              f"must lie in 0..{n_t - 2}. The drafter was made for a deeper target.", PICK,
                              IncompatiblePairError))
        else:
            out.append(passed("pair.taps", f"target_layer_ids {ids} fit the {n_t}-layer target"))
        n_decl = spec.raw.get("num_target_layers")
        if isinstance(n_decl, int) and n_decl != n_t:
            out.append(failed("pair.num_target_layers", f"Drafter {spec.path} says num_target_layers {n_decl} but "
                              f"target{where} has {n_t} layers.", PICK, IncompatiblePairError))
    v_t = target.vocab_size
    if v_t is not None and not 0 <= spec.mask_token_id < v_t:
        out.append(failed("pair.mask_token", f"Drafter {spec.path} has mask_token_id {spec.mask_token_id}, outside "
                          f"the target vocab_size {v_t}. llama.cpp would abort on the first draft.", PICK,
                          IncompatiblePairError))
    else:
        out.append(passed("pair.mask_token", f"mask token id {spec.mask_token_id}"))
    v_d = spec.raw.get("vocab_size")
    if isinstance(v_d, int) and v_t is not None and v_d != v_t:
        out.append(failed("pair.vocab", f"drafter vocab_size {v_d} != target vocab_size {v_t}: the embedded token "
                          "list is padded to the drafter's size and will differ from the target GGUF's.", PICK,
                          IncompatiblePairError, "warning"))
    return tuple(out)
