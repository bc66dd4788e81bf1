"""Bit-exact numpy Q4_0/Q8_0 kernels: ggml's ``quantize_row_q4_0_ref``/``quantize_row_q8_0_ref``.

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
"""

from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
QK = 32
GROUP_BLOCKS = 8192  # blocks per inner step: a 1 MB float32 scratch, about one core's L2
_F1, _F8_5, _FM8, _F127 = np.float32(1), np.float32(8.5), np.float32(-8), np.float32(127)
_U4, _U16, _U64_4 = np.uint8(4), np.uint32(16), np.uint64(4)
_OUT_BYTES = {Q.Q4_0: 18, Q.Q8_0: 34}
QUANT_TYPES = tuple(_OUT_BYTES)
# Source types read directly (BF16 as its raw 16-bit words); anything else is widened first.
SOURCE_DTYPES = {Q.F32: np.dtype(np.float32), Q.F16: np.dtype(np.float16), Q.BF16: np.dtype(np.uint16)}


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
    out = np.empty((nbt, _OUT_BYTES[dst_type] // 2), np.uint16)  # 2-byte words: every block is aligned
    group = _GROUP[dst_type]
    for b0 in range(0, nbt, GROUP_BLOCKS):
        b1 = min(nbt, b0 + GROUP_BLOCKS)
        group(_load_t(blocks[b0:b1], src_type, b1 - b0), out[b0:b1])
    return out.reshape(-1).view(np.uint8)
