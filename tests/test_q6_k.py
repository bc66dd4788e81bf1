"""The Q6_K kernels (compiled and numpy: every test runs on both) against ggml b11434's quantize_row_q6_K_ref.

Reference comparisons (``@pytest.mark.reference``; skip locally without the b11434 build, fail on CI):

* libggml-base.so of the b11434 build through ctypes, in a child process (a GGML_ASSERT cannot take
  pytest down): both ``quantize_row_q6_K_ref`` and ``ggml_quantize_chunk(GGML_TYPE_Q6_K, ..., imatrix=NULL)``
  (llama-quantize's entry point, which calls the former without an imatrix) on edge cases, non-finite
  input included, and ~60k random super-blocks of several distributions;
* ``llama-quantize in.gguf out.gguf Q6_K`` end to end on a tiny model with F32/F16 matrices.

Without the build, a scalar transcription of the C code in this file checks a smaller set (a port written
next to the kernel is no proof on its own, hence the reference tests).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import reference
from conftest import KERNEL_VARIANTS, REFERENCE_COMPARISONS, use_kernels
from gguf import GGMLQuantizationType, GGUFReader, quants
from kernel_parity import assert_same_blocks, stored

from dflash_gguf.quantize import kernels
from dflash_gguf.quantize.kernels import Q6_K_BYTES, Q6_K_GROUP, QK_K, quantize_q6_k, quantize_rows

Q = GGMLQuantizationType
F = np.float32


@pytest.fixture(autouse=True, params=KERNEL_VARIANTS)
def kernel_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test on the compiled kernels (every instruction set) and on the numpy fallback."""
    yield from use_kernels(request.param)


def _variant() -> str:
    """The active kernels as the reference labels name them: the path, and the compiled kernels' instruction set."""
    return f"compiled-{kernels.simd()}" if kernels.kernel_path() == "compiled" else kernels.kernel_path()


# -- inputs ------------------------------------------------------------------------------------------

def _edge_blocks(with_nonfinite: bool = True) -> np.ndarray:
    """Super-blocks (n x 256 float32) on the edges of quantize_row_q6_K_ref's code paths."""
    rng = np.random.default_rng(11)
    blocks: list[np.ndarray] = []

    def add(b: object) -> None:
        blocks.append(np.asarray(b, F).reshape(QK_K))

    def normal() -> np.ndarray:
        return rng.standard_normal(QK_K).astype(F)

    add(np.zeros(QK_K))
    add(-np.zeros(QK_K, F))  # all -0.0
    for pos, val in ((17, 50), (200, -50), (0, -1e4), (255, 1e4)):  # one large outlier, either sign
        b = normal()
        b[pos] = val
        add(b)
    for first, second in ((-7, 7), (7, -7), (7, 7)):  # |max| ties in a sub-block: the earlier one is max
        b = normal()
        b[3], b[9] = first, second
        add(b)
    add(-np.abs(normal()))  # negative maxima everywhere
    add(np.abs(normal()))
    add(np.arange(QK_K) - 128)  # integer grids: many exact .5 cases in nearest_int
    add((np.arange(QK_K) - 128) * F(0.25))
    add(np.ones(QK_K))
    add(-np.ones(QK_K))
    add(np.tile(np.arange(-32, 32, dtype=F) / 32, 4))
    add(np.tile(np.arange(16, dtype=F), 16))
    # magnitudes: subnormal, below/at GROUP_MAX_EPS (1e-15), fp16 d underflowing to 0 (values < ~1e-4),
    # fp16 d overflowing to inf (> ~2.7e8), x*x*x overflowing (> ~7e12), up to FLT_MAX
    for scale in (1e-45, 1e-40, 1e-38, 2.0 ** -126, 1e-30, 1e-20, 1e-16, 1e-15, 2e-15, 1e-14, 1e-10, 1e-7, 1e-6,
                  3e-6, 1e-5, 1e-4, 1e-3, 0.02, 1, 1e3, 65504, 1e6, 1e8, 3e8, 1e9, 1e10, 1e12, 1e13, 1e15, 1e19,
                  1e20, 1e30, 1e38, 3e38):
        if not with_nonfinite and scale > 1e8:
            continue
        for k in range(3):
            with np.errstate(over="ignore"):
                b = (rng.standard_normal(QK_K) * scale).astype(F)
                if k == 1:
                    b[rng.integers(QK_K)] = F(min(scale * 8, 3.4e38))
            if k == 2:
                b[:128] *= F(1e-3)
            add(b)
    b = normal()
    b[1] = F(1e-45)  # a subnormal inside normal data
    add(b)
    add(normal() * np.repeat(F(10.0) ** np.arange(-8, 8, dtype=F), 16))  # sub-blocks of very different sizes
    b = normal()
    b[:16] = 0  # an all-zero sub-block (L stays 0) in a live super-block
    b[32:48] = 1e-20
    add(b)
    s = rng.standard_normal(16).astype(F)
    add(np.concatenate([s, -s] * 8))  # equal |scale| across sub-blocks: the first one is max_scale
    add(np.concatenate([-s, s] * 8))
    if with_nonfinite:
        for special in (np.nan, np.inf, -np.inf):
            for pos in (0, 5, 255):
                b = normal()
                b[pos] = special
                add(b)
            add(np.full(QK_K, special))
        b = np.zeros(QK_K, F)
        b[4] = np.nan  # NaN never becomes max: this sub-block counts as all zero
        add(b)
        b = normal()
        b[4], b[5] = np.inf, -np.inf
        add(b)
        b = normal()
        b[4], b[40] = np.inf, np.nan
        add(b)
        b = normal()
        b[::16] = -np.nan
        add(b)
        # NaN payloads reach the output through nearest_int's mantissa bits (one NaN per sub-block; with
        # two different payloads x86 keeps the first operand's, which depends on the compiler's operand order)
        for payload in (0x7FC00001, 0xFFC0007F, 0x7FFFFFFF, 0x7F800001):
            b = normal()
            b.view(np.uint32)[[7, 100]] = payload
            add(b)
        b = np.zeros(QK_K, F)
        b.view(np.uint32)[3] = 0x7FC00005
        add(b)
    return np.stack(blocks)


def _random_blocks(n: int, seed: int) -> dict[str, np.ndarray]:
    """n x 256 float32 per distribution: weights-like, BF16-valued, integers, heavy tails, mixed scales."""
    rng = np.random.default_rng(seed)
    bf16 = (rng.standard_normal((n, QK_K)).astype(F) * F(0.05)).view(np.uint32) & np.uint32(0xFFFF0000)
    out = {
        "normal": rng.standard_normal((n, QK_K)) * 0.02,
        "bf16": bf16.view(F),
        "int": rng.integers(-40, 40, (n, QK_K)),
        "halfint": rng.integers(-80, 80, (n, QK_K)) / 2,
        "student-t": rng.standard_t(2, (n, QK_K)),
        "lognormal-scale": rng.standard_normal((n, QK_K)) * np.exp(rng.standard_normal((n, 1)) * 6),
        "powers-of-two": np.sign(rng.standard_normal((n, QK_K))) * 2.0 ** rng.integers(-8, 4, (n, QK_K)),
        "sparse": rng.standard_normal((n, QK_K)) * (rng.random((n, QK_K)) < 0.05),
    }
    return {k: np.asarray(v, F) for k, v in out.items()}


def _ggml_q6_k(x: np.ndarray, tmp: Path, blocks_per_row: int = 1) -> np.ndarray:
    """The b11434 libggml-base's Q6_K bytes for ``x`` (n x 256 float32), as (n x 210) uint8.

    Both entry points must agree: ggml_quantize_chunk (rows of ``blocks_per_row`` super-blocks, no
    imatrix: what llama-quantize calls) and quantize_row_q6_K_ref.
    """
    x = np.ascontiguousarray(x, F).reshape(-1, QK_K)
    assert len(x) % blocks_per_row == 0
    via_ref, via_chunk = reference.ggml_quantize(x, [(Q.Q6_K, None), (Q.Q6_K, QK_K * blocks_per_row)], tmp)
    assert np.array_equal(via_ref, via_chunk), "ggml_quantize_chunk(Q6_K) differs from quantize_row_q6_K_ref"
    return via_ref


@pytest.mark.reference
def test_q6_k_matches_libggml_on_edge_cases(tmp_path: Path) -> None:
    """Zeros, -0.0, outliers, negative maxima, ties, subnormals, tiny/huge scales, NaN/inf (and payloads)."""
    reference.require_or_skip(reference.llama_cpp_available())
    x = _edge_blocks()
    with np.errstate(all="ignore"):
        ours = quantize_q6_k(x.reshape(-1))
    assert_same_blocks(ours, _ggml_q6_k(x, tmp_path), x, "edge cases")
    REFERENCE_COMPARISONS.append(f"q6_k/ggml edge cases [{_variant()}]")


@pytest.mark.reference
def test_q6_k_matches_libggml_on_random_rows(tmp_path: Path) -> None:
    """~60k random super-blocks in rows of 4 (spanning kernel groups), from F32 and from F16/BF16 storage."""
    reference.require_or_skip(reference.llama_cpp_available())
    for name, x in _random_blocks(7500, seed=5).items():
        ref = _ggml_q6_k(x, tmp_path, blocks_per_row=4)
        assert_same_blocks(quantize_rows(x.reshape(-1), Q.F32, Q.Q6_K), ref, x, name)
    x = _random_blocks(3000, seed=6)["normal"]
    for stype in (Q.F16, Q.BF16):
        values, widened = stored(x, stype)
        assert_same_blocks(quantize_rows(values.reshape(-1), stype, Q.Q6_K), _ggml_q6_k(widened, tmp_path), x,
                           stype.name)
    REFERENCE_COMPARISONS.append(f"q6_k/ggml random [{_variant()}]")


def _write_model(path: Path, n_embd: int, rng: np.random.Generator, **matrices: np.ndarray) -> Path:
    """A one-layer tiny llama GGUF (F16 matrices, F16 token_embd) with ``matrices`` replacing some of them."""
    tensors = reference._tiny_tensors(1, n_embd, rng)
    n_vocab = len(reference._tiny_vocab()[0])
    tensors["token_embd.weight"] = (rng.standard_normal((n_vocab, n_embd)) * 0.02).astype(np.float16)
    tensors.update({f"blk.0.{name}.weight": m for name, m in matrices.items()})
    return reference._write_tiny(path, "llama", reference._tiny_hparams(1, n_embd), tensors, drop_tensors=(),
                                 extra_tensors=(), drop_keys=())


@pytest.mark.reference
def test_q6_k_matches_llama_quantize(tmp_path: Path) -> None:
    """`llama-quantize in.gguf out.gguf Q6_K` on a tiny model: every Q6_K tensor equals the kernel's bytes.

    Also pins the one input ggml quantizes but llama-quantize refuses: a block whose fp16 ``d`` overflows
    (|x| above ~2.7e8) fails its row validation, "quantized data validation failed"; the kernel returns
    that block with d = inf like quantize_row_q6_K_ref, so a caller must refuse it the same way.
    """
    reference.require_or_skip(reference.llama_cpp_available())
    n_embd = 256
    rng = np.random.default_rng(21)
    q = (rng.standard_normal((n_embd, n_embd)) * 0.02).astype(F)  # [out, in]: one super-block per row
    edge = _edge_blocks(with_nonfinite=False)
    edge = edge[np.abs(edge).max(axis=1) <= 1e8]  # fp16 d stays finite
    q[:len(edge)] = edge
    src = _write_model(tmp_path / "in.gguf", n_embd, rng, attn_q=q,
                       attn_k=(rng.standard_normal((n_embd, n_embd)) * 1e-5).astype(F),  # fp16 d -> 0
                       ffn_up=rng.standard_t(3, (2 * n_embd, n_embd)).astype(F))
    out = tmp_path / "q6_k.gguf"
    proc = reference.run_llama_quantize(src, out, "Q6_K")
    assert proc.returncode == 0, proc.stderr[-3000:]
    inputs = {t.name: (Q(t.tensor_type), np.asarray(t.data)) for t in GGUFReader(src).tensors}
    compared = []
    for t in GGUFReader(out).tensors:
        if Q(t.tensor_type) != Q.Q6_K:
            continue
        stype, values = inputs[t.name]
        expected = quantize_rows(np.ascontiguousarray(values).reshape(-1), stype, Q.Q6_K)
        assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), expected), t.name
        compared.append(f"{t.name}:{stype.name}")
    for name in ("blk.0.attn_q.weight:F32", "blk.0.attn_k.weight:F32", "blk.0.ffn_up.weight:F32",
                 "blk.0.ffn_down.weight:F16", "token_embd.weight:F16"):
        assert name in compared, (name, compared)
    REFERENCE_COMPARISONS.append(f"q6_k/llama-quantize {len(compared)} tensors [{_variant()}]")

    q[7, 3] = 1e9
    bad = _write_model(tmp_path / "bad.gguf", n_embd, rng, attn_q=q)
    proc = reference.run_llama_quantize(bad, tmp_path / "bad-q6_k.gguf", "Q6_K")
    assert proc.returncode != 0 and "quantized data validation failed" in proc.stdout + proc.stderr
    d = quantize_q6_k(q[7]).reshape(Q6_K_BYTES)[208:].view(np.float16)
    assert np.isinf(d).all()


# -- without the reference ---------------------------------------------------------------------------------

def _nearest_int(v: np.float32) -> int:
    (bits,) = struct.unpack("<i", np.float32(v + F(12582912)).tobytes())
    return (bits & 0x7FFFFF) - 0x400000


def _scalar_make_qx_quants(x: np.ndarray) -> tuple[np.float32, list[int]]:
    """make_qx_quants(16, 32, x, L, rmse_type=1, NULL), one float32 operation at a time."""
    nmax = 32
    amax, mx = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F(1e-15):
        return F(0), [0] * 16

    def fit(iscale: np.float32) -> tuple[np.float32, np.float32, list[int]]:
        sumlx, suml2, lv = F(0), F(0), []
        for v in x:
            q = max(-nmax, min(nmax - 1, _nearest_int(iscale * v)))
            lv.append(q + nmax)
            w = v * v
            sumlx = sumlx + w * v * F(q)
            suml2 = suml2 + w * F(q) * F(q)
        return sumlx, suml2, lv

    sumlx, suml2, levels = fit(F(-nmax) / mx)
    scale = sumlx / suml2 if suml2 else F(0)
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        sumlx, suml2, lv = fit(-(F(nmax) + F(0.1) * F(i)) / mx)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            levels, scale = lv, sumlx / suml2
            best = scale * sumlx
    return scale, levels


def _scalar_q6_k(x: np.ndarray) -> bytes:
    """quantize_row_q6_K_ref transcribed scalar by scalar (for the tests without the reference)."""
    out = bytearray()
    for blk in x.reshape(-1, QK_K):
        levels: list[int] = []
        scales = []
        for ib in range(16):
            s, lv = _scalar_make_qx_quants(blk[16 * ib:16 * ib + 16])
            scales.append(s)
            levels += lv
        max_abs, max_scale = F(0), F(0)
        for s in scales:
            if abs(s) > max_abs:
                max_abs, max_scale = abs(s), s
        if max_abs < F(1e-15):
            out += bytes(Q6_K_BYTES)
            continue
        iscale = F(-128) / max_scale
        d16 = np.array([F(1) / iscale], np.float16)
        sc = [min(127, _nearest_int(iscale * s)) for s in scales]
        for j in range(16):
            d = F(d16[0]) * F(sc[j])
            if d == 0:
                continue
            for ii in range(16):
                levels[16 * j + ii] = max(-32, min(31, _nearest_int(blk[16 * j + ii] / d))) + 32
        ql, qh = bytearray(128), bytearray(64)
        for h in range(2):
            lv = levels[128 * h:128 * h + 128]
            for i in range(32):
                ql[64 * h + i] = (lv[i] & 0xF) | (lv[i + 64] & 0xF) << 4
                ql[64 * h + 32 + i] = (lv[i + 32] & 0xF) | (lv[i + 96] & 0xF) << 4
                qh[32 * h + i] = lv[i] >> 4 | (lv[i + 32] >> 4) << 2 | (lv[i + 64] >> 4) << 4 | (lv[i + 96] >> 4) << 6
        out += ql + qh + bytes(s & 0xFF for s in sc) + d16.tobytes()
    return bytes(out)


def test_q6_k_matches_scalar_transcription() -> None:
    """Finite edge cases plus random blocks, against the scalar transcription above."""
    rng = np.random.default_rng(2)
    x = np.concatenate([_edge_blocks(with_nonfinite=False), (rng.standard_normal((8, QK_K)) * 0.02).astype(F)])
    with np.errstate(all="ignore"):
        assert quantize_q6_k(x.reshape(-1)).tobytes() == _scalar_q6_k(x)


def test_q6_k_groups_and_sources_are_consistent() -> None:
    """Group boundaries change nothing; F16/BF16 storage equals its exact float32 widening; shape checks."""
    rng = np.random.default_rng(4)
    n = 2 * Q6_K_GROUP + 3
    x = (rng.standard_normal((n, QK_K)) * 0.02).astype(F)
    x[5] = 0
    x[Q6_K_GROUP] = _edge_blocks(with_nonfinite=False)[2]
    whole = quantize_q6_k(x.reshape(-1)).reshape(n, Q6_K_BYTES)
    for i in (0, 5, Q6_K_GROUP - 1, Q6_K_GROUP, n - 1):
        assert np.array_equal(quantize_q6_k(x[i]), whole[i])
    assert np.array_equal(quantize_rows(x.reshape(-1), Q.F32, Q.Q6_K), whole.reshape(-1))
    x16 = x.astype(np.float16)
    assert np.array_equal(quantize_rows(x16, Q.F16, Q.Q6_K), quantize_q6_k(x16.astype(F)))
    bf = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    assert np.array_equal(quantize_rows(bf, Q.BF16, Q.Q6_K), quantize_q6_k((bf.astype(np.uint32) << 16).view(F)))
    assert Q.Q6_K in kernels.QUANT_TYPES
    with pytest.raises(ValueError):
        quantize_q6_k(np.zeros(128, F))
    with pytest.raises(ValueError):
        quantize_rows(np.zeros(256, np.float64), Q.F32, Q.Q6_K)


def test_q6_k_dequantizes_close_to_input() -> None:
    """gguf-py's Q6_K dequantizer reads the layout back: within a step of the input (half a step but for
    the clamp of +32 to 31), about 1.8% relative RMS error for Gaussian weights."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((64, QK_K)) * 0.02).astype(F)
    x[3] = 0
    q = quantize_q6_k(x.reshape(-1)).reshape(64, Q6_K_BYTES)
    y = quants.dequantize(q, Q.Q6_K).reshape(64, QK_K)
    d = q[:, 208:210].copy().view(np.float16).astype(F).reshape(-1)
    step = np.abs(d[:, None] * q[:, 192:208].view(np.int8).astype(F)).repeat(16, axis=1)
    assert np.all(np.abs(y - x) <= step)
    assert np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2)) < 0.025
    assert np.all(y[3] == 0)
