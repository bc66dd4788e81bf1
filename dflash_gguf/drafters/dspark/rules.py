"""DSpark: a DFlash drafter plus a semi-autoregressive Markov head (and, optionally, a confidence head).

llama.cpp b11434 converts them with ``DSparkModel`` (conversion/qwen.py, a ``DFlashModel`` subclass), so the
backbone rules are the DFlash ones (``dflash.interpret_backbone``) on the config as DSparkModel normalises it:
``transformer_layer_config`` merged into the top level (speculators-style exports), ``aux_hidden_state_layer_ids``
(EAGLE3-style, 1-based) turned into ``target_layer_ids`` minus one, top-level ``target_layer_ids`` and
``mask_token_id`` moved into ``dflash_config`` when there is none. The file keeps ``general.architecture`` dflash;
the ``markov_w1.weight`` tensor is what makes llama-server infer ``--spec-type draft-dspark``
(``common_speculative_types_from_gguf``). ``DeepseekV4DSparkModel`` is a DeepSeek-V4 backbone this package does
not convert. ``Gemma4DSparkModel`` (conversion/gemma.py) is a Gemma-4 backbone on the same loader: a
``DFlashModel`` subclass (not a ``DSparkModel`` one) that writes Gemma-4's global attention geometry, GELU, and a
generated ``rope_freqs``, and keeps its own ``lm_head``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...convert.configs import TargetFacts
from ...convert.targets.qwen3 import qwen3_hparams
from ...errors import ConfigError, IncompatiblePairError, NotCoveredError, UnsupportedModelError
from ...hf_configs import section
from ..dflash import rules as _dflash
from ..dflash.rules import DFlashSpec, DSparkParams, Gemma4Params
from ..findings import Finding, Interpretation, failed, passed

NAME = "dspark"
SPEC_TYPE = "draft-dspark"  # inferred from the Markov head's tensor (common_speculative_types_from_gguf)
QWEN_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "Lfm2DSparkDraftModel", "LingDSparkModel")
GEMMA4_ARCH = "Gemma4DSparkModel"
DEEPSEEK_V4_ARCH = "DeepseekV4DSparkModel"
ARCHITECTURES = (*QWEN_ARCHS, GEMMA4_ARCH, DEEPSEEK_V4_ARCH)
PUBLISHED = "Use the config.json published with the checkpoint."
# Keys a speculators-style export must carry in full: without a model_type transformers knows, b11434 reads the
# JSON as it is (ModelBase.load_hparams falls back to config.json) and fills in no default.
_RAW_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "hidden_act", "rms_norm_eps", "vocab_size")


# Gemma4TextConfig's full-attention rope, which Gemma4DSparkModel assumes when a config has no rope_parameters
GEMMA4_DEFAULT_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}


def interpret(raw: dict[str, Any], path: Path) -> Interpretation[DFlashSpec]:
    """The DSpark rules; the spec is None when an error finding blocks conversion."""
    arch = (raw.get("architectures") or [None])[0]
    findings: list[Finding] = []

    def refuse(id: str, message: str, fix: str = PUBLISHED, error: type = ConfigError) -> Interpretation[DFlashSpec]:
        return Interpretation(NAME, None, (*findings, failed(id, message, fix, error)))

    if arch == DEEPSEEK_V4_ARCH:
        return refuse(
            "format.arch", f"{path}: architectures is ['{DEEPSEEK_V4_ARCH}'], a DSpark drafter on a DeepSeek-V4 "
            "backbone (hyper-connections, MoE stages). llama.cpp b11434 converts it (DeepseekV4DSparkModel in "
            "conversion/deepseek.py), but dflash-gguf does not mirror that converter.",
            "Convert it with llama.cpp's own converter (convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET); "
            "the pipeline does so when given --llama-cpp DIR.", NotCoveredError)
    if arch == GEMMA4_ARCH:
        return _interpret_gemma4(raw, path)

    # DSparkModel.__init__: the anchor default is computed on the config as published, before any merge
    sample_from_anchor = raw.get("sample_from_anchor",
                                 "transformer_layer_config" not in raw and "aux_hidden_state_layer_ids" not in raw)
    if not isinstance(sample_from_anchor, bool):
        return refuse("format.dspark", f"{path}: sample_from_anchor is {sample_from_anchor!r}, not true or false.")
    layer_cfg = raw.get("transformer_layer_config")
    model_type = raw.get("model_type", "qwen3")
    if layer_cfg is not None:
        if not isinstance(layer_cfg, dict):
            return refuse("format.config", f"{path}: field 'transformer_layer_config' must be an object, got "
                          f"{type(layer_cfg).__name__}.")
        merged = {**raw, **layer_cfg}
        # AutoConfig normalises a qwen3 top level before the merge; any other top level is read as raw JSON
        hp = {**qwen3_hparams(raw), **layer_cfg} if model_type == "qwen3" else dict(merged)
        if model_type != "qwen3" and (missing := [k for k in _RAW_REQUIRED if k not in merged]):
            return refuse(
                "format.config", f"{path}: transformer_layer_config lacks {', '.join(missing)}. llama.cpp b11434 "
                f"reads this export (model_type {model_type!r}) as raw JSON, with no defaults, so the drafter's "
                "geometry cannot be known.", "Use the config.json published with the checkpoint (speculators "
                "exports carry the full layer config).")
        if layer_cfg.get("model_type", "qwen3") != "qwen3":
            return refuse("format.arch", f"{path}: transformer_layer_config.model_type is "
                          f"{layer_cfg.get('model_type')!r}; llama.cpp b11434's DSparkModel runs every such layer "
                          "stack as Qwen3 layers.", "Only Qwen3-style DSpark layers can be served.",
                          UnsupportedModelError)
    else:
        if model_type != "qwen3":
            return refuse("format.arch", f"{path}: model_type is {model_type!r}; llama.cpp b11434's DSparkModel "
                          "reads the drafter as a Qwen3 config.", PUBLISHED, UnsupportedModelError)
        merged, hp = dict(raw), None
    if "dflash_config" not in merged:
        if "aux_hidden_state_layer_ids" in merged:
            aux = merged["aux_hidden_state_layer_ids"]
            if not isinstance(aux, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1
                                                    for t in aux):
                return refuse("format.taps", f"{path}: aux_hidden_state_layer_ids {aux!r} must be integers >= 1 "
                              "(llama.cpp b11434 taps hidden state id - 1).")
            synth = {"target_layer_ids": [t - 1 for t in aux]}
            if merged.get("mask_token_id") is not None:
                synth["mask_token_id"] = merged["mask_token_id"]
        else:
            synth = {k: merged[k] for k in ("target_layer_ids", "mask_token_id") if k in merged}
        merged["dflash_config"] = synth
    if hp is not None:
        hp = {**hp, "dflash_config": merged["dflash_config"]}

    markov = merged.get("markov_head_type", "vanilla")
    if markov != "vanilla":
        return refuse("format.dspark", f"{path}: markov_head_type is {markov!r}. llama.cpp b11434 implements only "
                      "the 'vanilla' Markov head; its converter stops with \"unsupported markov_head_type\".",
                      "This drafter cannot be served by llama.cpp b11434.", UnsupportedModelError)
    vocab = merged.get("vocab_size", 151936 if model_type == "qwen3" else None)
    draft_vocab = merged.get("draft_vocab_size") or vocab
    if not isinstance(vocab, int) or not isinstance(draft_vocab, int) or draft_vocab <= 0:
        return refuse("format.dspark", f"{path}: vocab_size {vocab!r} / draft_vocab_size {draft_vocab!r} must be "
                      "positive integers.")
    if draft_vocab > vocab:
        return refuse("format.dspark", f"{path}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}; llama.cpp "
                      "b11434's converter stops with \"draft_vocab_size ... exceeds vocab_size\" (a draft vocabulary "
                      "is a subset of the target's).")
    params = DSparkParams(str(arch), sample_from_anchor, vocab, draft_vocab)
    vocab_text = f"reduced draft vocabulary {draft_vocab}" if params.reduced_vocab else "full vocabulary"
    findings.append(passed("format.dspark", f"DSpark ({arch}): vanilla Markov head, {vocab_text}, "
                           f"sample_from_anchor {str(sample_from_anchor).lower()}"))
    return _dflash.interpret_backbone(merged, path, hp=hp, family=NAME, findings=findings, dspark=params)


def _interpret_gemma4(raw: dict[str, Any], path: Path) -> Interpretation[DFlashSpec]:
    """Gemma4DSparkModel (conversion/gemma.py): its requirements (each a ValueError there), then the DFlash
    backbone rules on the config as it reads it (raw JSON: transformers 4.57.6 has no gemma4 config class)."""
    text = section(raw, "text_config")
    hp = {**raw, **text}
    dflash = section(hp, "dflash_config")
    n_layer = hp.get("num_hidden_layers")
    # Gemma4DSparkModel.__init__: Gemma4TextConfig's defaults when rope_parameters is absent
    rope_all = hp.get("rope_parameters") or {"full_attention": dict(GEMMA4_DEFAULT_ROPE)}
    rope = rope_all.get("full_attention", rope_all) if isinstance(rope_all, dict) else {}
    rope_type = rope.get("rope_type") if isinstance(rope, dict) else None
    vocab: Any = hp.get("vocab_size")  # an integer once the rules below hold
    rules: list[tuple[bool, str, str]] = [
        (bool(hp.get("final_logit_softcapping")), "Gemma4 DSpark logit softcapping is not supported",
         f"final_logit_softcapping is {hp.get('final_logit_softcapping')!r}. llama.cpp b11434's DSpark graph never "
         "applies a softcap, and the Markov head adds its bias to the backbone's logits, so serving the drafter "
         "without its cap would change which tokens it drafts. Serving it would need a llama.cpp whose "
         "draft-dspark graph caps the logits before the Markov bias, and a converter that writes the cap"),
        (not hp.get("attention_k_eq_v", False), "Gemma4 DSpark currently requires attention_k_eq_v",
         "attention_k_eq_v is not true"),
        (hp.get("layer_types") != ["full_attention"] * (n_layer if isinstance(n_layer, int) else -1),
         "Gemma4 DSpark currently requires uniform full_attention layer types",
         "layer_types are not full_attention on every layer"),
        (hp.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
         "Gemma4 DSpark currently requires hidden_activation=gelu_pytorch_tanh",
         f"hidden_activation is {hp.get('hidden_activation')!r}"),
        (bool(hp.get("attention_bias", False) or hp.get("enable_moe_block", False)),
         "Gemma4 DSpark attention bias and MoE are not supported", "attention_bias or enable_moe_block is set"),
        ((hp.get("draft_vocab_size") or vocab) != vocab, "Gemma4 DSpark currently requires a full draft vocabulary",
         f"draft_vocab_size {hp.get('draft_vocab_size')} differs from vocab_size {vocab}"),
        (dflash.get("markov_head_type", hp.get("markov_head_type", "vanilla")) != "vanilla",
         "Gemma4 DSpark currently requires a vanilla Markov head", "markov_head_type is not 'vanilla'"),
        (rope_type not in ("default", "proportional"), "Gemma4 DSpark requires default or proportional RoPE",
         f"the full-attention rope_type is {rope_type!r}"),
        (dflash.get("mask_token_id", hp.get("mask_token_id")) is None, "Gemma4 DSpark requires mask_token_id",
         "no mask_token_id"),
        (not dflash.get("target_layer_ids", hp.get("target_layer_ids")), "Gemma4 DSpark requires target_layer_ids",
         "no target_layer_ids"),
        (bool(dflash.get("use_swa", False)) and not (isinstance(dflash.get("swa_window_size"), int)
                                                     and dflash["swa_window_size"] > 0),
         "Gemma4 DSpark swa_window_size must be positive",
         f"dflash_config.use_swa is set with swa_window_size {dflash.get('swa_window_size')!r}"),
    ]
    for broken, b11434_error, what in rules:
        if broken:
            return Interpretation(NAME, None, (failed(
                "format.dspark", f"{path}: {what}; llama.cpp b11434's converter (Gemma4DSparkModel) stops with "
                f"\"{b11434_error}\".", "This drafter cannot be served by llama.cpp b11434.",
                UnsupportedModelError),))

    def refuse(message: str) -> Interpretation[DFlashSpec]:
        return Interpretation(NAME, None, (failed("format.dspark", f"{path}: {message}", PUBLISHED, ConfigError),))

    geometry = {k: hp.get(k) for k in ("global_head_dim", "num_global_key_value_heads", "hidden_size")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in geometry.values()):
        return refuse(f"{geometry} must be positive integers: Gemma4DSparkModel writes the global attention "
                      "geometry (num_global_key_value_heads, global_head_dim) as the drafter's KV heads and head size, "
                      "and llama.cpp b11434's converter stops with a KeyError without them.")
    head_dim = int(hp["global_head_dim"])
    rope_factors: tuple[float, ...] | None = None
    if rope_type == "proportional":  # Gemma4DSparkModel.generate_extra_tensors
        fraction = rope.get("partial_rotary_factor", 0.25)
        n_rot = int(head_dim * fraction / 2) if isinstance(fraction, (int, float)) else 0
        if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1 or head_dim * fraction != 2 * n_rot:
            return refuse(f"partial_rotary_factor {fraction!r} with global_head_dim {head_dim} gives no positive, "
                          "even rotary dimension count; llama.cpp b11434's converter stops with \"Gemma4 DSpark "
                          "rotary dimension count must be positive and even\".")
        rope_factors = (1.0,) * n_rot + (1e30,) * (head_dim // 2 - n_rot)
    sample_from_anchor = hp.get("sample_from_anchor", True)
    if not isinstance(sample_from_anchor, bool):
        return refuse(f"sample_from_anchor is {sample_from_anchor!r}, not true or false.")
    gemma = Gemma4Params(int(hp["num_global_key_value_heads"]), head_dim, float(hp["hidden_size"]) ** 0.5,
                         dict(rope), rope_factors, hp.get("tie_word_embeddings") is True)
    params = DSparkParams(GEMMA4_ARCH, sample_from_anchor, int(vocab), int(vocab), gemma)
    # the rest is DFlashModel's: b11434 reads the top-level mask id and taps where dflash_config has none
    top: dict[str, Any] = {k: hp[k] for k in ("target_layer_ids", "mask_token_id") if k in hp}
    backbone = {**hp, "dflash_config": {**top, **dflash}}
    rope_view = {**backbone, "rope_parameters": {"full_attention": dict(rope)}}
    findings = [passed("format.dspark", f"DSpark ({GEMMA4_ARCH}): Gemma-4 backbone, global attention "
                       f"{gemma.head_count_kv} KV head(s) of {head_dim}, vanilla Markov head, full vocabulary, "
                       f"sample_from_anchor {str(sample_from_anchor).lower()}")]
    return _dflash.interpret_backbone(backbone, path, hp=rope_view, family=NAME, findings=findings, dspark=params,
                                      writes_activation=True)


def pair_findings(spec: DFlashSpec, target: TargetFacts) -> tuple[Finding, ...]:
    """The DFlash pair rules, plus the Markov head's vocabulary: markov_w1 has one row per target token."""
    out = list(_dflash.pair_findings(spec, target))
    ds = spec.dspark
    assert ds is not None, "the DSpark rules read a DSpark spec"
    v_t = target.vocab_size
    if v_t is not None and ds.vocab_size != v_t:
        out.append(failed("pair.dspark_vocab", f"Drafter {spec.path} has vocab_size {ds.vocab_size} but the target "
                          f"has {v_t}: the Markov head's markov_w1 has one row per target token (llama.cpp b11434 "
                          "checks it against the vocabulary: 'markov_w1.weight has wrong shape').", _dflash.PICK,
                          IncompatiblePairError))
    elif v_t is not None:
        out.append(passed("pair.dspark_vocab", f"Markov head over the {v_t}-token target vocabulary"))
    return tuple(out)

