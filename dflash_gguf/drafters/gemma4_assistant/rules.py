"""Gemma-4 MTP assistants (``Gemma4AssistantForCausalLM``, e.g. google/gemma-4-31B-it-assistant).

llama.cpp b11434 converts them with ``Gemma4AssistantModel`` (conversion/gemma.py), a ``Gemma4Model`` subclass:
general.architecture ``gemma4-assistant``, every Gemma-4 key, plus ``embedding_length_out`` (the config's
``backbone_hidden_size``, the target's hidden size) and ``nextn_predict_layers`` (the block count). Unlike a DFlash
drafter it takes no ``--target-model-dir``: its own tokenizer is written, and it must be the target's. At run
time (src/models/gemma4-assistant.cpp) the assistant has no K/V projections: it attends over the target's KV
cache (its sliding layers over the target's last-but-one layer, its full layers over the last), embeds tokens
with the target's ``token_embd`` and feeds on the target's last hidden state. So its attention geometry must
equal the target's, which only a pair rule can see. llama-server serves it with ``--spec-type draft-mtp``;
nothing in the file makes it infer that type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from ...convert.configs import TargetFacts
from ...convert.targets.gemma4 import ARCH as GEMMA4
from ...errors import ConfigError, IncompatiblePairError, TokenizerError, UnsupportedModelError
from ...hf_configs import section
from ...jsonfile import load_json
from ..findings import Finding, Interpretation, failed, passed

NAME = "gemma4_assistant"
ARCHITECTURES = ("Gemma4AssistantForCausalLM", "Gemma4UnifiedAssistantForCausalLM")
GGUF_ARCH = "gemma4-assistant"
SPEC_TYPE = "draft-mtp"
PUBLISHED = "Use the config.json published with the assistant (e.g. google/gemma-4-31B-it-assistant)."
PICK = "Pick the assistant published for this target (google/gemma-4-<size>-it-assistant for google/gemma-4-<size>-it)."


@dataclass(frozen=True)
class AssistantSpec:
    """What the assistant's config fixes, as b11434's Gemma4AssistantModel reads it (``text_config`` merged)."""

    path: Path  # its config.json
    arch: str
    hidden_size: int  # the assistant's own width (n_embd)
    backbone_hidden_size: int  # embedding_length_out: the target's hidden size
    n_layer: int
    layer_types: tuple[str, ...]
    head_dim: int  # sliding layers
    head_dim_full: int  # full layers (global_head_dim, or per_layer_config)
    kv_heads: int | None  # sliding layers: the KV heads of the target layer it reads
    kv_heads_full: int | None
    vocab_size: int | None

    @property
    def block_size(self) -> None:
        """No block: an MTP head drafts one token per step (``tune`` bounds n-max instead)."""
        return None

    @property
    def n_max_limit(self) -> None:
        """draft-mtp clamps no --spec-draft-n-max for a head that shares the target's memory."""
        return None


def _pos_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _from_layer_config(hp: dict[str, Any], key: str) -> Any:
    """Gemma4Model's fallback: ``key`` of the first full-attention layer in ``per_layer_config``."""
    types = hp.get("layer_types") or []
    for idx, cfg in (hp.get("per_layer_config") or {}).items():
        if int(idx) < len(types) and types[int(idx)] == "full_attention" and isinstance(cfg, dict) and key in cfg:
            return cfg[key]
    return None


def interpret(raw: dict[str, Any], path: Path) -> Interpretation[AssistantSpec]:
    """The assistant's own rules (each a b11434 converter error, loader throw or start-up abort)."""
    arch = str((raw.get("architectures") or [None])[0])
    text = section(raw, "text_config")
    hp = {**raw, **text}

    def refuse(message: str, fix: str = PUBLISHED, error: type = ConfigError) -> Interpretation[AssistantSpec]:
        return Interpretation(NAME, None, (failed("format.assistant", f"{path}: {message}", fix, error),))

    backbone = hp.get("backbone_hidden_size")
    if not _pos_int(backbone):
        return refuse(f"field 'backbone_hidden_size' is {backbone!r}, not a positive integer. It is the target's "
                      "hidden size, written as embedding_length_out (the width of the target hidden state the "
                      "assistant reads); llama.cpp b11434's converter stops with KeyError: 'backbone_hidden_size'.")
    n_layer, types, hidden = hp.get("num_hidden_layers"), hp.get("layer_types"), hp.get("hidden_size")
    if not (_pos_int(n_layer) and _pos_int(hidden) and isinstance(types, list) and len(types) == n_layer):
        return refuse(f"num_hidden_layers {n_layer!r}, hidden_size {hidden!r} and layer_types (one entry per layer) "
                      "must be given; llama.cpp b11434's Gemma-4 converter reads them all.")
    if "sliding_attention" not in types:
        return refuse(
            "layer_types has no 'sliding_attention' layer. llama.cpp b11434 builds the assistant's KV view as a "
            "sliding-window one and aborts at start-up with GGML_ASSERT(hparams.is_swa_any()).",
            "This assistant cannot be served by llama.cpp b11434.", UnsupportedModelError)
    if "full_attention" not in types:
        return refuse(
            "layer_types has no 'full_attention' layer. llama.cpp b11434's converter still writes rope_freqs (it "
            "generates it for the full-attention layers), but its loader creates that tensor only for a full layer, "
            "so the file fails to load with 'wrong number of tensors'.",
            "This assistant cannot be served by llama.cpp b11434.", UnsupportedModelError)
    if hidden == backbone:
        return refuse(
            f"hidden_size {hidden} equals backbone_hidden_size; llama.cpp b11434's loader throws \"Gemma 4 assistant "
            "requires embedding_length_out to carry the target hidden size\".", PUBLISHED, UnsupportedModelError)
    head_dim = hp.get("head_dim")
    head_full = hp.get("global_head_dim")
    head_full = head_full if head_full is not None else _from_layer_config(hp, "head_dim")
    if not (_pos_int(head_dim) and _pos_int(head_full)):
        return refuse(f"head_dim {head_dim!r} / global_head_dim {head_full!r} (or a full-attention per_layer_config "
                      "head_dim) must be positive integers; llama.cpp b11434's converter asserts on them.")
    kv_full = hp.get("num_global_key_value_heads")
    kv_full = kv_full if kv_full is not None else _from_layer_config(hp, "num_key_value_heads")
    kv = hp.get("num_key_value_heads")
    vocab = hp.get("vocab_size")
    spec = AssistantSpec(path, arch, int(hidden), int(backbone), int(n_layer), tuple(types), int(head_dim),
                         int(head_full), kv if _pos_int(kv) else None, kv_full if _pos_int(kv_full) else None,
                         vocab if _pos_int(vocab) else None)
    n_swa = types.count("sliding_attention")
    return Interpretation(NAME, spec, (
        passed("format.arch", f"{arch}: a Gemma-4 MTP assistant (llama.cpp {GGUF_ARCH}, served with --spec-type "
               f"{SPEC_TYPE})"),
        passed("format.assistant", f"{n_layer} layers ({n_swa} sliding, {n_layer - n_swa} full), hidden {hidden}, "
               f"backbone {backbone}, head dims {head_dim}/{head_full}"),
    ))


def _vocab_of(tokenizer_json: Path) -> tuple[Any, Any] | None:
    """The vocabulary a tokenizer.json defines (its model and added tokens), or None when it cannot be read."""
    try:
        tj = load_json(tokenizer_json)
    except (OSError, ValueError):
        return None
    return (tj.get("model"), tj.get("added_tokens")) if isinstance(tj, dict) else None


def tokenizer_findings(spec: AssistantSpec, target_tok_dir: Path | None) -> tuple[Finding, ...]:
    """pair.assistant_tokenizer: the assistant's tokenizer.json (the one written) defines the target's vocabulary.

    b11434's converter writes the assistant's own vocabulary, while its drafts are read as target token ids; a
    different tokenizer would turn every draft into other tokens. Skipped when either file is not at hand (a
    config-only precheck)."""
    own, theirs = spec.path.parent / "tokenizer.json", (target_tok_dir / "tokenizer.json") if target_tok_dir else None
    if theirs is None or not own.is_file() or not theirs.is_file():
        return (Finding("pair.assistant_tokenizer", "skip", "error", "tokenizer.json of the assistant or the target "
                        "not at hand: the two vocabularies are compared when both are"),)
    a, b = _vocab_of(own), _vocab_of(theirs)
    if a is None or a != b:
        return (failed("pair.assistant_tokenizer", f"{own}: the assistant's tokenizer.json does not define the same "
                       f"vocabulary as the target's {theirs} (model vocabulary or added tokens differ). llama.cpp "
                       "b11434 writes the assistant's own tokenizer and reads its drafts as the target's token ids, "
                       "so every draft would be other tokens.", PICK, IncompatiblePairError),)
    return (passed("pair.assistant_tokenizer", "the assistant's tokenizer.json defines the target's vocabulary"),)


def require_tokenizer(spec: AssistantSpec) -> None:
    """The converter's rule: the assistant's own tokenizer.json is what b11434 writes; it has no fallback.

    Raises:
        TokenizerError: the assistant folder has no tokenizer.json.
    """
    path = spec.path.parent / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{path.parent}: no tokenizer.json. llama.cpp b11434 converts a Gemma-4 assistant with its own "
            "tokenizer (Gemma4Model.set_vocab reads tokenizer.json from the assistant's folder; it never looks at "
            "the target's), so the conversion fails without it. Download the assistant's tokenizer files "
            "(tokenizer.json, tokenizer_config.json) with its weights.")


def pair_findings(spec: AssistantSpec, target: TargetFacts) -> tuple[Finding, ...]:
    """The assistant against its target: b11434 reads the target's hidden state, embeddings and KV cache."""
    out: list[Finding] = []
    where = f"Assistant {spec.path}"
    if target.arch is not None and target.arch not in GEMMA4.hf:  # the targets whose KV cache b11434's assistant reads
        out.append(failed("pair.assistant_target", f"{where} drafts for a Gemma-4 target, but the target is "
                          f"{target.arch}; llama.cpp b11434's assistant graph reads a Gemma-4 target's KV cache "
                          "and hidden state.", PICK, IncompatiblePairError))
    h = target.hidden_size
    if h is not None and spec.backbone_hidden_size != h:
        out.append(failed(
            "pair.assistant_backbone", f"{where} has backbone_hidden_size {spec.backbone_hidden_size} but the target's "
            f"hidden_size is {h}: llama.cpp b11434 feeds the target's hidden state and embeddings into "
            "nextn.pre_projection and aborts with ggml_can_mul_mat (draft-mtp also requires n_embd_out to equal the "
            "target's).", PICK, IncompatiblePairError))
    elif h is not None:
        out.append(passed("pair.assistant_backbone", f"backbone_hidden_size {h} = the target's hidden_size"))
    types = target.layer_types
    if types is not None and (len(types) < 2 or types[-1] != "full_attention"
                              or types[-2] != "sliding_attention"):
        out.append(failed(
            "pair.assistant_target_layers", f"{where}: the target's last two layers are {list(types[-2:])}; "
            "llama.cpp b11434 has the assistant's sliding layers read the KV cache of the target's last-but-one layer "
            "and its full layers that of the last, so those must be a sliding and a full layer.", PICK,
            IncompatiblePairError))
    geometry = (("sliding", "head_dim", spec.head_dim, target.head_dim, "head dim"),
                ("full", "global_head_dim", spec.head_dim_full, target.global_head_dim, "head dim"),
                ("sliding", "num_key_value_heads", spec.kv_heads, target.kv_heads, "KV heads"),
                ("full", "num_global_key_value_heads", spec.kv_heads_full, target.global_kv_heads, "KV heads"))
    for kind, key, ours, theirs, what in geometry:
        cid = "pair.assistant_head_dim" if what == "head dim" else "pair.assistant_kv_heads"
        if ours is None or theirs is None or ours == theirs:
            continue
        consequence = ("aborts on the view of the target's K cache (a larger head) or attends over a slice of "
                       "each cached head (a smaller one)" if what == "head dim" else
                       "accepts it without a word and attends with the wrong head grouping, so the drafts are noise")
        out.append(failed(cid, f"{where} has {key} {ours} but the target has {theirs}: its {kind} layers attend over "
                          f"the target's KV cache ({what} {theirs}); llama.cpp b11434 {consequence}.", PICK,
                          IncompatiblePairError))
    if not any(f.id == "pair.assistant_head_dim" for f in out) and target.head_dim is not None:
        out.append(passed("pair.assistant_head_dim", f"head dims {spec.head_dim}/{spec.head_dim_full} = the target's"))
    if not any(f.id == "pair.assistant_kv_heads" for f in out) and target.kv_heads is not None:
        out.append(passed("pair.assistant_kv_heads", "KV heads = the target's"))
    v_t = target.vocab_size
    if v_t is not None and spec.vocab_size is not None and v_t != spec.vocab_size:
        out.append(failed("pair.assistant_vocab", f"{where} has vocab_size {spec.vocab_size} but the target has "
                          f"{v_t}; the assistant embeds tokens with the target's token_embd and drafts target ids.",
                          PICK, IncompatiblePairError))
    out.extend(tokenizer_findings(spec, target.path.parent if target.path is not None else None))
    return tuple(out)
