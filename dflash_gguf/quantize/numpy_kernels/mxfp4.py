"""ggml's MXFP4 in numpy: ``quantize_row_mxfp4_ref``, bit for bit.

Per 32 values, the E8M0 exponent e = (uint8_t)(floorf(log2f(amax)) - 2 + 127)
(amax: the largest |x|, NaN never counted), then each value the first of kvalues_mxfp4 whose distance
|k * d - x| (d = 2^(e - 128), float32) is smallest; value j in the low nibble of byte j, value j + 16 in its high.
floorf(log2f(amax)) is the floor of the exact logarithm unless log2f rounds up to the next integer, which only an
amax a hair below a power of two can make it do: those few blocks ask the C library's own log2f. A negative or
infinite result is cast as x86-64 gcc casts it (truncated to int32, its low byte).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from ...ggufio.layout import float_to_f32
from .common import GROUP_BLOCKS, QK

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


def mxfp4_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_mxfp4_ref: ``blocks`` (n x 32 values of ``src_type``) into ``out`` (n x 17 bytes: the E8M0
    exponent, then 16 bytes of 4-bit values)."""
    nbt = blocks.shape[0]
    for b0 in range(0, nbt, GROUP_BLOCKS):
        b1 = min(nbt, b0 + GROUP_BLOCKS)
        x = float_to_f32(blocks[b0:b1].reshape(-1), src_type).reshape(-1, QK)
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
