"""Decoder tensor names shared by every family here, as b11434's gguf-py ``tensor_mapping.py`` maps them.

A family's map is these tables placed under its own prefixes (``model.layers.{bid}.`` for targets,
``layers.{i}.`` for z-lab drafters), plus the names only it has.
"""

from __future__ import annotations

# HF name inside a decoder block -> GGUF name inside ``blk.N.`` (Llama-style blocks: every family here).
DECODER_BLOCK: dict[str, str] = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
QK_NORM: dict[str, str] = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Outside the blocks, for a text model.
TEXT_MODEL: dict[str, str] = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def block_map(block: dict[str, str], hf_prefix: str = "model.layers.{bid}.", gguf_prefix: str = "blk.{bid}.",
              suffix: str = "") -> dict[str, str]:
    """``block`` under a family's prefixes (``suffix``: ``.weight`` where the map keys carry it)."""
    return {f"{hf_prefix}{hf}{suffix}": f"{gguf_prefix}{gguf}{suffix}" for hf, gguf in block.items()}


# Qwen3-Next / Qwen3.5 gated-DeltaNet (linear attention) layer, inside a decoder block (MODEL_ARCH.QWEN35*).
# ``A_log`` has no ``.weight`` (GGUF ``ssm_a``); ``dt_bias`` is renamed ``dt_proj.bias`` first (Qwen3NextModel).
GATED_DELTA_NET: dict[str, str] = {
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_proj": "ssm_dt",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
# Qwen2-MoE-style sparse MLP: router, fused 3D experts, one shared expert and its sigmoid gate.
QWEN_MOE_MLP: dict[str, str] = {
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.experts.gate_up_proj": "ffn_gate_up_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# The NextN / multi-token-prediction block's own tensors, once b11434 has moved them to ``model.layers.N``.
NEXTN: dict[str, str] = {
    "eh_proj": "nextn.eh_proj",
    "enorm": "nextn.enorm",
    "hnorm": "nextn.hnorm",
    "shared_head.norm": "nextn.shared_head_norm",
    "shared_head.head": "nextn.shared_head_head",
    "embed_tokens": "nextn.embed_tokens",
}
