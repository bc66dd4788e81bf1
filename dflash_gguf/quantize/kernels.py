"""Bit-exact numpy Q4_0/Q8_0/Q6_K kernels: ggml's ``quantize_row_q4_0_ref``/``q8_0_ref``/``q6_K_ref``; and F16/BF16.

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
* F16 and BF16 (``round_floats``): ggml_quantize_chunk's roundings, NaN rules included.

Compiled path: when the optional C extension ``_kernels`` (``_kernels.c``, built by setup.py) imports,
``quantize_rows``/``quantize_q6_k`` run it instead: the same bytes, several times faster, GIL released.
``DFLASH_GGUF_KERNELS=numpy`` forces these numpy kernels, ``=compiled`` refuses to run without the
extension; :func:`kernel_path` says which one is active. A CPython extension rather than a ctypes library:
setuptools builds and names it for the interpreter, and a missing build is simply an ImportError.
"""

from __future__ import annotations

import os
import threading
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
QUANT_TYPES = (*_OUT_BYTES, Q.Q6_K)  # quantize_rows makes all of them (Q6_K through quantize_q6_k)
# Source types read directly (BF16 as its raw 16-bit words); anything else is widened first.
SOURCE_DTYPES = {Q.F32: np.dtype(np.float32), Q.F16: np.dtype(np.float16), Q.BF16: np.dtype(np.uint16)}


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
    """Quantize ``values`` to ``dst_type`` (Q4_0, Q8_0 or Q6_K); return the tensor bytes as a flat uint8 array.

    ``values``: float32 (``src_type`` F32), float16 (F16) or the raw uint16 words of BF16; any shape
    whose size is a multiple of the block (32; 256 for Q6_K): rows are contiguous, so blocks never
    straddle rows when the row length is a multiple of the block.
    """
    src_type, dst_type = Q(src_type), Q(dst_type)
    if dst_type == Q.Q6_K:
        return quantize_q6_k(values, src_type)
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


_SCALE_AT = {Q.Q4_0: 0, Q.Q8_0: 0, Q.Q6_K: 208}  # where each block's fp16 d is
_EXPONENT = {Q.F32: (np.uint32, 0x7F800000), Q.F16: (np.uint16, 0x7C00), Q.BF16: (np.uint16, 0x7F80)}
CHECKED_TYPES = (*_EXPONENT, *_SCALE_AT)  # the types count_nonfinite reads


def count_nonfinite(data: np.ndarray, qtype: GGMLQuantizationType) -> int:
    """NaN or infinite values (F32, F16, BF16) or block scales (Q4_0, Q8_0, Q6_K's fp16 ``d``) in the bytes
    ``data``: what ggml_validate_row_data finds before llama-quantize refuses a tensor."""
    qtype = Q(qtype)
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if _compiled is not None:
        return int(_compiled.count_nonfinite(flat, int(qtype)))
    if qtype in _EXPONENT:
        dtype, mask = _EXPONENT[qtype]
        return int(np.count_nonzero((flat.view(dtype) & dtype(mask)) == dtype(mask)))
    # the fp16 d's high byte holds its exponent bits, 0x7C
    high = flat.reshape(-1, GGML_QUANT_SIZES[qtype][1])[:, _SCALE_AT[qtype] + 1]
    return int(np.count_nonzero((high & np.uint8(0x7C)) == np.uint8(0x7C)))


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


def _load_q6_t(src: np.ndarray, qtype: GGMLQuantizationType, ng: int) -> np.ndarray:
    """``src`` (ng super-blocks of ``qtype``) widened to float32, transposed to 16 x 16*ng (scratch)."""
    n = QK_K * ng
    xt = _q6_scratch.xt[:n].reshape(_SUB, n // _SUB)
    view = src.reshape(n // _SUB, _SUB).T
    if qtype == Q.BF16:  # exact: a bf16 is the top half of its float32
        x32 = xt.view(np.uint32)
        np.copyto(x32, view)
        np.left_shift(x32, _U16, out=x32)
    else:  # F32 copy, F16 exact widening
        np.copyto(xt, view, casting="same_kind")
    return xt


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
