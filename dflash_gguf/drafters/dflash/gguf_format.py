"""The DFlash contract, in one place: architecture, keys and tensor names that PyPI gguf 0.19.0 lacks,
the tensor set and shapes, and the tap rule. Its converter, checks and config rules share it.

Sources (paths inside the b11434 sdist's ``llama.cpp/``): keys in ``gguf-py/gguf/constants.py``
(class ``Keys``) and ``src/llama-arch.cpp``; tensor names in ``gguf-py/gguf/constants.py``
(``TENSOR_NAMES``) and the DFLASH block of ``gguf-py/gguf/tensor_mapping.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...ggufio.reader import GGUFMeta
from ...tensor_names import DECODER_BLOCK, QK_NORM, block_map

ARCH = "dflash"  # src/llama-arch.cpp: { LLM_ARCH_DFLASH, "dflash" }

# dflash.block_size when a file has none: b11434's converter writes 16 when the config has none
# (DFlashModel.set_gguf_parameters) and common/speculative.cpp assumes 16 for a file without the key.
DEFAULT_BLOCK_SIZE = 16


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
    CONV_KERNEL_SIZE = f"{ARCH}.conv_kernel_size"  # DFlash2 (Keys.LLM.CONV_KERNEL_SIZE ... SELECTOR_TOP_K)
    CONV_GROUP_SIZE = f"{ARCH}.conv_group_size"
    SELECTOR_RANK = f"{ARCH}.selector_rank"
    SELECTOR_TOP_K = f"{ARCH}.selector_top_k"
    SAMPLE_FROM_ANCHOR = f"{ARCH}.sample_from_anchor"  # DSpark (Keys.LLM.SAMPLE_FROM_ANCHOR, bool)
    HAS_CONFIDENCE_HEAD = f"{ARCH}.has_confidence_head"  # DSpark (Keys.LLM.HAS_CONFIDENCE_HEAD, bool)
    ATTENTION_SCALE = f"{ARCH}.attention.scale"
    HIDDEN_ACT = f"{ARCH}.hidden_activation"  # Keys.LLM.HIDDEN_ACT
    TARGET_LAYERS = f"{ARCH}.target_layers"  # Keys.LLM.TARGET_LAYERS; HF ids + 1
    EMBEDDING_SCALE = f"{ARCH}.embedding_scale"  # Keys.LLM.EMBEDDING_SCALE
    LOGIT_SCALE = f"{ARCH}.logit_scale"
    FINAL_LOGIT_SOFTCAPPING = f"{ARCH}.final_logit_softcapping"

    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"
    MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"

    @staticmethod
    def of(arch: str, key: str) -> str:
        """The same key under another architecture (a target's ``{arch}.embedding_length``)."""
        return key.replace(f"{ARCH}.", f"{arch}.", 1)



# HF tensor name (z-lab files carry no "model." prefix) -> GGUF name; "{i}" is the block id.
# b11434 gguf-py/gguf/tensor_mapping.py, MODEL_ARCH.DFLASH entries.
TENSOR_MAP: dict[str, str] = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    **block_map(DECODER_BLOCK | QK_NORM, "layers.{i}.", "blk.{i}.", ".weight"),
}

# DFlash2's extra tensors (b11434 tensor_mapping.py: attention_conv, mlp_conv, candidate_selector; DFlashModel
# adds ".weight" to the two codebooks). The conv base kernels have no ".weight": b11434 writes them F32.
DFLASH2_TENSOR_MAP: dict[str, str] = {
    "layers.{i}.attention_conv.base_kernel": "blk.{i}.attn_conv_base",
    "layers.{i}.attention_conv.kernel_projection.weight": "blk.{i}.attn_conv_proj.weight",
    "layers.{i}.mlp_conv.base_kernel": "blk.{i}.ffn_conv_base",
    "layers.{i}.mlp_conv.kernel_projection.weight": "blk.{i}.ffn_conv_proj.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}

# DSpark's heads (b11434 tensor_mapping.py: markov_head.markov_w1/markov_w2, confidence_head.proj). ``d2t`` is
# written apart (I64, absolute target ids) and ``t2d`` is dropped (DSparkModel.filter_tensors / prepare_tensors).
DSPARK_MARKER = "markov_w1.weight"  # common_speculative_types_from_gguf: this tensor means draft-dspark
DSPARK_TENSOR_MAP: dict[str, str] = {
    "markov_head.markov_w1.weight": DSPARK_MARKER,
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
}
# Gemma4DSparkModel's names on top of those (conversion/gemma.py filter_tensors / modify_tensors): the shared DFlash
# map would take post_attention_layernorm for Qwen's pre-FFN norm, so the Gemma block's four norms are renamed.
GEMMA4_DSPARK_TENSOR_MAP: dict[str, str] = {
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
    "layers.{i}.layer_scalar": "blk.{i}.layer_output_scale.weight",
}
GEMMA4_DSPARK_RENAMES = {"confidence_proj.": "confidence_head.proj."}  # prefix -> prefix, before mapping
DSPARK_REQUIRED = (DSPARK_MARKER, "markov_w2.weight")
DSPARK_OPTIONAL = ("markov_w2.scale", "conf_proj.weight", "conf_proj.bias", "d2t")

# Tensors b11434 maps but its DFlash loader (src/models/dflash.cpp) would reject or misuse.
EMBEDDING_TENSORS = {"embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


# Per-block tensors of the b11434 DFlash graph (src/models/dflash.cpp); attn_v is optional in the loader.
BLOCK_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
OPTIONAL_BLOCK_TENSORS = ("post_attention_norm", "post_ffw_norm", "layer_output_scale", "attn_sinks")
OPTIONAL_TENSORS = ("token_embd.weight", "output.weight", "fc.scale", "rope_freqs.weight")


@dataclass(frozen=True)
class DFlash2Shape:
    """What DFlash2's extra tensor shapes follow from: its conv/selector keys and the vocabulary size."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    n_vocab: int | None


@dataclass(frozen=True)
class DSparkShape:
    """What DSpark's head shapes follow from: the Markov rank and the target / draft vocabulary sizes."""

    markov_rank: int | None
    n_vocab: int | None
    n_vocab_draft: int | None


def expected_shapes(*, hidden: int | None, heads: int | None, kv_heads: int | None, head_dim: int | None,
                    ffn: int | None, n_taps: int | None, dflash2: DFlash2Shape | None = None,
                    dspark: DSparkShape | None = None) -> dict[str, tuple[int | None, ...]]:
    """GGUF tensor name (``blk.N.`` stripped) -> ``ne`` (ggml order); ``None`` where a parameter is unknown.

    llama_model::load_tensors for LLM_ARCH_DFLASH (src/models/dflash.cpp); a PyTorch shape is the reverse.
    """
    h = hidden
    q = heads * head_dim if heads and head_dim else None
    kv = kv_heads * head_dim if kv_heads and head_dim else None
    out: dict[str, tuple[int | None, ...]] = {
        "fc.weight": (n_taps * h if h and n_taps else None, h), "enc.output_norm.weight": (h,),
        "output_norm.weight": (h,), "attn_norm.weight": (h,), "ffn_norm.weight": (h,),
        "attn_q.weight": (h, q), "attn_k.weight": (h, kv), "attn_v.weight": (h, kv),
        "attn_output.weight": (q, h), "attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,),
        "ffn_gate.weight": (h, ffn), "ffn_up.weight": (h, ffn), "ffn_down.weight": (ffn, h),
        "post_attention_norm.weight": (h,), "post_ffw_norm.weight": (h,), "layer_output_scale.weight": (1,),
        "rope_freqs.weight": (head_dim // 2 if head_dim else None,)}
    if dflash2 is not None:
        k, rank, v = dflash2.conv_kernel_size, dflash2.selector_rank, dflash2.n_vocab
        projected = 2 * k * (h // dflash2.conv_group_size) if h and dflash2.conv_group_size > 0 else None
        out.update({"attn_conv_base": (h, k, 2), "ffn_conv_base": (h, k, 2), "attn_conv_proj.weight": (h, projected),
                    "ffn_conv_proj.weight": (h, projected), "selector_predecessor.weight": (rank, v),
                    "selector_successor.weight": (rank, v), "selector_hidden.weight": (h, rank)})
    if dspark is not None:  # load_arch_tensors, "DSpark = DFlash + a semi-autoregressive Markov head"
        r, v, vd = dspark.markov_rank, dspark.n_vocab, dspark.n_vocab_draft
        out.update({DSPARK_MARKER: (r, v), "markov_w2.weight": (r, vd), "markov_w2.scale": (1,),
                    "conf_proj.weight": (h + r if h and r else None, 1), "conf_proj.bias": (1,), "d2t": (vd,),
                    "output.weight": (h, vd)})
    return out


def shape_key(name: str) -> str:
    """The key of :func:`expected_shapes` for a GGUF tensor name."""
    return name.split(".", 2)[-1] if name.startswith("blk.") else name


# The tap rule. An HF drafter's target_layer_ids are hidden-state indices; llama.cpp b11434 taps the *input*
# of layer id + 1 (dflash.target_layers stores id + 1), so on an N-layer target ids lie in 0..N-2.
def is_drafter_like(meta: GGUFMeta) -> bool:
    """A DFlash drafter of any layout (mainline, fork, pre-merge), or a file with no architecture at all."""
    return meta.arch in (None, ARCH, "dflash-draft") or any(k.startswith(("dflash.", "dflash-draft.")) for k in meta.kv)


def gguf_taps(hf_ids: Iterable[int]) -> list[int]:
    """HF ``target_layer_ids`` -> ``dflash.target_layers`` (convert_hf_to_gguf DFlashModel: id + 1)."""
    return [int(i) + 1 for i in hf_ids]


def hf_taps_outside(hf_ids: Sequence[int], n_target_layers: int) -> list[int]:
    """The HF tap ids an ``n_target_layers`` target cannot feed (valid: 0..n-2)."""
    return [i for i in hf_ids if not 0 <= i <= n_target_layers - 2]


def gguf_taps_outside(gguf_ids: Sequence[int], n_target_layers: int) -> list[int]:
    """The GGUF taps an ``n_target_layers`` target cannot feed (valid: 1..n-1)."""
    return [i for i in gguf_ids if not 1 <= i <= n_target_layers - 1]
