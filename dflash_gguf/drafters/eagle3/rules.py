"""EAGLE-3 draft heads: one Llama decoder layer fed with three of the target's hidden states.

llama.cpp b11434 converts them with ``LlamaModel`` (conversion/llama.py), which switches to the ``eagle3``
architecture when the config has ``draft_vocab_size`` and ``num_hidden_layers == 1`` (after merging a
speculators-style ``transformer_layer_config``). It writes ``eagle_aux_hidden_state_layer_ids`` as they are (no
+1), or derives ``[2, N // 2, N - 3]`` from the target's layer count, and takes ``target_hidden_size``,
``norm_before_residual`` and ``norm_before_fc`` from the drafter's config.json. Its converter checks none of them
against the target and its loader (src/models/eagle3.cpp) only counts the taps, so the rules here turn the
start-up and first-request failures of ``--spec-type draft-eagle3`` into refusals before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from ...convert.configs import TargetFacts
from ...convert.targets import by_hf
from ...errors import ConfigError, IncompatiblePairError, UnsupportedModelError
from ...hf_configs import section
from ..findings import Finding, Interpretation, failed, passed

GGUF_ARCH = "eagle3"  # general.architecture of its GGUF (llm_arch_from_string "eagle3")
NAME = GGUF_ARCH  # the family is named after it
# The EAGLE-3 class names b11434 registers on LlamaModel (SpecForge, vLLM/AngelSlim, speculators).
ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator", "Eagle3DraftModel")
SPEC_TYPE = "draft-eagle3"  # never inferred from the file (common_speculative_types_from_gguf knows only dflash)
N_TAPS = 3  # llama_model_eagle3::load_arch_hparams: "EAGLE3 requires exactly 3 entries in 'extract_layers'"
PUBLISHED = "Use the config.json published with the checkpoint."
PICK = "Pick the EAGLE-3 head trained for this target, or point --target at the model it was trained for."
# Keys a config read as raw JSON must carry (no transformers class fills in defaults for it).
_RAW_REQUIRED = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
# transformers 4.57 LlamaConfig defaults: b11434 reads a model_type "llama" config through AutoConfig.
_LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "max_position_embeddings": 2048, "intermediate_size": 11008, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
    "tie_word_embeddings": False, "num_hidden_layers": 32,
}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class Eagle3Spec:
    """An EAGLE-3 head as b11434's LlamaModel reads it; ``taps`` None means derived from the target."""

    path: Path
    arch: str
    hp: dict[str, Any]  # self.hparams: AutoConfig's view (or raw JSON), transformer_layer_config merged in
    taps: tuple[int, ...] | None  # eagle_aux_hidden_state_layer_ids as written, None: [2, N//2, N-3]
    nested_taps: tuple[int, ...] | None  # eagle_config.eagle_aux_hidden_state_layer_ids (b11434 ignores them)
    target_hidden_size: int | None  # None: the target's hidden_size
    norm_before_residual: bool
    norm_before_fc: bool
    hidden_size: int
    n_head: int
    n_head_kv: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    block_size: None = None  # EAGLE-3 drafts token by token: no block
    n_max_limit: None = None  # and llama.cpp clamps no --spec-draft-n-max for it

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.vocab_size


def default_taps(n_layers: int) -> tuple[int, ...]:
    """LlamaModel.__init__'s taps without eagle_aux_hidden_state_layer_ids: low, middle and high layers."""
    return (2, n_layers // 2, n_layers - 3)


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _taps(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(_is_int(t) for t in value):
        return tuple(value)
    return None


def hparams(raw: dict[str, Any]) -> dict[str, Any]:
    """b11434's ``self.hparams`` for an EAGLE-3 config: LlamaConfig's view of a model_type llama config (raw JSON
    otherwise), ``text_config`` and then ``transformer_layer_config`` moved to the root (LlamaModel.index_tensors)."""
    hp = {**_LLAMA_DEFAULTS, **raw} if raw.get("model_type") == "llama" else dict(raw)
    if hp.get("model_type") == "llama":
        if hp.get("num_key_value_heads") is None:
            hp["num_key_value_heads"] = hp.get("num_attention_heads")
        heads, hidden = hp.get("num_attention_heads"), hp.get("hidden_size")
        if hp.get("head_dim") is None and _is_int(heads) and heads > 0 and _is_int(hidden):
            hp["head_dim"] = hidden // heads
    if isinstance(hp.get("text_config"), dict):
        hp = {**hp, **hp["text_config"]}
    if isinstance(hp.get("transformer_layer_config"), dict):
        hp = {**hp, **hp["transformer_layer_config"]}
    return hp


def interpret(raw: dict[str, Any], path: Path) -> Interpretation[Eagle3Spec]:
    """The EAGLE-3 rules on the drafter's config alone; the spec is None when an error finding blocks it."""
    arch = str((raw.get("architectures") or [None])[0])
    hp = hparams(raw)

    def refuse(id: str, message: str, fix: str = PUBLISHED, error: type = ConfigError) -> Interpretation[Eagle3Spec]:
        return Interpretation(NAME, None, (failed(id, f"{path}: {message}", fix, error),))

    n_layer = hp.get("num_hidden_layers")
    if "draft_vocab_size" not in hp or n_layer != 1:
        why = ("has no draft_vocab_size" if "draft_vocab_size" not in hp else f"has num_hidden_layers {n_layer!r}")
        return refuse(
            "format.arch", f"architectures is ['{arch}'] (an EAGLE-3 head) but the config {why}. llama.cpp b11434 "
            "recognises an EAGLE-3 head only by draft_vocab_size and num_hidden_layers 1 (its graph has one decoder "
            "layer); otherwise it converts the checkpoint as a plain Llama model and stops on the first EAGLE-3 "
            "tensor (\"Can not map tensor 'd2t'\" or 'fc.weight').",
            "Use the config.json published with the checkpoint; a multi-layer EAGLE-3 head cannot be served by "
            "llama.cpp b11434.", UnsupportedModelError)
    if raw.get("model_type") != "llama" and (missing := [k for k in _RAW_REQUIRED if not _is_int(hp.get(k))]):
        return refuse("format.config", f"model_type is {raw.get('model_type')!r}, so llama.cpp b11434 reads the "
                      f"config as raw JSON with no defaults, and {', '.join(missing)} is missing or not an integer.")
    geometry = {k: hp.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "intermediate_size", "vocab_size", "draft_vocab_size")}
    if bad := [k for k, v in geometry.items() if not (_is_int(v) and v > 0)]:
        return refuse("format.config", f"{', '.join(bad)} must be positive integers (got "
                      f"{', '.join(repr(geometry[k]) for k in bad)}).")
    hidden, heads, kv = int(hp["hidden_size"]), int(hp["num_attention_heads"]), int(hp["num_key_value_heads"])
    given = hp.get("head_dim")
    head_dim = given if _is_int(given) else hidden // heads
    if heads % kv or head_dim % 2 or head_dim <= 0:
        return refuse("format.config", f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}, "
                      f"or head_dim {head_dim} is not a positive even number.")
    vocab, draft_vocab = int(hp["vocab_size"]), int(hp["draft_vocab_size"])
    if draft_vocab > vocab:
        return refuse("format.eagle3", f"draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}; a draft "
                      "vocabulary is a subset of the target's (d2t maps each draft row to a distinct target token).")
    rope = hp.get("rope_scaling") or hp.get("rope_parameters") or {}
    if isinstance(rope, dict) and str(rope.get("rope_type", rope.get("type", ""))).lower() == "llama3" and (
            missing := [k for k in _LLAMA3_ROPE_KEYS if rope.get(k) is None]):
        return refuse("format.config", f"rope_scaling has rope_type 'llama3' but lacks {missing}; llama.cpp b11434 "
                      "would generate rope_freqs from guessed values.")

    taps: tuple[int, ...] | None = None
    if aux := raw.get("eagle_aux_hidden_state_layer_ids"):
        taps = _taps(aux)
        if taps is None or len(taps) != N_TAPS or min(taps) < 0:
            return refuse("format.taps", f"eagle_aux_hidden_state_layer_ids is {aux!r}. llama.cpp b11434's converter "
                          "writes any list as it is, but its loader stops with \"EAGLE3 requires exactly 3 entries in "
                          "'extract_layers'\" unless there are exactly 3, and a negative id is no target layer.")
        if len(set(taps)) != N_TAPS:
            return refuse("format.taps", f"eagle_aux_hidden_state_layer_ids {list(taps)} repeat a layer; EAGLE-3 "
                          "fuses a low, a middle and a high layer of the target (llama.cpp b11434 would feed the "
                          "same hidden state twice into fc).")
    nested_cfg = section(raw, "eagle_config")
    nested = _taps(nested_cfg.get("eagle_aux_hidden_state_layer_ids")) or None
    th = raw.get("target_hidden_size")
    if th is not None and not (_is_int(th) and th > 0):
        return refuse("format.eagle3", f"target_hidden_size is {th!r}, not a positive integer.")
    flags = {k: raw.get(k, False) for k in ("norm_before_residual", "norm_before_fc")}
    if bad := [k for k, v in flags.items() if not isinstance(v, bool)]:
        return refuse("format.eagle3", f"{', '.join(bad)} must be true or false (got "
                      f"{', '.join(repr(flags[k]) for k in bad)}).")
    spec = Eagle3Spec(path, arch, hp, taps, nested, th, flags["norm_before_residual"], flags["norm_before_fc"], hidden,
                      heads, kv, head_dim, int(hp["intermediate_size"]), vocab, draft_vocab)
    where = f"taps {list(taps)}" if taps is not None else "taps [2, N//2, N-3] of the target's N layers"
    vocab_text = f"reduced draft vocabulary {draft_vocab}" if spec.reduced_vocab else "full vocabulary"
    findings: list[Finding] = [passed("format.eagle3", f"EAGLE-3 head ({arch}): one layer, {where}, {vocab_text}, "
                                      f"norm_before_fc {str(spec.norm_before_fc).lower()}, norm_before_residual "
                                      f"{str(spec.norm_before_residual).lower()}; served with --spec-type "
                                      f"{SPEC_TYPE}")]
    return Interpretation(NAME, spec, tuple(findings))


def target_taps(spec: Eagle3Spec, n_layers: int) -> tuple[int, ...]:
    """The taps b11434 writes for this drafter with a target of ``n_layers`` layers."""
    return spec.taps if spec.taps is not None else default_taps(n_layers)


def pair_findings(spec: Eagle3Spec, target: TargetFacts) -> tuple[Finding, ...]:
    """The taps against the target's layers, target_hidden_size against its hidden size, and the vocabulary."""
    s: Eagle3Spec = spec
    out: list[Finding] = []
    n = target.n_layers
    if n is not None:
        taps = target_taps(s, n)
        derived = s.taps is None
        how = "derived by llama.cpp b11434 as [2, N//2, N-3]" if derived else "eagle_aux_hidden_state_layer_ids"
        if derived and s.nested_taps is not None and s.nested_taps != taps:
            out.append(failed(
                "pair.taps", f"Drafter {s.path} keeps its taps {list(s.nested_taps)} under eagle_config, which "
                f"llama.cpp b11434 does not read: it reads eagle_aux_hidden_state_layer_ids only at the top level and "
                f"would write the derived taps {list(taps)} of the {n}-layer target instead, so the head would read "
                "other hidden states than it was trained on.", "Copy eagle_config.eagle_aux_hidden_state_layer_ids "
                "to the top level of the drafter's config.json, then convert again.", ConfigError))
        elif len(set(taps)) != len(taps) or min(taps) < 0:
            out.append(failed(
                "pair.taps", f"Drafter {s.path}: the taps {how} for the {n}-layer target {target.path} are "
                f"{list(taps)}, which repeat a layer (or are negative): the target is too shallow for the default "
                "EAGLE-3 taps. The head was not trained for this target.", "Give the taps the head was trained on in "
                "eagle_aux_hidden_state_layer_ids, or " + PICK[0].lower() + PICK[1:], IncompatiblePairError))
        elif max(taps) == n and ((known := by_hf(target.arch)) is None or not known.output_tap):
            out.append(failed(
                "pair.taps", f"Drafter {s.path}: tap {n} ({how}) is the output of the {n}-layer target "
                f"{target.path}, which llama.cpp b11434 reads from the target's next-token hidden state; the "
                f"{target.arch} graph does not publish it, so the first request aborts with \"EAGLE3: target layer "
                f"{n} input not extracted.\"", PICK, IncompatiblePairError))
        elif max(taps) > n:
            out.append(failed(
                "pair.taps", f"Drafter {s.path}: taps {list(taps)} ({how}) go past the {n} layers of target "
                f"{target.path}. llama.cpp b11434 converts it, then aborts at start-up with \"EAGLE3: target layer "
                f"id {max(taps)} exceeds target n_layer {n}\".", PICK, IncompatiblePairError))
        else:
            out.append(passed("pair.taps", f"taps {list(taps)} ({how}) within the target's {n} layers"))
    th = s.target_hidden_size
    if th is not None and target.hidden_size is not None and th != target.hidden_size:
        out.append(failed(
            "pair.hidden", f"Drafter {s.path} has target_hidden_size {th} but target {target.path} has hidden_size "
            f"{target.hidden_size}. llama.cpp b11434 writes the drafter's value without comparing, loads the pair, "
            "and aborts at the first request (\"get_sub_batch: failed to add embedding\": the fused features are not "
            "the size fc reads).", PICK, IncompatiblePairError))
    elif target.hidden_size is not None:
        out.append(passed("pair.hidden", f"fc reads 3 x {th or target.hidden_size} target features"))
    v_t = target.vocab_size
    if v_t is not None and s.vocab_size != v_t:
        out.append(failed(
            "pair.vocab", f"Drafter {s.path} has vocab_size {s.vocab_size} but target {target.path} has {v_t}. The "
            "EAGLE-3 file carries the target's vocabulary padded to the drafter's vocab_size, and its d2t maps into "
            "the target's; llama-server refuses a draft whose vocabulary differs from the target's.", PICK,
            IncompatiblePairError))
    elif v_t is not None:
        out.append(passed("pair.vocab", f"the target's {v_t}-token vocabulary"))
    return tuple(out)
