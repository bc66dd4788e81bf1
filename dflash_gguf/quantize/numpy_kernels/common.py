"""What the numpy kernels share: ggml's block sizes, C's float->int conversions and the widening loads.

Every helper performs the float32 operations ggml's C code performs, one rounding per C operator, so the kernels
built on them give ggml's bytes (see each family's notes for the order of those operations).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
QK = 32  # values per block of the 32-block types (ggml's QK4_0, QK8_0, QK5_0, ...)
QK_K = 256  # values per super-block of the K-quants
GROUP_BLOCKS = 8192  # 32-value blocks per inner step: a 1 MB float32 scratch, about one core's L2
F0, F1, F31, F32 = np.float32(0), np.float32(1), np.float32(31), np.float32(32)
U4, U16 = np.uint8(4), np.uint32(16)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: nearest_int's constant


def inv(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` elementwise (NaN counts as true, as in C)."""
    out = np.zeros_like(d)
    np.divide(F1, d, out=out, where=d != 0)
    return out


def c_to_uint8(y: np.ndarray) -> np.ndarray:
    """The low byte of x86 cvttss2si: truncate toward zero; NaN, inf and |y| >= 2**31 give 0."""
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(y) & (np.abs(y) < np.float32(2.0 ** 31))
    return (np.where(ok, y, np.float32(0)).astype(np.int64) & 0xFF).astype(np.uint8)


def nearest_int(v: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ggml's nearest_int on every element: the low 23 bits of ``v + 1.5*2^23``, minus 2^22 (int32).

    ``out``: an int32 array of v's shape to use (may be ``v.view(np.int32)``: in place)."""
    with np.errstate(all="ignore"):
        f = np.add(v, _MAGIC, out=None if out is None else out.view(np.float32))
    i = f.view(np.int32)
    np.bitwise_and(i, np.int32(0x7FFFFF), out=i)
    np.subtract(i, np.int32(0x400000), out=i)
    return i


def fp16_bits(d: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16: round to nearest even, too large -> inf, NaN -> sign | 0x7E00."""
    with np.errstate(over="ignore", invalid="ignore"):
        h = d.astype(np.float16).view(np.uint16)
    nan = np.isnan(d)
    if nan.any():
        h[nan] = (d[nan].view(np.uint32) >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000) | np.uint16(0x7E00)
    return h


def first_absmax(v: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
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


def load_transposed(src: np.ndarray, qtype: GGMLQuantizationType, width: int, n: int, buf: np.ndarray) -> np.ndarray:
    """``src`` (n runs of ``width`` values of ``qtype``) widened to float32 and transposed: (width x n), in ``buf``."""
    xt = buf[:width * n].reshape(width, n)
    view = src.reshape(n, width).T
    if qtype == Q.BF16:  # exact: a bf16 is the top half of its float32
        x32 = xt.view(np.uint32)
        np.copyto(x32, view)
        np.left_shift(x32, U16, out=x32)
    else:  # F32 copy, F16 exact widening
        np.copyto(xt, view, casting="same_kind")
    return xt


def nan_to(xt: np.ndarray, v: np.float32) -> np.ndarray:
    """``xt`` with its NaNs replaced by ``v``. (Not np.fmin/np.fmax to skip NaNs: given a signalling NaN they
    return a NaN, as C99's fmin does, so a reduction restarts from the values after it.)"""
    return np.where(np.isnan(xt), v, xt)
