"""llama-quantize b11434's per-tensor type rules for the types the built-in quantizer makes.

Source: ``src/llama-quant.cpp`` of llama.cpp b11434 (``tensor_allows_quantization``, ``tensor_get_category``,
``init_quantize_state_counters``, ``llama_tensor_get_type``, ``llama_tensor_get_type_impl``,
``tensor_type_fallback``), ``weight_name_comparer`` in ``src/llama-model-loader.h`` (the tensor order the counters
run in), and the model types the rules ask for (``LLM_TYPE_70B`` in ``src/models/*.cpp``). The branches reachable for
the file types in ``ALL_FTYPES``, with and without an importance matrix, are mirrored, with ``--output-tensor-type``,
``--token-embedding-type`` and ``--pure``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from gguf import GGMLQuantizationType, LlamaFileType

from ..errors import QuantizeError
from .recipes import TensorTypeRule, first_match
from .types import TENSOR_TYPES, ggml_type, quant_type

Q = GGMLQuantizationType
F = LlamaFileType

# The file types whose rules are mirrored here, by TYPE argument -> the llama_ftype written to general.file_type
# (include/llama.h). MXFP4_MOE: experts MXFP4 (kept as they are when already), the rest Q8_0.
_MIRRORED = {"q4_0": F.MOSTLY_Q4_0, "q4_1": F.MOSTLY_Q4_1, "q8_0": F.MOSTLY_Q8_0, "q6_k": F.MOSTLY_Q6_K,
             "q4_k_m": F.MOSTLY_Q4_K_M, "q4_k_s": F.MOSTLY_Q4_K_S, "q5_k_m": F.MOSTLY_Q5_K_M,
             "q5_k_s": F.MOSTLY_Q5_K_S, "q5_0": F.MOSTLY_Q5_0, "q5_1": F.MOSTLY_Q5_1,
             "mxfp4_moe": F.MOSTLY_MXFP4_MOE, "iq4_nl": F.MOSTLY_IQ4_NL, "iq4_xs": F.MOSTLY_IQ4_XS,
             "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "f32": F.ALL_F32}
_IQ4 = (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS)


def _default_type(key: str) -> GGMLQuantizationType:
    """The file type's default tensor type (llama_ftype_get_default_type(), in its record)."""
    tensor = quant_type(key).tensor
    assert tensor is not None, key
    return tensor


# TYPE argument -> (llama_ftype, default tensor type)
ALL_FTYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    key: (ftype, _default_type(key)) for key, ftype in _MIRRORED.items()}
# The file types the built-in makes: every tensor type their rules pick (mixtures and fallbacks included) is one
# the built-in makes (``TensorType.builtin``).
FTYPES = ALL_FTYPES
SUPPORTED_TYPES = tuple(FTYPES)
# ... and with an importance matrix (all: Q4_0's rules then take Q4_1 for the first eighth of ffn_down, which the
# compiled weighted kernels make)
IMATRIX_TYPES = tuple(FTYPES)

# Types that are not "quantized" for ggml_is_quantized(); everything else is a block quant.
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16, Q.F64)
INT_TYPES = (Q.I8, Q.I16, Q.I32, Q.I64)

# tensor_allows_quantization(): substrings that keep a tensor in its stored type.
_KEEP_SUBSTRINGS = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    *(f"time_mix_{n}.weight" for n in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2", "g1", "g2",
                                       "decay_w1", "decay_w2", "lerp_fused")),
    "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
    ".patch_merger", "a.rvq.codebook", "mm.a.code_embd")
# ... and for glm5-next only
_KEEP_GLM5_NEXT = ("hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
                   "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight",
                   "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight")
# LLM_TENSOR_POS_EMBD / LLM_TENSOR_TOKEN_TYPES names (BERT-style), kept as stored.
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")
_LAYER_RE = re.compile(r"^blk\.(-?\d+)\.")
_TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")  # tensor_name_match_token_embd
# Types the built-in can make for --output-tensor-type / --token-embedding-type (llama-quantize takes any).
OVERRIDE_TYPES = {t.name.lower(): t.qtype for t in TENSOR_TYPES if t.override}
# Architectures and block counts b11434 calls LLM_TYPE_70B (src/models/*.cpp load_arch_hparams); llama's only
# when its heads do not all have their own K/V (n_head == n_head_kv is 65B there).
_70B_LAYERS = {"llama": 80, "qwen2": 80, "olmo": 80, "deci": 80, "jais2": 68}


def is_quantized(qtype: GGMLQuantizationType) -> bool:
    """ggml_is_quantized(): a block format (not float, not integer)."""
    return qtype not in FLOAT_TYPES and qtype not in INT_TYPES


# The types converted and quantized in one pass: every block type the built-in quantizer makes.
ONE_PASS_TYPES = tuple(key for key, (_, default) in FTYPES.items() if is_quantized(default))


def ggml_n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims(): dimensions up to the last one above 1 (a [64, 1] tensor is 1-D, so never quantized)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return max(1, n)


def allows_quantization(name: str, n_dims: int, arch: str = "") -> bool:
    """Whether llama-quantize may change this tensor's type at all (else it is copied as stored)."""
    if n_dims < 2 or not name.endswith("weight"):
        return False
    keep = (*_KEEP_SUBSTRINGS, *_KEEP_GLM5_NEXT) if arch == "glm5-next" else _KEEP_SUBSTRINGS
    return not any(s in name for s in keep) and name not in _KEEP_NAMES


class Category(Enum):
    """tensor_get_category(): the broad role the mixture rules key on."""

    OUTPUT = "output"
    TOKEN_EMBD = "token_embd"
    ATTENTION_QKV = "attn_qkv"
    ATTENTION_KV_B = "attn_kv_b"
    ATTENTION_V = "attn_v"
    ATTENTION_K = "attn_k"
    ATTENTION_Q = "attn_q"
    ATTENTION_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OTHER = "other"


_CATEGORY_SUBSTRINGS = ((Category.ATTENTION_QKV, "attn_qkv.weight"), (Category.ATTENTION_KV_B, "attn_kv_b.weight"),
                        (Category.ATTENTION_V, "attn_v.weight"), (Category.ATTENTION_K, "attn_k.weight"),
                        (Category.ATTENTION_Q, "attn_q.weight"), (Category.ATTENTION_OUTPUT, "attn_output.weight"),
                        (Category.FFN_UP, "ffn_up"), (Category.FFN_GATE, "ffn_gate"), (Category.FFN_DOWN, "ffn_down"))
_ATTN_V_LIKE = (Category.ATTENTION_V, Category.ATTENTION_QKV, Category.ATTENTION_KV_B)  # category_is_attn_v
_FFN = (Category.FFN_UP, Category.FFN_GATE, Category.FFN_DOWN)


def category_of(name: str) -> Category:
    if name == "output.weight":
        return Category.OUTPUT
    if name in _TOKEN_EMBD:
        return Category.TOKEN_EMBD
    return next((cat for cat, part in _CATEGORY_SUBSTRINGS if part in name), Category.OTHER)


@dataclass(frozen=True)
class ModelFacts:
    """What llama-quantize's rules read of the model: its hyperparameters (llama_hparams) and, from the tensor
    names, how many attention-V tensors it has and whether the token embedding doubles as the output."""

    arch: str = ""
    n_layer_all: int = 0  # {arch}.block_count, nextn layers included
    n_expert: int = 0
    is_70b: bool = False
    n_attention_wv: int = 0
    has_tied_embeddings: bool = True
    n_gqa: int = 0  # hparams.n_gqa(): layer 0's heads per K/V head (0 without K/V heads)

    @classmethod
    def of(cls, values: Mapping[str, object], names: Sequence[str]) -> ModelFacts:
        """From a GGUF's key values and tensor names (llama_model_loader's reading of them)."""
        arch = str(values.get("general.architecture") or "")

        def number(key: str) -> int:
            value = values.get(f"{arch}.{key}")
            if isinstance(value, Sequence) and not isinstance(value, str | bytes):
                value = value[0] if len(value) else 0  # per-layer arrays: hparams.n_head() reads layer 0
            return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0

        n_layer_all, n_expert = number("block_count"), number("expert_count")
        n_layer = n_layer_all - number("nextn_predict_layers")
        n_head, n_head_kv = number("attention.head_count"), number("attention.head_count_kv") or \
            number("attention.head_count")
        is_70b = n_expert != 8 and _70B_LAYERS.get(arch) == n_layer and (arch != "llama" or n_head != n_head_kv)
        cats = [category_of(n) for n in names]
        return cls(arch, n_layer_all, n_expert, is_70b, sum(c in _ATTN_V_LIKE for c in cats),
                   Category.OUTPUT not in cats, n_head // n_head_kv if n_head_kv else 0)


@dataclass(frozen=True)
class TensorChoice:
    """The type llama-quantize picks for one tensor, and why when it is not the default."""

    qtype: GGMLQuantizationType
    reason: str = ""
    fallback: bool = False
    override: bool = False  # taken as given, with no row-length fallback


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """use_more_bits in llama_tensor_get_type_impl (C integer division and remainder)."""
    eighth = n_layers // 8
    return i_layer < eighth or i_layer >= 7 * n_layers // 8 or int(math.fmod(i_layer - eighth, 3)) == 2


# tensor_type_fallback(): a 256-block type whose rows do not divide into 256 -> a 32-block one
_FALLBACKS = {t.qtype: t.fallback for t in TENSOR_TYPES if t.fallback is not None}


class Mixture:
    """llama_tensor_get_type over one file's tensors, asked in llama-quantize's order (``layer_sort_key``): the
    file type's mixture rules, which count attention-V and FFN tensors as they go, the overrides and the
    row-length fallbacks."""

    def __init__(self, facts: ModelFacts, type_key: str, *, output_type: GGMLQuantizationType | None = None,
                 token_embd_type: GGMLQuantizationType | None = None, pure: bool = False,
                 has_imatrix: bool = False, tensor_types: tuple[TensorTypeRule, ...] = ()) -> None:
        self.facts, self.ftype = facts, ALL_FTYPES[type_key][0]
        self.has_imatrix = has_imatrix  # llama-quantize given an importance matrix (qs.has_imatrix)
        self.default = ALL_FTYPES[type_key][1]
        self.output_type, self.token_embd_type, self.pure = output_type, token_embd_type, pure
        self.tensor_types = tensor_types
        self.matched: set[TensorTypeRule] = set()  # the rules some tensor took (an unmatched one is reported)
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0

    def choose(self, name: str, ne: tuple[int, ...], stored: GGMLQuantizationType) -> TensorChoice:
        """The type of tensor ``name`` (its ``ne`` and the type it is stored in).

        Raises:
            QuantizeError: llama-quantize's own refusal (an expert tensor whose layer it cannot tell).
        """
        if not allows_quantization(name, ggml_n_dims(ne), self.facts.arch):
            return TensorChoice(stored)
        category = category_of(name)
        manual = first_match(self.tensor_types, name)
        # a recipe may name per_layer_token_embd, which otherwise follows --token-embedding-type
        named = manual is not None and name == "per_layer_token_embd.weight"
        if self.token_embd_type is not None and category is Category.TOKEN_EMBD and not named:
            return TensorChoice(self.token_embd_type, "--token-embedding-type", override=True)
        if self.output_type is not None and category is Category.OUTPUT:
            return TensorChoice(self.output_type, "--output-tensor-type", override=True)
        if not is_quantized(self.default):  # F16/BF16/F32: no mixture rules, no recipe, no fallback
            return TensorChoice(self.default)
        new, reason = self.default, ""
        if manual is not None:  # the recipe replaces the mixture rules (their counters do not move)
            self.matched.add(manual)
            new, reason = manual.qtype, f"--tensor-type {manual.arg}"
        elif not self.pure:
            new, reason = self._mixture(name, ne, category)
        block = ggml_type(new).block_size
        if ne[0] % block:  # tensor_type_fallback()
            fb = _FALLBACKS.get(new, new)
            if ne[0] % ggml_type(fb).block_size:
                fb = Q.F16
            return TensorChoice(fb, f"row length {ne[0]} is not a multiple of {block}: falls back to {fb.name}", True)
        return TensorChoice(new, reason)

    def _layer(self, counter: int, name: str) -> tuple[int, int]:
        """layer_info: the running count, or for a model with experts the layer in the tensor's name."""
        n_layer = self.facts.n_layer_all
        if max(1, self.facts.n_expert) <= 1:
            return counter, n_layer
        m = _LAYER_RE.match(name)
        if m is None:
            raise QuantizeError(f"Tensor {name}: llama-quantize b11434 cannot tell its layer ('Failed to determine "
                                "layer for tensor') in a model with experts, and stops.")
        i_layer = int(m.group(1))
        if not 0 <= i_layer < n_layer:
            raise QuantizeError(f"Tensor {name}: layer {i_layer} is outside the {n_layer} blocks the file declares; "
                                "llama-quantize b11434 stops ('Bad layer').")
        return i_layer, n_layer

    def _mixture(self, name: str, ne: tuple[int, ...], category: Category) -> tuple[GGMLQuantizationType, str]:
        """llama_tensor_get_type_impl for the file types of ALL_FTYPES (with an importance matrix: its Q4_0/Q5_0
        ffn_down rule too)."""
        f, facts, new = self.ftype, self.facts, self.default
        if category is Category.OUTPUT or (facts.has_tied_embeddings and category is Category.TOKEN_EMBD):
            if self.output_type is not None:  # a tied embedding follows --output-tensor-type
                return self.output_type, "--output-tensor-type (tied embedding)"
            if f == F.MOSTLY_MXFP4_MOE:
                return Q.Q8_0, "MXFP4_MOE: the output in Q8_0"
            if facts.arch == "falcon" or ne[0] % ggml_type(new).block_size:
                return Q.Q8_0, "output rule: row not a multiple of the block"
            if new != Q.Q8_0:
                return Q.Q6_K, "output rule: llama-quantize keeps the output/tied embedding in Q6_K"
            return new, ""
        if f == F.MOSTLY_MXFP4_MOE:  # expert stacks (3-D) MXFP4, every other tensor Q8_0
            experts = len(ne) > 2 and ne[2] > 1 and (facts.arch != "bailingmoe3" or category in _FFN)
            return (new, "") if experts else (Q.Q8_0, "MXFP4_MOE: tensors other than the experts in Q8_0")
        if category is Category.TOKEN_EMBD:
            return new, ""
        if category in _ATTN_V_LIKE:
            i, n = self.i_attention_wv, facts.n_attention_wv
            self.i_attention_wv += 1
            if f in _IQ4 and facts.n_gqa >= 4:
                new = Q.Q5_K
            elif f in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _use_more_bits(i, n):
                new = Q.Q6_K
            elif f == F.MOSTLY_Q4_K_S and i < 4:
                new = Q.Q5_K
            if facts.is_70b and new in (Q.Q3_K, Q.Q4_K):
                new = Q.Q5_K
            if facts.n_expert == 8:
                new = Q.Q8_0
            return new, "" if new == self.default else "attention-V rule"
        if category is Category.ATTENTION_K:
            return (Q.Q8_0, "8-expert rule") if facts.n_expert == 8 else (new, "")
        if category is Category.FFN_DOWN:
            i_layer, n_layer = self._layer(self.i_ffn_down, name)
            self.i_ffn_down += 1
            if f == F.MOSTLY_Q4_K_M:
                if facts.arch == "falcon":
                    new = Q.Q6_K if i_layer < n_layer // 16 else Q.Q5_K if _use_more_bits(i_layer, n_layer) else Q.Q4_K
                elif _use_more_bits(i_layer, n_layer):
                    new = Q.Q6_K
            elif i_layer < n_layer // 8 and f in _IQ4 and not self.has_imatrix:
                new = Q.Q5_K
            elif f == F.MOSTLY_Q5_K_M and _use_more_bits(i_layer, n_layer):
                new = Q.Q6_K
            elif f == F.MOSTLY_Q4_K_S and facts.arch != "falcon" and i_layer < n_layer // 8:
                new = Q.Q5_K
            elif f in (F.MOSTLY_Q4_0, F.MOSTLY_Q5_0) and self.has_imatrix and i_layer < n_layer // 8:
                new = Q.Q4_1 if f == F.MOSTLY_Q4_0 else Q.Q5_1  # with a matrix: the first eighth of ffn_down
            return new, "" if new == self.default else "ffn_down rule"
        if category is Category.ATTENTION_OUTPUT:
            if facts.arch != "falcon" and facts.n_expert == 8 and f in (F.MOSTLY_Q4_K_S, F.MOSTLY_Q4_K_M, *_IQ4):
                return Q.Q5_K, "8-expert rule"
            return new, ""
        if category is Category.FFN_GATE:
            self._layer(self.i_ffn_gate, name)
            self.i_ffn_gate += 1
        elif category is Category.FFN_UP:
            self._layer(self.i_ffn_up, name)
            self.i_ffn_up += 1
        return new, ""


def choose_type(name: str, ne: tuple[int, ...], stored: GGMLQuantizationType, default: GGMLQuantizationType,
                has_output: bool) -> TensorChoice:
    """One tensor's type under a uniform file type (``default``: Q4_0, Q8_0, F16, BF16 or F32), as llama-quantize
    picks it for a file with (``has_output``) or without an ``output.weight``; the rules that count tensors do not
    apply to these types."""
    key = next(k for k, (_, t) in ALL_FTYPES.items() if t == default)
    return Mixture(ModelFacts(has_tied_embeddings=not has_output), key).choose(name, ne, stored)


def layer_sort_key(name: str) -> tuple[int, str]:
    """weight_name_comparer: by ``blk.N.`` layer number (-1 for non-layer tensors), then by name."""
    m = _LAYER_RE.match(name)
    return (int(m.group(1)) if m else -1, name)
