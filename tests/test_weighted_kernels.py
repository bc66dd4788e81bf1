"""The importance-weighted kernels (compiled), bit for bit against b11434's libggml-base ``ggml_quantize_chunk`` with
an importance matrix, which is what llama-quantize --imatrix calls per tensor (quantize_row_q4_0_impl / q5_0 /
q5_1 / q4_K / q5_K / q6_K with quant_weights, and Q4_1, which Q4_0's rules pick with a matrix), and Q4_1 / IQ4_NL
/ IQ4_XS with and without one.

Inputs: rows of random weights at three scales, rows of the edges the unweighted tests use (zeros of either sign,
single nonzeros, constants, subnormals, huge values), every finite 16-bit value of F16 and BF16 as rows (both
refuse non-finite input: llama-quantize's check_tensors, the built-in's own check); importances that
are random, all zero, all one, one-hot, denormal and huge, with sources stored as F32, F16 and BF16 (the reference
gets the widened float32 values).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import reference
from conftest import NARROWER_SIMD_VARIANTS, REFERENCE_COMPARISONS, use_kernels
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from kernel_parity import assert_same_blocks, every_16_bit_value, stored

from dflash_gguf.quantize import kernels

Q = GGMLQuantizationType
F = np.float32
# six super-blocks: the row-wide sigma2 of the 32-blocks spans them; the K-quant fits run in groups of 1, 2 and 4
# super-blocks (portable, AVX2, AVX-512): whole groups and a group padded with zeros
N_PER_ROW = 1536
WEIGHTED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)
UNWEIGHTED_TOO = (Q.Q4_1, Q.IQ4_NL, Q.IQ4_XS)  # made by the same entry point without an importance as well


def _rows(rng: np.random.Generator) -> np.ndarray:
    rows = [rng.standard_normal(N_PER_ROW) * s for s in (0.02, 1.0, 300.0) for _ in range(6)]
    rows += [np.zeros(N_PER_ROW), -np.zeros(N_PER_ROW), np.full(N_PER_ROW, 0.5), np.linspace(-1, 1, N_PER_ROW)]
    one = np.zeros(N_PER_ROW)
    one[37] = 3.0
    rows.append(one)
    rows.append(rng.standard_normal(N_PER_ROW) * 1e-40)  # subnormal
    rows.append(rng.integers(-8, 8, N_PER_ROW).astype(float) * 0.25)  # grids where nearest_int meets .5
    tiny_blocks = rng.standard_normal(N_PER_ROW) * 0.02
    tiny_blocks[:32] *= 1e-20  # a block far below the rest
    rows.append(tiny_blocks)
    return np.asarray(rows, F)


def _importances(rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    hot = np.zeros(N_PER_ROW, F)
    hot[5] = 1.0
    return [("random", (rng.random(N_PER_ROW) * 10).astype(F)), ("ones", np.ones(N_PER_ROW, F)),
            ("zeros", np.zeros(N_PER_ROW, F)), ("one-hot", hot), ("denormal", np.full(N_PER_ROW, 1e-41, F)),
            ("huge", (rng.random(N_PER_ROW) * 1e20).astype(F))]


@pytest.fixture(params=("compiled", *NARROWER_SIMD_VARIANTS))
def compiled_variant(request: pytest.FixtureRequest) -> Iterator[str]:
    """The compiled kernels at every instruction set this CPU has."""
    yield from use_kernels(request.param)


def _ours(values: np.ndarray, stype: Q, qtype: Q, weights: np.ndarray | None) -> np.ndarray:
    return kernels.quantize_weighted(values.reshape(-1), stype, qtype, N_PER_ROW, weights)


@pytest.mark.reference
def test_weighted_kernels_match_libggml(tmp_path: Path, compiled_variant: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    rng = np.random.default_rng(11)
    x = _rows(rng)
    for stype in (Q.F32, Q.F16, Q.BF16):
        values, widened = stored(x, stype)
        for label, w in _importances(rng):
            refs = reference.ggml_quantize(widened, [(t, N_PER_ROW) for t in WEIGHTED], tmp_path, weights=w)
            for qtype, ref in zip(WEIGHTED, refs, strict=True):
                assert_same_blocks(_ours(values, stype, qtype, w), ref, widened, f"{qtype.name} {stype.name} {label}")
    for qtype, ref in zip(UNWEIGHTED_TOO, reference.ggml_quantize(x, [(t, N_PER_ROW) for t in UNWEIGHTED_TOO],
                                                                    tmp_path), strict=True):
        assert_same_blocks(_ours(x, Q.F32, qtype, None), ref, x, f"{qtype.name} without importance")
    REFERENCE_COMPARISONS.append(f"weighted q4_0/q4_1/q5_0/q5_1/q4_k/q5_k/q6_k/iq4_nl/iq4_xs = ggml_quantize_chunk "
                                 f"[{compiled_variant}]")


@pytest.mark.reference
@pytest.mark.parametrize("stype", [Q.F16, Q.BF16])
def test_weighted_kernels_on_every_16_bit_value(tmp_path: Path, stype: Q, compiled_variant: str) -> None:
    reference.require_or_skip(reference.llama_cpp_available())
    values, widened = every_16_bit_value(stype)
    finite = np.isfinite(widened)  # both refuse non-finite input (llama-quantize's check_tensors): left out
    values, widened = values[finite], widened[finite]
    keep = widened.size // N_PER_ROW * N_PER_ROW
    values, widened = values[:keep], widened[:keep]
    w = (np.random.default_rng(3).random(N_PER_ROW) * 4).astype(F)
    for qtype, ref in zip(WEIGHTED, reference.ggml_quantize(widened, [(t, N_PER_ROW) for t in WEIGHTED], tmp_path,
                                                            weights=w), strict=True):
        assert ref.shape[1] == GGML_QUANT_SIZES[qtype][1]
        assert_same_blocks(_ours(values, stype, qtype, w), ref, widened, f"{qtype.name} {stype.name} every value")
    REFERENCE_COMPARISONS.append(f"weighted kernels, every {stype.name} value [{compiled_variant}]")
