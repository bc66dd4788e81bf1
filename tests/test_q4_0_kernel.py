"""The Q4_0/Q8_0 kernels, bit for bit against b11434's libggml-base ``quantize_row_q4_0_ref`` / ``q8_0_ref``.

The compiled kernels have two paths: AVX2 batches of 8 blocks (chosen at run time; a block with a NaN
or inf, or a scale whose inverse overflows, goes to the scalar code) and the scalar code (no AVX2, or a
build with ``-DNO_AVX2``). These tests run whichever path the build and CPU select; build once with
``CFLAGS=-DNO_AVX2`` to check the other. The numpy kernels run the same tests.

Inputs: adversarial blocks (ties of |x| with opposite signs, zeros of either sign, single nonzeros,
x * id + 8.5 and x * id on rounding boundaries, subnormals, scales at fp16 overflow, NaN and inf, NaN
payloads) and many random blocks of plausible weights, stored as F32, F16 and BF16 (the reference gets
the widened float32 values), at every position in a batch, and from unaligned buffers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import reference
from conftest import REFERENCE_COMPARISONS, use_kernels
from gguf import GGMLQuantizationType
from kernel_parity import assert_same_blocks, every_16_bit_value, stored

from dflash_gguf.quantize import kernels

Q = GGMLQuantizationType
F = np.float32
QTYPES = (Q.Q4_0, Q.Q8_0)
SOURCES = (Q.F32, Q.F16, Q.BF16)
NBYTES = {Q.Q4_0: 18, Q.Q8_0: 34}


# -- inputs ------------------------------------------------------------------------------------------

def _adversarial_blocks() -> np.ndarray:
    """n x 32 float32 blocks on the edges of quantize_row_q4_0_ref / q8_0_ref."""
    rng = np.random.default_rng(2024)
    out: list[np.ndarray] = []

    def add(b: object) -> None:
        out.append(np.asarray(b, F).reshape(32))

    def weights(scale: float) -> np.ndarray:
        return (rng.standard_normal(32) * scale).astype(F)

    nz = -np.zeros(32, F)
    add(np.zeros(32, F))  # max = +0.0: d = -0.0
    add(nz)  # all -0.0: max stays +0.0 (C's initial value), never -0.0
    b = np.zeros(32, F)
    b[::2] = -0.0
    add(b)
    b = nz.copy()
    b[31] = 0.0
    add(b)
    for pos in (0, 1, 7, 8, 15, 16, 17, 24, 31):  # a single nonzero among zeros of either sign
        for k, v in enumerate((1.0, -1.0, 3e-3, -0.5, 1e-45, -1e-40, 2.0 ** -126, 65504.0, -1e30, 3.4e38)):
            b = (nz if k % 2 else np.zeros(32, F)).copy()
            b[pos] = v
            add(b)
    # ties of |x|: the first of them is max, whatever the signs
    pairs = ((0, 1), (0, 16), (0, 31), (1, 0), (3, 4), (7, 8), (8, 9), (15, 16), (16, 17), (23, 24), (30, 31),
             (5, 27), (31, 0), (12, 13))
    for i, j in pairs:
        for a in (3.0, 0.046875, 2.0 ** -10, 6.0e4, 2.0 ** -130):
            for si, sj in ((-1, 1), (1, -1), (-1, -1), (1, 1)):
                b = np.clip(weights(a / 4), -a * 0.75, a * 0.75).astype(F)
                b[i], b[j] = si * a, sj * a
                add(b)
    for i, j, k in ((2, 9, 30), (0, 15, 16), (29, 30, 31)):  # three-way ties
        for signs in ((1, -1, -1), (-1, 1, 1), (-1, -1, 1)):
            b = weights(0.01)
            b[[i, j, k]] = np.array(signs, F) * F(0.5)
            add(b)
    alt = np.where(np.arange(32) % 2, 1, -1).astype(F)
    for v in (2.0, 1e-3, 7e4):  # every |x| equal
        add(alt * F(v))
        add(-alt * F(v))
        add(np.full(32, v, F))
        add(np.full(32, -v, F))
        add(rng.choice(np.array([-1, 1], F), 32) * F(v))
    # x * id + 8.5 on integers (Q4_0: max = -8 * 2^k gives id = 2^-k) and x * id on .5 (Q8_0: max = 127 * 2^k),
    # exactly and one or two ulps either side
    half = np.arange(-8, 8, 0.5, dtype=F)
    q8_half = (np.arange(32, dtype=F) - 16 + F(0.5))
    q8_half[0] = 127
    for k in (-120, -40, -3, 0, 4, 30, 100):
        s = F(2.0 ** k)
        for base in (half, -half, q8_half, -q8_half):
            b = base * s
            add(b)
            for direction in (np.inf, -np.inf):
                p = np.nextafter(b, F(direction)).astype(F)
                p[0] = b[0]
                add(p)
                p2 = np.nextafter(p, F(direction)).astype(F)
                p2[0] = b[0]
                add(p2)
    # the same for random scales: values x with f32(x * id) on (Q4_0) n - 8.5 or (Q8_0) n + 0.5, and neighbours
    with np.errstate(all="ignore"):
        for _ in range(120):
            mx = F(rng.choice([-1, 1]) * 10.0 ** rng.uniform(-4, 1))
            d4 = F(mx / F(-8))
            id4 = F(F(1) / d4)
            t = (np.arange(-8, 8, dtype=F) + F(0.5))[rng.integers(0, 16, 31)]
            x = (t / id4).astype(F)
            x = np.nextafter(x, F(np.inf) * rng.choice([-1, 1], 31)).astype(F) if rng.random() < 0.5 else x
            add(np.concatenate([[mx], np.clip(x, -abs(mx), abs(mx))]).astype(F))
            amax = F(abs(mx))
            d8 = F(amax / F(127))
            id8 = F(F(1) / d8)
            t = (rng.integers(-127, 127, 31) + F(0.5)).astype(F)
            x = (t / id8).astype(F)
            x = np.nextafter(x, F(np.inf) * rng.choice([-1, 1], 31)).astype(F) if rng.random() < 0.5 else x
            add(np.concatenate([[mx], np.clip(x, -amax, amax)]).astype(F))
    # magnitudes: subnormal values and scales; d subnormal; 1/d overflowing (Q4_0 below |max| ~ 2.4e-38, Q8_0
    # below amax ~ 3.7e-37); d overflowing fp16 (|d| >= 65520: Q4_0 |max| >= 524160, Q8_0 amax >= 8321040)
    scales = np.concatenate([10.0 ** np.linspace(-45, -33, 40), [2.0 ** -126, 2.0 ** -149, 2.35e-38, 2.36e-38,
                                                                  3.7e-37, 3.8e-37, 1e-30, 1e-10, 1e-5, 6e-8]])
    big = np.array([65504, 65519, 65520, 65536, 70000], np.float64)
    scales = np.concatenate([scales, big * 8, big * 127, [1e20, 1e30, 1e37, 1e38, 3.4e38, 3.4028235e38]])
    with np.errstate(all="ignore"):
        for s in scales:
            for k in range(3):
                b = (rng.uniform(-1, 1, 32) * s).astype(F)
                if k:
                    b[rng.integers(32)] = F(s) * (1 if k == 1 else -1)
                add(b)
        for s in (524032, 524160, 524288, 8319008, 8321040, 8323072):  # max exactly at the fp16 edges
            for sign in (1, -1):
                b = (rng.uniform(-1, 1, 32) * s).astype(F)
                b[rng.integers(32)] = sign * F(s)
                add(b)
    # NaN and inf mixed in (NaN never becomes max; in Q8_0 a NaN resets the running MAX)
    for special in (np.nan, -np.nan, np.inf, -np.inf):
        for pos in (0, 1, 7, 8, 16, 31):
            b = weights(0.02)
            b[pos] = special
            add(b)
        add(np.full(32, special, F))
        b = np.zeros(32, F)
        b[3] = special
        add(b)
    b = weights(0.02)
    b[2], b[3], b[20] = 100, np.nan, 0.5
    add(b)
    b = weights(0.02)
    b[4], b[5] = np.inf, -np.inf
    add(b)
    b = weights(0.02)
    b[4], b[30] = np.nan, np.inf
    add(b)
    b = weights(0.02)
    b[0], b[1] = -7.0, np.nan  # NaN right after the max
    add(b)
    b = weights(1e30)
    b[9] = np.inf
    add(b)
    for payload in (0x7FC00001, 0xFFC0007F, 0x7FFFFFFF, 0x7F800001, 0xFF810000, 0x7F810000):
        b = weights(0.02)
        b.view(np.uint32)[[3, 19]] = payload
        add(b)
    return np.stack(out)


def _random_blocks(n: int, seed: int) -> np.ndarray:
    """n x 32 float32: plausible weights (per-block |x| ~ 1e-3..1e-1), heavy tails, outliers, BF16-valued."""
    rng = np.random.default_rng(seed)
    q = n // 4
    scale = 10.0 ** rng.uniform(-3, -1, (q, 1))
    parts = [
        rng.standard_normal((q, 32)) * scale,
        rng.standard_t(3, (q, 32)) * 0.02,
        (rng.standard_normal((q, 32)) * 0.02) * np.where(rng.random((q, 32)) < 0.01, 50, 1),
    ]
    bf = (rng.standard_normal((n - 3 * q, 32)).astype(F) * F(0.05)).view(np.uint32) & np.uint32(0xFFFF0000)
    parts.append(bf.view(F))
    x = np.concatenate([np.asarray(p, F) for p in parts])
    return x[rng.permutation(len(x))]


def _ggml(x: np.ndarray, tmp: Path) -> dict[Q, np.ndarray]:
    """b11434's Q4_0 and Q8_0 bytes for the float32 blocks ``x`` (n x 32), as n x 18 / n x 34 uint8."""
    return dict(zip(QTYPES, reference.ggml_quantize(x, [(t, None) for t in QTYPES], tmp), strict=True))


def _quantize(values: np.ndarray, stype: Q, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):
        return kernels.quantize_rows(values.reshape(-1), stype, qtype)


# -- tests -------------------------------------------------------------------------------------------

@pytest.mark.reference
def test_q4_0_q8_0_match_libggml_on_adversarial_blocks(tmp_path: Path, kernel_path: str) -> None:
    """Every adversarial block from F32, F16 and BF16 storage, starting at each of the 8 batch positions
    (so every block meets the batched code at every lane, and the block counts leave every tail length)."""
    reference.require_or_skip(reference.llama_cpp_available())
    x = _adversarial_blocks()
    for stype in SOURCES:
        values, widened = stored(x, stype)
        ref = _ggml(widened, tmp_path)
        for qtype in QTYPES:
            for start in range(8 if kernel_path.startswith("compiled") else 1):
                assert_same_blocks(_quantize(values[start:], stype, qtype), ref[qtype][start:], widened[start:],
                             f"{qtype.name} from {stype.name}, from block {start}")
    REFERENCE_COMPARISONS.append(f"q4_0/q8_0 adversarial blocks [{kernel_path}]")


@pytest.mark.reference
def test_q4_0_q8_0_match_libggml_on_random_weights(tmp_path: Path, kernel_path: str) -> None:
    """~100k random blocks of plausible weights from each storage type."""
    reference.require_or_skip(reference.llama_cpp_available())
    x = _random_blocks(100_003, seed=41)
    for stype in SOURCES:
        values, widened = stored(x, stype)
        ref = _ggml(widened, tmp_path)
        for qtype in QTYPES:
            assert_same_blocks(_quantize(values, stype, qtype), ref[qtype], widened, f"{qtype.name} from {stype.name}")
    REFERENCE_COMPARISONS.append(f"q4_0/q8_0 random weights [{kernel_path}]")


@pytest.mark.reference
def test_q4_0_q8_0_match_libggml_on_every_16_bit_value(tmp_path: Path, kernel_path: str) -> None:
    """Every F16 and every BF16 bit pattern (NaN and inf included), in blocks of 32 consecutive patterns and
    shuffled: each widening, as every element and as every block maximum."""
    reference.require_or_skip(reference.llama_cpp_available())
    for stype in (Q.F16, Q.BF16):
        values, widened = every_16_bit_value(stype)
        ref = _ggml(widened.reshape(-1, 32), tmp_path)
        for qtype in QTYPES:
            assert_same_blocks(_quantize(values, stype, qtype), ref[qtype], widened,
                               f"{qtype.name} from every {stype.name}")
    REFERENCE_COMPARISONS.append(f"q4_0/q8_0 every 16-bit value [{kernel_path}]")


@pytest.mark.reference
def test_compiled_q4_0_q8_0_read_unaligned_sources(tmp_path: Path) -> None:
    """The extension reads its source at any byte offset (the buffers of a mapped file need not be aligned)."""
    reference.require_or_skip(reference.llama_cpp_available())
    for _ in use_kernels("compiled"):
        _unaligned(tmp_path)
    REFERENCE_COMPARISONS.append("q4_0/q8_0 unaligned sources [compiled]")


def _unaligned(tmp_path: Path) -> None:
    from dflash_gguf.quantize import _kernels

    x = np.concatenate([_random_blocks(203, seed=42), _adversarial_blocks()[::7]])
    for stype in SOURCES:
        values, widened = stored(x, stype)
        ref = _ggml(widened, tmp_path)
        raw = values.tobytes()
        for offset in (1, 2, 3, 5):
            buf = bytearray(offset) + bytearray(raw)
            src = memoryview(buf)[offset:]
            for qtype in QTYPES:
                dst = np.empty(len(x) * NBYTES[qtype], np.uint8)
                _kernels.quantize(src, int(stype), dst, int(qtype))
                assert_same_blocks(dst, ref[qtype], widened, f"{qtype.name} from {stype.name} at offset {offset}")
