/* Q4_K and Q5_K super-blocks: quantize_row_q4_K_ref / quantize_row_q5_K_ref (ggml-quants.c), KQ_G * KQ_N / 8
 * super-blocks at a time, and make_qkx3_quants' fits of the weighted Q4_K/Q5_K/Q4_1/Q5_1 (qkx3_group). Included by _kernels.c once per instruction set, as a template:
 *   KQ_N       lanes of a vector: one per sub-block of 32 values (8 per super-block)
 *   KQ_G       independent chains of vectors: a group is KQ_G * KQ_N / 8 super-blocks
 *   KQ_ANY(m)  whether any lane of the comparison result m is set
 *   KQ_FN(f)   the instantiation's name for f
 *   KQ_TARGET  its function attribute (empty, or target("avx2") ...)
 *   KQ_HW      lanes of the native vector KQ_NATIVE; KQ_NMIN, KQ_NMAX, KQ_NSQRT its minps, maxps, sqrtps
 *
 * make_qkx2_quants' trials cannot run side by side: a winning trial moves `min`, which every later trial uses. So
 * the sub-blocks run side by side instead, one per lane (the super-blocks transposed, lane j holding sub-block j of
 * the group): each lane performs C's operations on its own sub-block in C's order (every sum in index order), and
 * C's branches become per-lane selects, so each lane computes what C computes. The chains of a group are
 * independent: a trial is a chain of some 70 additions, and two of them in flight hide their latency.
 *
 * Fewer instructions than C, same values:
 * - a trial's levels MIN(nmax, nearest_int(v)) are computed in float, (v + 1.5*2^23) - 1.5*2^23 then minps, when
 *   every lane's iscale is finite and positive, the group's values are finite and no v is below -2^21 ("plain"
 *   trials, nearly all): then -2^21 <= v = iscale*(x - min) <= about nmax, where nearest_int is that rounding,
 *   exactly, as a float (and the clamp from below is needed only where a fitted min lies above a value);
 *   other trials take nearest_int's bit arithmetic (level_exact), exact for any v, NaN payloads included;
 * - a trial's levels are not copied into L when it wins: the winner's iscale and min are kept per lane, and L is
 *   computed from them once at the end (the same operations on the same values give the same levels);
 * - a lane whose values are all equal (C's early return, max == min) divides by 1 instead of 0, so that its
 *   trials stay plain; it never wins, and its L, scale and min are C's at the end.
 */

#define VF KQ_FN(vf)
#define VI KQ_FN(vi)
#define KQ_SB (KQ_G * KQ_N / KSUB) /* super-blocks a group */

typedef float VF __attribute__((vector_size(KQ_N * 4)));
typedef int32_t VI __attribute__((vector_size(KQ_N * 4)));

KALWAYS KQ_TARGET VF KQ_FN(splat)(float v) { return (VF){0} + v; }

KALWAYS KQ_TARGET VI KQ_FN(splati)(int32_t v) { return (VI){0} + v; }

KALWAYS KQ_TARGET VF KQ_FN(sel)(VI m, VF a, VF b) { return (VF)(((VI)a & m) | ((VI)b & ~m)); }

KALWAYS KQ_TARGET int KQ_FN(any)(VI m) {
    int any = 0;
    for (int k = 0; k < KQ_N; ++k) {
        any |= m[k] != 0;
    }
    return any;
}

/* A native two-operand instruction on each slice of the vectors: KQ_NMIN / KQ_NMAX are C's `a < b ? a : b` and
 * `a > b ? a : b` when neither is NaN. */
#define KQ_SLICED(name, NATIVE_OP)                                                                                   \
    KALWAYS KQ_TARGET VF KQ_FN(name)(VF a, VF b) {                                                                  \
        union {                                                                                                    \
            VF v;                                                                                                  \
            KQ_NATIVE n[KQ_N / KQ_HW];                                                                             \
        } ua, ub;                                                                                                  \
        ua.v = a;                                                                                                  \
        ub.v = b;                                                                                                  \
        for (int k = 0; k < KQ_N / KQ_HW; ++k) {                                                                   \
            ua.n[k] = NATIVE_OP(ua.n[k], ub.n[k]);                                                                 \
        }                                                                                                          \
        return ua.v;                                                                                               \
    }
KQ_SLICED(vmin, KQ_NMIN)
KQ_SLICED(vmax, KQ_NMAX)
#undef KQ_SLICED

/* MAX(0, MIN(top, r)) per lane for r without NaN */
KALWAYS KQ_TARGET VF KQ_FN(clamp)(VF r, VF top) { return KQ_FN(vmax)(KQ_FN(vmin)(r, top), KQ_FN(splat)(0.0f)); }

/* sqrtf per lane: the native sqrtps (IEEE, as sqrtf) on each slice */
KALWAYS KQ_TARGET VF KQ_FN(vsqrt)(VF v) {
    union {
        VF v;
        KQ_NATIVE n[KQ_N / KQ_HW];
    } u;
    u.v = v;
    for (int k = 0; k < KQ_N / KQ_HW; ++k) {
        u.n[k] = KQ_NSQRT(u.n[k]);
    }
    return u.v;
}

KALWAYS KQ_TARGET VF KQ_FN(cvt)(VI q) {
#if defined(__clang__) || __GNUC__ >= 9
    return __builtin_convertvector(q, VF);
#else
    VF f;
    for (int k = 0; k < KQ_N; ++k) {
        f[k] = (float)q[k];
    }
    return f;
#endif
}

/* MAX(0, MIN(nmax, nearest_int(v))) per lane, as a float: nearest_int's bit arithmetic, exact for any v. */
KALWAYS KQ_TARGET VF KQ_FN(level_exact)(VF v, int nmax) {
    VI q = ((VI)(v + KQ_FN(splat)(ROUND_MAGIC)) & 0x007FFFFF) - 0x00400000;
    const VI hi = KQ_FN(splati)(nmax);
    const VI over = q > hi;
    q = (q & ~over) | (hi & over);
    q &= q > 0; /* MAX(0, q) */
    return KQ_FN(cvt)(q);
}

/* The fit's iscale*(x - min): where both are NaN (a NaN x[0] makes a lane's iscale NaN; another NaN x), ggml's
 * build keeps the NaN of x - min (measured); the operand order of our multiplication is our compiler's choice,
 * so the result is set to it there, quieted as the multiplication does. */
KALWAYS KQ_TARGET VF KQ_FN(scaled)(VF iscale, VF xm, int iscale_nan) {
    VF v = iscale * xm;
    if (iscale_nan) {
        v = KQ_FN(sel)((iscale != iscale) & (xm != xm), (VF)((VI)xm | 0x00400000), v);
    }
    return v;
}

/* v's level MIN(nmax, nearest_int(v)) as a float on a plain trial (see the top): the rounding, then the clamp; from
 * below only when some v may be negative (plain == 1). */
KALWAYS KQ_TARGET VF KQ_FN(level_plain)(VF v, VF top, int plain) {
    const VF magic = KQ_FN(splat)(ROUND_MAGIC);
    return plain == 2 ? KQ_FN(vmin)((v + magic) - magic, top) : KQ_FN(clamp)((v + magic) - magic, top);
}

/* One trial's levels of every value (la), exactly as C: the plain float rounding or the exact bit arithmetic. */
KALWAYS KQ_TARGET void KQ_FN(levels)(VF xt[KQ_G][KLEN], const VF iscale[KQ_G], const VF min[KQ_G], int plain, int nmax,
                                     VF la[KQ_G][KLEN]) {
    if (plain) {
        const VF top = KQ_FN(splat)((float)nmax);
        for (int i = 0; i < KLEN; ++i) {
            for (int g = 0; g < KQ_G; ++g) {
                la[g][i] = KQ_FN(level_plain)(iscale[g] * (xt[g][i] - min[g]), top, plain);
            }
        }
        return;
    }
    for (int g = 0; g < KQ_G; ++g) {
        const int iscale_nan = KQ_FN(any)(iscale[g] != iscale[g]);
        for (int i = 0; i < KLEN; ++i) {
            la[g][i] = KQ_FN(level_exact)(KQ_FN(scaled)(iscale[g], xt[g][i] - min[g], iscale_nan), nmax);
        }
    }
}

/* A trial's levels (la) and C's sums of them: sum_l = sum w*l, sum_l2 = sum w*l*l, sum_xl = sum w*l*x, in order. On
 * a plain trial in one loop, each level used as it is made. */
KALWAYS KQ_TARGET void KQ_FN(levels_sums)(VF xt[KQ_G][KLEN], VF w[KQ_G][KLEN], const VF iscale[KQ_G],
                                          const VF min[KQ_G], int plain, int nmax, VF la[KQ_G][KLEN], VF sum_l[KQ_G],
                                          VF sum_l2[KQ_G], VF sum_xl[KQ_G]) {
    const VF top = KQ_FN(splat)((float)nmax);
    if (!plain) {
        KQ_FN(levels)(xt, iscale, min, plain, nmax, la);
    }
    for (int g = 0; g < KQ_G; ++g) {
        sum_l[g] = sum_l2[g] = sum_xl[g] = KQ_FN(splat)(0.0f);
    }
    for (int i = 0; i < KLEN; ++i) {
        for (int g = 0; g < KQ_G; ++g) {
            if (plain) {
                la[g][i] = KQ_FN(level_plain)(iscale[g] * (xt[g][i] - min[g]), top, plain);
            }
            const VF wl = w[g][i] * la[g][i];
            sum_l[g] += wl;
            sum_l2[g] += wl * la[g][i];
            sum_xl[g] += wl * xt[g][i];
        }
    }
}

/* Whether a trial is plain (see the top) in one chain: 0 if not; else every lane's iscale is finite and positive
 * and its smallest v = iscale*(lo - min) (lo: the lane's smallest value; a fitted min may lie above it) is at least
 * -2^21: 2 if that v is never negative, else 1. */
KALWAYS KQ_TARGET int KQ_FN(plain)(VF iscale, VF lo, VF min) {
    const VF inf = KQ_FN(splat)(INFINITY);
    const VF low = iscale * (lo - min);
    if (KQ_ANY(~((iscale > 0.0f) & (iscale < inf) & (low >= -0x1.0p21f)))) {
        return 0;
    }
    return KQ_ANY(low < 0.0f) ? 1 : 2;
}

/* C's error sum of a fit: sum over i, in order from +0.0, of w*((scale*L + min - x)^2). */
KALWAYS KQ_TARGET void KQ_FN(error)(VF xt[KQ_G][KLEN], VF w[KQ_G][KLEN], VF l[KQ_G][KLEN], const VF scale[KQ_G],
                                    const VF min[KQ_G], VF err[KQ_G]) {
    for (int g = 0; g < KQ_G; ++g) {
        err[g] = KQ_FN(splat)(0.0f);
    }
    for (int i = 0; i < KLEN; ++i) {
        for (int g = 0; g < KQ_G; ++g) {
            VF diff = scale[g] * l[g][i] + min[g] - xt[g][i];
            diff = diff * diff;
            err[g] += w[g][i] * diff;
        }
    }
}

/* make_qkx2_quants(32, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, false) on the KQ_G * KQ_N
 * sub-blocks xt (transposed: xt[g][i] holds value i of chain g's sub-blocks) with weights w: L (as floats), the
 * scales and the mins. Chains are independent; every loop over them is innermost, so their work interleaves. */
KALWAYS KQ_TARGET void KQ_FN(qkx2)(VF xt[KQ_G][KLEN], VF w[KQ_G][KLEN], const kq_params *p, int finite,
                                   VF L[KQ_G][KLEN], VF scales[KQ_G], VF the_min[KQ_G], int *all_plain) {
    const int nmax = p->nmax;
    const VF zerof = KQ_FN(splat)(0.0f), one = KQ_FN(splat)(1.0f);
    VF min[KQ_G], max[KQ_G], sum_w[KQ_G], sum_x[KQ_G], lo[KQ_G], min0[KQ_G], range[KQ_G], iscale[KQ_G], scale[KQ_G];
    VF best[KQ_G], win_iscale[KQ_G], win_min[KQ_G];
    VI zero[KQ_G];
    VF la[KQ_G][KLEN];
    for (int g = 0; g < KQ_G; ++g) {
        min[g] = max[g] = xt[g][0];
        sum_w[g] = w[g][0];
        sum_x[g] = sum_w[g] * xt[g][0];
    }
    for (int i = 1; i < KLEN; ++i) {
        for (int g = 0; g < KQ_G; ++g) {
            min[g] = KQ_FN(sel)(xt[g][i] < min[g], xt[g][i], min[g]);
            max[g] = KQ_FN(sel)(xt[g][i] > max[g], xt[g][i], max[g]);
            sum_w[g] += w[g][i];
            sum_x[g] += w[g][i] * xt[g][i];
        }
    }
    int plain = finite ? 2 : 0;
    for (int g = 0; g < KQ_G; ++g) {
        lo[g] = min[g];
        min0[g] = min[g] = KQ_FN(sel)(min[g] > 0.0f, zerof, min[g]);
        zero[g] = max[g] == min[g]; /* C returns early there: its lanes divide by 1 below and are C's at the end */
        range[g] = KQ_FN(sel)(zero[g], one, max[g] - min[g]);
        iscale[g] = KQ_FN(splat)(p->lanes[0]) / range[g];
        scale[g] = 1.0f / iscale[g];
        const int chain = KQ_FN(plain)(iscale[g], lo[g], min[g]);
        plain = chain < plain ? chain : plain;
    }
    *all_plain = plain != 0;
    KQ_FN(levels)(xt, iscale, min, plain, nmax, la);
    KQ_FN(error)(xt, w, la, scale, min, best);
    for (int g = 0; g < KQ_G; ++g) {
        win_iscale[g] = iscale[g]; /* the levels' iscale and min of the best fit so far */
        win_min[g] = min[g];
    }
    for (int t = 1; t < p->nlanes; ++t) {
        plain = finite ? 2 : 0;
        for (int g = 0; g < KQ_G; ++g) {
            iscale[g] = KQ_FN(splat)(p->lanes[t]) / range[g];
            const int chain = KQ_FN(plain)(iscale[g], lo[g], min[g]);
            plain = chain < plain ? chain : plain;
        }
        *all_plain &= plain != 0;
        VF sum_l[KQ_G], sum_l2[KQ_G], sum_xl[KQ_G], this_scale[KQ_G], this_min[KQ_G], cur[KQ_G], D[KQ_G];
        KQ_FN(levels_sums)(xt, w, iscale, min, plain, nmax, la, sum_l, sum_l2, sum_xl);
        for (int g = 0; g < KQ_G; ++g) {
            D[g] = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
            this_scale[g] = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / D[g];
            this_min[g] = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / D[g];
            const VI pos = this_min[g] > 0.0f;
            this_min[g] = KQ_FN(sel)(pos, zerof, this_min[g]);
            this_scale[g] = KQ_FN(sel)(pos, sum_xl[g] / sum_l2[g], this_scale[g]);
        }
        KQ_FN(error)(xt, w, la, this_scale, this_min, cur);
        for (int g = 0; g < KQ_G; ++g) {
            /* if (D > 0) { ... if (cur_error < best_error) { ... } } */
            const VI won = (D[g] > 0.0f) & (cur[g] < best[g]) & ~zero[g];
            if (!KQ_ANY(won)) {
                continue;
            }
            best[g] = KQ_FN(sel)(won, cur[g], best[g]);
            scale[g] = KQ_FN(sel)(won, this_scale[g], scale[g]);
            win_iscale[g] = KQ_FN(sel)(won, iscale[g], win_iscale[g]);
            win_min[g] = KQ_FN(sel)(won, min[g], win_min[g]);
            min[g] = KQ_FN(sel)(won, this_min[g], min[g]);
            range[g] = KQ_FN(sel)(zero[g], one, max[g] - min[g]);
        }
    }
    KQ_FN(levels)(xt, win_iscale, win_min, 0, nmax, L);
    for (int g = 0; g < KQ_G; ++g) {
        for (int i = 0; i < KLEN; ++i) {
            L[g][i] = KQ_FN(sel)(zero[g], zerof, L[g][i]);
        }
        the_min[g] = -KQ_FN(sel)(zero[g], min0[g], min[g]);
        scales[g] = KQ_FN(sel)(zero[g], zerof, scale[g]);
    }
}

/* quantize_row_q4_K_ref (q5 = 0: 144 bytes: fp16 d, fp16 dmin, scales[12], qs[128]) or quantize_row_q5_K_ref
 * (q5 = 1: 176 bytes: d, dmin, scales[12], qh[32], qs[128]) of the KQ_SB super-blocks at x, one after another. */
KQ_TARGET static void KQ_FN(qk_group)(const float *restrict x, uint8_t *restrict y, const kq_params *p, int q5) {
    const int nmax = p->nmax;
    VF xt[KQ_G][KLEN], w[KQ_G][KLEN], L[KQ_G][KLEN], scales[KQ_G], mins[KQ_G], d[KQ_G], dm[KQ_G];
    for (int g = 0; g < KQ_G; ++g) {
        for (int i = 0; i < KLEN; ++i) {
            for (int j = 0; j < KQ_N; ++j) {
                xt[g][i][j] = x[KLEN * (KQ_N * g + j) + i];
            }
        }
    }
    const int finite = all_finite(x, KQ_G * KQ_N * KLEN);
    for (int g = 0; g < KQ_G; ++g) {
        VF sum_x2 = KQ_FN(splat)(0.0f);
        for (int i = 0; i < KLEN; ++i) {
            sum_x2 += xt[g][i] * xt[g][i];
        }
        const VF m2 = sum_x2 / 32.0f;
        VF av_x;
        for (int j = 0; j < KQ_N; ++j) {
            av_x[j] = sqrtf(m2[j]);
        }
        for (int i = 0; i < KLEN; ++i) {
            w[g][i] = av_x + (VF)((VI)xt[g][i] & 0x7FFFFFFF);
        }
    }
    int all_plain;
    KQ_FN(qkx2)(xt, w, p, finite, L, scales, mins, &all_plain);
    int redo = 0;
    for (int b = 0; b < KQ_SB; ++b) {
        uint8_t *yb = y + (q5 ? 176 : 144) * b;
        const int g = KSUB * b / KQ_N, j0 = KSUB * b % KQ_N; /* super-block b: lanes j0.. of chain g */
        float max_scale = 0, max_min = 0;
        for (int j = j0; j < j0 + KSUB; ++j) {
            if (scales[g][j] > max_scale) {
                max_scale = scales[g][j];
            }
            if (mins[g][j] > max_min) {
                max_min = mins[g][j];
            }
        }
        const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
        const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
        uint8_t ls[KSUB], lm[KSUB];
        for (int j = 0; j < KSUB; ++j) {
            const uint8_t a = (uint8_t)nearest_int(inv_scale * scales[g][j0 + j]); /* the int's low byte */
            const uint8_t c = (uint8_t)nearest_int(inv_min * mins[g][j0 + j]);
            ls[j] = a < 63 ? a : 63;
            lm[j] = c < 63 ? c : 63;
        }
        uint8_t *sc = yb + 4;
        for (int j = 0; j < 4; ++j) { /* what get_scale_min_k4 reads back */
            sc[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
            sc[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
            sc[j + 8] = (uint8_t)((ls[j + 4] & 0xF) | ((lm[j + 4] & 0xF) << 4));
        }
        const uint16_t dh = fp32_to_fp16(max_scale / 63.f), mh = fp32_to_fp16(max_min / 63.f);
        store_fp16(yb, dh);
        store_fp16(yb + 2, mh);
        const float df = fp16_to_fp32(dh), mf = fp16_to_fp32(mh);
        for (int j = 0; j < KSUB; ++j) {
            d[g][j0 + j] = df * ls[j];
            dm[g][j0 + j] = mf * lm[j];
            redo |= d[g][j0 + j] != 0; /* `if (!d) continue;`: NaN counts as non-zero */
        }
    }
    for (int g = 0; redo && g < KQ_G; ++g) {
        const VI keep = d[g] == 0.0f;
        const VI dm_nan = dm[g] != dm[g];
        const int any_nan = KQ_FN(any)(dm_nan);
        for (int i = 0; i < KLEN; ++i) {
            VF v = xt[g][i] + dm[g];
            if (any_nan) { /* where x and dm are both NaN: the operand ggml's build keeps (see KQ_X_FIRST) */
                const VI both = (xt[g][i] != xt[g][i]) & dm_nan;
                const VF first = i < KQ_X_FIRST ? xt[g][i] : dm[g];
                v = KQ_FN(sel)(both, (VF)((VI)first | 0x00400000), v);
            }
            L[g][i] = KQ_FN(sel)(keep, L[g][i], KQ_FN(level_exact)(v / d[g], nmax));
        }
    }
    /* the levels row by row (value i of every lane) into the bytes they share: qs[32k + i] holds sub-blocks 2k (low
     * nibble) and 2k + 1 (high); Q5_K's qh[i] has bit 4 of sub-block j's level as bit j */
    for (int g = 0; g < KQ_G; ++g) {
        for (int i = 0; i < KLEN; ++i) {
            int32_t r[KQ_N];
            const VI q = __builtin_convertvector(L[g][i], VI);
            memcpy(r, &q, sizeof q);
            for (int j0 = 0; j0 < KQ_N; j0 += KSUB) {
                uint8_t *yb = y + (q5 ? 176 : 144) * ((KQ_N * g + j0) / KSUB);
                uint8_t *qs = yb + (q5 ? 48 : 16);
                for (int k = 0; k < KSUB / 2; ++k) {
                    qs[KLEN * k + i] = (uint8_t)((r[j0 + 2 * k] & 0xF) | ((r[j0 + 2 * k + 1] & 0xF) << 4));
                }
                if (q5) {
                    uint8_t h = 0;
                    for (int j = 0; j < KSUB; ++j) {
                        h |= (uint8_t)(((r[j0 + j] >> 4) & 1) << j);
                    }
                    yb[16 + i] = h;
                }
            }
        }
    }
}

/* make_qkx3_quants(32, nmax, x, weights, L, &min, Laux, -0.9f, 0.05f, 36, false) for the KQ_G * KQ_N sub-blocks
 * of 32 at x, one after another, with the weights of quantize_row_q4_K_impl / q5_K / q4_1 / q5_1: qw * sqrtf(sig +
 * x*x), sig given per sub-block (sigma2 of its super-block or row). Its trials are qkx2's but for the level of a v
 * that is NaN, below 0 or beyond nmax: equal on plain trials. So: L (bytes, in x's order), scales, mins (C's
 * the_min) and the weights' sums sw for each sub-block, and 1; or 0 when the values are not all finite or a trial
 * was not plain, and the caller runs the scalar code instead. */
KQ_TARGET static int KQ_FN(qkx3_group)(const float *restrict x, const float *restrict qw, const float *restrict sigma2,
                                       const kq_params *p, uint8_t *restrict L, float *restrict scales,
                                       float *restrict mins, float *restrict sw) {
    if (!all_finite(x, KQ_G * KQ_N * KLEN)) {
        return 0;
    }
    VF xt[KQ_G][KLEN], w[KQ_G][KLEN], Lv[KQ_G][KLEN], sc[KQ_G], mn[KQ_G];
    for (int g = 0; g < KQ_G; ++g) {
        VF sig, q[KLEN];
        for (int j = 0; j < KQ_N; ++j) {
            sig[j] = sigma2[KQ_N * g + j];
        }
        for (int i = 0; i < KLEN; ++i) {
            for (int j = 0; j < KQ_N; ++j) {
                xt[g][i][j] = x[KLEN * (KQ_N * g + j) + i];
                q[i][j] = qw[KLEN * (KQ_N * g + j) + i];
            }
        }
        VF sum_w = KQ_FN(splat)(0.0f);
        for (int i = 0; i < KLEN; ++i) {
            w[g][i] = q[i] * KQ_FN(vsqrt)(sig + xt[g][i] * xt[g][i]);
            sum_w += w[g][i];
        }
        for (int j = 0; j < KQ_N; ++j) {
            sw[KQ_N * g + j] = sum_w[j];
        }
    }
    int all_plain;
    KQ_FN(qkx2)(xt, w, p, 1, Lv, sc, mn, &all_plain);
    if (!all_plain) {
        return 0;
    }
    for (int g = 0; g < KQ_G; ++g) {
        for (int i = 0; i < KLEN; ++i) {
            int32_t r[KQ_N];
            const VI v = __builtin_convertvector(Lv[g][i], VI);
            memcpy(r, &v, sizeof v);
            for (int j = 0; j < KQ_N; ++j) {
                L[KLEN * (KQ_N * g + j) + i] = (uint8_t)r[j];
            }
        }
        for (int j = 0; j < KQ_N; ++j) {
            scales[KQ_N * g + j] = sc[g][j];
            mins[KQ_N * g + j] = mn[g][j];
        }
    }
    return 1;
}

#undef VF
#undef VI
#undef KQ_SB
/* the instantiation's parameters, so that the next one defines its own */
#undef KQ_N
#undef KQ_G
#undef KQ_ANY
#undef KQ_HW
#undef KQ_NATIVE
#undef KQ_NMIN
#undef KQ_NMAX
#undef KQ_NSQRT
#undef KQ_FN
#undef KQ_TARGET
