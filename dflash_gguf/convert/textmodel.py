"""b11434's ``TextModel`` keys, shared by the target families and the DFlash drafter.

Every b11434 text converter class derives from ``TextModel`` (conversion/base.py): its ``__init__``
mirrors the global rope values into ``rope_parameters``, and its ``set_gguf_parameters`` writes the
generic keys below, in this order, before the class adds its own. One implementation here keeps the
drafter and every target family writing them the same way.
"""

from __future__ import annotations

from typing import Any

from gguf import Keys, LlamaFileType

from ..errors import UnsupportedModelError
from ..ggufio import GGUFPlan


def find_hparam(hp: dict[str, Any], keys: tuple[str, ...], optional: bool = False) -> Any:
    """The value of the first key present (b11434 ModelBase.find_hparam); None when optional and absent."""
    for k in keys:
        if k in hp:
            return hp[k]
    if optional:
        return None
    raise KeyError(keys)


def rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    """TextModel.__init__'s ``self.rope_parameters``: global rope values mirrored into one dict."""
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope
    theta = find_hparam(hp, ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                             "rotary_emb_base"), optional=True)
    local = find_hparam(hp, ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                             "rope_local_base_freq"), optional=True)
    prf = find_hparam(hp, ("partial_rotary_factor", "rope_pct", "rope_percent"), optional=True)
    orig = find_hparam(hp, ("original_max_position_embeddings",), optional=True)
    if local is not None:
        rope["sliding_attention"] = {"rope_theta": local}
    if "rope_theta" not in rope and theta is not None:
        rope["rope_theta"] = theta
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    if "partial_rotary_factor" not in rope and prf is not None:
        rope["partial_rotary_factor"] = prf
    if "original_max_position_embeddings" not in rope and orig is not None:
        rope["original_max_position_embeddings"] = orig
    return rope


def add_textmodel_keys(plan: GGUFPlan, arch: str, hp: dict[str, Any], ftype: LlamaFileType) -> None:
    """The keys of b11434 ``TextModel.set_gguf_parameters`` for ``hp`` (``self.hparams``), in order.

    Shared by every target family and the DFlash drafter (whose b11434 class derives from TextModel too).
    """
    def k(template: str) -> str:
        return template.format(arch=arch)

    def find(keys: tuple[str, ...], optional: bool = False) -> Any:
        return find_hparam(hp, keys, optional)

    plan.add_uint32(k(Keys.LLM.BLOCK_COUNT), find(("n_layers", "num_hidden_layers", "n_layer", "num_layers")))
    for template, names in ((Keys.LLM.CONTEXT_LENGTH, ("max_position_embeddings", "n_ctx", "n_positions",
                                                       "max_length", "max_sequence_length", "model_max_length")),
                            (Keys.LLM.EMBEDDING_LENGTH, ("hidden_size", "n_embd", "dim")),
                            (Keys.LLM.FEED_FORWARD_LENGTH, ("prefix_dense_intermediate_size",
                                                            "dense_intermediate_size", "intermediate_size",
                                                            "n_inner", "hidden_dim")),
                            (Keys.Attention.HEAD_COUNT, ("num_attention_heads", "n_head", "n_heads")),
                            (Keys.Attention.HEAD_COUNT_KV, ("num_key_value_heads", "n_kv_heads"))):
        if (value := find(names, optional=True)) is not None:
            plan.add_uint32(k(template), value)
    if hp.get("is_causal") is False:
        plan.add_bool(k(Keys.Attention.CAUSAL), False)

    rope = rope_parameters(hp)
    params = rope.get("full_attention", rope)
    rope_type, factor = params.get("rope_type"), params.get("factor")
    if rope_type == "linear" and factor is not None:
        plan.add_string(k(Keys.Rope.SCALING_TYPE), "linear")
        plan.add_float32(k(Keys.Rope.SCALING_FACTOR), factor)
    elif rope_type == "yarn" and factor is not None:
        plan.add_string(k(Keys.Rope.SCALING_TYPE), "yarn")
        plan.add_float32(k(Keys.Rope.SCALING_FACTOR), factor)
        plan.add_uint32(k(Keys.Rope.SCALING_ORIG_CTX_LEN), params["original_max_position_embeddings"])
        for src, template in (("extrapolation_factor", Keys.Rope.SCALING_YARN_EXT_FACTOR),
                              ("attention_factor", Keys.Rope.SCALING_YARN_ATTN_FACTOR),
                              ("beta_fast", Keys.Rope.SCALING_YARN_BETA_FAST),
                              ("beta_slow", Keys.Rope.SCALING_YARN_BETA_SLOW)):
            value = params.get(src, params.get("attn_factor") if src == "attention_factor" else None)
            if value is not None:
                plan.add_float32(k(template), value)
    elif rope_type in ("su", "longrope"):
        plan.add_string(k(Keys.Rope.SCALING_TYPE), "longrope")
    if "mrope_section" in rope:
        sections = list(rope["mrope_section"])[:4]
        plan.add_array(k(Keys.Rope.DIMENSION_SECTIONS), sections + [0] * (4 - len(sections)))
    if params.get("rope_theta") is not None:
        plan.add_float32(k(Keys.Rope.FREQ_BASE), params["rope_theta"])
    if (swa_theta := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
        plan.add_float32(k(Keys.Rope.FREQ_BASE_SWA), swa_theta)
    if (eps := find(("rms_norm_eps", "norm_eps"), optional=True)) is not None:
        plan.add_float32(k(Keys.Attention.LAYERNORM_RMS_EPS), eps)
    if (eps := find(("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"), optional=True)) is not None:
        plan.add_float32(k(Keys.Attention.LAYERNORM_EPS), eps)
    if (n := find(("num_local_experts", "num_experts", "n_routed_experts"), optional=True)) is not None:
        plan.add_uint32(k(Keys.LLM.EXPERT_COUNT), n)
    if (n := find(("num_experts_per_tok", "num_experts_per_token", "top_k_experts"), optional=True)) is not None:
        plan.add_uint32(k(Keys.LLM.EXPERT_USED_COUNT), n)
    if (n := hp.get("n_group")) is not None:
        plan.add_uint32(k(Keys.LLM.EXPERT_GROUP_COUNT), n)
    if (n := hp.get("topk_group")) is not None:
        plan.add_uint32(k(Keys.LLM.EXPERT_GROUP_USED_COUNT), n)
    if find(("score_function", "scoring_func", "score_func", "moe_router_activation", "moe_router_activation_func",
             "expert_selection_fn"), optional=True) is not None:
        raise UnsupportedModelError(f"{arch}: an expert gating function in the config (a mixture-of-experts "
                                    "model); the built-in converter covers dense models only.")
    if (head_dim := hp.get("head_dim")) is not None:
        plan.add_uint32(k(Keys.Attention.KEY_LENGTH), head_dim)
        plan.add_uint32(k(Keys.Attention.VALUE_LENGTH), head_dim)
    plan.add_uint32(Keys.General.FILE_TYPE, ftype)
