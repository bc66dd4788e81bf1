"""The Q5_0/Q5_1/Q4_K/Q5_K kernels, bit for bit against b11434's libggml-base ``quantize_row_q5_0_ref`` /
``q5_1_ref`` / ``q4_K_ref`` / ``q5_K_ref`` (and ``ggml_quantize_chunk`` without an imatrix, llama-quantize's
entry point, which calls them), on the compiled kernels and on the numpy fallback.

The compiled Q4_K/Q5_K code has an AVX2 build of the same vector code (chosen at run time) and a portable one
(no AVX2, or a build with ``-DNO_AVX2``); these tests run whichever the build and CPU select.

Inputs: adversarial super-blocks (zeros of either sign, single nonzeros, all-equal sub-blocks, integer grids
where nearest_int meets .5 and make_qkx2_quants' trials tie, sub-blocks whose 6-bit scale or min rounds to 0 or
63, offsets far from their 6-bit min, subnormals, sums of squares that underflow or overflow, fp16 d/dmin at
overflow, max - min overflowing, NaN, inf and NaN payloads) and many random blocks of plausible weights, stored
as F32, F16 and BF16 (the reference gets the widened float32 values). Q5_0/Q5_1 take the same values as blocks
of 32, plus their own edges (|x| ties, zero signs of min/max, x*id on rounding boundaries, 1/d overflowing).

NaN payloads matter where nearest_int reads a NaN's mantissa bits. Where two NaNs meet in one commutative float
operation, x86 keeps the first operand's and the compiler picks the order: the kernels reproduce what ggml's build
does at the two places that feed nearest_int (the requantization's x + dm, the fit's iscale*(x - min)), pinned
here by payloads at every position next to an overflowing dmin, and by x[0] NaNs meeting other payloads.
"""

from __future__ import annotations

import functools
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
QK_K = 256
KTYPES = (Q.Q4_K, Q.Q5_K)
QTYPES = (Q.Q5_0, Q.Q5_1, *KTYPES)
SOURCES = (Q.F32, Q.F16, Q.BF16)
NBYTES = {Q.Q5_0: 22, Q.Q5_1: 24, Q.Q4_K: 144, Q.Q5_K: 176}
BLOCK = {Q.Q5_0: 32, Q.Q5_1: 32, Q.Q4_K: QK_K, Q.Q5_K: QK_K}
QUANTIZE = {Q.Q5_0: kernels.quantize_q5_0, Q.Q5_1: kernels.quantize_q5_1, Q.Q4_K: kernels.quantize_q4_k,
            Q.Q5_K: kernels.quantize_q5_k}


# -- inputs ------------------------------------------------------------------------------------------

def _edge_superblocks() -> np.ndarray:
    """n x 256 float32 super-blocks on the edges of quantize_row_q4_K_ref / q5_K_ref (and, as blocks of 32, of
    q5_0_ref / q5_1_ref)."""
    rng = np.random.default_rng(7)
    out: list[np.ndarray] = []

    def add(b: object) -> None:
        out.append(np.asarray(b, F).reshape(QK_K))

    def normal(scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(QK_K) * scale).astype(F)

    add(np.zeros(QK_K))
    add(-np.zeros(QK_K, F))
    b = np.zeros(QK_K, F)
    b[1::2] = -0.0
    add(b)
    for pos in (0, 1, 31, 32, 100, 255):  # a single nonzero among zeros (every other sub-block: max == min)
        for v in (1.0, -1.0, 3e-3, -7e-5, 1e-45, 65504.0, -1e30):
            b = np.zeros(QK_K, F) if v > 0 else -np.zeros(QK_K, F)
            b[pos] = v
            add(b)
    for v in (1.0, -1.0, 0.02, -0.02, 5.0, -1e-3, 1e-40):  # all-equal: a positive constant is still fitted (min
        add(np.full(QK_K, v))  # is clamped to 0), a negative one is max == min (L 0, scale 0, the_min = -x)
    add(np.repeat(np.array([3, -3, 0.5, -0.5, 0, -0.0, 1e-20, -7], F), 32))  # one constant per sub-block
    add(np.repeat(np.array([1, 2, 4, 8, 16, 32, 64, 128], F), 32) * normal(1))
    # integer and half-integer grids: nearest_int on .5 and trials with equal errors (the first one must win)
    for lo, hi in ((-8, 8), (0, 16), (0, 32), (-16, 16), (-1, 2), (0, 2), (-40, 40)):
        add(rng.integers(lo, hi, QK_K))
        add(np.tile(np.arange(lo, hi, dtype=F), QK_K // (hi - lo) + 1)[:QK_K])
        add(rng.integers(lo, hi, QK_K) / F(2))
    add(np.tile(np.arange(32, dtype=F), 8))
    add(np.tile(np.arange(16, dtype=F), 16))
    add(np.tile(np.arange(16, dtype=F), 16) - F(15))
    add(np.tile([0, 0, 0, 1], 64))
    add(np.tile([0, 1], 128))
    add(np.tile([-1, 1], 128))
    # positive data (min clamped to 0; the fitted min comes out > 0 and is clamped, scale = sum_xl/sum_l2),
    # negative data, offsets
    add(np.abs(normal()))
    add(np.abs(normal()) + F(0.05))
    add(-np.abs(normal()))
    add(normal() + F(1))
    add(normal() - F(1))
    # offsets far from their scale: the 6-bit min is then far from each sub-block's own min, and
    # (x + dmin*m)/(d*sc) is far outside [0, nmax] (nearest_int's bits beyond 2^22)
    for off, noise in ((-100, 1e-6), (-100, 1e-3), (-1, 1e-7), (-1e4, 1), (50, 1e-5), (-3e4, 1e-8)):
        b = (rng.standard_normal(QK_K) * noise + off).astype(F)
        add(b)
        b[:32] = (rng.standard_normal(32) * noise * 1e3 - off * 0.01).astype(F)
        add(b)
    # sub-blocks of very different sizes: 6-bit scales/mins rounding to 0, 1 or 63; d*sc == 0 keeps the fit's L
    add(normal(1) * np.repeat(F(10.0) ** np.arange(-7, 1, dtype=F), 32))
    add(normal(1) * np.repeat(F(2.0) ** -np.arange(8, dtype=F), 32))
    for ratio in (0.5 / 63, 0.51 / 63, 1.5 / 63, 62.5 / 63, 62.49 / 63, 1.0):  # a sub-block scale at k + 1/2 of 63
        b = normal()
        b[32:64] = np.linspace(0, 15, 32, dtype=F) * F(ratio)
        b[0:32] = np.linspace(0, 15, 32, dtype=F)
        add(b)
        b = normal()
        b[64:96] -= F(ratio)  # a min at the same fraction of the largest
        b[0:32] -= F(1)
        add(b)
    s = normal(1)[:32]
    add(np.concatenate([s, -s] * 4))
    # magnitudes: subnormal; x*x underflowing (av_x 0); fp16 d/dmin subnormal or 0; fp16 d/dmin overflowing
    # (max_scale or max_min above ~4.1e6); x*x overflowing (av_x inf); max - min overflowing
    for scale in (1e-45, 1e-42, 1e-39, 2.0 ** -126, 1e-30, 1e-22, 1e-19, 1e-12, 1e-8, 1e-7, 3e-6, 1e-5, 1e-4, 1e-3,
                  1, 100, 65504, 1e5, 4e6, 5e7, 1e8, 1e10, 1e19, 1e20, 1e30, 1e37, 1e38, 3e38):
        for k in range(3):
            with np.errstate(over="ignore"):
                b = (rng.standard_normal(QK_K) * scale).astype(F)
                if k == 1:
                    b[rng.integers(QK_K)] = F(min(scale * 8, 3.4e38))
            if k == 2:
                b[:128] *= F(1e-3)
            add(b)
    add(np.array([3.4e38, -3.4e38] * 128, F))  # max - min = inf
    b = normal()
    b[5], b[6] = F(3.4028235e38), F(-3.4028235e38)
    add(b)
    b = normal()
    b[1] = F(1e-45)
    add(b)
    # NaN and inf: a NaN x[0] is a sub-block's min and max; later NaNs never count but make the weights NaN
    for special in (np.nan, -np.nan, np.inf, -np.inf):
        for pos in (0, 1, 5, 31, 32, 130, 255):
            b = normal()
            b[pos] = special
            add(b)
        add(np.full(QK_K, special))
        b = np.zeros(QK_K, F)
        b[3] = special
        add(b)
        b = normal()
        b[::32] = special  # x[0] of every sub-block
        add(b)
    b = normal()
    b[4], b[5] = np.inf, -np.inf
    add(b)
    b = normal()
    b[4], b[40] = np.inf, np.nan
    add(b)
    b = normal()
    b[0], b[1] = np.nan, np.inf
    add(b)
    b = normal()
    b[:32] = -1e7  # dmin's fp16 overflows, and a NaN elsewhere: x + inf*0 in the requantization
    b[100] = np.nan
    add(b)
    # NaN payloads reach the output through nearest_int's mantissa bits: one payload per block
    for payload in (0x7FC00001, 0xFFC0007F, 0x7FFFFFFF, 0x7F800001, 0x7FC0000F, 0xFFC00040):
        for positions in ((7, 100), (0, 32), (0,), (31, 63, 95, 127, 159, 191, 223, 255)):
            b = normal()
            b.view(np.uint32)[list(positions)] = payload
            add(b)
            b[65] = -np.inf  # fp16 d and dmin inf: the requantization's x + dm meets inf*0 (ggml keeps dm's NaN)
            add(b)
        b = np.zeros(QK_K, F)
        b.view(np.uint32)[[3, 40]] = payload
        add(b)
    # two payloads: a NaN x[0] (scale NaN, 6-bit scale its payload's low byte: 0 here, so d*sc = 0 keeps the fit's
    # L) and another NaN in the sub-block: ggml's iscale*(x - min) keeps the NaN of x - min
    for p0, q in ((0x7FC00100, 0x7FC00003), (0x7FC00200, 0xFFC00007), (0xFFC00300, 0x7FC00009),
                  (0x7FC00101, 0x7FC0000B)):
        for pos in (1, 5, 27, 28, 31):
            b = normal()
            b.view(np.uint32)[[0, pos]] = p0, q
            add(b)
    # ... and at every position next to an overflowing fp16 dmin: ggml's x + dm keeps x's NaN for elements 0..27
    # of a sub-block, dm's (inf*0) for 28..31
    base = normal()
    base[65] = -np.inf
    for pos in range(QK_K):
        if pos != 65:
            b = base.copy()
            b.view(np.uint32)[pos] = 0x7FC00005 if pos % 2 else 0xFFC0003F
            add(b)
    return np.stack(out)


def _edge_blocks32() -> np.ndarray:
    """n x 32 float32 blocks on the edges of quantize_row_q5_0_ref / q5_1_ref (besides the super-blocks above)."""
    rng = np.random.default_rng(17)
    out: list[np.ndarray] = []

    def add(b: object) -> None:
        out.append(np.asarray(b, F).reshape(32))

    def weights(scale: float) -> np.ndarray:
        return (rng.standard_normal(32) * scale).astype(F)

    nz = -np.zeros(32, F)
    for first, rest in ((0.0, -0.0), (-0.0, 0.0)):  # Q5_1: of equal zeros the first one is min / max
        b = np.full(32, rest, F)
        b[0] = first
        add(b)
        for k in (3, 31):
            b = np.abs(weights(1)) + F(0.1)
            b[k], b[k + 1 if k < 31 else 0] = first, rest
            add(b)
            add(-b)
    for pos in (0, 1, 15, 16, 31):
        for v in (1.0, -1.0, 1e-45, -3e-3, 3.4e38):
            b = nz.copy()
            b[pos] = v
            add(b)
    # Q5_0: ties of |x|, the first one is max
    for i, j in ((0, 1), (0, 31), (1, 0), (15, 16), (16, 17), (30, 31), (31, 0)):
        for a in (3.0, 0.046875, 2.0 ** -10, 6.0e4, 2.0 ** -130):
            for si, sj in ((-1, 1), (1, -1)):
                b = np.clip(weights(a / 4), -a * 0.75, a * 0.75).astype(F)
                b[i], b[j] = si * a, sj * a
                add(b)
    # x*id + 16.5 (Q5_0) and (x - min)*id + 0.5 (Q5_1) on integers, exactly and one or two ulps either side
    q5_0 = np.arange(-16, 16, dtype=F) + F(0.5)
    q5_0[0] = -16
    q5_1 = np.arange(32, dtype=F) - F(0.5)
    q5_1[0], q5_1[31] = 0, 31
    for k in (-120, -40, -3, 0, 4, 30, 100):
        for base in (q5_0, -q5_0, q5_1, -q5_1):
            b = (base * F(2.0 ** k)).astype(F)
            add(b)
            for direction in (np.inf, -np.inf):
                p = np.nextafter(b, F(direction)).astype(F)
                p[0], p[-1] = b[0], b[-1]
                add(p)
    # magnitudes: d subnormal; 1/d overflowing; d overflowing fp16 (Q5_0 |max| >= 16*65520, Q5_1 range >=
    # 31*65520); max - min overflowing; min overflowing fp16
    scales = [1e-45, 1e-43, 2.0 ** -130, 2.0 ** -126, 1e-37, 2.3e-37, 5e-37, 1e-30, 1e-5, 1, 1048320, 1048321, 2031120,
              2031200, 1e7, 1e20, 1e38, 3.4e38]
    with np.errstate(all="ignore"):
        for s in scales:
            for k in range(3):
                b = (rng.uniform(-1, 1, 32) * s).astype(F)
                if k:
                    b[rng.integers(32)] = F(s) * (1 if k == 1 else -1)
                add(b)
                add(np.abs(b) + F(s) * 4)  # an offset: Q5_1's min far from 0
    for special in (np.nan, np.inf, -np.inf):
        for pos in (0, 16, 31):
            b = weights(0.02)
            b[pos] = special
            add(b)
        add(np.full(32, special, F))  # Q5_1: all NaN leaves min = FLT_MAX, max = -FLT_MAX
    b = np.full(32, np.nan, F)
    b[9] = 0.25
    add(b)
    b = weights(0.02)
    b[4], b[5] = np.inf, -np.inf
    add(b)
    for payload in (0x7FC00001, 0xFFC0007F, 0x7F800001):
        b = weights(0.02)
        b.view(np.uint32)[[3, 19]] = payload
        add(b)
    return np.stack(out)


def _random_superblocks(n: int, seed: int) -> np.ndarray:
    """n x 256 float32 of several weight-like distributions (per-super-block scales ~1e-3..1e-1), shuffled."""
    rng = np.random.default_rng(seed)
    k = n // 8
    parts = [
        rng.standard_normal((k, QK_K)) * 10.0 ** rng.uniform(-3, -1, (k, 1)),
        rng.standard_t(3, (k, QK_K)) * 0.02,
        rng.standard_normal((k, QK_K)) * 0.02 * np.where(rng.random((k, QK_K)) < 0.01, 50, 1),  # outliers
        rng.standard_normal((k, QK_K)) * np.exp(rng.standard_normal((k, 1)) * 3) * 0.01,
        rng.standard_normal((k, QK_K)) * 0.02 * (rng.random((k, QK_K)) < 0.1),  # sparse
        rng.standard_normal((k, QK_K)) * 0.01 + rng.standard_normal((k, 1)) * 0.05,  # offset rows
        rng.integers(-6, 7, (k, QK_K)) * 0.01,  # few levels: ties in the fit
    ]
    bf = (rng.standard_normal((n - 7 * k, QK_K)).astype(F) * F(0.03)).view(np.uint32) & np.uint32(0xFFFF0000)
    parts.append(bf.view(F))
    x = np.concatenate([np.asarray(p, F) for p in parts])
    return x[rng.permutation(len(x))]


@functools.cache
def _cases(name: str) -> dict[Q, tuple[np.ndarray, np.ndarray, dict[Q, np.ndarray]]]:
    """Per source type: (stored values, widened float32, {type: ggml's blocks}) of an input set, computed once per
    session (both kernel paths compare with the same reference bytes)."""
    import tempfile

    if name == "edges":
        x, types = _edge_superblocks(), QTYPES
    elif name == "edges32":
        x, types = _edge_blocks32(), (Q.Q5_0, Q.Q5_1)
    else:
        x, types = _random_superblocks(12_000, seed=31), QTYPES
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stype in SOURCES:
            values, widened = stored(x.reshape(-1), stype)
            out[stype] = (values, widened, _ggml(widened, types, Path(tmp)))
    return out


def _ggml(x: np.ndarray, types: tuple[Q, ...], tmp: Path) -> dict[Q, np.ndarray]:
    """b11434's bytes for the float32 values ``x`` through quantize_row_<type>_ref; for the K types also through
    ggml_quantize_chunk without an imatrix (rows of 1024 values, as llama-quantize calls it): both must agree."""
    jobs = [(t, None) for t in types] + [(t, 1024) for t in types if t in KTYPES and x.size % 1024 == 0]
    res = reference.ggml_quantize(x, jobs, tmp)
    by_ref = dict(zip(types, res[:len(types)], strict=True))
    for (t, _), chunk in zip(jobs[len(types):], res[len(types):], strict=True):
        assert np.array_equal(chunk, by_ref[t]), f"ggml_quantize_chunk({t.name}) differs from quantize_row_{t.name}_ref"
    return by_ref


def _quantize(values: np.ndarray, stype: Q, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):
        return QUANTIZE[qtype](values, stype)


def _compare(name: str, kernel_path: str) -> None:
    for stype, (values, widened, ref) in _cases(name).items():
        for qtype, blocks in ref.items():
            assert_same_blocks(_quantize(values, stype, qtype), blocks, widened, f"{qtype.name} from {stype.name}")


# -- tests -------------------------------------------------------------------------------------------

@pytest.mark.reference
def test_kquants_match_libggml_on_adversarial_blocks(kernel_path: str) -> None:
    """Every adversarial super-block (as Q4_K/Q5_K, and as 8 blocks of Q5_0/Q5_1) from F32, F16 and BF16."""
    reference.require_or_skip(reference.llama_cpp_available())
    _compare("edges", kernel_path)
    REFERENCE_COMPARISONS.append(f"q5_0/q5_1/q4_k/q5_k adversarial super-blocks [{kernel_path}]")


@pytest.mark.reference
def test_q5_0_q5_1_match_libggml_on_adversarial_blocks(kernel_path: str) -> None:
    """Q5_0/Q5_1's own edges (|x| ties, zero signs, rounding boundaries, d at fp16 overflow, 1/d overflowing)."""
    reference.require_or_skip(reference.llama_cpp_available())
    _compare("edges32", kernel_path)
    REFERENCE_COMPARISONS.append(f"q5_0/q5_1 adversarial blocks [{kernel_path}]")


@pytest.mark.reference
def test_kquants_match_libggml_on_random_weights(kernel_path: str) -> None:
    """12,000 random weight-like super-blocks (96,000 Q5_0/Q5_1 blocks) from each storage type."""
    reference.require_or_skip(reference.llama_cpp_available())
    _compare("random", kernel_path)
    REFERENCE_COMPARISONS.append(f"q5_0/q5_1/q4_k/q5_k random weights [{kernel_path}]")


@pytest.mark.reference
def test_kquants_match_libggml_on_every_16_bit_value(tmp_path: Path, kernel_path: str) -> None:
    """Every F16 and every BF16 bit pattern (NaN payloads and inf included), in blocks of consecutive patterns and
    shuffled: each widening as an element, a sub-block extreme and a super-block scale."""
    reference.require_or_skip(reference.llama_cpp_available())
    for stype in (Q.F16, Q.BF16):
        values, widened = every_16_bit_value(stype)
        ref = _ggml(widened, QTYPES, tmp_path)
        for qtype in QTYPES:
            assert_same_blocks(_quantize(values, stype, qtype), ref[qtype], widened,
                               f"{qtype.name} from every {stype.name}")
    REFERENCE_COMPARISONS.append(f"q5_0/q5_1/q4_k/q5_k every 16-bit value [{kernel_path}]")


@pytest.mark.reference
def test_compiled_kquants_read_unaligned_sources(tmp_path: Path) -> None:
    """The extension reads its source at any byte offset (the buffers of a mapped file need not be aligned)."""
    reference.require_or_skip(reference.llama_cpp_available())
    for _ in use_kernels("compiled"):
        _unaligned(tmp_path)
    REFERENCE_COMPARISONS.append("q5_0/q5_1/q4_k/q5_k unaligned sources [compiled]")


def _unaligned(tmp_path: Path) -> None:
    from dflash_gguf.quantize import _kernels

    x = np.concatenate([_random_superblocks(40, seed=5), _edge_superblocks()[::9]])
    for stype in SOURCES:
        values, widened = stored(x.reshape(-1), stype)
        ref = _ggml(widened, QTYPES, tmp_path)
        raw = values.tobytes()
        for offset in (1, 2, 3):
            src = memoryview(bytearray(offset) + bytearray(raw))[offset:]
            for qtype in QTYPES:
                dst = np.empty(x.size // BLOCK[qtype] * NBYTES[qtype], np.uint8)
                _kernels.quantize(src, int(stype), dst, int(qtype))
                assert_same_blocks(dst, ref[qtype], widened, f"{qtype.name} from {stype.name} at offset {offset}")


# -- without the reference ---------------------------------------------------------------------------------

def test_compiled_kquants_equal_numpy_kquants() -> None:
    """Both paths on the same mixed input (weights, edge cases, NaN/inf with random payloads, huge values, random
    bit patterns): identical bytes."""
    rng = np.random.default_rng(12)
    edges = _edge_superblocks()
    x = (rng.standard_normal((len(edges) + 600, QK_K)) * 0.02).astype(F)
    x[:len(edges)] = edges
    x[-100:-80] *= F(1e9)
    x[-50:] = rng.integers(0, 1 << 32, (50, QK_K), dtype=np.uint64).astype(np.uint32).view(F)
    u = x.view(np.uint32).reshape(-1)
    at = rng.integers(0, u.size, 3000)
    u[at] = rng.integers(0, 2, at.size, dtype=np.uint32) << np.uint32(31) | np.uint32(0x7F800000) | \
        rng.integers(0, 1 << 23, at.size, dtype=np.uint32)  # NaN (any payload) or inf
    for stype in SOURCES:
        values, _ = stored(x.reshape(-1), stype)
        for qtype in QTYPES:
            got = {}
            for path in kernels.KERNEL_PATHS:
                for _ in use_kernels(path):  # skips (fails on CI) without the extension
                    got[path] = _quantize(values, stype, qtype)
            assert np.array_equal(got["compiled"], got["numpy"]), (qtype.name, stype.name)


def test_kquant_groups_shapes_and_entry_points(kernel_path: str) -> None:
    """Group boundaries change nothing (numpy works in groups), quantize_rows routes the new types, F16/BF16 storage
    equals its exact widening, and wrong sizes or dtypes are refused; the built-in quantizer makes and checks them."""
    rng = np.random.default_rng(4)
    n = 2 * kernels.K_GROUP + 3
    x = (rng.standard_normal((n, QK_K)) * 0.02).astype(F)
    x[5] = 0
    x[kernels.K_GROUP] = _edge_superblocks()[40]
    for qtype in QTYPES:
        nb, per = NBYTES[qtype], QK_K // BLOCK[qtype]
        whole = _quantize(x.reshape(-1), Q.F32, qtype).reshape(n, per * nb)
        for i in (0, 5, kernels.K_GROUP - 1, kernels.K_GROUP, n - 1):
            assert np.array_equal(_quantize(x[i], Q.F32, qtype).reshape(-1), whole[i]), (qtype.name, i)
        assert np.array_equal(kernels.quantize_rows(x, Q.F32, qtype), whole.reshape(-1))
        x16 = x.astype(np.float16)
        assert np.array_equal(kernels.quantize_rows(x16, Q.F16, qtype), _quantize(x16.astype(F), Q.F32, qtype))
        bf = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        widened = (bf.astype(np.uint32) << np.uint32(16)).view(F)
        assert np.array_equal(kernels.quantize_rows(bf, Q.BF16, qtype), _quantize(widened, Q.F32, qtype))
        with pytest.raises(ValueError):
            QUANTIZE[qtype](np.zeros(BLOCK[qtype] // 2, F))
        with pytest.raises(ValueError):
            QUANTIZE[qtype](np.zeros(BLOCK[qtype], np.float64))
        with pytest.raises(ValueError):
            QUANTIZE[qtype](np.zeros(BLOCK[qtype], F), Q.F16)
    assert set(QTYPES) <= set(kernels.QUANT_TYPES) & set(kernels.CHECKED_TYPES)


def test_nonfinite_scales_are_found_where_ggml_validates_them(kernel_path: str) -> None:
    """ggml_validate_row_data checks d, and dmin (Q4_K, Q5_K) or m (Q5_1): an infinite one in any of them is
    counted, by both kernel paths; finite blocks count nothing."""
    x = (np.random.default_rng(9).standard_normal(4 * QK_K) * 0.02).astype(F)
    for qtype in QTYPES:
        data = np.array(_quantize(x, Q.F32, qtype)).reshape(-1).copy()
        assert kernels.count_nonfinite(data, qtype) == 0
        second = (2,) if qtype in (Q.Q5_1, Q.Q4_K, Q.Q5_K) else ()
        for at in (0, *second):
            bad = data.copy()
            bad[NBYTES[qtype] + at:NBYTES[qtype] + at + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
            assert kernels.count_nonfinite(bad, qtype) == 1, (qtype.name, at)


def test_kquants_dequantize_close_to_input(kernel_path: str) -> None:
    """gguf-py's dequantizers read the layouts back: relative RMS error of Gaussian weights near the types' usual
    figures, and zero blocks stay zero."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((64, QK_K)) * 0.02).astype(F)
    x[3] = 0
    from gguf import quants

    for qtype, limit in ((Q.Q5_0, 0.05), (Q.Q5_1, 0.05), (Q.Q4_K, 0.1), (Q.Q5_K, 0.05)):
        q = _quantize(x.reshape(-1), Q.F32, qtype).reshape(-1, NBYTES[qtype])
        y = quants.dequantize(q, qtype).reshape(64, QK_K)
        assert np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2)) < limit, qtype.name
        assert np.all(y[3] == 0), qtype.name
