"""The quant types, each fact about one in one place.

``TensorType``: one record per ggml tensor type llama-quantize b11434 can write: its block format, the kernels that
make it here (numpy, and the compiled one by its C id), where its scales are, llama-quantize's fallback for rows its
block does not divide (``tensor_type_fallback`` in src/llama-quant.cpp) and whether it needs an importance matrix
(``tensor_requires_imatrix``). The kernels' dispatch and checks (``kernels.py``) and the tensor type rules
(``rules.py``) build their tables from these records.

``QuantType``: every file type llama-quantize b11434 makes, by the names it accepts (``QUANT_OPTIONS`` in
tools/quantize/quantize.cpp, matched case-insensitively), with its default tensor type
(``llama_ftype_get_default_type``) and what the pipeline needs to know of it. ``bits`` is the average bits per
weight of a whole file, for size estimates only: the block size for the uniform types (Q4_0: 4.5), and for the
mixtures the size llama-quantize's own table gives for Llama-3-8B (Q4_K_M: 4.58 GB of 8.03 B weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import QuantizeError
from .numpy_kernels import floats, kquants, legacy, mxfp4, q6_k

Q = GGMLQuantizationType
# A numpy kernel: kernel(blocks, src_type, out) quantizes whole blocks of values stored as ``src_type`` (F32, F16,
# or BF16 as raw words) into ``out`` (one row of the type's bytes per block; the float types: uint16 bits).
BlockKernel = Callable[[np.ndarray, GGMLQuantizationType, np.ndarray], None]


@dataclass(frozen=True)
class ScaleLayout:
    """Where ggml_validate_row_data looks for NaN or infinity in a tensor of the type (llama-quantize refuses the
    tensor when it finds one): the byte offsets in each block of its fp16 scales (``d``, and ``dmin`` or ``m`` where
    the type has one) or of its E8M0 exponent; for a float type, the exponent bits of every value."""

    fp16_at: tuple[int, ...] = ()
    e8m0_at: tuple[int, ...] = ()
    exponent_mask: int = 0


@dataclass(frozen=True)
class TensorType:
    """One ggml tensor type, and what the built-in quantizer and llama-quantize b11434 do with it."""

    qtype: GGMLQuantizationType  # the ggml type id
    block_size: int  # values per block (1 for a float type)
    type_size: int  # bytes per block
    kernel: BlockKernel | None = None  # the numpy kernel; None: nothing to quantize (F32) or llama-quantize's only
    c_id: int | None = None  # the id _kernels.c knows it by (its ggml id); None: the extension does not know it
    scales: ScaleLayout | None = None  # None: not checked here (the built-in never writes it)
    fallback: GGMLQuantizationType | None = None  # for a row its block does not divide; None: F16 then
    builtin: bool = False  # the built-in quantizer makes it (else only llama-quantize does)
    override: bool = False  # the built-in takes it for --output-tensor-type / --token-embedding-type
    needs_imatrix: bool = False  # b11434 refuses to make it without an importance matrix
    values_dtype: np.dtype | None = None  # the kernels read values stored in it as this (BF16: raw words)

    @property
    def name(self) -> str:
        """As ggml spells it: "Q5_1"."""
        return self.qtype.name

    @property
    def compiled(self) -> bool:
        """Whether the extension makes it (when it is built and active)."""
        return self.kernel is not None and self.c_id is not None


def _builtin(qtype: GGMLQuantizationType, kernel: BlockKernel | None, scales: ScaleLayout, *,
             fallback: GGMLQuantizationType | None = None, values: type[np.generic] | None = None,
             override: bool = True) -> TensorType:
    """A type the built-in makes; ``_kernels.c`` knows it by its ggml id (its enum copies ggml.h's)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return TensorType(qtype, block, size, kernel, int(qtype), scales, fallback, builtin=True, override=override,
                      values_dtype=None if values is None else np.dtype(values))


def _compiled_only(qtype: GGMLQuantizationType, fallback: GGMLQuantizationType | None = None,
                   scales: ScaleLayout | None = None) -> TensorType:
    """A type the built-in makes with its compiled kernels only (no numpy kernel; its scales checked in numpy, by
    default one fp16 d first): without them, llama-quantize makes it."""
    block, size = GGML_QUANT_SIZES[qtype]
    return TensorType(qtype, block, size, None, None, scales or _D, fallback, builtin=True)


def _llama_only(qtype: GGMLQuantizationType, fallback: GGMLQuantizationType | None = None, *,
                needs_imatrix: bool = False) -> TensorType:
    """A type only llama-quantize makes."""
    block, size = GGML_QUANT_SIZES[qtype]
    return TensorType(qtype, block, size, fallback=fallback, needs_imatrix=needs_imatrix)


_D = ScaleLayout(fp16_at=(0,))  # fp16 d first
_D_M = ScaleLayout(fp16_at=(0, 2))  # fp16 d, then dmin (the K-quants) or m (Q5_1)

TENSOR_TYPES: tuple[TensorType, ...] = (
    # Made by the built-in, in the order it names its --output-tensor-type choices.
    _builtin(Q.Q4_0, legacy.q4_0_blocks, _D),
    _builtin(Q.Q5_0, legacy.q5_0_blocks, _D),
    _builtin(Q.Q5_1, legacy.q5_1_blocks, _D_M),
    _builtin(Q.Q8_0, legacy.q8_0_blocks, _D),
    _builtin(Q.Q4_K, kquants.q4_k_blocks, _D_M, fallback=Q.Q5_0),
    _builtin(Q.Q5_K, kquants.q5_k_blocks, _D_M, fallback=Q.Q5_1),
    _builtin(Q.Q6_K, q6_k.q6_k_blocks, ScaleLayout(fp16_at=(208,)), fallback=Q.Q8_0),
    _builtin(Q.F16, floats.round_f16, ScaleLayout(exponent_mask=0x7C00), values=np.float16),
    _builtin(Q.BF16, floats.round_bf16, ScaleLayout(exponent_mask=0x7F80), values=np.uint16),
    _builtin(Q.F32, None, ScaleLayout(exponent_mask=0x7F800000), values=np.float32),  # copied or widened
    # MXFP4_MOE's expert type; no override (the built-in never offered it as one).
    _builtin(Q.MXFP4, mxfp4.mxfp4_blocks, ScaleLayout(e8m0_at=(0,)), override=False),
    # The 4-bit non-linear types, and Q4_1 (Q4_0's rules with an importance matrix take it for the first eighth of
    # ffn_down): compiled only (kernels.quantize_weighted, with or without an importance matrix).
    _compiled_only(Q.IQ4_NL), _compiled_only(Q.IQ4_XS, Q.IQ4_NL), _compiled_only(Q.Q4_1, scales=_D_M),
    # Made by llama-quantize only.
    _llama_only(Q.Q1_0),
    _llama_only(Q.Q2_K, Q.Q4_0), _llama_only(Q.Q3_K, Q.Q4_0), _llama_only(Q.TQ1_0, Q.Q4_0),
    _llama_only(Q.TQ2_0, Q.Q4_0), _llama_only(Q.IQ3_S, Q.IQ4_NL),
    *(_llama_only(t, Q.IQ4_NL, needs_imatrix=True)
      for t in (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS)),
)
_BY_QTYPE = {t.qtype: t for t in TENSOR_TYPES}


def ggml_type(qtype: GGMLQuantizationType | int) -> TensorType:
    """The record of ``qtype``.

    Raises:
        KeyError: not a type llama-quantize b11434 writes.
    """
    return _BY_QTYPE[Q(qtype)]


@dataclass(frozen=True)
class QuantType:
    """One llama-quantize file type."""

    name: str  # as llama-quantize spells it: "Q4_K_M"
    bits: float
    tensor: GGMLQuantizationType | None  # its default tensor type; None: Q2_0's, which gguf-py has no id for

    @property
    def key(self) -> str:
        """The lower-case name the pipeline's options, pair.json and file stages use: "q4_k_m"."""
        return self.name.lower()

    @property
    def unquantized(self) -> bool:
        return self.tensor is not None and ggml_type(self.tensor).block_size == 1

    @property
    def needs_imatrix(self) -> bool:
        """b11434 refuses to make the type without an importance matrix: its tensor type needs one, or its rules
        make Q2_K tensors that do."""
        return self.name in _IMATRIX_FILE_TYPES or (self.tensor is not None and ggml_type(self.tensor).needs_imatrix)


_LLAMA3_8B_WEIGHTS = 8.03e9
# tensor_requires_imatrix(): Q2_K needs an importance matrix only in a Q2_K_S file.
_IMATRIX_FILE_TYPES = ("Q2_K_S",)


def _mix(gigabytes: float) -> float:
    """Bits per weight of a mixture from its Llama-3-8B file size in llama-quantize's table."""
    return gigabytes * 1e9 * 8 / _LLAMA3_8B_WEIGHTS


TYPES: tuple[QuantType, ...] = (
    QuantType("Q1_0", 1.125, Q.Q1_0), QuantType("Q2_0", 2.25, None), QuantType("Q4_0", 4.5, Q.Q4_0),
    QuantType("Q4_1", 5.0, Q.Q4_1), QuantType("MXFP4_MOE", 4.25, Q.MXFP4), QuantType("Q5_0", 5.5, Q.Q5_0),
    QuantType("Q5_1", 6.0, Q.Q5_1), QuantType("IQ2_XXS", 2.06, Q.IQ2_XXS), QuantType("IQ2_XS", 2.31, Q.IQ2_XS),
    QuantType("IQ2_S", 2.5, Q.IQ2_XS), QuantType("IQ2_M", 2.7, Q.IQ2_S), QuantType("IQ1_S", 1.56, Q.IQ1_S),
    QuantType("IQ1_M", 1.75, Q.IQ1_M), QuantType("TQ1_0", 1.69, Q.TQ1_0), QuantType("TQ2_0", 2.06, Q.TQ2_0),
    QuantType("Q2_K", _mix(2.96), Q.Q2_K), QuantType("Q2_K_S", _mix(2.96), Q.Q2_K),
    QuantType("IQ3_XXS", 3.06, Q.IQ3_XXS), QuantType("IQ3_S", 3.44, Q.IQ3_S), QuantType("IQ3_M", 3.66, Q.IQ3_S),
    QuantType("IQ3_XS", 3.3, Q.IQ3_S), QuantType("Q3_K_S", _mix(3.41), Q.Q3_K), QuantType("Q3_K_M", _mix(3.74), Q.Q3_K),
    QuantType("Q3_K_L", _mix(4.03), Q.Q3_K), QuantType("IQ4_NL", 4.5, Q.IQ4_NL), QuantType("IQ4_XS", 4.25, Q.IQ4_XS),
    QuantType("Q4_K_S", _mix(4.37), Q.Q4_K), QuantType("Q4_K_M", _mix(4.58), Q.Q4_K),
    QuantType("Q5_K_S", _mix(5.21), Q.Q5_K), QuantType("Q5_K_M", _mix(5.33), Q.Q5_K),
    QuantType("Q6_K", 6.5625, Q.Q6_K), QuantType("Q8_0", 8.5, Q.Q8_0), QuantType("F16", 16.0, Q.F16),
    QuantType("BF16", 16.0, Q.BF16), QuantType("F32", 32.0, Q.F32),
)
# llama-quantize's aliases: the file it writes is of the type aliased (and named so here).
ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}
_BY_KEY = {t.key: t for t in TYPES}
NAMES = tuple(t.name for t in TYPES)


def quant_type(name: str, flag: str = "type") -> QuantType:
    """The type ``name`` denotes (any case; Q4_K is Q4_K_M, as llama-quantize reads it).

    Raises:
        QuantizeError: not a type llama-quantize b11434 makes (COPY included: it quantizes nothing).
    """
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in _BY_KEY:
        raise QuantizeError(f"{flag} {name!r} is not a type llama-quantize b11434 makes. Choose one of "
                            f"{', '.join(NAMES)} (any case).")
    return _BY_KEY[key]
