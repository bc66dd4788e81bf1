"""Bit-exact numpy Q4_0/Q8_0 kernels: ggml's ``quantize_row_q4_0_ref``/``quantize_row_q8_0_ref``.

Why not gguf-py's quantizers: they reduce along the 32 elements of each block (numpy loops once
per block there), allocate a temporary per step, need a separate BF16 widening pass, and differ
from ggml on an all-zero block that starts with -0.0 (ggml's scale is then -0.0, gguf-py's +0.0).
Here a group of blocks is widened straight into a *transposed* float32 scratch (32 x n_blocks), so
every step, the per-block max/min included, is a long contiguous numpy loop over cache-sized data.

Exactness (same float32 operations, in the same order, as the C reference):

* Q4_0 takes the first element with the largest ``|v|`` (ties go to the earlier index), starting
  from ``max = +0.0``; ``d = max / -8``; ``id = d ? 1/d : 0``; ``q = MIN(15, (int8)(x*id + 8.5))``.
* Q8_0: ``d = amax / 127``; ``q = roundf(x*id)`` (half away from zero).
* Non-finite input (NaN/inf) or a scale whose inverse overflows takes a slower vectorised path that
  mirrors the C code's NaN comparisons and x86's float->int conversion (out-of-range -> 0).
"""

from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
QK = 32
GROUP_BLOCKS = 2048  # blocks per inner step: a 256 KB float32 scratch, resident in L2
_F1, _F8_5, _FM8, _F127 = np.float32(1), np.float32(8.5), np.float32(-8), np.float32(127)
_U4, _U16 = np.uint8(4), np.uint32(16)
_OUT_BYTES = {Q.Q4_0: 18, Q.Q8_0: 34}
QUANT_TYPES = tuple(_OUT_BYTES)
# Source types read directly (BF16 as its raw 16-bit words); anything else is widened first.
SOURCE_DTYPES = {Q.F32: np.dtype(np.float32), Q.F16: np.dtype(np.float16), Q.BF16: np.dtype(np.uint16)}


class _Scratch(threading.local):
    """Per-thread buffers, reused across groups so no step allocates (or page-faults) fresh memory."""

    def __init__(self) -> None:
        self.xt = np.empty((QK, GROUP_BLOCKS), np.float32)
        self.tt = np.empty((QK, GROUP_BLOCKS), np.float32)
        self.q = np.empty((QK, GROUP_BLOCKS), np.uint8)
        self.q2 = np.empty((QK, GROUP_BLOCKS), np.uint8)


_scratch = _Scratch()


def _load_t(src: np.ndarray, qtype: GGMLQuantizationType, xt: np.ndarray) -> None:
    """Write ``src`` (n_blocks x 32 values of ``qtype``) widened to float32, transposed, into ``xt``."""
    if qtype == Q.BF16:  # exact: a bf16 is the top half of its float32
        np.left_shift(src.T, _U16, out=xt.view(np.uint32))
    else:  # F32, F16 (exact widening)
        np.copyto(xt, src.T, casting="same_kind")


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


def _store_d(dst: np.ndarray, d: np.ndarray) -> None:
    """The fp16 scale (round to nearest even, as GGML_FP32_TO_FP16; too large -> inf, as in ggml)."""
    with np.errstate(over="ignore"):
        np.copyto(dst[:, :2].view(np.float16)[:, 0], d, casting="same_kind")


def _q4_0_group(xt: np.ndarray, dst: np.ndarray) -> None:
    """Quantize ``xt`` (32 x nb float32, destroyed) into ``dst`` (nb x 18 bytes)."""
    s = _scratch
    nb = xt.shape[1]
    mx = xt.max(axis=0)
    mn = xt.min(axis=0)
    neg = np.negative(mn)
    maxv = np.where(neg > mx, mn, mx)
    maxv += np.float32(0)  # an all-zero block keeps C's initial max = +0.0 (never -0.0)
    tie = np.flatnonzero((neg == mx) & (mx != 0))
    if tie.size:  # +a and -a both present: the earlier one wins
        sub = xt[:, tie]
        first_pos = np.argmax(sub == mx[tie], axis=0)
        first_neg = np.argmax(sub == mn[tie], axis=0)
        maxv[tie] = np.where(first_pos < first_neg, mx[tie], mn[tie])
    with np.errstate(over="ignore", invalid="ignore"):
        d = maxv / _FM8
        idv = _inv(d)
        finite = bool(np.isfinite(mx - mn + idv).all())
    if not finite:
        _q4_0_group_slow(xt, dst)
        return
    np.multiply(xt, idv, out=xt)
    np.add(xt, _F8_5, out=xt)  # in [0.5, 16.5] here: the truncating cast is C's (int8_t)
    q, q2 = s.q[:, :nb], s.q2[:16, :nb]
    np.copyto(q, xt, casting="unsafe")
    np.right_shift(q, _U4, out=s.q2[:, :nb])
    np.subtract(q, s.q2[:, :nb], out=q)  # MIN(15, v) for v in 0..16
    np.left_shift(q[16:], _U4, out=q2)
    np.bitwise_or(q2, q[:16], out=q2)
    np.copyto(dst[:, 2:], q2.T)
    _store_d(dst, d)


def _q4_0_group_slow(xt: np.ndarray, dst: np.ndarray) -> None:
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
    _store_d(dst, d)


def _q8_0_group(xt: np.ndarray, dst: np.ndarray) -> None:
    """Quantize ``xt`` (32 x nb float32, destroyed) into ``dst`` (nb x 34 bytes)."""
    s = _scratch
    nb = xt.shape[1]
    mx = xt.max(axis=0)
    mn = xt.min(axis=0)
    amax = np.maximum(mx, np.negative(mn))
    amax += np.float32(0)
    with np.errstate(over="ignore", invalid="ignore"):
        d = amax / _F127
        idv = _inv(d)
        finite = bool(np.isfinite(mx - mn + idv).all())
    if not finite:
        _q8_0_group_slow(xt, dst)
        return
    tt, q, q2 = s.tt[:, :nb], s.q[:, :nb].view(np.int8), s.q2[:, :nb].view(np.int8)
    np.multiply(xt, idv, out=xt)  # |v| <= 127
    # roundf(v) = trunc(v) + trunc(2 * (v - trunc(v))), all steps exact in float32
    np.trunc(xt, out=tt)
    np.subtract(xt, tt, out=xt)
    np.add(xt, xt, out=xt)
    np.copyto(q, tt, casting="unsafe")
    np.copyto(q2, xt, casting="unsafe")
    np.add(q, q2, out=q)
    np.copyto(dst[:, 2:], q.view(np.uint8).T)
    _store_d(dst, d)


def _q8_0_group_slow(xt: np.ndarray, dst: np.ndarray) -> None:
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
    _store_d(dst, d)


_GROUP = {Q.Q4_0: _q4_0_group, Q.Q8_0: _q8_0_group}


def quantize_rows(values: np.ndarray, src_type: GGMLQuantizationType, dst_type: GGMLQuantizationType) -> np.ndarray:
    """Quantize ``values`` to ``dst_type`` (Q4_0 or Q8_0); return the tensor bytes as a flat uint8 array.

    ``values``: float32 (``src_type`` F32), float16 (F16) or the raw uint16 words of BF16; any shape
    whose size is a multiple of 32 (rows are contiguous, so blocks never straddle rows).
    """
    src_type, dst_type = Q(src_type), Q(dst_type)
    want = SOURCE_DTYPES[src_type]
    if values.dtype != want or values.size % QK:
        raise ValueError(f"cannot quantize {values.dtype} values ({values.size}) given as {src_type.name}")
    blocks = np.ascontiguousarray(values).reshape(-1, QK)
    nbt = blocks.shape[0]
    out = np.empty((nbt, _OUT_BYTES[dst_type]), np.uint8)
    group = _GROUP[dst_type]
    xt_all = _scratch.xt
    for b0 in range(0, nbt, GROUP_BLOCKS):
        b1 = min(nbt, b0 + GROUP_BLOCKS)
        xt = xt_all[:, :b1 - b0]
        _load_t(blocks[b0:b1], src_type, xt)
        group(xt, out[b0:b1])
    return out.reshape(-1)
