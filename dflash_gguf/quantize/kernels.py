"""The built-in quantizer's kernels: ggml b11434's reference quantizers (``quantize_row_*_ref``, what
``ggml_quantize_chunk`` runs without an importance matrix) and its F16/BF16 roundings, bit for bit.

Every entry point looks the type up in its record (:mod:`.types`) and runs the compiled kernel (``_kernels.c``,
by the record's ``c_id``: several times faster, GIL released) when the extension is active, else the record's numpy
kernel (:mod:`.numpy_kernels`, where each family's exactness notes are). Both give the same bytes; which one runs
is :mod:`.native`'s (``DFLASH_GGUF_KERNELS``, :func:`kernel_path`, :func:`set_kernel_path`).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from .native import (
    KERNEL_PATHS,
    KERNELS_ENV,
    SIMD_ENV,
    SIMD_LEVELS,
    compiled,
    compiled_available,
    kernel_path,
    set_kernel_path,
    set_simd,
    simd,
    simd_levels,
)
from .numpy_kernels.common import GROUP_BLOCKS, QK, QK_K
from .numpy_kernels.kquants import K_GROUP, QK_K_SUB
from .numpy_kernels.q6_k import Q6_K_GROUP
from .types import TENSOR_TYPES, TensorType, ggml_type

Q = GGMLQuantizationType
# Source types read directly (BF16 as its raw 16-bit words); anything else is widened first.
SOURCE_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    t.qtype: t.values_dtype for t in TENSOR_TYPES if t.values_dtype is not None}
_BLOCKS = {t.qtype: t for t in TENSOR_TYPES if t.kernel is not None and t.block_size > 1}
_ROUNDINGS = {t.qtype: t for t in TENSOR_TYPES if t.kernel is not None and t.block_size == 1}
_CHECKED = {t.qtype: t for t in TENSOR_TYPES if t.scales is not None}
QUANT_TYPES = tuple(_BLOCKS)  # the block types quantize_rows makes
FLOAT_TYPES = tuple(_ROUNDINGS)  # the roundings round_floats makes
CHECKED_TYPES = tuple(_CHECKED)  # the types count_nonfinite reads
Q6_K_BYTES = ggml_type(Q.Q6_K).type_size


def _run(t: TensorType, values: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """``t``'s kernel over contiguous ``values`` into ``out``: the compiled one when active (one call, the GIL
    released for all of it), else the numpy one."""
    lib = compiled()
    if lib is not None and t.c_id is not None:
        lib.quantize(values, int(src_type), out, t.c_id)
    else:
        assert t.kernel is not None
        t.kernel(values, src_type, out)


def _quantize(values: np.ndarray, src_type: GGMLQuantizationType, t: TensorType) -> np.ndarray:
    """``values`` quantized to ``t`` by the active kernels: the bytes as a flat uint8 array."""
    if values.dtype != SOURCE_DTYPES[src_type] or values.size % t.block_size:
        raise ValueError(f"cannot quantize {values.dtype} values ({values.size}) given as {src_type.name} to "
                         f"{t.name}")
    blocks = np.ascontiguousarray(values).reshape(-1, t.block_size)
    out = np.empty((blocks.shape[0], t.type_size), np.uint8)
    _run(t, blocks, src_type, out)
    return out.reshape(-1)


def quantize_rows(values: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType) -> np.ndarray:
    """Quantize ``values`` to ``dst_type`` (one of QUANT_TYPES); return the tensor bytes as a flat uint8 array.

    ``values``: float32 (``src_type`` F32), float16 (F16) or the raw uint16 words of BF16; any shape whose size is a
    multiple of the block (32; 256 for the K-quants): rows are contiguous, so blocks never straddle rows when the row
    length is a multiple of the block. Non-finite input is quantized as ggml does (it does not reject it; the scales
    can come out NaN or infinite, which llama-quantize's validation then refuses: see :func:`count_nonfinite`).
    """
    return _quantize(values, Q(src_type), _BLOCKS[Q(dst_type)])


def quantize_q6_k(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q6_K_ref over ``values`` (as for :func:`quantize_rows`): 210 bytes per 256 values."""
    return quantize_rows(values, src_type, Q.Q6_K)


def quantize_q5_0(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q5_0_ref over ``values`` (as for :func:`quantize_rows`): 22 bytes per 32 values."""
    return quantize_rows(values, src_type, Q.Q5_0)


def quantize_q5_1(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q5_1_ref over ``values`` (as for :func:`quantize_rows`): 24 bytes per 32 values."""
    return quantize_rows(values, src_type, Q.Q5_1)


def quantize_q4_k(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q4_K_ref over ``values`` (as for :func:`quantize_rows`): 144 bytes per 256 values."""
    return quantize_rows(values, src_type, Q.Q4_K)


def quantize_q5_k(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q5_K_ref over ``values`` (as for :func:`quantize_rows`): 176 bytes per 256 values."""
    return quantize_rows(values, src_type, Q.Q5_K)


def quantize_mxfp4(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_mxfp4_ref over ``values`` (as for :func:`quantize_rows`): 17 bytes per 32 values."""
    return quantize_rows(values, src_type, Q.MXFP4)


# What ggml_quantize_chunk weights by an importance matrix (quantize_q4_0 ... quantize_q6_K with quant_weights) and
# Q4_1 and the two IQ4 types, made with or without one; ggml type id -> (values per block, bytes per block).
WEIGHTED_TYPES = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q4_K: (QK_K, 144),
                  Q.Q5_K: (QK_K, 176), Q.Q6_K: (QK_K, 210), Q.IQ4_NL: (32, 18), Q.IQ4_XS: (QK_K, 136)}
UNWEIGHTED_TOO = (Q.Q4_1, Q.IQ4_NL, Q.IQ4_XS)  # made by quantize_weighted without an importance as well


def quantize_weighted(values: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType,
                      n_per_row: int, importance: np.ndarray | None) -> np.ndarray:
    """Rows of ``n_per_row`` values (as for :func:`quantize_rows`) quantized as ggml_quantize_chunk does with an
    importance matrix: ``importance`` holds one float32 per column, the same for every row (one expert's slice of a
    stacked tensor); IQ4_NL/IQ4_XS also without one (None). Compiled kernels only: without them the built-in
    quantizer leaves an importance matrix to llama-quantize.

    Raises:
        ValueError: the compiled kernels are not active, or the type, sizes or importance do not fit.
    """
    lib = compiled()
    src_type, dst_type = Q(src_type), Q(dst_type)
    if lib is None:
        raise ValueError("the importance-weighted kernels are compiled only; the compiled kernels are not active")
    if dst_type not in WEIGHTED_TYPES or (importance is None and dst_type not in UNWEIGHTED_TOO):
        raise ValueError(f"{dst_type.name} is not made by the weighted kernels"
                         f"{'' if importance is not None else ' without an importance'}")
    if values.dtype != SOURCE_DTYPES[src_type] or values.size % n_per_row:
        raise ValueError(f"cannot quantize {values.dtype} values ({values.size}) given as {src_type.name} in rows of "
                         f"{n_per_row}")
    block, size = WEIGHTED_TYPES[dst_type]
    flat = np.ascontiguousarray(values).reshape(-1)
    out = np.empty(flat.size // block * size, np.uint8)
    weights = b"" if importance is None else np.ascontiguousarray(importance, np.float32)
    lib.quantize_weighted(flat, int(src_type), out, int(dst_type), n_per_row, weights)
    return out


def round_floats(values: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType) -> np.ndarray:
    """``values`` (as for :func:`quantize_rows`) rounded to F16 or BF16 as ggml_quantize_chunk does: the bits as
    a flat uint16 array (ggml's NaN rules included, which numpy's ``astype`` does not follow)."""
    src_type, dst_type = Q(src_type), Q(dst_type)
    if dst_type not in _ROUNDINGS:
        raise ValueError(f"cannot round to {dst_type.name}: {' or '.join(t.name for t in FLOAT_TYPES)} only")
    if values.dtype != SOURCE_DTYPES[src_type]:
        raise ValueError(f"cannot round {values.dtype} values given as {src_type.name}")
    flat = np.ascontiguousarray(values).reshape(-1)
    out = np.empty(flat.size, np.uint16)
    _run(_ROUNDINGS[dst_type], flat, src_type, out)
    return out


def count_nonfinite(data: np.ndarray, qtype: GGMLQuantizationType) -> int:
    """NaN or infinite values (F32, F16, BF16) or block scales (the fp16 ``d``, and ``dmin``/``m`` where a type has
    one; MXFP4's E8M0 exponent 0xFF) in the bytes ``data`` (a type of CHECKED_TYPES): what ggml_validate_row_data
    finds before llama-quantize refuses a tensor."""
    t = _CHECKED[Q(qtype)]
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    lib = compiled()
    if lib is not None and t.c_id is not None:
        return int(lib.count_nonfinite(flat, t.c_id))
    assert t.scales is not None
    if t.scales.exponent_mask:  # a float type: every value's exponent bits
        dtype = np.uint32 if t.type_size == 4 else np.uint16
        mask = dtype(t.scales.exponent_mask)
        return int(np.count_nonzero((flat.view(dtype) & mask) == mask))
    blocks = flat.reshape(-1, t.type_size)
    # an fp16 scale's high byte holds its exponent bits, 0x7C; validate_e_e8m0: the exponent byte 0xFF is NaN
    return sum(int(np.count_nonzero((blocks[:, at + 1] & np.uint8(0x7C)) == np.uint8(0x7C)))
               for at in t.scales.fp16_at) + \
        sum(int(np.count_nonzero(blocks[:, at] == np.uint8(0xFF))) for at in t.scales.e8m0_at)


__all__ = ["CHECKED_TYPES", "FLOAT_TYPES", "GROUP_BLOCKS", "KERNELS_ENV", "KERNEL_PATHS", "K_GROUP", "Q6_K_BYTES",
           "Q6_K_GROUP", "QK", "QK_K", "QK_K_SUB", "QUANT_TYPES", "SOURCE_DTYPES", "UNWEIGHTED_TOO",
           "WEIGHTED_TYPES", "compiled_available", "count_nonfinite", "kernel_path", "quantize_mxfp4",
           "quantize_q4_k", "quantize_q5_0", "quantize_q5_1", "quantize_q5_k", "quantize_q6_k", "quantize_rows",
           "quantize_weighted", "round_floats", "set_kernel_path", "SIMD_ENV", "SIMD_LEVELS", "set_simd", "simd",
           "simd_levels"]
