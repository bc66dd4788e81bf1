"""The F16 and BF16 roundings of the built-in quantizer, bit for bit against b11434's libggml-base
``ggml_quantize_chunk`` (its F16 and BF16 cases are what llama-quantize runs for those types), on the compiled
path and the numpy fallback.

Inputs: every F32 value a BF16 or F16 widens to (every 16-bit pattern, NaN payloads and infinities
included), F32 values on and beside every rounding edge of fp16 (halfway between neighbours, the subnormal
range, the overflow at 65520) and of bf16, signalling and quiet NaNs with payloads, and random weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS
from gguf import GGMLQuantizationType

from dflash_gguf.quantize import kernels

Q = GGMLQuantizationType
F = np.float32


def _edges() -> np.ndarray:
    """float32 values at and one ulp either side of fp16's and bf16's rounding edges, plus special values."""
    rng = np.random.default_rng(7)
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(F)  # every finite non-negative fp16
    mid = ((h[:-1].astype(np.float64) + h[1:]) / 2).astype(F)  # exact in float32: the halfway points
    b = (np.arange(0x7F80, dtype=np.uint32) << np.uint32(16)).view(F)  # every finite non-negative bf16
    bmid = (b.view(np.uint32)[:-1] + np.uint32(0x8000)).view(F)
    base = np.concatenate([mid, bmid, F([65504, 65519.996, 65520, 65536, 3.4e38, 2.0 ** -24, 2.0 ** -25,
                                         2.0 ** -26, 2.0 ** -149, 2.0 ** -126, 1e-45])])
    with np.errstate(all="ignore"):
        near = np.concatenate([base, np.nextafter(base, F(np.inf)), np.nextafter(base, F(0))]).astype(F)
    payloads = np.array([0x7F800000, 0x7F800001, 0x7F810000, 0x7FBFFFFF, 0x7FC00000, 0x7FC00001, 0x7FFFFFFF,
                         0x7F802000, 0x7FC0E000, 0x00000000, 0x00000001, 0x007FFFFF], np.uint32)
    special = np.concatenate([payloads, payloads | np.uint32(0x80000000)]).view(F)
    weights = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-6, 0, 200_000)).astype(F)
    x = np.concatenate([near, -near, special, weights])
    return x[rng.permutation(x.size)]


def _every_16_bit(stype: Q) -> np.ndarray:
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    return words.view(np.float16) if stype == Q.F16 else words


def _widened(values: np.ndarray, stype: Q) -> np.ndarray:
    if stype == Q.F32:
        return values
    if stype == Q.F16:
        with np.errstate(all="ignore"):
            return values.astype(F)
    return (values.astype(np.uint32) << np.uint32(16)).view(F)


def _ggml(x: np.ndarray, tmp: Path) -> dict[Q, np.ndarray]:
    """b11434's F16 and BF16 words for the float32 values ``x``, through ggml_quantize_chunk."""
    out = reference.ggml_quantize(x, [(Q.F16, x.size), (Q.BF16, x.size)], tmp)
    return {Q.F16: out[0].reshape(-1).view(np.uint16), Q.BF16: out[1].reshape(-1).view(np.uint16)}


def _assert_same(ours: np.ndarray, ref: np.ndarray, x: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(ours != ref)
    if bad.size:
        i = int(bad[0])
        pytest.fail(f"{what}: {bad.size}/{ref.size} values differ; first #{i}: input bits "
                    f"{x.view(np.uint32)[i]:#010x}, ours {ours[i]:#06x}, ggml {ref[i]:#06x}")


@pytest.mark.reference
def test_f16_bf16_match_libggml_on_every_16_bit_value_and_every_edge(tmp_path: Path, kernel_path: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    sources = [(Q.F32, _edges()), (Q.F16, _every_16_bit(Q.F16)), (Q.BF16, _every_16_bit(Q.BF16))]
    for stype, values in sources:
        widened = _widened(values, stype)
        ref = _ggml(widened, tmp_path)
        for dtype in kernels.FLOAT_TYPES:
            if dtype == stype:
                continue  # llama-quantize copies a tensor already of its type
            _assert_same(kernels.round_floats(values, stype, dtype), ref[dtype], widened,
                         f"{dtype.name} from {stype.name} [{kernel_path}]")
    REFERENCE_COMPARISONS.append(f"f16/bf16 roundings [{kernel_path}]")


def test_round_floats_refuses_what_it_does_not_make(kernel_path: str) -> None:
    with pytest.raises(ValueError, match="F16 or BF16 only"):
        kernels.round_floats(np.zeros(4, F), Q.F32, Q.Q8_0)
    with pytest.raises(ValueError, match="given as BF16"):
        kernels.round_floats(np.zeros(4, F), Q.BF16, Q.F16)  # BF16 comes as its raw uint16 words
