"""ggml's Q6_K in numpy: ``quantize_row_q6_K_ref`` (what ggml_quantize_chunk -> quantize_q6_K runs without an
imatrix), bit for bit.

Per 256-value super-block, make_qx_quants(16, 32, x, L, rmse_type=1, NULL) fits every 16-value
sub-block (an initial scale plus 18 trial scales), the 16 sub-block scales are quantized to int8
against an fp16 super-scale ``d``, then every value is re-quantized to 6 bits against its scale.

Layout: a group of G super-blocks is held transposed, (16 x 16G) float32 with row i holding element
i of every sub-block, so each step of the fit is one long numpy loop over all sub-blocks and the
16-term sums of the fit are 15 sequential row additions -- exactly C's left-to-right order, which a
numpy reduction (pairwise when contiguous) would not guarantee.

Exactness notes (all arithmetic is float32, one rounding per C operator; ggml-base is compiled
without -march flags, so x86-64 gcc emits no FMA and nothing is contracted):
* nearest_int(v) reads the mantissa bits of v + 12582912.f (1.5*2^23). For |v| < 2^22 that is
  round-half-even, i.e. np.rint; for NaN/inf/huge v it is garbage that the C code then clamps, so
  those cases use the bit trick itself (``nearest_int``).
* make_qx_quants: ``max`` is the first value with the largest |x| (strict >, NaN never wins);
  ``amax < 1e-15f`` gives scale 0 and L = 0. Sums: sumlx += (x*x*x)*l, suml2 += ((x*x)*l)*l, from
  +0.0. Trial iscale = -(32 + 0.1f*is)/max (product and sum rounded separately); a trial wins when
  ``suml2 > 0 && sumlx*sumlx > best*suml2``, then scale = sumlx/suml2, best = scale*sumlx.
* Super-block: ``max_scale`` = first scale with the largest |scale|; ``< 1e-15f`` -> all-zero block.
  iscale = -128.f/max_scale; d = fp16(1/iscale) (round-to-nearest-even, overflow -> inf);
  scales[j] = (int8) MIN(127, nearest_int(iscale*scale_j)); where fp32(d)*scales[j] != 0 (NaN
  counts), L = clamp(nearest_int(x / (d*scales[j])), -32, 31) + 32, else L stays make_qx_quants'.
"""

from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType

from .common import F0, F31, F32, QK_K, U4, first_absmax, fp16_bits, load_transposed, nearest_int

Q6_K_GROUP = 256  # super-blocks per step: 16 x 4096 float32 work arrays, ~3.5 MB of scratch per thread
_SUB = 16
_FM32, _FM128 = np.float32(-32), np.float32(-128)
_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
# make_qx_quants' scales in its order: the initial -nmax/max, then is = -9..-1, 1..9. C computes
# nmax + 0.1f*is as two rounded float operations; the numerators here are -(that), exactly.
_TRIALS = (0, *range(-9, 0), *range(1, 10))
_NEG_C = np.array([-(F32 + np.float32(np.float32(0.1) * np.float32(i))) for i in _TRIALS], np.float32)
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


def _round_clamp(v: np.ndarray, hi: bool, lo: bool, bits: bool) -> None:
    """In place: ``(float) MAX(-32, MIN(31, nearest_int(v)))``.

    ``bits`` False is allowed only when every value is finite and below 2^22 in magnitude: nearest_int is then
    np.rint (round half to even), which commutes with a clamp to integers; ``hi``/``lo`` skip a clamp
    that cannot bite."""
    if bits:
        i = nearest_int(v, out=v.view(np.int32))
        np.clip(i, -32, 31, out=i)
        np.copyto(v, i, casting="unsafe")  # same-size elementwise cast: safe in place
        return
    if hi:  # fmin/fmax (no NaN here) are faster than minimum/maximum
        np.fmin(v, F31, out=v)
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
        amax, mx = first_absmax(xt, 0)
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
            np.add(t[0], F0, out=acc)  # sumlx = suml2 = 0, then += in index order
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
        np.greater(suml2, F0, out=won)
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
    np.add(lf, F32, out=lf)
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
    max_abs, max_scale = first_absmax(sc, 1)
    zero = ~(max_abs >= _EPS)
    max_scale[zero] = 1  # placeholder: those blocks are all zero bytes
    with np.errstate(all="ignore"):
        iscale = _FM128 / max_scale
        d16 = fp16_bits(np.float32(1) / iscale)
        q = nearest_int(iscale[:, None] * sc)
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
        i = nearest_int(v, out=v.view(np.int32))
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
    np.left_shift(lb[:, :, 2:], U4, out=ql)
    np.bitwise_or(ql, lb[:, :, :2] & np.uint8(0xF), out=ql)
    hi = lb >> U4
    hi <<= np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    qh = dst[:, 128:192].reshape(ng, 2, 32)
    np.bitwise_or(np.bitwise_or(hi[:, :, 0], hi[:, :, 1]), np.bitwise_or(hi[:, :, 2], hi[:, :, 3]), out=qh)
    dst[:, 192:208] = q8
    dst[:, 208:210] = d16.view(np.uint8).reshape(ng, 2)
    dst[zero] = 0


def _load_q6_t(src: np.ndarray, qtype: GGMLQuantizationType, ng: int) -> np.ndarray:
    """``src`` (ng super-blocks of ``qtype``) widened to float32, transposed to 16 x 16*ng (scratch)."""
    return load_transposed(src, qtype, _SUB, QK_K * ng // _SUB, _q6_scratch.xt)


def q6_k_blocks(blocks: np.ndarray, src_type: GGMLQuantizationType, out: np.ndarray) -> None:
    """quantize_row_q6_K_ref: ``blocks`` (n x 256 values of ``src_type``) into ``out`` (n x 210 bytes: ql[128],
    qh[64], int8 scales[16], fp16 d), in groups of Q6_K_GROUP super-blocks."""
    nbt = blocks.shape[0]
    for b0 in range(0, nbt, Q6_K_GROUP):
        b1 = min(nbt, b0 + Q6_K_GROUP)
        _q6_k_group(_load_q6_t(blocks[b0:b1], src_type, b1 - b0), out[b0:b1])
