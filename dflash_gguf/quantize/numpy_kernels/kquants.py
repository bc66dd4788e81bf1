"""ggml's Q4_K and Q5_K in numpy (the K-quants with a per-sub-block min): ``quantize_row_q4_K_ref`` and
``quantize_row_q5_K_ref`` (ggml_quantize_chunk -> quantize_q4_K / quantize_q5_K without an imatrix), bit for bit.

Per 256-value super-block of 8 sub-blocks of 32:
* per sub-block, sum_x2 = x0*x0 + x1*x1 + ... (from +0.0, in index order), av_x = sqrtf(sum_x2/32), weights
  w = av_x + |x|, then make_qkx2_quants(32, nmax, x, w, L, &the_min, Laux, rmin, rdelta, nstep, false) with
  (nmax, rmin, rdelta, nstep) = (15, -1, 0.1, 20) for Q4_K and (31, -0.5, 0.1, 15) for Q5_K;
* 6-bit scales and mins against max_scale/63 and max_min/63 (fp16 d and dmin), then every value requantized
  against its sub-block's fp16-rounded scale and min (where that scale is not 0; NaN counts as not 0).

make_qkx2_quants, step by step (what the numpy and compiled kernels both reproduce):
* min = max = x[0], then ``if (x[i] < min)`` / ``if (x[i] > max)`` (a NaN x[0] sticks, later NaNs never
  count); sum_w = w[0], sum_x = w[0]*x[0], then += w[i] and += w[i]*x[i]; ``if (min > 0) min = 0``;
  max == min: L = 0, scale 0.
* The first fit: iscale = nmax/(max - min), scale = 1/iscale, L = clamp(nearest_int(iscale*(x - min)), 0, nmax),
  best_error = sum of w*((scale*L + min - x)^2) (each step rounded, from +0.0, in index order).
* Then, for is = 0..nstep in order, iscale = (rmin + rdelta*is + nmax)/(max - min) with the *current* min:
  sum_l += w*l, sum_l2 += (w*l)*l, sum_xl += (w*l)*x; D = sum_w*sum_l2 - sum_l*sum_l; when D > 0:
  this_scale = (sum_w*sum_xl - sum_x*sum_l)/D, this_min = (sum_l2*sum_x - sum_l*sum_xl)/D, and if
  this_min > 0: this_min = 0, this_scale = sum_xl/sum_l2; its error as above; when cur_error < best_error the
  trial wins: L, best_error, scale and *min* take its values. A win moves min, so every later trial depends on
  the earlier ones: the trials run in sequence, each over all sub-blocks at once (C's branches as selects).
* nearest_int is the bit trick (see Q6_K). A trial's values iscale*(x - min) lie between iscale*(min_x - min)
  and iscale*(max - min) (rounding is monotonic): when those bounds are finite and below 2^22 for every
  sub-block, np.rint then the clamp gives the same levels; otherwise the bits themselves are used.
* Super-block: max_scale / max_min from 0 with ``>`` (NaN never counts); inv = m > 0 ? 63/m : 0;
  ls = MIN(63, (uint8_t) nearest_int(inv*scale)) (the int's low byte); d = fp16(max_scale/63), dmin likewise;
  then L = clamp(nearest_int((x + fp32(dmin)*lm)/(fp32(d)*ls)), 0, nmax) where fp32(d)*ls != 0. Those values
  are not bounded (a sub-block's min can be far from its 6-bit rounding), so nearest_int's bits are used.
* NaN payloads reach the bytes only through nearest_int, and where two NaNs meet in one commutative operation
  x86 keeps the first operand's, which is the compiler's choice. Two such places feed nearest_int: the
  requantization's x + dm (see _ggml_nan_sum) and the fit's iscale*(x - min) when x[0] is NaN (ggml keeps the
  NaN of x - min); both kernels set what ggml's build gives there, whatever their own operand order.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType

from .common import F0, QK_K, U4, fp16_bits, load_transposed, nan_to, nearest_int

QK_K_SUB = 32  # values per Q4_K/Q5_K sub-block
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


class _Fit(NamedTuple):
    """One type's make_qkx2_quants arguments and layout: levels 0..nmax, the iscale numerators, and whether bit 4
    of every level goes to qh (Q5_K)."""

    nmax: int
    lanes: np.ndarray
    high_bits: bool


_Q4_K = _Fit(15, _qkx2_lanes(15, -1.0, 0.1, 20), False)
_Q5_K = _Fit(31, _qkx2_lanes(31, -0.5, 0.1, 15), True)


class _KScratch(threading.local):
    """Per-thread Q4_K/Q5_K work arrays (see q6_k._Q6Scratch: large temporaries would be fresh, page-faulting
    memory)."""

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
    acc = np.add(t[0], F0) if from_zero else t[0].copy()
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
            return np.clip(out, F0, np.float32(nmax), out=out)
    isc_nan = np.isnan(iscale)
    if isc_nan.any():  # where both are NaN, ggml's build keeps the NaN of x - min (see the notes above)
        both = np.isnan(xm) & isc_nan
        out.view(np.uint32)[both] = xm.view(np.uint32)[both] | np.uint32(0x00400000)
    li = nearest_int(out, out=out.view(np.int32))
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
            mx, mn = nan_to(xt, np.float32(-np.inf)).max(axis=0), nan_to(xt, np.float32(np.inf)).min(axis=0)
            nan0 = np.isnan(xt[0])
            mx[nan0] = xt[0][nan0]
            mn[nan0] = xt[0][nan0]
        x_lo = mn  # every x >= this (and <= mx)
        mn = np.where(mn > F0, F0, mn)  # if (min > 0) min = 0
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
            pos = this_min > F0
            this_min[pos] = 0
            np.copyto(this_scale, sum_xl / sum_l2, where=pos)
            err = _weighted_error(lf, this_scale, this_min, xt, w, terms[:, 0])
            won = (dd > F0) & (err < best)  # `if (D > 0)`, then `if (cur_error < best_error)`
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


def _qk_group(xt: np.ndarray, dst: np.ndarray, fit: _Fit) -> None:
    """quantize_row_q4_K_ref / q5_K_ref: ``xt`` (32 x 8G: the transposed sub-blocks of G super-blocks) into
    ``dst`` (G x 144 or G x 176 uint8)."""
    ng, nmax = dst.shape[0], fit.nmax
    scale, the_min, lq = _make_qkx2_quants(xt, nmax, fit.lanes)
    sc, mins = scale.reshape(ng, 8), the_min.reshape(ng, 8)
    with np.errstate(all="ignore"):
        # from 0, ``if (v > m) m = v``: the largest positive value (NaN never counts), else C's +0.0
        max_scale = np.where(sc > F0, sc, F0).max(axis=1)
        max_min = np.where(mins > F0, mins, F0).max(axis=1)
        inv_scale = np.where(max_scale > F0, _F63 / max_scale, F0)
        inv_min = np.where(max_min > F0, _F63 / max_min, F0)
        ls = np.minimum(nearest_int(inv_scale[:, None] * sc) & 0xFF, 63).astype(np.uint8)
        lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
        d16, dm16 = fp16_bits(max_scale / _F63), fp16_bits(max_min / _F63)
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
            li = nearest_int(v, out=v.view(np.int32))
            np.clip(li, 0, nmax, out=li)
            np.copyto(lq, li, casting="unsafe", where=redo)
    dst[:, 0:2] = d16.view(np.uint8).reshape(ng, 2)
    dst[:, 2:4] = dm16.view(np.uint8).reshape(ng, 2)
    # 6-bit scales and mins: bytes 0-3 ls[0..4) | (ls[4..8) >> 4) << 6, bytes 4-7 lm the same, bytes 8-11
    # (ls[4..8) & 15) | (lm[4..8) & 15) << 4 (get_scale_min_k4 reads them back)
    scales = dst[:, 4:16]
    scales[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> U4) << np.uint8(6))
    scales[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> U4) << np.uint8(6))
    scales[:, 8:12] = (ls[:, 4:] & np.uint8(0xF)) | (lm[:, 4:] << U4)
    lb = lq.T.reshape(ng, 8, QK_K_SUB)  # L of sub-block j, in order
    pairs = lb.reshape(ng, 4, 2, QK_K_SUB)  # sub-blocks 2k (low nibbles) and 2k+1 (high) share 32 bytes
    qs = dst[:, -128:].reshape(ng, 4, QK_K_SUB)
    np.left_shift(pairs[:, :, 1], U4, out=qs)
    np.bitwise_or(qs, pairs[:, :, 0] & np.uint8(0xF), out=qs)
    if fit.high_bits:  # qh[l]: bit j is bit 4 of sub-block j's L[l]
        hi = (lb >> U4) << np.arange(8, dtype=np.uint8)[None, :, None]
        np.bitwise_or.reduce(hi, axis=1, out=dst[:, 16:48])


def _k_blocks(fit: _Fit, blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """``blocks`` (n x 256 values of ``src_type``) into ``out`` (n x the type's bytes), K_GROUP super-blocks at a
    time, each super-block's 8 sub-blocks as columns of a transposed (32 x 8n) group."""
    per = QK_K // QK_K_SUB
    nbt = blocks.shape[0]
    for b0 in range(0, nbt, K_GROUP):
        b1 = min(nbt, b0 + K_GROUP)
        _qk_group(load_transposed(blocks[b0:b1], src_type, QK_K_SUB, per * (b1 - b0), _k_scratch.xt), out[b0:b1],
                  fit)


def q4_k_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_q4_K_ref: 144 bytes a super-block (fp16 d, fp16 dmin, scales[12], qs[128])."""
    _k_blocks(_Q4_K, blocks, src_type, out)


def q5_k_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_q5_K_ref: 176 bytes a super-block (fp16 d, fp16 dmin, scales[12], qh[32], qs[128])."""
    _k_blocks(_Q5_K, blocks, src_type, out)
