"""ggml_quantize_chunk's F16 and BF16 roundings in numpy (ggml_fp32_to_fp16_row, ggml_fp32_to_bf16_row_ref).

Why not ``astype(np.float16)``: numpy keeps a NaN's payload where ggml writes ``sign | 0x7E00``. These give ggml's
bits, NaN rules included; the compiled rounding is preferred when built, since numpy converts values below fp16's
normal range (most of a BF16 weight file can be there) about 20x slower than others.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from ...ggufio.layout import float_to_f32
from .common import U16, fp16_bits


def round_f16(values: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """``values`` (stored as ``src_type``) rounded to F16 as GGML_FP32_TO_FP16 does, into ``out`` (uint16 bits)."""
    out[...] = fp16_bits(float_to_f32(values, src_type))


def round_bf16(values: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """``values`` rounded to BF16 as ggml_compute_fp32_to_bf16 does (to nearest even on the bits; a NaN keeps its top
    half, made quiet), into ``out`` (uint16 bits)."""
    u = float_to_f32(values, src_type).view(np.uint32)  # no overflow below NaN's bit patterns
    words = ((u + (np.uint32(0x7FFF) + ((u >> U16) & np.uint32(1)))) >> U16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        words[nan] = (u[nan] >> U16).astype(np.uint16) | np.uint16(64)
    out[...] = words
