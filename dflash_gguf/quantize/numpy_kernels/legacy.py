"""ggml's "legacy" 32-value block types in numpy: Q4_0 and Q8_0 (``quantize_row_q4_0_ref``/``q8_0_ref``), Q5_0 and
Q5_1 (``quantize_row_q5_0_ref``/``q5_1_ref``), bit for bit.

Why not gguf-py's quantizers: they reduce along the 32 elements of each block (numpy loops once per block there),
allocate a temporary per step, need a separate BF16 widening pass, and differ from ggml on an all-zero block that
starts with -0.0 (ggml's scale is then -0.0, gguf-py's +0.0). Here a group of Q4_0/Q8_0 blocks is widened straight
into a (quad-)transposed float32 scratch (8 x 4*n_blocks: row r holds elements 4r..4r+3 of every block), so every
step, the per-block max/min included, is a long contiguous numpy loop over cache-sized data; the transposes in and
out move 8-byte (BF16/F16 in) and 4-byte (packed out) units rather than single values, and groups are large (few GIL
round trips).

Exactness (same float32 operations, in the same order, as the C reference):

* Q4_0 takes the first element with the largest ``|v|`` (ties go to the earlier index), starting from
  ``max = +0.0``; ``d = max / -8``; ``id = d ? 1/d : 0``; ``q = MIN(15, (int8)(x*id + 8.5))``.
* Q8_0: ``d = amax / 127``; ``q = roundf(x*id)`` (half away from zero).
* Non-finite input (NaN/inf) or a scale whose inverse overflows takes a slower vectorised path that mirrors the C
  code's NaN comparisons and x86's float->int conversion (out-of-range -> 0).
* Q5_0/Q5_1: see the notes at their section below.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType

from .common import (
    F0,
    F31,
    F32,
    GROUP_BLOCKS,
    QK,
    U4,
    U16,
    Q,
    c_to_uint8,
    first_absmax,
    fp16_bits,
    inv,
    load_transposed,
    nan_to,
)

_F8_5, _FM8, _F127 = np.float32(8.5), np.float32(-8), np.float32(127)
_U64_4 = np.uint64(4)


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
        np.left_shift(x32, U16, out=x32)
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
        idv = inv(d)
        finite = bool(np.isfinite(mx - mn + idv).all())
    if not finite:
        _q4_0_group_slow(_natural_t(xt), dst16)
        return
    np.multiply(xt, np.repeat(idv, _L), out=xt)
    np.add(xt, _F8_5, out=xt)  # in [0.5, 16.5] here: the truncating cast is C's (int8_t)
    q, q2 = s.q[:QK * nb].reshape(_ROWS, _L * nb), s.q2[:QK * nb].reshape(_ROWS, _L * nb)
    np.copyto(q, xt, casting="unsafe")
    np.right_shift(q, U4, out=q2)
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
        idv = inv(d)
        y = xt * idv + _F8_5
    q = np.minimum(c_to_uint8(y).view(np.int8), np.int8(15)).view(np.uint8)
    dst[:, 2:] = (q[:16] | (q[16:] << U4)).T
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
        idv = inv(d)
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
        idv = inv(d)
        v = xt * idv
        t = np.trunc(v)
        r = t + np.trunc((v - t) * np.float32(2))
        r = np.where(np.isfinite(v), r, v)
    dst[:, 2:] = c_to_uint8(r).T
    _store_d(dst16, d)


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

_FM16, _F16_5, _F0_5 = np.float32(-16), np.float32(16.5), np.float32(0.5)
_FLT_MAX = np.finfo(np.float32).max


class _ColScratch(threading.local):
    """Per-thread float32 buffer for a group of blocks in the transposed (32 x n) layout."""

    def __init__(self) -> None:
        self.xt = np.empty(QK * GROUP_BLOCKS, np.float32)


_col_scratch = _ColScratch()


def _load_cols(src: np.ndarray, qtype: GGMLQuantizationType, n: int, buf: np.ndarray) -> np.ndarray:
    """``src`` (n runs of 32 values of ``qtype``) widened to float32 and transposed: (32 x n), in ``buf``."""
    return load_transposed(src, qtype, QK, n, buf)


def _pack_q5(q: np.ndarray, qh: np.ndarray, qs: np.ndarray) -> None:
    """The 5-bit values ``q`` (32 x nb uint8) into ``qh`` (nb x 4) and ``qs`` (nb x 16) as ggml lays them out."""
    np.copyto(qs, ((q[:QK // 2] & np.uint8(0x0F)) | (q[QK // 2:] << U4)).T)
    bits = (q >> U4) & np.uint8(1)
    np.copyto(qh, np.packbits(bits, axis=0, bitorder="little").T)  # bit j of the 32-bit LE word: q[j]


def _first_absmax_cols(xt: np.ndarray) -> tuple[np.ndarray, bool]:
    """Per column of ``xt``, C's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` from 0: the first value of
    largest |x| (NaN never wins; +0.0 when every |x| is 0); and whether every value is finite."""
    mxv, mnv = xt.max(axis=0), xt.min(axis=0)  # NaN propagates
    finite = bool(np.isfinite(mxv).all() and np.isfinite(mnv).all())
    if not finite:
        return first_absmax(xt, 0)[1], False
    neg = np.negative(mnv)
    maxv = np.where(neg > mxv, mnv, mxv)
    maxv += F0  # an all-zero block keeps C's initial max = +0.0 (never -0.0)
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
        idv = inv(d)
        # |x*id| <= |max*id| (rounding is monotonic), ~16: x*id + 16.5 then lies in [0, 33), a plain conversion
        fast = finite and bool(np.all(np.abs(maxv * idv) <= _F16_5))
        np.multiply(xt, idv, out=xt)
        np.add(xt, _F16_5, out=xt)
    if fast:
        q = np.empty(xt.shape, np.uint8)
        np.copyto(q, xt, casting="unsafe")
        np.minimum(q, np.uint8(31), out=q)
    else:
        q = np.minimum(c_to_uint8(xt).view(np.int8), np.int8(31)).view(np.uint8)
    dst[:, 0:2] = fp16_bits(d).view(np.uint8).reshape(-1, 2)
    _pack_q5(q, dst[:, 2:6], dst[:, 6:22])


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
        mn = np.minimum(nan_to(xt, _FLT_MAX).min(axis=0), _FLT_MAX)
        mx = np.maximum(nan_to(xt, -_FLT_MAX).max(axis=0), -_FLT_MAX)
    _first_zero(xt, mn)
    _first_zero(xt, mx)
    with np.errstate(all="ignore"):
        d = (mx - mn) / F31
        idv = inv(d)
        # 0 <= (x - min)*id <= (max - min)*id, ~31: + 0.5 stays in [0, 33), a plain conversion
        fast = finite and bool(np.all((mx - mn) * idv <= F32))
        np.subtract(xt, mn, out=xt)
        np.multiply(xt, idv, out=xt)
        np.add(xt, _F0_5, out=xt)
    if fast:
        q = np.empty(xt.shape, np.uint8)
        np.copyto(q, xt, casting="unsafe")
    else:
        q = c_to_uint8(xt)
    dst[:, 0:2] = fp16_bits(d).view(np.uint8).reshape(-1, 2)
    dst[:, 2:4] = fp16_bits(mn).view(np.uint8).reshape(-1, 2)
    _pack_q5(q, dst[:, 4:8], dst[:, 8:24])


# ------------------------------------------------------------------------------------ the block kernels
#
# What a type's record (quantize/types.py) holds: ``kernel(blocks, src_type, out)`` quantizes ``blocks`` (n x 32
# values stored as ``src_type``: float32, float16 or BF16's raw words) into ``out`` (n x the type's bytes, uint8).

_Group = Callable[[np.ndarray, np.ndarray], None]


def _quad_blocks(group: _Group, blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """Q4_0/Q8_0: groups of blocks in the quad-transposed layout, written as 2-byte words (every block is aligned)."""
    out16 = out.view(np.uint16)
    nbt = blocks.shape[0]
    for b0 in range(0, nbt, GROUP_BLOCKS):
        b1 = min(nbt, b0 + GROUP_BLOCKS)
        group(_load_t(blocks[b0:b1], src_type, b1 - b0), out16[b0:b1])


def _column_blocks(group: _Group, blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """Q5_0/Q5_1: groups of blocks in the transposed (32 x n) layout."""
    nbt = blocks.shape[0]
    for b0 in range(0, nbt, GROUP_BLOCKS):
        b1 = min(nbt, b0 + GROUP_BLOCKS)
        group(_load_cols(blocks[b0:b1], src_type, b1 - b0, _col_scratch.xt), out[b0:b1])


def q4_0_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_q4_0_ref: 18 bytes a block (fp16 d, qs[16])."""
    _quad_blocks(_q4_0_group, blocks, src_type, out)


def q8_0_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_q8_0_ref: 34 bytes a block (fp16 d, qs[32])."""
    _quad_blocks(_q8_0_group, blocks, src_type, out)


def q5_0_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_q5_0_ref: 22 bytes a block (fp16 d, qh[4], qs[16])."""
    _column_blocks(_q5_0_group, blocks, src_type, out)


def q5_1_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_q5_1_ref: 24 bytes a block (fp16 d, fp16 m, qh[4], qs[16])."""
    _column_blocks(_q5_1_group, blocks, src_type, out)
