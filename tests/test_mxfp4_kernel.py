"""The built-in MXFP4 kernel (what llama-quantize's MXFP4_MOE makes of a 16- or 32-bit expert tensor) against b11434's
libggml-base ``quantize_row_mxfp4_ref``: random weights, every F16 and BF16 bit pattern, and the blocks where the
arithmetic is delicate (a largest value a few ulps below a power of two, where log2f rounds up; subnormals; ties
between two grid points; NaN and infinity; an exponent that wraps to 0xFF, which ggml's validation refuses), on the
compiled kernel and on the numpy one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS
from gguf import GGMLQuantizationType as Q
from kernel_parity import assert_same_blocks, every_16_bit_value

from dflash_gguf.quantize import kernels

F = np.float32


def _edge_blocks(rng: np.random.Generator) -> np.ndarray:
    blocks = []
    for k in range(-149, 128):
        for mant in (1.0, 1 - 2**-24, 1 - 2**-22, 1 - 2**-20, 1 - 2**-19, 0.75, 0.5 + 2**-24):
            top = F(min(np.ldexp(mant, k + 1), np.finfo(F).max))  # the largest |x|: at or just below 2^(k+1)
            if not np.isfinite(top) or top == 0:
                continue
            b = (rng.uniform(-1, 1, 32) * top).astype(F)
            b[rng.integers(32)] = -top if k % 2 else top
            blocks.append(b)
    for special in (np.nan, np.inf, -np.inf):
        b = rng.standard_normal(32).astype(F)
        b[rng.integers(32)] = special
        blocks.append(b)
    blocks += [np.full(32, np.nan, F), np.zeros(32, F), -np.zeros(32, F), np.full(32, F(1e-45)),
               np.full(32, F(3.4e38))]
    for scale in (0.25, 1.0, 8.0):  # values halfway between grid points: the first of two equal errors wins
        blocks.append(((np.arange(32) % 16 - 8) * F(scale) + F(scale) / 4).astype(F))
    return np.concatenate(blocks).astype(F)


@pytest.mark.reference
def test_mxfp4_matches_libggml(tmp_path: Path, kernel_path: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    rng = np.random.default_rng(7)
    f32 = np.concatenate([(rng.standard_normal(32 * 20000) * 0.02).astype(F), _edge_blocks(rng)])
    cases = {Q.F32: (f32, f32), Q.BF16: every_16_bit_value(Q.BF16), Q.F16: every_16_bit_value(Q.F16)}
    for src_type, (values, as_f32) in cases.items():
        ref = reference.ggml_quantize(as_f32, [(Q.MXFP4, None)], tmp_path)[0]
        ours = kernels.quantize_mxfp4(values, src_type)
        assert_same_blocks(ours, ref, as_f32, f"MXFP4 from {src_type.name}")
        assert kernels.count_nonfinite(ours, Q.MXFP4) == int(np.count_nonzero(ref[:, 0] == 0xFF))
    REFERENCE_COMPARISONS.append(f"mxfp4 kernel = libggml quantize_row_mxfp4_ref [{kernel_path}]")


def test_an_exponent_of_0xff_is_what_validation_refuses(kernel_path: str) -> None:
    """A block whose largest value lies in [2^-126, 2^-125) gets e = (uint8_t)(-1): 0xFF, ggml's NaN exponent."""
    block = np.zeros(32, F)
    block[0] = F(2.0**-126)
    out = kernels.quantize_mxfp4(block, Q.F32)
    assert out[0] == 0xFF and kernels.count_nonfinite(out, Q.MXFP4) == 1
    assert kernels.count_nonfinite(kernels.quantize_mxfp4(np.ones(32, F), Q.F32), Q.MXFP4) == 0
