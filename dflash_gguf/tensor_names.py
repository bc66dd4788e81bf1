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
