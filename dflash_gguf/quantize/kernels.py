"""Bit-exact numpy Q4_0/Q8_0/Q6_K kernels: ggml's ``quantize_row_q4_0_ref``/``q8_0_ref``/``q6_K_ref``; and F16/BF16.

Also Q5_0/Q5_1/Q4_K/Q5_K (``quantize_q5_0``, ``quantize_q5_1``, ``quantize_q4_k``, ``quantize_q5_k``: ggml's
``quantize_row_q5_0_ref``/``q5_1_ref``/``q4_K_ref``/``q5_K_ref``); see their sections at the end.

Why not gguf-py's quantizers: they reduce along the 32 elements of each block (numpy loops once
per block there), allocate a temporary per step, need a separate BF16 widening pass, and differ
from ggml on an all-zero block that starts with -0.0 (ggml's scale is then -0.0, gguf-py's +0.0).
Here a group of blocks is widened straight into a (quad-)transposed float32 scratch (8 x 4*n_blocks:
row r holds elements 4r..4r+3 of every block), so every step, the per-block max/min included, is a
long contiguous numpy loop over cache-sized data; the transposes in and out move 8-byte (BF16/F16 in)
and 4-byte (packed out) units rather than single values, and groups are large (few GIL round trips).

Exactness (same float32 operations, in the same order, as the C reference):

* Q4_0 takes the first element with the largest ``|v|`` (ties go to the earlier index), starting
  from ``max = +0.0``; ``d = max / -8``; ``id = d ? 1/d : 0``; ``q = MIN(15, (int8)(x*id + 8.5))``.
* Q8_0: ``d = amax / 127``; ``q = roundf(x*id)`` (half away from zero).
* Non-finite input (NaN/inf) or a scale whose inverse overflows takes a slower vectorised path that
  mirrors the C code's NaN comparisons and x86's float->int conversion (out-of-range -> 0).
* Q6_K (``quantize_q6_k``, also reached through ``quantize_rows``): see the notes at its section below.
* Q5_0/Q5_1/Q4_K/Q5_K (also reached through ``quantize_rows``): see the notes at their sections below.
* F16 and BF16 (``round_floats``): ggml_quantize_chunk's roundings, NaN rules included.

Compiled path: when the optional C extension ``_kernels`` (``_kernels.c``, built by setup.py) imports,
``quantize_rows``/``quantize_q6_k`` (and the Q5_0/Q5_1/Q4_K/Q5_K functions) run it instead: the same bytes,
several times faster, GIL released.
``DFLASH_GGUF_KERNELS=numpy`` forces these numpy kernels, ``=compiled`` refuses to run without the
extension; :func:`kernel_path` says which one is active. A CPython extension rather than a ctypes library:
setuptools builds and names it for the interpreter, and a missing build is simply an ImportError.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from types import ModuleType

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..ggufio.layout import float_to_f32

Q = GGMLQuantizationType
QK = 32
GROUP_BLOCKS = 8192  # blocks per inner step: a 1 MB float32 scratch, about one core's L2
_F1, _F8_5, _FM8, _F127 = np.float32(1), np.float32(8.5), np.float32(-8), np.float32(127)
_U4, _U16, _U64_4 = np.uint8(4), np.uint32(16), np.uint64(4)
_OUT_BYTES = {Q.Q4_0: 18, Q.Q8_0: 34}
# quantize_rows makes all of them (Q6_K and the last four through their own functions)
QUANT_TYPES = (*_OUT_BYTES, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.MXFP4)
# Source types read directly (BF16 as its raw 16-bit words); anything else is widened first.
SOURCE_DTYPES: dict[GGMLQuantizationType, np.dtype] = {
    Q.F32: np.dtype(np.float32), Q.F16: np.dtype(np.float16), Q.BF16: np.dtype(np.uint16)}


KERNELS_ENV = "DFLASH_GGUF_KERNELS"  # "numpy": force the fallback; "compiled": require the extension
KERNEL_PATHS = ("compiled", "numpy")


def _load_compiled(mode: str) -> ModuleType | None:
    """The C extension, or None for the numpy kernels (``mode``: auto, numpy or compiled)."""
    if mode == "numpy":
        return None
    try:
        from . import _kernels
    except ImportError as e:
        if mode == "compiled":
            raise ImportError(f"{KERNELS_ENV}=compiled, but the compiled kernels are not built ({e}); reinstall "
                              "dflash-gguf with a C compiler present, or unset it to use the numpy kernels.") from e
        return None
    return _kernels


_compiled = _load_compiled(os.environ.get(KERNELS_ENV, "auto").strip().lower())


def compiled_available() -> bool:
    """Whether the C extension can be imported (whatever the active path)."""
    return _load_compiled("auto") is not None


def kernel_path() -> str:
    """``"compiled"`` or ``"numpy"``: which kernels quantize now (for ``--json`` and the bench report)."""
    return "numpy" if _compiled is None else "compiled"


def set_kernel_path(path: str) -> None:
    """Switch the active kernels at run time (tests and the bench compare both).

    Raises:
        ImportError: ``"compiled"`` without the extension.
    """
    global _compiled
    if path not in KERNEL_PATHS:
        raise ValueError(f"kernel path must be one of {KERNEL_PATHS}, not {path!r}")
    _compiled = _load_compiled(path)


class _Scratch(threading.local):
    """Per-thread flat buffers, reused across groups so no step allocates (or page-faults) fresh memory."""

    def __init__(self) -> None:
        n = QK * GROUP_BLOCKS
        self.w = np.empty(n // 4, np.uint64)
        self.xt = np.empty(n, np.float32)
        self.tt = np.empty(n, np.float32)
        self.q = np.empty(n, np.uint8)
        self.q2 = np.empty(n, np.uint8)


_scratch = _Scratch()

# Layout of a group of nb blocks: "quad-transposed", (8, 4*nb) float32 where row r holds elements
# 4r..4r+3 of every block side by side. Moving whole 4-element units (8 bytes of BF16/F16) makes
# the transpose cheap, every later step a long contiguous loop, and the output goes back in 4-byte
# units (4 packed Q4_0 bytes or 4 Q8_0 values) per block.
_L = 4
_ROWS = QK // _L


def _load_t(src: np.ndarray, qtype: GGMLQuantizationType, nb: int) -> np.ndarray:
    """``src`` (nb x 32 values of ``qtype``) widened to float32 in the quad-transposed layout (scratch)."""
    s = _scratch
    xt = s.xt[:QK * nb].reshape(_ROWS, _L * nb)
    if qtype == Q.F32:  # exact
        pairs = src.view(np.uint64).reshape(nb, _ROWS, 2).transpose(1, 0, 2)
        np.copyto(xt.view(np.uint64).reshape(_ROWS, nb, 2), pairs)
        return xt
    w = s.w[:_ROWS * nb].reshape(_ROWS, nb)
    np.copyto(w, src.view(np.uint64).T)
    if qtype == Q.BF16:  # exact: a bf16 is the top half of its float32
        x32 = xt.view(np.uint32)
        np.copyto(x32, w.view(np.uint16))
        np.left_shift(x32, _U16, out=x32)
    else:  # F16 (exact widening)
        np.copyto(xt, w.view(np.float16), casting="same_kind")
    return xt


def _natural_t(xt: np.ndarray, cols: np.ndarray | slice = slice(None)) -> np.ndarray:
    """Blocks ``cols`` of a quad-transposed group as a plain transposed (32 x n) float32 copy."""
    p = xt.reshape(_ROWS, -1, _L)[:, cols, :]
    return p.transpose(0, 2, 1).reshape(QK, -1)


def _quad_max_min(xt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block max and min (NaN propagates, like the per-row reductions)."""
    m, n = xt.max(axis=0), xt.min(axis=0)
    mx = np.maximum(np.maximum(m[0::4], m[1::4]), np.maximum(m[2::4], m[3::4]))
    mn = np.minimum(np.minimum(n[0::4], n[1::4]), np.minimum(n[2::4], n[3::4]))
    return mx, mn


def _inv(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` elementwise (NaN counts as true, as in C)."""
    out = np.zeros_like(d)
    np.divide(_F1, d, out=out, where=d != 0)
    return out


def _c_to_uint8(y: np.ndarray) -> np.ndarray:
    """The low byte of x86 cvttss2si: truncate toward zero; NaN, inf and |y| >= 2**31 give 0."""
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(y) & (np.abs(y) < np.float32(2.0 ** 31))
    return (np.where(ok, y, np.float32(0)).astype(np.int64) & 0xFF).astype(np.uint8)


def _store_d(dst16: np.ndarray, d: np.ndarray) -> None:
    """The fp16 scale (round to nearest even, as GGML_FP32_TO_FP16; too large -> inf, as in ggml)."""
    with np.errstate(over="ignore"):
        d16 = d.astype(np.float16)
    np.copyto(dst16[:, 0], d16.view(np.uint16))


def _q4_0_group(xt: np.ndarray, dst16: np.ndarray) -> None:
    """Quantize ``xt`` (quad-transposed nb blocks, destroyed) into ``dst16`` (nb x 9 uint16 words)."""
    s = _scratch
    nb = dst16.shape[0]
    mx, mn = _quad_max_min(xt)
    neg = np.negative(mn)
    maxv = np.where(neg > mx, mn, mx)
    maxv += np.float32(0)  # an all-zero block keeps C's initial max = +0.0 (never -0.0)
    tie = np.flatnonzero((neg == mx) & (mx != 0))
    if tie.size:  # +a and -a both present: the earlier one wins
        sub = _natural_t(xt, tie)
        first_pos = np.argmax(sub == mx[tie], axis=0)
        first_neg = np.argmax(sub == mn[tie], axis=0)
        maxv[tie] = np.where(first_pos < first_neg, mx[tie], mn[tie])
    with np.errstate(over="ignore", invalid="ignore"):
        d = maxv / _FM8
        idv = _inv(d)
        finite = bool(np.isfinite(mx - mn + idv).all())
    if not finite:
        _q4_0_group_slow(_natural_t(xt), dst16)
        return
    np.multiply(xt, np.repeat(idv, _L), out=xt)
    np.add(xt, _F8_5, out=xt)  # in [0.5, 16.5] here: the truncating cast is C's (int8_t)
    q, q2 = s.q[:QK * nb].reshape(_ROWS, _L * nb), s.q2[:QK * nb].reshape(_ROWS, _L * nb)
    np.copyto(q, xt, casting="unsafe")
    np.right_shift(q, _U4, out=q2)
    np.subtract(q, q2, out=q)  # MIN(15, v) for v in 0..16
    # Pack rows 4..7 (elements 16..31) into the high nibbles of rows 0..3, eight bytes at a time:
    # every byte is <= 15, so a wide shift by 4 never carries into a neighbouring byte.
    half = 16 * nb  # bytes in rows 0..3: a multiple of 16, so the uint64 views are aligned
    lo, hi, out = (a.view(np.uint64) for a in (s.q[:half], s.q[half:2 * half], s.q2[:half]))
    np.left_shift(hi, _U64_4, out=out)
    np.bitwise_or(out, lo, out=out)
    np.copyto(dst16[:, 1:].view(np.uint32), s.q2[:half].view(np.uint32).reshape(_ROWS // 2, nb).T)
    _store_d(dst16, d)


def _q4_0_group_slow(xt: np.ndarray, dst16: np.ndarray) -> None:
    """``xt``: plain transposed (32 x nb) float32."""
    dst = dst16.view(np.uint8)
    nb = xt.shape[1]
    cols = np.arange(nb)
    with np.errstate(all="ignore"):
        a = np.abs(xt)
        a[np.isnan(a)] = 0  # `amax < fabsf(NaN)` is false: NaN is never picked
        idx = a.argmax(axis=0)
        maxv = np.where(a[idx, cols] > 0, xt[idx, cols], np.float32(0)).astype(np.float32)
        d = maxv / _FM8
        idv = _inv(d)
        y = xt * idv + _F8_5
    q = np.minimum(_c_to_uint8(y).view(np.int8), np.int8(15)).view(np.uint8)
    dst[:, 2:] = (q[:16] | (q[16:] << _U4)).T
    _store_d(dst16, d)


def _q8_0_group(xt: np.ndarray, dst16: np.ndarray) -> None:
    """Quantize ``xt`` (quad-transposed nb blocks, destroyed) into ``dst16`` (nb x 17 uint16 words)."""
    s = _scratch
    nb = dst16.shape[0]
    mx, mn = _quad_max_min(xt)
    amax = np.maximum(mx, np.negative(mn))
    amax += np.float32(0)
    with np.errstate(over="ignore", invalid="ignore"):
        d = amax / _F127
        idv = _inv(d)
        finite = bool(np.isfinite(mx - mn + idv).all())
    if not finite:
        _q8_0_group_slow(_natural_t(xt), dst16)
        return
    n = QK * nb
    tt = s.tt[:n].reshape(_ROWS, _L * nb)
    q, q2 = s.q[:n].view(np.int8).reshape(_ROWS, _L * nb), s.q2[:n].view(np.int8).reshape(_ROWS, _L * nb)
    np.multiply(xt, np.repeat(idv, _L), out=xt)  # |v| <= 127
    # roundf(v) = trunc(v) + trunc(2 * (v - trunc(v))), all steps exact in float32
    np.trunc(xt, out=tt)
    np.subtract(xt, tt, out=xt)
    np.add(xt, xt, out=xt)
    np.copyto(q, tt, casting="unsafe")
    np.copyto(q2, xt, casting="unsafe")
    np.add(q, q2, out=q)
    np.copyto(dst16[:, 1:].view(np.uint32), q.view(np.uint32).T)
    _store_d(dst16, d)


def _q8_0_group_slow(xt: np.ndarray, dst16: np.ndarray) -> None:
    """``xt``: plain transposed (32 x nb) float32."""
    dst = dst16.view(np.uint8)
    with np.errstate(all="ignore"):
        a = np.abs(xt)
        nan = np.isnan(a)
        # amax = MAX(amax, |v|) = amax > |v| ? amax : |v| -- a NaN resets the running max to NaN and
        # the next element replaces it: only the elements after the last NaN count.
        last = np.where(nan.any(axis=0), QK - 1 - np.argmax(nan[::-1], axis=0), -1)
        after = np.arange(QK)[:, None] > last
        amax = np.where(after, a, np.float32(0)).max(axis=0)
        amax = np.where(last == QK - 1, np.float32(np.nan), amax).astype(np.float32)
        d = amax / _F127
        idv = _inv(d)
        v = xt * idv
        t = np.trunc(v)
        r = t + np.trunc((v - t) * np.float32(2))
        r = np.where(np.isfinite(v), r, v)
    dst[:, 2:] = _c_to_uint8(r).T
    _store_d(dst16, d)


_GROUP = {Q.Q4_0: _q4_0_group, Q.Q8_0: _q8_0_group}


def _run_compiled(blocks: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType,
                  n_bytes: int) -> np.ndarray:
    """The C extension over contiguous ``blocks``: one call (the GIL is released for all of it)."""
    assert _compiled is not None
    out = np.empty(n_bytes, np.uint8)
    _compiled.quantize(blocks, int(src_type), out, int(dst_type))
    return out


def quantize_rows(values: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType) -> np.ndarray:
    """Quantize ``values`` to ``dst_type`` (one of QUANT_TYPES); return the tensor bytes as a flat uint8 array.

    ``values``: float32 (``src_type`` F32), float16 (F16) or the raw uint16 words of BF16; any shape
    whose size is a multiple of the block (32; 256 for Q6_K, Q4_K, Q5_K): rows are contiguous, so blocks never
    straddle rows when the row length is a multiple of the block.
    """
    src_type, dst_type = Q(src_type), Q(dst_type)
    if dst_type == Q.Q6_K:
        return quantize_q6_k(values, src_type)
    if dst_type in _EXTRA:
        return _EXTRA[dst_type](values, src_type)
    want = SOURCE_DTYPES[src_type]
    if values.dtype != want or values.size % QK:
        raise ValueError(f"cannot quantize {values.dtype} values ({values.size}) given as {src_type.name}")
    blocks = np.ascontiguousarray(values).reshape(-1, QK)
    nbt = blocks.shape[0]
    if _compiled is not None:
        return _run_compiled(blocks, src_type, dst_type, nbt * _OUT_BYTES[dst_type])
    out = np.empty((nbt, _OUT_BYTES[dst_type] // 2), np.uint16)  # 2-byte words: every block is aligned
    group = _GROUP[dst_type]
    for b0 in range(0, nbt, GROUP_BLOCKS):
        b1 = min(nbt, b0 + GROUP_BLOCKS)
        group(_load_t(blocks[b0:b1], src_type, b1 - b0), out[b0:b1])
    return out.reshape(-1).view(np.uint8)


# ------------------------------------------------------------------------------------- F16 and BF16

FLOAT_TYPES = (Q.F16, Q.BF16)  # the roundings round_floats makes


def round_floats(values: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType) -> np.ndarray:
    """``values`` (as for :func:`quantize_rows`) rounded to F16 or BF16 as ggml_quantize_chunk does: the bits as
    a flat uint16 array.

    Why not ``astype(np.float16)``: numpy keeps a NaN's payload where ggml writes ``sign | 0x7E00``, and its
    conversion of values below fp16's normal range runs about 20x slower than of others (most of a BF16 weight
    file can be there), so the compiled rounding runs when built; the numpy one is exact and data-dependent.
    """
    src_type, dst_type = Q(src_type), Q(dst_type)
    if dst_type not in FLOAT_TYPES:
        raise ValueError(f"cannot round to {dst_type.name}: F16 or BF16 only")
    if values.dtype != SOURCE_DTYPES[src_type]:
        raise ValueError(f"cannot round {values.dtype} values given as {src_type.name}")
    flat = np.ascontiguousarray(values).reshape(-1)
    if _compiled is not None:
        out = np.empty(flat.size, np.uint16)
        _compiled.quantize(flat, int(src_type), out, int(dst_type))
        return out
    f32 = float_to_f32(flat, src_type)
    if dst_type == Q.F16:
        return _fp16_bits(f32)
    u = f32.view(np.uint32)  # ggml_compute_fp32_to_bf16: no overflow below NaN's bit patterns
    words = ((u + (np.uint32(0x7FFF) + ((u >> _U16) & np.uint32(1)))) >> _U16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        words[nan] = (u[nan] >> _U16).astype(np.uint16) | np.uint16(64)
    return words


# where each block's fp16 scales are (ggml_validate_row_data checks d, and dmin or m where a type has one)
_SCALES_AT = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
              Q.Q5_K: (0, 2)}
_EXPONENT = {Q.F32: (np.uint32, 0x7F800000), Q.F16: (np.uint16, 0x7C00), Q.BF16: (np.uint16, 0x7F80)}
CHECKED_TYPES = (*_EXPONENT, *_SCALES_AT, Q.MXFP4)  # the types count_nonfinite reads


def count_nonfinite(data: np.ndarray, qtype: GGMLQuantizationType) -> int:
    """NaN or infinite values (F32, F16, BF16) or block scales (the fp16 ``d``, and ``dmin``/``m`` where a type has
    one; MXFP4's E8M0 exponent 0xFF) in the bytes ``data``: what ggml_validate_row_data finds before llama-quantize
    refuses a tensor."""
    qtype = Q(qtype)
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if _compiled is not None:
        return int(_compiled.count_nonfinite(flat, int(qtype)))
    if qtype == Q.MXFP4:  # validate_e_e8m0: the exponent byte 0xFF is NaN
        return int(np.count_nonzero(flat.reshape(-1, MXFP4_BYTES)[:, 0] == np.uint8(0xFF)))
    if qtype in _EXPONENT:
        dtype, mask = _EXPONENT[qtype]
        return int(np.count_nonzero((flat.view(dtype) & dtype(mask)) == dtype(mask)))
    # an fp16 scale's high byte holds its exponent bits, 0x7C
    blocks = flat.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    return sum(int(np.count_nonzero((blocks[:, at + 1] & np.uint8(0x7C)) == np.uint8(0x7C)))
               for at in _SCALES_AT[qtype])


# ---------------------------------------------------------------------------------------------- Q6_K
#
# ggml's quantize_row_q6_K_ref (what ggml_quantize_chunk -> quantize_q6_K runs without an imatrix):
# per 256-value super-block, make_qx_quants(16, 32, x, L, rmse_type=1, NULL) fits every 16-value
# sub-block (an initial scale plus 18 trial scales), the 16 sub-block scales are quantized to int8
# against an fp16 super-scale ``d``, then every value is re-quantized to 6 bits against its scale.
#
# Layout: a group of G super-blocks is held transposed, (16 x 16G) float32 with row i holding element
# i of every sub-block, so each step of the fit is one long numpy loop over all sub-blocks and the
# 16-term sums of the fit are 15 sequential row additions -- exactly C's left-to-right order, which a
# numpy reduction (pairwise when contiguous) would not guarantee.
#
# Exactness notes (all arithmetic is float32, one rounding per C operator; ggml-base is compiled
# without -march flags, so x86-64 gcc emits no FMA and nothing is contracted):
# * nearest_int(v) reads the mantissa bits of v + 12582912.f (1.5*2^23). For |v| < 2^22 that is
#   round-half-even, i.e. np.rint; for NaN/inf/huge v it is garbage that the C code then clamps, so
#   those cases use the bit trick itself (``_nearest_int``).
# * make_qx_quants: ``max`` is the first value with the largest |x| (strict >, NaN never wins);
#   ``amax < 1e-15f`` gives scale 0 and L = 0. Sums: sumlx += (x*x*x)*l, suml2 += ((x*x)*l)*l, from
#   +0.0. Trial iscale = -(32 + 0.1f*is)/max (product and sum rounded separately); a trial wins when
#   ``suml2 > 0 && sumlx*sumlx > best*suml2``, then scale = sumlx/suml2, best = scale*sumlx.
# * Super-block: ``max_scale`` = first scale with the largest |scale|; ``< 1e-15f`` -> all-zero block.
#   iscale = -128.f/max_scale; d = fp16(1/iscale) (round-to-nearest-even, overflow -> inf);
#   scales[j] = (int8) MIN(127, nearest_int(iscale*scale_j)); where fp32(d)*scales[j] != 0 (NaN
#   counts), L = clamp(nearest_int(x / (d*scales[j])), -32, 31) + 32, else L stays make_qx_quants'.

QK_K = 256
Q6_K_BYTES = 210  # ql[128], qh[64], int8 scales[16], fp16 d
Q6_K_GROUP = 256  # super-blocks per step: 16 x 4096 float32 work arrays, ~3.5 MB of scratch per thread
_SUB = 16
_F0, _F32, _FM32, _F31, _FM128 = np.float32(0), np.float32(32), np.float32(-32), np.float32(31), np.float32(-128)
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_MAGIC = np.float32(12582912.0)
# make_qx_quants' scales in its order: the initial -nmax/max, then is = -9..-1, 1..9. C computes
# nmax + 0.1f*is as two rounded float operations; the numerators here are -(that), exactly.
_TRIALS = (0, *range(-9, 0), *range(1, 10))
_NEG_C = np.array([-(_F32 + np.float32(np.float32(0.1) * np.float32(i))) for i in _TRIALS], np.float32)
# |iscale*x| <= c*(1+2^-23)^2 for every x of a sub-block (|x| <= |max|), so the round-to-nearest-even
# result can leave [-32, 31] only when c >= 31.5 (then it may reach 32) or c >= 32.5 (-33):
# clamping is skipped where it cannot bite.
_CLAMP_HI = tuple(bool(-c > np.float32(31.49)) for c in _NEG_C)
_CLAMP_LO = tuple(bool(-c > np.float32(32.49)) for c in _NEG_C)


class _Q6Scratch(threading.local):
    """Per-thread Q6_K work arrays, reused by every group: large temporaries would be fresh mmaps, and their
    page faults cost more than the arithmetic (np.empty: nothing is touched until a thread quantizes Q6_K)."""

    def __init__(self) -> None:
        n, nt = QK_K * Q6_K_GROUP, len(_TRIALS)
        ns = n // _SUB
        self.xt = np.empty(n, np.float32)
        self.l = np.empty(n, np.float32)
        self.w = np.empty(2 * n, np.float32)
        self.t = np.empty(2 * n, np.float32)
        self.sums = np.empty(2 * nt * ns, np.float32)
        self.trials = np.empty(4 * nt * ns, np.float32)
        self.won = np.empty(nt * ns, bool)
        self.lq = np.empty(n, np.uint8)


_q6_scratch = _Q6Scratch()


def _nearest_int(v: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ggml's nearest_int on every element: the low 23 bits of ``v + 1.5*2^23``, minus 2^22 (int32).

    ``out``: an int32 array of v's shape to use (may be ``v.view(np.int32)``: in place)."""
    with np.errstate(all="ignore"):
        f = np.add(v, _MAGIC, out=None if out is None else out.view(np.float32))
    i = f.view(np.int32)
    np.bitwise_and(i, np.int32(0x7FFFFF), out=i)
    np.subtract(i, np.int32(0x400000), out=i)
    return i


def _fp16_bits(d: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: round to nearest even, too large -> inf, NaN -> sign | 0x7E00."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = d.astype(np.float16).view(np.uint16)
    nan = np.isnan(d)
    if nan.any():
        h[nan] = (d[nan].view(np.uint32) >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000) | np.uint16(0x7E00)
    return h


def _first_absmax(v: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(|m|, m) for the first element m of largest |v| along ``axis``, as C's ``if (|v| > amax)`` scan from
    amax = 0 finds it: NaN never wins, and where nothing beats 0 both are 0."""
    a = np.abs(v)
    a[np.isnan(a)] = -1
    idx = np.expand_dims(np.argmax(a, axis=axis), axis)
    amax = np.take_along_axis(a, idx, axis).squeeze(axis)
    m = np.take_along_axis(v, idx, axis).squeeze(axis)
    none = ~(amax > 0)
    amax[none] = 0
    m[none] = 0
    return amax, m


def _round_clamp(v: np.ndarray, hi: bool, lo: bool, bits: bool) -> None:
    """In place: ``(float) MAX(-32, MIN(31, nearest_int(v)))``.

    ``bits`` False is allowed only when every value is finite and below 2^22 in magnitude: nearest_int is then
    np.rint (round half to even), which commutes with a clamp to integers; ``hi``/``lo`` skip a clamp
    that cannot bite."""
    if bits:
        i = _nearest_int(v, out=v.view(np.int32))
        np.clip(i, -32, 31, out=i)
        np.copyto(v, i, casting="unsafe")  # same-size elementwise cast: safe in place
        return
    if hi:  # fmin/fmax (no NaN here) are faster than minimum/maximum
        np.fmin(v, _F31, out=v)
    if lo:
        np.fmax(v, _FM32, out=v)
    np.rint(v, out=v)


def _make_qx_quants(xt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants(16, 32, x, L, 1, NULL) for every column of ``xt`` (16 x S).

    Returns the scales (S float32) and L (16 x S uint8, scratch)."""
    s = _q6_scratch
    n, ns, nt = xt.size, xt.shape[1], len(_TRIALS)
    mxv, mnv = xt.max(axis=0), xt.min(axis=0)  # NaN propagates
    finite = bool(np.isfinite(mxv).all() and np.isfinite(mnv).all())
    if finite:
        neg = np.negative(mnv)
        amax = np.maximum(mxv, neg)
        mx = np.where(neg > mxv, mnv, mxv)
        tie = np.flatnonzero((neg == mxv) & (mxv != 0))
        if tie.size:  # +a and -a both present: the earlier one is max
            sub = xt[:, tie]
            first_pos = np.argmax(sub == mxv[tie], axis=0)
            first_neg = np.argmax(sub == mnv[tie], axis=0)
            mx[tie] = np.where(first_pos < first_neg, mxv[tie], mnv[tie])
    else:
        amax, mx = _first_absmax(xt, 0)
    zero = ~(amax >= _EPS)
    mx[zero] = 1  # placeholder: in C those sub-blocks return early (scale 0, L 0)
    # (16, 2, S): row i holds [w*x[i], w] with w = x[i]*x[i] (then the two terms of sumlx and suml2), so
    # the running sums add one contiguous (2, S) slab per element index.
    w = s.w[:2 * n].reshape(_SUB, 2, ns)
    t = s.t[:2 * n].reshape(_SUB, 2, ns)
    lf = s.l[:n].reshape(_SUB, ns)  # C's l, as float
    sums = s.sums[:2 * nt * ns].reshape(nt, 2, ns)  # per trial: [sumlx, suml2]
    iscales, scales, bests, lhs = s.trials[:4 * nt * ns].reshape(4, nt, ns)
    won = s.won[:nt * ns].reshape(nt, ns)
    np.multiply(xt, xt, out=w[:, 1])
    with np.errstate(all="ignore"):
        np.multiply(w[:, 1], xt, out=w[:, 0])
        np.divide(_NEG_C[:, None], mx, out=iscales)  # every trial's iscale = -(nmax + 0.1f*is) / max
        for k in range(nt):
            np.multiply(xt, iscales[k], out=lf)
            _round_clamp(lf, _CLAMP_HI[k], _CLAMP_LO[k], not finite)
            np.multiply(w[:, 0], lf, out=t[:, 0])  # (w*x[i])*l
            np.multiply(w[:, 1], lf, out=t[:, 1])
            np.multiply(t[:, 1], lf, out=t[:, 1])  # (w*l)*l
            acc = sums[k]
            np.add(t[0], _F0, out=acc)  # sumlx = suml2 = 0, then += in index order
            for i in range(1, _SUB):
                np.add(acc, t[i], out=acc)
        sumlx, suml2 = sums[:, 0], sums[:, 1]
        # The trials in C's order: trial 0 sets scale = suml2 ? sumlx/suml2 : 0 and best = scale*sumlx;
        # trial k wins when suml2 > 0 && sumlx*sumlx > best*suml2 (best being the latest winner's). Only
        # that comparison is sequential; the winner is the last trial that won.
        np.divide(sumlx, suml2, out=scales)
        scales[0][suml2[0] == 0] = 0
        np.multiply(scales, sumlx, out=bests)
        np.multiply(sumlx, sumlx, out=lhs)
        np.greater(suml2, _F0, out=won)
        best = bests[0].copy()
        rhs, gt = np.empty(ns, np.float32), np.empty(ns, bool)
        mask, diff = np.empty(ns, np.int32), np.empty(ns, np.int32)
        winner, step = np.zeros(ns, np.uint8), np.empty(ns, np.uint8)
        best_bits, bests_bits = best.view(np.int32), bests.view(np.int32)
        for k in range(1, nt):
            np.multiply(best, suml2[k], out=rhs)
            np.logical_and(won[k], np.greater(lhs[k], rhs, out=gt), out=gt)
            # best = won ? bests[k] : best, as a bit blend (much cheaper than a masked copy)
            np.negative(gt, out=mask, dtype=np.int32, casting="unsafe")
            np.bitwise_xor(best_bits, bests_bits[k], out=diff)
            np.bitwise_and(diff, mask, out=diff)
            np.bitwise_xor(best_bits, diff, out=best_bits)
            np.multiply(gt, np.uint8(k), out=step)  # k exceeds every earlier winner: max = latest
            np.maximum(winner, step, out=winner)
        cols = np.arange(ns)
        scale = scales[winner, cols]
        np.multiply(xt, iscales[winner, cols], out=lf)  # the winner's L, from its iscale
        _round_clamp(lf, True, True, not finite)
    np.add(lf, _F32, out=lf)
    lq = s.lq[:n].reshape(_SUB, ns)
    np.copyto(lq, lf, casting="unsafe")
    if zero.any():
        lq[:, zero] = 0
        scale[zero] = 0
    return scale, lq


def _q6_k_group(xt: np.ndarray, dst: np.ndarray) -> None:
    """Quantize ``xt`` (16 x 16G: the transposed sub-blocks of G super-blocks) into ``dst`` (G x 210 uint8)."""
    ng, ns = dst.shape[0], xt.shape[1]
    scales, lq = _make_qx_quants(xt)
    sc = scales.reshape(ng, _SUB)
    max_abs, max_scale = _first_absmax(sc, 1)
    zero = ~(max_abs >= _EPS)
    max_scale[zero] = 1  # placeholder: those blocks are all zero bytes
    with np.errstate(all="ignore"):
        iscale = _FM128 / max_scale
        d16 = _fp16_bits(np.float32(1) / iscale)
        q = _nearest_int(iscale[:, None] * sc)
    np.minimum(q, 127, out=q)
    q8 = q.astype(np.uint8)  # the int8 store keeps the low byte
    with np.errstate(all="ignore"):
        dsub = (d16.view(np.float16).astype(np.float32)[:, None] * q8.view(np.int8)).reshape(ns)
    redo = dsub != 0  # `if (!d) continue;`: NaN counts as non-zero
    redo &= np.repeat(~zero, _SUB)
    if redo.any():
        v = _q6_scratch.l[:xt.size].reshape(xt.shape)
        with np.errstate(all="ignore"):
            np.divide(xt, dsub, out=v)
        i = _nearest_int(v, out=v.view(np.int32))
        np.clip(i, -32, 31, out=i)
        np.add(i, 32, out=i)
        if redo.all():
            np.copyto(lq, i, casting="unsafe")
        else:
            np.copyto(lq, i, casting="unsafe", where=redo)
    # Pack: per half h of 128 values, ql[64h + l] = L[l] | L[l+64] << 4, ql[64h + 32 + l] = L[l+32] | L[l+96] << 4,
    # qh[32h + l] = L[l] >> 4 | L[l+32] >> 4 << 2 | L[l+64] >> 4 << 4 | L[l+96] >> 4 << 6 (L relative to the half).
    lb = lq.T.reshape(ng, 2, 4, 32)
    ql = dst[:, :128].reshape(ng, 2, 2, 32)
    np.left_shift(lb[:, :, 2:], _U4, out=ql)
    np.bitwise_or(ql, lb[:, :, :2] & np.uint8(0xF), out=ql)
    hi = lb >> _U4
    hi <<= np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    qh = dst[:, 128:192].reshape(ng, 2, 32)
    np.bitwise_or(np.bitwise_or(hi[:, :, 0], hi[:, :, 1]), np.bitwise_or(hi[:, :, 2], hi[:, :, 3]), out=qh)
    dst[:, 192:208] = q8
    dst[:, 208:210] = d16.view(np.uint8).reshape(ng, 2)
    dst[zero] = 0


def _load_transposed(src: np.ndarray, qtype: GGMLQuantizationType, width: int, n: int, buf: np.ndarray
                     ) -> np.ndarray:
    """``src`` (n runs of ``width`` values of ``qtype``) widened to float32 and transposed: (width x n), in ``buf``."""
    xt = buf[:width * n].reshape(width, n)
    view = src.reshape(n, width).T
    if qtype == Q.BF16:  # exact: a bf16 is the top half of its float32
        x32 = xt.view(np.uint32)
        np.copyto(x32, view)
        np.left_shift(x32, _U16, out=x32)
    else:  # F32 copy, F16 exact widening
        np.copyto(xt, view, casting="same_kind")
    return xt


def _load_q6_t(src: np.ndarray, qtype: GGMLQuantizationType, ng: int) -> np.ndarray:
    """``src`` (ng super-blocks of ``qtype``) widened to float32, transposed to 16 x 16*ng (scratch)."""
    return _load_transposed(src, qtype, _SUB, QK_K * ng // _SUB, _q6_scratch.xt)


def quantize_q6_k(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q6_K_ref over ``values``; the Q6_K bytes (210 per 256 values) as a flat uint8 array.

    ``values``: float32 (``src_type`` F32), float16 (F16) or the raw uint16 words of BF16, any shape whose size
    is a multiple of 256 (whole rows of a tensor with ``ne[0] % 256 == 0``, so no super-block straddles rows).
    Non-finite input is quantized exactly as ggml does (it does not reject it; llama-quantize's
    validation afterwards rejects only a non-finite ``d``, which this returns as fp16 inf like ggml).
    """
    src_type = Q(src_type)
    want = SOURCE_DTYPES[src_type]
    if values.dtype != want or values.size % QK_K:
        raise ValueError(f"cannot quantize {values.dtype} values ({values.size}) given as {src_type.name} to Q6_K")
    blocks = np.ascontiguousarray(values).reshape(-1, QK_K)
    nbt = blocks.shape[0]
    if _compiled is not None:
        return _run_compiled(blocks, src_type, Q.Q6_K, nbt * Q6_K_BYTES)
    out = np.empty((nbt, Q6_K_BYTES), np.uint8)
    for b0 in range(0, nbt, Q6_K_GROUP):
        b1 = min(nbt, b0 + Q6_K_GROUP)
        _q6_k_group(_load_q6_t(blocks[b0:b1], src_type, b1 - b0), out[b0:b1])
    return out.reshape(-1)


# ------------------------------------------------------------------------------------ Q5_0 and Q5_1
#
# ggml's quantize_row_q5_0_ref and quantize_row_q5_1_ref (what ggml_quantize_chunk -> quantize_q5_0 /
# quantize_q5_1 runs without an imatrix), per 32-value block. A group of blocks is held transposed, (32 x nb)
# float32, row j holding element j of every block. Exactness notes (float32, one rounding per C operator):
# * Q5_0 is Q4_0 with 5 bits: ``max`` is the first value of largest |x| (NaN never wins; +0.0 when every |x| is
#   0), d = max / -16, id = d ? 1/d : 0, q = MIN(31, (int8_t)(x*id + 16.5f)) stored as a uint8 (a negative
#   int8 wraps: its low nibble and bit 4 are what lands in the block).
# * Q5_1: ``min``/``max`` from FLT_MAX/-FLT_MAX with strict comparisons (NaN never counts, nor +inf as min or
#   -inf as max; of equal zeros the first one stays, so min/max keep that zero's sign, which fp16 ``m`` shows);
#   d = (max - min) / 31; q = (uint8_t)((x - min)*id + 0.5f) with no clamp (x86's cvttss2si, low byte; an
#   out-of-range value gives 0).
# * Both store q's low nibbles as qs[j] = q[j] | q[j+16] << 4 and bit 4 of q[j] as bit j of the little-endian
#   32-bit qh. Non-finite input (or a scale whose inverse overflows) takes the slow, general conversion.

Q5_0_BYTES = 22  # fp16 d, qh[4], qs[16]
Q5_1_BYTES = 24  # fp16 d, fp16 m, qh[4], qs[16]
_FM16, _F16_5, _F0_5 = np.float32(-16), np.float32(16.5), np.float32(0.5)
_FLT_MAX = np.finfo(np.float32).max


class _ColScratch(threading.local):
    """Per-thread float32 buffer for a group of blocks in the transposed (32 x n) layout."""

    def __init__(self) -> None:
        self.xt = np.empty(QK * GROUP_BLOCKS, np.float32)


_col_scratch = _ColScratch()


def _load_cols(src: np.ndarray, qtype: GGMLQuantizationType, n: int, buf: np.ndarray) -> np.ndarray:
    """``src`` (n runs of 32 values of ``qtype``) widened to float32 and transposed: (32 x n), in ``buf``."""
    return _load_transposed(src, qtype, QK, n, buf)


def _pack_q5(q: np.ndarray, qh: np.ndarray, qs: np.ndarray) -> None:
    """The 5-bit values ``q`` (32 x nb uint8) into ``qh`` (nb x 4) and ``qs`` (nb x 16) as ggml lays them out."""
    np.copyto(qs, ((q[:QK // 2] & np.uint8(0x0F)) | (q[QK // 2:] << _U4)).T)
    bits = (q >> _U4) & np.uint8(1)
    np.copyto(qh, np.packbits(bits, axis=0, bitorder="little").T)  # bit j of the 32-bit LE word: q[j]


def _first_absmax_cols(xt: np.ndarray) -> tuple[np.ndarray, bool]:
    """Per column of ``xt``, C's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` from 0: the first value of
    largest |x| (NaN never wins; +0.0 when every |x| is 0); and whether every value is finite."""
    mxv, mnv = xt.max(axis=0), xt.min(axis=0)  # NaN propagates
    finite = bool(np.isfinite(mxv).all() and np.isfinite(mnv).all())
    if not finite:
        return _first_absmax(xt, 0)[1], False
    neg = np.negative(mnv)
    maxv = np.where(neg > mxv, mnv, mxv)
    maxv += _F0  # an all-zero block keeps C's initial max = +0.0 (never -0.0)
    tie = np.flatnonzero((neg == mxv) & (mxv != 0))
    if tie.size:  # +a and -a both present: the earlier one wins
        sub = xt[:, tie]
        first_pos = np.argmax(sub == mxv[tie], axis=0)
        first_neg = np.argmax(sub == mnv[tie], axis=0)
        maxv[tie] = np.where(first_pos < first_neg, mxv[tie], mnv[tie])
    return maxv, True


def _q5_0_group(xt: np.ndarray, dst: np.ndarray) -> None:
    """quantize_row_q5_0_ref: ``xt`` (32 x nb float32, destroyed) into ``dst`` (nb x 22 uint8)."""
    maxv, finite = _first_absmax_cols(xt)
    with np.errstate(all="ignore"):
        d = maxv / _FM16
        idv = _inv(d)
        # |x*id| <= |max*id| (rounding is monotonic), ~16: x*id + 16.5 then lies in [0, 33), a plain conversion
        fast = finite and bool(np.all(np.abs(maxv * idv) <= _F16_5))
        np.multiply(xt, idv, out=xt)
        np.add(xt, _F16_5, out=xt)
    if fast:
        q = np.empty(xt.shape, np.uint8)
        np.copyto(q, xt, casting="unsafe")
        np.minimum(q, np.uint8(31), out=q)
    else:
        q = np.minimum(_c_to_uint8(xt).view(np.int8), np.int8(31)).view(np.uint8)
    dst[:, 0:2] = _fp16_bits(d).view(np.uint8).reshape(-1, 2)
    _pack_q5(q, dst[:, 2:6], dst[:, 6:22])


def _nan_to(xt: np.ndarray, v: np.float32) -> np.ndarray:
    """``xt`` with its NaNs replaced by ``v``. (Not np.fmin/np.fmax to skip NaNs: given a signalling NaN they
    return a NaN, as C99's fmin does, so a reduction restarts from the values after it.)"""
    return np.where(np.isnan(xt), v, xt)


def _first_zero(xt: np.ndarray, v: np.ndarray) -> None:
    """Where ``v`` (a per-column min or max) is zero, make it the column's first zero, sign included (C's strict
    comparisons keep the first of equal values)."""
    z = np.flatnonzero(v == 0)
    if z.size:
        sub = xt[:, z]
        v[z] = sub[np.argmax(sub == 0, axis=0), np.arange(z.size)]


def _q5_1_group(xt: np.ndarray, dst: np.ndarray) -> None:
    """quantize_row_q5_1_ref: ``xt`` (32 x nb float32, destroyed) into ``dst`` (nb x 24 uint8)."""
    mn, mx = xt.min(axis=0), xt.max(axis=0)  # NaN propagates
    finite = bool(np.isfinite(mn).all() and np.isfinite(mx).all())
    if not finite:  # from FLT_MAX / -FLT_MAX: NaN never counts, nor does +inf as min or -inf as max
        mn = np.minimum(_nan_to(xt, _FLT_MAX).min(axis=0), _FLT_MAX)
        mx = np.maximum(_nan_to(xt, -_FLT_MAX).max(axis=0), -_FLT_MAX)
    _first_zero(xt, mn)
    _first_zero(xt, mx)
    with np.errstate(all="ignore"):
        d = (mx - mn) / _F31
        idv = _inv(d)
        # 0 <= (x - min)*id <= (max - min)*id, ~31: + 0.5 stays in [0, 33), a plain conversion
        fast = finite and bool(np.all((mx - mn) * idv <= _F32))
        np.subtract(xt, mn, out=xt)
        np.multiply(xt, idv, out=xt)
        np.add(xt, _F0_5, out=xt)
    if fast:
        q = np.empty(xt.shape, np.uint8)
        np.copyto(q, xt, casting="unsafe")
    else:
        q = _c_to_uint8(xt)
    dst[:, 0:2] = _fp16_bits(d).view(np.uint8).reshape(-1, 2)
    dst[:, 2:4] = _fp16_bits(mn).view(np.uint8).reshape(-1, 2)
    _pack_q5(q, dst[:, 4:8], dst[:, 8:24])


# -------------------------------------------------------------------------------------- Q4_K and Q5_K
#
# ggml's quantize_row_q4_K_ref and quantize_row_q5_K_ref (ggml_quantize_chunk -> quantize_q4_K / quantize_q5_K
# without an imatrix), per 256-value super-block of 8 sub-blocks of 32:
# * per sub-block, sum_x2 = x0*x0 + x1*x1 + ... (from +0.0, in index order), av_x = sqrtf(sum_x2/32), weights
#   w = av_x + |x|, then make_qkx2_quants(32, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, false) with
#   (nmax, rmin, rdelta, nstep) = (15, -1, 0.1, 20) for Q4_K and (31, -0.5, 0.1, 15) for Q5_K;
# * 6-bit scales and mins against max_scale/63 and max_min/63 (fp16 d and dmin), then every value requantized
#   against its sub-block's fp16-rounded scale and min (where that scale is not 0; NaN counts as not 0).
#
# make_qkx2_quants, step by step (what the numpy and compiled kernels both reproduce):
# * min = max = x[0], then ``if (x[i] < min)`` / ``if (x[i] > max)`` (a NaN x[0] sticks, later NaNs never
#   count); sum_w = w[0], sum_x = w[0]*x[0], then += w[i] and += w[i]*x[i]; ``if (min > 0) min = 0``;
#   max == min: L = 0, scale 0.
# * The first fit: iscale = nmax/(max - min), scale = 1/iscale, L = clamp(nearest_int(iscale*(x - min)), 0, nmax),
#   best_error = sum of w*((scale*L + min - x)^2) (each step rounded, from +0.0, in index order).
# * Then, for is = 0..nstep in order, iscale = (rmin + rdelta*is + nmax)/(max - min) with the *current* min:
#   sum_l += w*l, sum_l2 += (w*l)*l, sum_xl += (w*l)*x; D = sum_w*sum_l2 - sum_l*sum_l; when D > 0:
#   this_scale = (sum_w*sum_xl - sum_x*sum_l)/D, this_min = (sum_l2*sum_x - sum_l*sum_xl)/D, and if
#   this_min > 0: this_min = 0, this_scale = sum_xl/sum_l2; its error as above; when cur_error < best_error the
#   trial wins: L, best_error, scale and *min* take its values. A win moves min, so every later trial depends on
#   the earlier ones: the trials run in sequence, each over all sub-blocks at once (C's branches as selects).
# * nearest_int is the bit trick (see Q6_K). A trial's values iscale*(x - min) lie between iscale*(min_x - min)
#   and iscale*(max - min) (rounding is monotonic): when those bounds are finite and below 2^22 for every
#   sub-block, np.rint then the clamp gives the same levels; otherwise the bits themselves are used.
# * Super-block: max_scale / max_min from 0 with ``>`` (NaN never counts); inv = m > 0 ? 63/m : 0;
#   ls = MIN(63, (uint8_t) nearest_int(inv*scale)) (the int's low byte); d = fp16(max_scale/63), dmin likewise;
#   then L = clamp(nearest_int((x + fp32(dmin)*lm)/(fp32(d)*ls)), 0, nmax) where fp32(d)*ls != 0. Those values
#   are not bounded (a sub-block's min can be far from its 6-bit rounding), so nearest_int's bits are used.
# * NaN payloads reach the bytes only through nearest_int, and where two NaNs meet in one commutative operation
#   x86 keeps the first operand's, which is the compiler's choice. Two such places feed nearest_int: the
#   requantization's x + dm (see _ggml_nan_sum) and the fit's iscale*(x - min) when x[0] is NaN (ggml keeps the
#   NaN of x - min); both kernels set what ggml's build gives there, whatever their own operand order.

QK_K_SUB = 32  # values per Q4_K/Q5_K sub-block
Q4_K_BYTES = 144  # fp16 d, fp16 dmin, scales[12], qs[128]
Q5_K_BYTES = 176  # fp16 d, fp16 dmin, scales[12], qh[32], qs[128]
K_GROUP = 256  # super-blocks per numpy step: 32 x 2048 float32 work arrays, ~2 MB of scratch per thread
_F63 = np.float32(63)
_F2_22 = np.float32(2.0 ** 22)


def _qkx2_lanes(nmax: int, rmin: float, rdelta: float, nstep: int) -> np.ndarray:
    """The iscale numerators in C's order: the first fit's nmax, then rmin + rdelta*is + nmax for is = 0..nstep,
    each operation rounded to float32 as C computes it."""
    lanes = [np.float32(nmax)]
    lanes += [np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(i)) + np.float32(nmax)
              for i in range(nstep + 1)]
    return np.array(lanes, np.float32)


_KQ_NMAX = {Q.Q4_K: 15, Q.Q5_K: 31}
_KQ_LANES = {Q.Q4_K: _qkx2_lanes(15, -1.0, 0.1, 20), Q.Q5_K: _qkx2_lanes(31, -0.5, 0.1, 15)}


class _KScratch(threading.local):
    """Per-thread Q4_K/Q5_K work arrays (see _Q6Scratch: large temporaries would be fresh, page-faulting memory)."""

    def __init__(self) -> None:
        n = QK_K * K_GROUP
        self.xt = np.empty(n, np.float32)
        self.l = np.empty(n, np.float32)
        self.best_l = np.empty(n, np.float32)
        self.xm = np.empty(n, np.float32)
        self.terms = np.empty(3 * n, np.float32)


_k_scratch = _KScratch()


def _seq_sum(t: np.ndarray, from_zero: bool = True) -> np.ndarray:
    """C's ``s = 0; for (i...) s += t[i]`` along axis 0, one rounded addition per term in index order
    (``from_zero`` False: ``s = t[0]``, then the rest)."""
    acc = np.add(t[0], _F0) if from_zero else t[0].copy()
    for i in range(1, t.shape[0]):
        np.add(acc, t[i], out=acc)
    return acc


def _levels(xt: np.ndarray, x_lo: np.ndarray, x_hi: np.ndarray, mn: np.ndarray, iscale: np.ndarray, nmax: int,
            finite: bool, xm: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``MAX(0, MIN(nmax, nearest_int(iscale*(x - mn))))`` as float32 into ``out`` (32 x S); ``x_lo``/``x_hi``: a
    lower and upper bound of each column of ``xt``; ``xm``: scratch."""
    np.subtract(xt, mn, out=xm)
    np.multiply(xm, iscale, out=out)
    if finite:
        lo, hi = iscale * (x_lo - mn), iscale * (x_hi - mn)  # the extreme values of iscale*(x - mn)
        bound = np.maximum(np.abs(lo), np.abs(hi))
        if bool(np.all(bound < _F2_22)):  # not NaN or inf either: nearest_int is round-half-even
            np.rint(out, out=out)
            return np.clip(out, _F0, np.float32(nmax), out=out)
    isc_nan = np.isnan(iscale)
    if isc_nan.any():  # where both are NaN, ggml's build keeps the NaN of x - min (see the notes above)
        both = np.isnan(xm) & isc_nan
        out.view(np.uint32)[both] = xm.view(np.uint32)[both] | np.uint32(0x00400000)
    li = _nearest_int(out, out=out.view(np.int32))
    np.clip(li, 0, nmax, out=li)
    np.copyto(out, li, casting="unsafe")  # same-size elementwise cast: safe in place
    return out


def _weighted_error(lf: np.ndarray, scale: np.ndarray, mn: np.ndarray, xt: np.ndarray, w: np.ndarray,
                    diff: np.ndarray) -> np.ndarray:
    """make_qkx2_quants' error: the sum over i, in order, of w*((scale*L + min - x)^2) (``diff``: scratch)."""
    np.multiply(lf, scale, out=diff)
    np.add(diff, mn, out=diff)
    np.subtract(diff, xt, out=diff)
    np.multiply(diff, diff, out=diff)
    np.multiply(w, diff, out=diff)
    return _seq_sum(diff)


def _make_qkx2_quants(xt: np.ndarray, nmax: int, lanes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_quants(32, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, false) with the weights of
    quantize_row_q4_K_ref / q5_K_ref, for every column of ``xt`` (32 x S).

    Returns (scale, the_min) (S float32 each) and L (32 x S uint8)."""
    s = _k_scratch
    n = xt.size
    lf, best_l, xm = (a[:n].reshape(xt.shape) for a in (s.l, s.best_l, s.xm))
    terms = s.terms[:3 * n].reshape(xt.shape[0], 3, xt.shape[1])
    with np.errstate(all="ignore"):
        mx, mn = xt.max(axis=0), xt.min(axis=0)  # NaN propagates
        finite = bool(np.isfinite(mx).all() and np.isfinite(mn).all())
        if not finite:  # later NaNs never count; a NaN x[0] is min and max (with its payload)
            mx, mn = _nan_to(xt, np.float32(-np.inf)).max(axis=0), _nan_to(xt, np.float32(np.inf)).min(axis=0)
            nan0 = np.isnan(xt[0])
            mx[nan0] = xt[0][nan0]
            mn[nan0] = xt[0][nan0]
        x_lo = mn  # every x >= this (and <= mx)
        mn = np.where(mn > _F0, _F0, mn)  # if (min > 0) min = 0
        zero = mx == mn  # C returns early there (L 0, scale 0); the lanes below compute placeholders
        sum_x2 = _seq_sum(xt * xt)
        w = np.abs(xt)
        np.add(np.sqrt(sum_x2 / np.float32(QK_K_SUB)), w, out=w)  # av_x + fabsf(x)
        sum_w = _seq_sum(w, from_zero=False)
        sum_x = _seq_sum(w * xt, from_zero=False)  # w[0]*x[0], then += w*x

        def iscale_for(lane: np.float32, cur_min: np.ndarray) -> np.ndarray:
            r = mx - cur_min
            r[zero] = 1
            return lane / r

        iscale = iscale_for(lanes[0], mn)
        _levels(xt, x_lo, mx, mn, iscale, nmax, finite, xm, best_l)
        scale = np.float32(1) / iscale
        best = _weighted_error(best_l, scale, mn, xt, w, terms[:, 0])
        cur_min = mn.copy()
        for lane in lanes[1:]:
            iscale = iscale_for(lane, cur_min)
            _levels(xt, x_lo, mx, cur_min, iscale, nmax, finite, xm, lf)
            np.multiply(w, lf, out=terms[:, 0])  # w*l
            np.multiply(terms[:, 0], lf, out=terms[:, 1])  # (w*l)*l
            np.multiply(terms[:, 0], xt, out=terms[:, 2])  # (w*l)*x
            sum_l, sum_l2, sum_xl = _seq_sum(terms)
            dd = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / dd
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / dd
            pos = this_min > _F0
            this_min[pos] = 0
            np.copyto(this_scale, sum_xl / sum_l2, where=pos)
            err = _weighted_error(lf, this_scale, this_min, xt, w, terms[:, 0])
            won = (dd > _F0) & (err < best)  # `if (D > 0)`, then `if (cur_error < best_error)`
            if won.any():
                np.copyto(best, err, where=won)
                np.copyto(scale, this_scale, where=won)
                np.copyto(cur_min, this_min, where=won)
                np.copyto(best_l, lf, where=won)
    lq = best_l.astype(np.uint8)
    if zero.any():
        scale[zero] = 0
        cur_min[zero] = mn[zero]
        lq[:, zero] = 0
    return scale, np.negative(cur_min), lq


# ggml's build computes the requantization's x + dm as vector additions whose first operand (the NaN x86 keeps when
# both are NaN) is x for elements 0..27 of a sub-block and dm for 28..31 (measured: the register allocation of
# its vectorised loop). Both are NaN only for a NaN input x in a sub-block whose dm = inf*0 (fp16 dmin
# overflowed, 6-bit min 0); the payload then reaches nearest_int. Ours add in whatever order, then put that
# operand (quieted, as the addition would) where both are NaN.
_GGML_X_FIRST = 28


def _ggml_nan_sum(xt: np.ndarray, dm: np.ndarray) -> np.ndarray:
    """The bits of ggml's ``x + dm`` where both are NaN (``xt``: 32 x S, ``dm``: S)."""
    rows = np.arange(xt.shape[0])[:, None] < _GGML_X_FIRST
    return np.where(rows, xt.view(np.uint32), dm.view(np.uint32)) | np.uint32(0x00400000)


def _qk_group(xt: np.ndarray, dst: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """quantize_row_q4_K_ref / q5_K_ref: ``xt`` (32 x 8G: the transposed sub-blocks of G super-blocks) into
    ``dst`` (G x 144 or G x 176 uint8)."""
    ng, nmax = dst.shape[0], _KQ_NMAX[qtype]
    scale, the_min, lq = _make_qkx2_quants(xt, nmax, _KQ_LANES[qtype])
    sc, mins = scale.reshape(ng, 8), the_min.reshape(ng, 8)
    with np.errstate(all="ignore"):
        # from 0, ``if (v > m) m = v``: the largest positive value (NaN never counts), else C's +0.0
        max_scale = np.where(sc > _F0, sc, _F0).max(axis=1)
        max_min = np.where(mins > _F0, mins, _F0).max(axis=1)
        inv_scale = np.where(max_scale > _F0, _F63 / max_scale, _F0)
        inv_min = np.where(max_min > _F0, _F63 / max_min, _F0)
        ls = np.minimum(_nearest_int(inv_scale[:, None] * sc) & 0xFF, 63).astype(np.uint8)
        lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
        d16, dm16 = _fp16_bits(max_scale / _F63), _fp16_bits(max_min / _F63)
        d = (d16.view(np.float16).astype(np.float32)[:, None] * ls).reshape(-1)
        dm = (dm16.view(np.float16).astype(np.float32)[:, None] * lm).reshape(-1)
        redo = d != 0  # `if (!d) continue;`: NaN counts as non-zero
        if redo.any():
            both = np.isnan(xt) & np.isnan(dm) if np.isnan(dm).any() else None
            if both is not None and both.any():  # see _ggml_nan_sum
                first = _ggml_nan_sum(xt, dm)
            v = np.add(xt, dm, out=xt)
            if both is not None and both.any():
                v.view(np.uint32)[both] = first[both]
            np.divide(v, d, out=v)
            li = _nearest_int(v, out=v.view(np.int32))
            np.clip(li, 0, nmax, out=li)
            np.copyto(lq, li, casting="unsafe", where=redo)
    dst[:, 0:2] = d16.view(np.uint8).reshape(ng, 2)
    dst[:, 2:4] = dm16.view(np.uint8).reshape(ng, 2)
    # 6-bit scales and mins: bytes 0-3 ls[0..4) | (ls[4..8) >> 4) << 6, bytes 4-7 lm the same, bytes 8-11
    # (ls[4..8) & 15) | (lm[4..8) & 15) << 4 (get_scale_min_k4 reads them back)
    scales = dst[:, 4:16]
    scales[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> _U4) << np.uint8(6))
    scales[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> _U4) << np.uint8(6))
    scales[:, 8:12] = (ls[:, 4:] & np.uint8(0xF)) | (lm[:, 4:] << _U4)
    lb = lq.T.reshape(ng, 8, QK_K_SUB)  # L of sub-block j, in order
    pairs = lb.reshape(ng, 4, 2, QK_K_SUB)  # sub-blocks 2k (low nibbles) and 2k+1 (high) share 32 bytes
    qs = dst[:, -128:].reshape(ng, 4, QK_K_SUB)
    np.left_shift(pairs[:, :, 1], _U4, out=qs)
    np.bitwise_or(qs, pairs[:, :, 0] & np.uint8(0xF), out=qs)
    if qtype == Q.Q5_K:  # qh[l]: bit j is bit 4 of sub-block j's L[l]
        hi = (lb >> _U4) << np.arange(8, dtype=np.uint8)[None, :, None]
        np.bitwise_or.reduce(hi, axis=1, out=dst[:, 16:48])


def _quantize_blocks(values: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType,
                     block: int, nbytes: int) -> np.ndarray:
    """The shared frame of the Q5_0/Q5_1/Q4_K/Q5_K entry points: checks, then the compiled kernel or numpy groups."""
    src_type = Q(src_type)
    if values.dtype != SOURCE_DTYPES[src_type] or values.size % block:
        raise ValueError(f"cannot quantize {values.dtype} values ({values.size}) given as {src_type.name} "
                         f"to {dst_type.name}")
    blocks = np.ascontiguousarray(values).reshape(-1, block)
    nbt = blocks.shape[0]
    if _compiled is not None:
        return _run_compiled(blocks, src_type, dst_type, nbt * nbytes)
    out = np.empty((nbt, nbytes), np.uint8)
    if block == QK:
        group = _q5_0_group if dst_type == Q.Q5_0 else _q5_1_group
        for b0 in range(0, nbt, GROUP_BLOCKS):
            b1 = min(nbt, b0 + GROUP_BLOCKS)
            group(_load_cols(blocks[b0:b1], src_type, b1 - b0, _col_scratch.xt), out[b0:b1])
    else:
        per = QK_K // QK_K_SUB
        for b0 in range(0, nbt, K_GROUP):
            b1 = min(nbt, b0 + K_GROUP)
            _qk_group(_load_cols(blocks[b0:b1], src_type, per * (b1 - b0), _k_scratch.xt), out[b0:b1], dst_type)
    return out.reshape(-1)


def quantize_q5_0(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q5_0_ref over ``values``; the Q5_0 bytes (22 per 32 values) as a flat uint8 array.

    ``values``: float32 (``src_type`` F32), float16 (F16) or the raw uint16 words of BF16, any shape whose size is
    a multiple of 32. Non-finite input is quantized as ggml does (the fp16 ``d`` can come out NaN or infinite,
    which llama-quantize's validation then refuses)."""
    return _quantize_blocks(values, src_type, Q.Q5_0, QK, Q5_0_BYTES)


def quantize_q5_1(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q5_1_ref over ``values``; the Q5_1 bytes (24 per 32 values) as a flat uint8 array
    (``values`` as for :func:`quantize_q5_0`)."""
    return _quantize_blocks(values, src_type, Q.Q5_1, QK, Q5_1_BYTES)


def quantize_q4_k(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q4_K_ref over ``values``; the Q4_K bytes (144 per 256 values) as a flat uint8 array.

    ``values`` as for :func:`quantize_q6_k` (a size that is a multiple of 256: whole rows of a tensor with
    ``ne[0] % 256 == 0``). This is what llama-quantize makes of a Q4_K tensor without an imatrix."""
    return _quantize_blocks(values, src_type, Q.Q4_K, QK_K, Q4_K_BYTES)


def quantize_q5_k(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_q5_K_ref over ``values``; the Q5_K bytes (176 per 256 values) as a flat uint8 array
    (``values`` as for :func:`quantize_q4_k`)."""
    return _quantize_blocks(values, src_type, Q.Q5_K, QK_K, Q5_K_BYTES)


# --------------------------------------------------------------------------------------------- MXFP4
#
# ggml's quantize_row_mxfp4_ref: per 32 values, the E8M0 exponent e = (uint8_t)(floorf(log2f(amax)) - 2 + 127)
# (amax: the largest |x|, NaN never counted), then each value the first of kvalues_mxfp4 whose distance
# |k * d - x| (d = 2^(e - 128), float32) is smallest; value j in the low nibble of byte j, value j + 16 in its high.
# floorf(log2f(amax)) is the floor of the exact logarithm unless log2f rounds up to the next integer, which only an
# amax a hair below a power of two can make it do: those few blocks ask the C library's own log2f. A negative or
# infinite result is cast as x86-64 gcc casts it (truncated to int32, its low byte).

MXFP4_BYTES = 17  # the E8M0 exponent, 16 bytes of 4-bit values
_KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)
_GRID_MXFP4 = _KVALUES_MXFP4[:8]  # the magnitudes, ascending; codes 8-15 are their negatives
_MXFP4_FAST_MIN = np.float32(2.0**-100)  # amax from which k * d never vanishes next to a value of the block
# far more than log2f's rounding of any float32 logarithm (|log2| < 150: half an ulp is under 2^-17)
_NEAR_INTEGER = 2.0**-12


def _log2f_floor(amax: np.ndarray) -> np.ndarray:
    """floorf(log2f(amax)) for positive finite float32 ``amax``, as int64: the floor of the exact logarithm, except
    where it lies just below an integer, which log2f may round up to (the C library's own log2f answers those)."""
    exact = np.log2(amax.astype(np.float64))
    out = np.floor(exact).astype(np.int64)
    gap = np.ceil(exact) - exact
    near = (gap > 0) & (gap < _NEAR_INTEGER)
    if near.any():
        log2f = _libm_log2f()
        idx = np.flatnonzero(near)
        out[idx] = [int(np.floor(log2f(float(v)))) for v in amax[idx]]
    return out


@functools.cache
def _libm_log2f() -> Callable[[float], float]:
    """The C library's log2f, the one ggml calls (loaded once)."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.log2f.restype, libm.log2f.argtypes = ctypes.c_float, [ctypes.c_float]
    return libm.log2f


def _mxfp4_codes(x: np.ndarray, d: np.ndarray, usual: np.ndarray) -> np.ndarray:
    """best_index_mxfp4 of every value, packed two to a byte. The errors are C's own float32 expressions; a value's
    best code is one of the two grid points around |x| / d (the errors grow away from it on either side, by at least
    d, more than their rounding), so only those two are compared, the lower winning a tie as C's first-found does.
    Blocks of unusual scale (amax infinite, zero or tiny: k * d can vanish next to x) compare all 16, as C does."""
    idx = np.zeros(x.shape, np.uint8)
    rows = np.flatnonzero(usual)
    if rows.size:
        xs, ds = x[rows], d[rows, None]
        with np.errstate(invalid="ignore", over="ignore"):
            hi = np.minimum(np.searchsorted(_GRID_MXFP4, (np.abs(xs) / ds).reshape(-1)).reshape(xs.shape), 7)
            lo = np.maximum(hi - 1, 0)
            sign = np.where(xs < 0, np.float32(-1), np.float32(1))
            err_lo = np.abs(_GRID_MXFP4[lo] * sign * ds - xs)
            err_hi = np.abs(_GRID_MXFP4[hi] * sign * ds - xs)
        pick = np.where(err_hi < err_lo, hi, lo)
        code = np.where((xs < 0) & (pick > 0), pick + 8, pick)
        idx[rows] = np.where(np.isnan(xs), 0, code).astype(np.uint8)
    rest = np.flatnonzero(~usual)
    if rest.size:
        with np.errstate(invalid="ignore", over="ignore"):
            err = np.abs(_KVALUES_MXFP4[None, None, :] * d[rest, None, None] - x[rest, :, None])
        slow = np.argmin(np.where(np.isnan(err), np.float32(np.inf), err), axis=2).astype(np.uint8)
        slow[np.isnan(err).all(axis=2)] = 0
        idx[rest] = slow
    return idx[:, :16] | (idx[:, 16:] << np.uint8(4))


def quantize_mxfp4(values: np.ndarray, src_type: GGMLQuantizationType = Q.F32) -> np.ndarray:
    """ggml's quantize_row_mxfp4_ref over ``values`` (as for :func:`quantize_q5_0`); the MXFP4 bytes (17 per 32
    values) as a flat uint8 array."""
    src_type = Q(src_type)
    if values.dtype != SOURCE_DTYPES[src_type] or values.size % QK:
        raise ValueError(f"cannot quantize {values.dtype} values ({values.size}) given as {src_type.name} to MXFP4")
    flat = np.ascontiguousarray(values).reshape(-1)
    nbt = flat.size // QK
    if _compiled is not None:
        return _run_compiled(flat.reshape(-1, QK), src_type, Q.MXFP4, nbt * MXFP4_BYTES)
    out = np.empty((nbt, MXFP4_BYTES), np.uint8)
    for b0 in range(0, nbt, GROUP_BLOCKS):
        b1 = min(nbt, b0 + GROUP_BLOCKS)
        x = float_to_f32(flat[b0 * QK:b1 * QK], src_type).reshape(-1, QK)
        a = np.abs(x)
        amax = np.where(np.isnan(a), np.float32(0), a).max(axis=1)
        e = np.zeros(b1 - b0, np.int64)
        finite = np.isfinite(amax) & (amax > 0)
        e[finite] = _log2f_floor(amax[finite]) - 2 + 127  # amax = inf: (int32) inf is 0x80000000, low byte 0
        e = (e & 0xFF).astype(np.uint8)
        bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32),
                        (e.astype(np.uint32) - np.uint32(1)) << np.uint32(23))  # ggml_e8m0_to_fp32_half
        d = bits.astype(np.uint32).view(np.float32)
        out[b0:b1, 1:] = _mxfp4_codes(x, d, np.isfinite(amax) & (amax >= _MXFP4_FAST_MIN))
        out[b0:b1, 0] = e
    return out.reshape(-1)


_EXTRA = {Q.Q5_0: quantize_q5_0, Q.Q5_1: quantize_q5_1, Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k,
          Q.MXFP4: quantize_mxfp4}
