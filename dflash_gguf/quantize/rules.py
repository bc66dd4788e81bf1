"""llama-quantize b11434's per-tensor type rules for the types the built-in quantizer makes.

Source: ``src/llama-quant.cpp`` of llama.cpp b11434 (``tensor_allows_quantization``,
``llama_tensor_get_type``, ``llama_tensor_get_type_impl``, ``tensor_type_fallback``) and
``weight_name_comparer`` in ``src/llama-model-loader.h`` (the output tensor order). Only the
branches reachable for Q4_0/Q8_0/F16/BF16/F32 without an imatrix are mirrored, with the
``--output-tensor-type`` and ``--token-embedding-type`` overrides and ``--pure``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

Q = GGMLQuantizationType

# TYPE argument -> (llama_ftype written to general.file_type, default tensor type); llama_ftype values
# from include/llama.h, the default types from llama_ftype_get_default_type().
FTYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "f32": (LlamaFileType.ALL_F32, Q.F32),
}
SUPPORTED_TYPES = tuple(FTYPES)

# Types that are not "quantized" for ggml_is_quantized(); everything else is a block quant.
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16, Q.F64)
INT_TYPES = (Q.I8, Q.I16, Q.I32, Q.I64)

# tensor_allows_quantization(): substrings that keep a tensor in its stored type.
_KEEP_SUBSTRINGS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
                    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
                    "indexer.q_proj.weight")
# LLM_TENSOR_POS_EMBD / LLM_TENSOR_TOKEN_TYPES names (BERT-style), kept as stored.
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")
_LAYER_RE = re.compile(r"^blk\.(-?\d+)\.")


def is_quantized(qtype: GGMLQuantizationType) -> bool:
    """ggml_is_quantized(): a block format (not float, not integer)."""
    return qtype not in FLOAT_TYPES and qtype not in INT_TYPES


def ggml_n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims(): dimensions up to the last one above 1 (a [64, 1] tensor is 1-D, so never quantized)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return max(1, n)


def allows_quantization(name: str, n_dims: int) -> bool:
    """Whether llama-quantize may change this tensor's type at all (else it is copied as stored)."""
    if n_dims < 2 or not name.endswith("weight"):
        return False
    return not any(s in name for s in _KEEP_SUBSTRINGS) and name not in _KEEP_NAMES


@dataclass(frozen=True)
class TensorChoice:
    """The type llama-quantize picks for one tensor, and why when it is not the default."""

    qtype: GGMLQuantizationType
    reason: str = ""
    fallback: bool = False
    override: bool = False  # taken as given, with no row-length fallback


_TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")  # tensor_name_match_token_embd
# Types the built-in can make for --output-tensor-type / --token-embedding-type (llama-quantize takes any).
OVERRIDE_TYPES = {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0, "q6_k": Q.Q6_K, "f16": Q.F16, "bf16": Q.BF16, "f32": Q.F32}


def choose_type(name: str, ne: tuple[int, ...], stored: GGMLQuantizationType, default: GGMLQuantizationType,
                has_output: bool, *, output_type: GGMLQuantizationType | None = None,
                token_embd_type: GGMLQuantizationType | None = None, pure: bool = False) -> TensorChoice:
    """llama_tensor_get_type() for ``default`` in {Q4_0, Q8_0, F16, BF16, F32}, no imatrix.

    ``has_output``: the file has ``output.weight``; without it the token embedding is tied and
    takes the output tensor's rule (init_quantize_state_counters / has_tied_embeddings).
    ``output_type`` / ``token_embd_type``: llama-quantize's ``--output-tensor-type`` /
    ``--token-embedding-type``. As there, an override on its own tensor is taken as is (no row-length
    fallback), while a tied embedding follows ``output_type`` through the mixture rules. ``pure``: llama-quantize's
    ``--pure`` skips the mixture rules (``llama_tensor_get_type_impl``), so every quantizable tensor takes the
    default type (the overrides still apply, and so does the row-length fallback).
    """
    if not allows_quantization(name, ggml_n_dims(ne)):
        return TensorChoice(stored)
    if token_embd_type is not None and name in _TOKEN_EMBD:
        return TensorChoice(token_embd_type, "--token-embedding-type", override=True)
    if output_type is not None and name == "output.weight":
        return TensorChoice(output_type, "--output-tensor-type", override=True)
    if not is_quantized(default):  # F16/BF16/F32: no mixture rules, no fallback
        return TensorChoice(default)
    new = default
    reason = ""
    tied_embd = not has_output and name in _TOKEN_EMBD
    if pure:
        pass
    elif (name == "output.weight" or tied_embd) and output_type is not None:
        new, reason = output_type, "--output-tensor-type (tied embedding)"
    elif name == "output.weight" or tied_embd:
        block = GGML_QUANT_SIZES[new][0]
        if ne[0] % block:
            new, reason = Q.Q8_0, "output rule: row not a multiple of the block"
        elif new != Q.Q8_0:
            new, reason = Q.Q6_K, "output rule: llama-quantize keeps the output/tied embedding in Q6_K"
    block = GGML_QUANT_SIZES[new][0]
    if ne[0] % block:  # tensor_type_fallback()
        fb = Q.Q8_0 if new == Q.Q6_K else new
        if ne[0] % GGML_QUANT_SIZES[fb][0]:
            fb = Q.F16
        return TensorChoice(fb, f"row length {ne[0]} is not a multiple of {block}: falls back to {fb.name}", True)
    return TensorChoice(new, reason)


def layer_sort_key(name: str) -> tuple[int, str]:
    """weight_name_comparer: by ``blk.N.`` layer number (-1 for non-layer tensors), then by name."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)) if m else -1, name)
