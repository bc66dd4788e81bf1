"""Drafter and target config.json, read raw and interpreted the way b11434 sees them.

b11434 loads a drafter's config through ``transformers.AutoConfig`` (z-lab drafters declare
``model_type: qwen3``), so the values it writes are those of a ``Qwen3Config`` built by
transformers 4.57.6: defaults filled in, ``sliding_window`` dropped when ``use_sliding_window``
is false, ``layer_types`` synthesised from ``max_window_layers``. We read the raw JSON (never
importing transformers, never running ``auto_map`` code) and apply the same rules here, in one
place, so the written keys match. Where b11434 writes a file that cannot load or run correctly (no
taps, a mask id only at the top level, a sliding window without ``layer_types``, a non-SiLU activation,
attention biases) we refuse or fix, and record what we fixed or noticed in ``notes``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..dflash_format import KNOWN_UNSUPPORTED_DRAFTER_ARCHS, SUPPORTED_DRAFTER_ARCHS
from ..errors import ConfigError, UnsupportedModelError
from ..jsonfile import read_json

log = logging.getLogger(__name__)

# transformers 4.57.6 Qwen3Config.__init__ defaults (models/qwen3/configuration_qwen3.py).
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
}

GEMMA4_TARGETS = ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration", "Gemma4ForCausalLM")
BPE_TARGETS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


def load_json(path: Path, what: str) -> dict[str, Any]:
    """Read a JSON object file. Raises ConfigError naming the file and what to do."""
    if not path.is_file():
        raise ConfigError(f"{what}: {path} does not exist. Point at the folder of a Hugging Face checkpoint "
                          "(it must contain config.json).")
    try:
        data = read_json(path)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what}: {path} is not valid JSON ({e}). Re-download it.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} is not a JSON object. Re-download it.")
    return data


@dataclass
class DrafterConfig:
    """A DFlash drafter's hyperparameters as b11434 would write them, plus what we fixed."""

    path: Path
    raw: dict[str, Any]
    hp: dict[str, Any]  # Qwen3Config-normalised view
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    block_size_explicit: bool
    sliding_window: int | None
    swa_pattern: list[bool] | None
    causal: bool | None
    notes: list[str] = field(default_factory=list)

    @property
    def n_layer(self) -> int:
        return int(self.hp["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.hp["hidden_size"])

    @property
    def dflash(self) -> dict[str, Any]:
        return self.raw.get("dflash_config") or {}


def qwen3_hparams(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3 config.json as transformers 4.57.6's ``Qwen3Config(...).to_dict()`` gives it to b11434."""
    hp = {**QWEN3_DEFAULTS, **raw}
    if raw.get("num_key_value_heads") is None:
        hp["num_key_value_heads"] = hp["num_attention_heads"]
    if not hp.get("use_sliding_window"):
        hp["sliding_window"] = None
    if hp.get("layer_types") is None:
        hp["layer_types"] = [
            "sliding_attention" if hp["sliding_window"] is not None and i >= hp["max_window_layers"]
            else "full_attention" for i in range(hp["num_hidden_layers"])
        ]
    if isinstance(hp.get("rope_scaling"), dict) and "type" in hp["rope_scaling"]:
        hp["rope_scaling"] = {**hp["rope_scaling"], "rope_type": hp["rope_scaling"]["type"]}
    return hp


def read_drafter_config(drafter_dir: Path) -> DrafterConfig:
    """Read and check a drafter's config.json.

    Raises:
        ConfigError: config missing/unparsable, taps or mask id missing, inconsistent SWA fields.
        UnsupportedModelError: not a DFlash1 drafter, non-SiLU activation, attention biases.
    """
    path = drafter_dir / "config.json"
    raw = load_json(path, "Drafter config")
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_DRAFTER_ARCHS:
        extra = (" llama.cpp b11434 reads that checkpoint kind too, but this version of dflash-gguf does not "
                 "convert it yet; use llama.cpp's convert_hf_to_gguf.py." if arch in KNOWN_UNSUPPORTED_DRAFTER_ARCHS
                 else "")
        raise UnsupportedModelError(
            f"{path}: field 'architectures' is {archs!r}, not a DFlash drafter. Supported: "
            f"{', '.join(SUPPORTED_DRAFTER_ARCHS)}.{extra} Check that --drafter points at the DFlash repo "
            "(e.g. z-lab/Qwen3-8B-DFlash-b16) and --target at the model it drafts for."
        )
    if raw.get("model_type", "qwen3") != "qwen3":
        raise UnsupportedModelError(f"{path}: model_type is {raw.get('model_type')!r}; every published DFlash "
                                    "drafter declares 'qwen3' and llama.cpp b11434 reads it as a Qwen3 config.")
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise ConfigError(f"{path}: field 'dflash_config' must be an object, got {type(dflash).__name__}.")
    hp = qwen3_hparams(raw)
    notes: list[str] = []

    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if key not in raw:
            raise ConfigError(f"{path}: field '{key}' is missing. The drafter's geometry cannot be guessed; "
                              "use the config.json published with the checkpoint.")

    taps = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
    if not taps:
        raise ConfigError(
            f"{path}: no 'dflash_config.target_layer_ids' (nor top-level 'target_layer_ids'). llama.cpp b11434 "
            "would write a file without dflash.target_layers that cannot load ('DFlash model requires "
            "'target_layers' in GGUF metadata'), and guessing taps is wrong for most z-lab drafters. "
            "Use the config.json published with the checkpoint, or add the ids it was trained with."
        )
    if not all(isinstance(t, int) and t >= 0 for t in taps):
        raise ConfigError(f"{path}: target_layer_ids {taps!r} must be non-negative integers.")

    if "mask_token_id" in dflash:
        mask = dflash["mask_token_id"]
    elif "mask_token_id" in raw:
        mask = raw["mask_token_id"]
        notes.append("mask_token_id read from the top level of config.json: llama.cpp b11434's converter "
                     "(DFlashModel.set_vocab) reads only dflash_config.mask_token_id, writes no "
                     "tokenizer.ggml.mask_token_id, and llama-server then aborts on the first draft")
    else:
        raise ConfigError(
            f"{path}: no 'dflash_config.mask_token_id' (nor top-level 'mask_token_id'). Without it llama.cpp "
            "aborts on the first draft ('get_sub_batch: failed to add embedding'). Use the config.json "
            "published with the checkpoint."
        )
    if not isinstance(mask, int) or mask < 0:
        raise ConfigError(f"{path}: mask_token_id {mask!r} must be a non-negative integer.")

    if hp["hidden_act"] != "silu":
        raise UnsupportedModelError(
            f"{path}: hidden_act is {hp['hidden_act']!r}. llama.cpp b11434 writes no activation key for DFlash "
            "and runs every drafter with SiLU, so this drafter would run with the wrong activation. "
            "Only 'silu' drafters can be served."
        )
    if hp.get("attention_bias"):
        raise UnsupportedModelError(
            f"{path}: attention_bias is true. llama.cpp b11434's DFlash loader has no attention bias tensors, "
            "so the file would fail at load with 'wrong number of tensors'; dropping trained biases would "
            "change the model. This drafter cannot be served by llama.cpp b11434."
        )
    if not hp.get("rope_is_neox_style", True):
        raise UnsupportedModelError(f"{path}: rope_is_neox_style is false (interleaved RoPE); dflash-gguf does "
                                    "not permute such checkpoints yet. Use llama.cpp's convert_hf_to_gguf.py.")
    if "conv_kernel_size" in dflash or "mrope_section" in (hp.get("rope_parameters") or {}):
        raise UnsupportedModelError(f"{path}: DFlash2 / M-RoPE drafter fields are not supported yet.")

    layer_types = raw.get("layer_types")
    if layer_types is not None and len(layer_types) != hp["num_hidden_layers"]:
        raise ConfigError(f"{path}: layer_types has {len(layer_types)} entries for {hp['num_hidden_layers']} "
                          "layers. Fix config.json so there is one entry per layer.")

    block_explicit = "block_size" in dflash or "block_size" in raw
    block = int(dflash.get("block_size", raw.get("block_size", 16)))
    if not block_explicit:
        notes.append("block_size absent from config.json: wrote 16, the default of llama.cpp b11434's converter "
                     "(DFlashModel.set_gguf_parameters); check it is the block size the drafter was trained with")
        log.warning("%s: no block_size in dflash_config or at top level; writing 16 as llama.cpp would", path)

    use_swa = bool(raw.get("use_sliding_window", False)) or bool(dflash.get("use_swa", False))
    window = dflash.get("swa_window_size") or hp.get("sliding_window")
    pattern: list[bool] | None = None
    if use_swa and window:
        if dflash.get("use_swa", False):
            pattern = [True] * hp["num_hidden_layers"]
        elif layer_types is None:
            raise ConfigError(
                f"{path}: use_sliding_window is true with sliding_window {window} but config.json has no "
                "'layer_types'. llama.cpp b11434 would then take a pattern synthesised by transformers (all "
                "full attention, silently) or none (load error). Add the drafter's per-layer 'layer_types'."
            )
        else:
            pattern = [t == "sliding_attention" for t in layer_types]
    else:
        window = None
        if layer_types and "sliding_attention" in layer_types:
            notes.append("layer_types contain sliding_attention but use_sliding_window is false: llama.cpp "
                         "b11434's converter (DFlashModel.set_gguf_parameters) writes no sliding-window pattern, "
                         "so every layer will use full attention")
            log.warning("%s: sliding_attention layers but use_sliding_window is false; llama.cpp will run "
                        "full attention", path)

    causal = raw.get("is_causal")
    if causal is None:
        causal = dflash.get("causal")
    return DrafterConfig(
        path=path, raw=raw, hp=hp, target_layer_ids=[int(t) for t in taps], mask_token_id=int(mask),
        block_size=block, block_size_explicit=block_explicit, sliding_window=window, swa_pattern=pattern,
        causal=None if causal is None else bool(causal), notes=notes,
    )


@dataclass(frozen=True)
class TargetConfig:
    """What the drafter conversion needs from the target's config.json (read raw, as b11434 does)."""

    path: Path
    raw: dict[str, Any]
    arch: str
    hidden_size: int
    n_layer: int
    vocab_size: int | None

    @property
    def is_gemma(self) -> bool:
        return self.arch.startswith("Gemma")

    @property
    def vocab_family(self) -> str:
        return "gemma4" if self.arch in GEMMA4_TARGETS else "bpe"

    @property
    def uses_mrope(self) -> bool:
        cfg = self.raw.get("text_config", self.raw)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        return "mrope_section" in rope


def read_target_config(target_dir: Path) -> TargetConfig:
    """Read the target's config.json and check its architecture has a b11434 vocab path we mirror.

    Raises:
        ConfigError: missing or unparsable config, no architecture or hidden size.
        UnsupportedModelError: an architecture whose vocabulary path we do not implement.
    """
    path = target_dir / "config.json"
    raw = load_json(path, "Target config")
    text = raw.get("text_config") or {}
    arch = (text.get("architectures") or raw.get("architectures") or [None])[0]
    if arch is None:
        raise ConfigError(f"{path}: no 'architectures' field, so the target's tokenizer path is unknown. "
                          "Use the config.json published with the target model.")
    if arch not in GEMMA4_TARGETS + BPE_TARGETS:
        raise UnsupportedModelError(
            f"{path}: target architecture {arch!r} is not supported. dflash-gguf converts drafters for "
            f"targets of: {', '.join(GEMMA4_TARGETS + BPE_TARGETS)}."
        )
    merged = {**raw, **text}
    try:
        hidden, layers = int(merged["hidden_size"]), int(merged["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{path}: 'hidden_size' or 'num_hidden_layers' missing (also under text_config). "
                          "Use the config.json published with the target model.") from None
    vocab = merged.get("vocab_size")
    return TargetConfig(path, raw, arch, hidden, layers, int(vocab) if vocab is not None else None)
