"""GGUF names for DFlash that PyPI gguf 0.19.0 lacks, each as llama.cpp b11434 defines it.

Sources (paths inside the b11434 sdist's ``llama.cpp/``): keys in ``gguf-py/gguf/constants.py``
(class ``Keys``) and ``src/llama-arch.cpp``; tensor names in ``gguf-py/gguf/constants.py``
(``TENSOR_NAMES``) and the DFLASH block of ``gguf-py/gguf/tensor_mapping.py``.
"""

from __future__ import annotations

ARCH = "dflash"  # src/llama-arch.cpp: { LLM_ARCH_DFLASH, "dflash" }

# Architectures of drafter checkpoints that b11434's DFlashModel (conversion/qwen.py) handles and
# that this project converts. DFlash2/DSpark need selector/Markov tensors we do not map yet.
SUPPORTED_DRAFTER_ARCHS = ("DFlashDraftModel",)
KNOWN_UNSUPPORTED_DRAFTER_ARCHS = ("DFlash2DraftModel", "DSparkDraftModel", "Qwen3DSparkModel")


class Keys:
    """``{arch}``-templated keys (gguf-py ``Keys.LLM`` / ``Keys.Attention`` / ``Keys.Rope``)."""

    BLOCK_COUNT = f"{ARCH}.block_count"
    CONTEXT_LENGTH = f"{ARCH}.context_length"
    EMBEDDING_LENGTH = f"{ARCH}.embedding_length"
    FEED_FORWARD_LENGTH = f"{ARCH}.feed_forward_length"
    HEAD_COUNT = f"{ARCH}.attention.head_count"
    HEAD_COUNT_KV = f"{ARCH}.attention.head_count_kv"
    KEY_LENGTH = f"{ARCH}.attention.key_length"
    VALUE_LENGTH = f"{ARCH}.attention.value_length"
    RMS_EPS = f"{ARCH}.attention.layer_norm_rms_epsilon"
    CAUSAL = f"{ARCH}.attention.causal"
    SLIDING_WINDOW = f"{ARCH}.attention.sliding_window"
    SLIDING_WINDOW_PATTERN = f"{ARCH}.attention.sliding_window_pattern"
    VALUE_SCALE = f"{ARCH}.attention.value_scale"
    ROPE_FREQ_BASE = f"{ARCH}.rope.freq_base"
    ROPE_DIMENSION_COUNT = f"{ARCH}.rope.dimension_count"
    ROPE_DIMENSION_SECTIONS = f"{ARCH}.rope.dimension_sections"
    ROPE_SCALING_TYPE = f"{ARCH}.rope.scaling.type"
    ROPE_SCALING_FACTOR = f"{ARCH}.rope.scaling.factor"
    ROPE_SCALING_ORIG_CTX = f"{ARCH}.rope.scaling.original_context_length"
    ROPE_SCALING_YARN_EXT = f"{ARCH}.rope.scaling.yarn_ext_factor"
    ROPE_SCALING_YARN_ATTN = f"{ARCH}.rope.scaling.yarn_attn_factor"
    ROPE_SCALING_YARN_BETA_FAST = f"{ARCH}.rope.scaling.yarn_beta_fast"
    ROPE_SCALING_YARN_BETA_SLOW = f"{ARCH}.rope.scaling.yarn_beta_slow"
    BLOCK_SIZE = f"{ARCH}.block_size"  # Keys.LLM.BLOCK_SIZE
    TARGET_LAYERS = f"{ARCH}.target_layers"  # Keys.LLM.TARGET_LAYERS; HF ids + 1
    EMBEDDING_SCALE = f"{ARCH}.embedding_scale"  # Keys.LLM.EMBEDDING_SCALE
    LOGIT_SCALE = f"{ARCH}.logit_scale"
    FINAL_LOGIT_SOFTCAPPING = f"{ARCH}.final_logit_softcapping"

    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"
    MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"


GGML_QUANT_VERSION = 2  # gguf-py constants.GGML_QUANT_VERSION

# Prefix of this project's own provenance keys; llama.cpp ignores unknown keys and
# llama-quantize copies them (format reference, section 6).
PROVENANCE_PREFIX = "dflash_gguf."

# HF tensor name (z-lab files carry no "model." prefix) -> GGUF name; "{i}" is the block id.
# b11434 gguf-py/gguf/tensor_mapping.py, MODEL_ARCH.DFLASH entries.
TENSOR_MAP: dict[str, str] = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}

# Tensors b11434 maps but its DFlash loader (src/models/dflash.cpp) would reject or misuse.
EMBEDDING_TENSORS = {"embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}

# Names the reference converter drops silently (ModelBase.prepare_tensors).
IGNORED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
