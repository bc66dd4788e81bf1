/* Compiled Q4_0/Q8_0/Q6_K/Q5_0/Q5_1/Q4_K/Q5_K/MXFP4 kernels, the importance-weighted ones (and Q4_1, IQ4_NL,
 * IQ4_XS) and F16/BF16 roundings, bit-exact with ggml b11434's reference quantizers.
 *
 * A plain CPython extension (not a ctypes library): setuptools builds and names it for the running
 * interpreter, import fails cleanly when it was not built (the numpy kernels then take over), the
 * buffer protocol checks sizes and writability, and the GIL is released explicitly around the loop.
 * No numpy headers are needed to build it.
 *
 * Exactness: every float operation is the one ggml's C code performs, in the same order, in float32.
 * Build with -ffp-contract=off and without -ffast-math (setup.py does): ggml-base's portable x86-64
 * build fuses no multiply-adds. Float -> int8 conversions follow x86's cvttss2si (what ggml's
 * `(int8_t) f` compiles to): truncate toward zero and keep the low byte; NaN, inf and |f| >= 2^31
 * give 0.
 *
 * The hot scans use GCC/clang vector extensions (and, on x86, SSE2 intrinsics: the x86-64 baseline);
 * another compiler fails the build, which only means the numpy kernels are used. The build stays portable: AVX2
 * and AVX-512 versions (target attributes, never FMA) are chosen at run time by simd_level() (the CPU's widest,
 * or lower by set_simd / DFLASH_GGUF_SIMD): Q4_0/Q8_0, Q6_K's fits, MXFP4, the K-quant template (_kquants.h,
 * instantiated per instruction set), IQ4's fits. They perform the same float operations, so they give the same
 * bytes; the tests hold every level to libggml.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* DISPATCH_AVX2: x86 with a GCC/clang that has target attributes and __builtin_cpu_supports; the AVX2
 * functions are compiled for AVX2 alone (no FMA, and -ffp-contract=off holds there too). -DNO_AVX2
 * keeps only the SSE2 code. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__) && (defined(__clang__) || __GNUC__ >= 6) && \
    !defined(NO_AVX2)
#define DISPATCH_AVX2 1
#include <immintrin.h>
#else
#define DISPATCH_AVX2 0
#endif

/* DISPATCH_AVX512: the same for AVX-512 (F, VL, BW, DQ), with a compiler that knows it; -DNO_AVX512 drops it. */
#if DISPATCH_AVX2 && (defined(__clang__) || __GNUC__ >= 8) && !defined(NO_AVX512)
#define DISPATCH_AVX512 1
#define AVX512_TARGET "avx512f,avx512vl,avx512bw,avx512dq"
#else
#define DISPATCH_AVX512 0
#endif

/* Independent chains of vectors in the K-quant template (_kquants.h): 8 lanes of AVX2 (one super-block) a chain,
 * 16 of AVX-512 (two) */
#define KQ_AVX2_CHAINS 2
#define KQ_AVX512_CHAINS 2
#define KQ_GROUP_MAX (KQ_AVX512_CHAINS * 2) /* super-blocks in the widest group */

/* Instruction sets of the kernels, by level: the highest this CPU and build have, or a lower one chosen by
 * set_simd (DFLASH_GGUF_SIMD, for tests and comparisons). Every level gives the same bytes. */
enum { SIMD_PORTABLE = 0, SIMD_AVX2 = 1, SIMD_AVX512 = 2 };
static const char *const simd_names[] = {"portable", "avx2", "avx512"};
static int simd_active = -1; /* -1: not chosen yet, the highest available */

static int simd_available(void) {
#if DISPATCH_AVX2
    __builtin_cpu_init();
#if DISPATCH_AVX512
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
        return SIMD_AVX512;
    }
#endif
    return __builtin_cpu_supports("avx2") ? SIMD_AVX2 : SIMD_PORTABLE; /* checks that the OS saves the state */
#else
    return SIMD_PORTABLE;
#endif
}

static int simd_level(void) {
    if (simd_active < 0) {
        simd_active = simd_available();
    }
    return simd_active;
}

/* GGML type ids (ggml.h): the ids Python passes are each type's record's c_id (quantize/types.py, the one place
 * they are named on that side); tests/test_quant_types.py holds the types and sizes quantize() and
 * count_nonfinite() accept to those records. */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13,
       T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39 };

#define QK 32
#define QK_K 256
#define GROUP_MAX_EPS 1e-15f

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* ggml_compute_fp16_to_fp32 (ggml-impl.h): the portable fp16 -> fp32 widening. */
static inline float fp16_to_fp32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = u2f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = u2f((two_w >> 17) | (126u << 23)) - 0.5f;
    return u2f(sign | (two_w < (1u << 27) ? f2u(denormalized) : f2u(normalized)));
}

/* ggml_compute_fp32_to_fp16 (ggml-impl.h): round to nearest even, overflow -> inf, NaN -> sign | 0x7E00. */
static inline uint16_t fp32_to_fp16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f2u(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) {
        bias = 0x71000000u;
    }
    base = u2f((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f2u(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline void store_fp16(uint8_t *dst, uint16_t h) { memcpy(dst, &h, 2); }

/* C's `(int8_t) v` as x86-64 gcc compiles it (cvttss2si, low byte), defined for every v: an out-of-range
 * or NaN v gives cvttss2si's 0x80000000, whose low byte is 0, as does converting 0.0f. Written as a select
 * then a conversion so that the compiler can vectorise it. */
static inline int8_t trunc_i8(float v) {
    const int32_t i = (int32_t)(fabsf(v) < 2147483648.0f ? v : 0.0f);
    return (int8_t)(uint8_t)((uint32_t)i & 0xFFu);
}

/* `(int8_t) roundf(v)` (roundf: half away from zero) without a libm call: trunc(v) plus
 * trunc(2 * (v - trunc(v))), both steps exact for |v| < 2^31 (for |v| >= 2^23, v is an integer and the
 * second term is 0); out of that range, 0 as above. */
static inline int8_t round_i8(float v) {
    const float r = fabsf(v) < 2147483648.0f ? v : 0.0f;
    const int32_t t = (int32_t)r;
    const float frac = r - (float)t;
    const int32_t i = t + (int32_t)(frac + frac);
    return (int8_t)(uint8_t)((uint32_t)i & 0xFFu);
}

/* nearest_int (ggml-quants.c): the mantissa bits of fval + 1.5 * 2^23. */
static inline int nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* C's scan `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from amax = max = 0 over a block of 32:
 * the first value of largest |v| (NaN never wins), or +0.0. Its 4-cycle dependency chain per value is
 * most of Q4_0's time, so the same scan runs in 8 independent lanes (lane k sees x[k], x[k+8], ...) in
 * GCC/clang vectors, then the lane winners are merged: the largest |v|, of equals the smallest index.
 * Also sets *finite: no NaN or inf in the block (the sums of |v| * 0 stay 0). */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

static inline v4f select4(v4i mask, v4f a, v4f b) { return (v4f)(((v4i)a & mask) | ((v4i)b & ~mask)); }

static inline float first_absmax(const float *restrict x, int *restrict finite) {
    const v4i abs_mask = {0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF};
    v4f am[2] = {{0}}, mx[2] = {{0}}, ix[2] = {{0}}, z = {0};
    for (int j = 0; j < QK; j += 8) {
        for (int h = 0; h < 2; ++h) {
            v4f v;
            memcpy(&v, x + j + 4 * h, sizeof v);
            const v4f a = (v4f)((v4i)v & abs_mask);
            const v4i gt = am[h] < a;
            const float j0 = (float)(j + 4 * h);
            const v4f idx = {j0, j0 + 1, j0 + 2, j0 + 3};
            am[h] = select4(gt, a, am[h]);
            mx[h] = select4(gt, v, mx[h]);
            ix[h] = select4(gt, idx, ix[h]);
            z += a * 0.0f;
        }
    }
    *finite = z[0] == 0.0f && z[1] == 0.0f && z[2] == 0.0f && z[3] == 0.0f;
    /* merge without branches (the winning lane is random): 8 lanes to 4, then a select chain */
    const v4i hi = (am[1] > am[0]) | ((am[1] == am[0]) & (ix[1] < ix[0]));
    const v4f am4 = select4(hi, am[1], am[0]), mx4 = select4(hi, mx[1], mx[0]), ix4 = select4(hi, ix[1], ix[0]);
    float amax = am4[0], max = mx4[0], first = ix4[0];
    for (int k = 1; k < 4; ++k) {
        const int take = am4[k] > amax || (am4[k] == amax && ix4[k] < first);
        amax = take ? am4[k] : amax;
        max = take ? mx4[k] : max;
        first = take ? ix4[k] : first;
    }
    return max; /* every |v| 0: every lane holds +0.0 */
}

/* quantize_row_q4_0_ref (ggml-quants.c), one 32-value block -> 18 bytes. */
static void q4_0_block(const float *restrict x, uint8_t *restrict y) {
    int finite;
    const float max = first_absmax(x, &finite);
    const float d = max / -8;
    const float id = d ? 1.0f / d : 0.0f;
    store_fp16(y, fp32_to_fp16(d));
    if (finite && fabsf(id) * fabsf(max) <= 64.0f) {
        /* the usual case: |x * id| <= |max * id| <= 64, so x * id + 8.5f lies in [-56, 73] where (int8_t)
         * is a plain conversion */
        for (int j = 0; j < QK / 2; ++j) {
            const int i0 = (int)(x[j] * id + 8.5f);
            const int i1 = (int)(x[QK / 2 + j] * id + 8.5f);
            const uint8_t xi0 = (uint8_t)(i0 < 15 ? i0 : 15);
            const uint8_t xi1 = (uint8_t)(i1 < 15 ? i1 : 15);
            y[2 + j] = (uint8_t)(xi0 | (xi1 << 4));
        }
        return;
    }
    for (int j = 0; j < QK / 2; ++j) {
        const int8_t i0 = trunc_i8(x[j] * id + 8.5f);
        const int8_t i1 = trunc_i8(x[QK / 2 + j] * id + 8.5f);
        const uint8_t xi0 = (uint8_t)(i0 < 15 ? i0 : 15);
        const uint8_t xi1 = (uint8_t)(i1 < 15 ? i1 : 15);
        y[2 + j] = (uint8_t)(xi0 | (xi1 << 4));
    }
}

/* quantize_row_q8_0_ref (ggml-quants.c), one 32-value block -> 34 bytes. */
static void q8_0_block(const float *restrict x, uint8_t *restrict y) {
    int finite;
    float amax = fabsf(first_absmax(x, &finite)); /* MAX(amax, fabsf(v)) over a block without NaN */
    if (!finite) { /* MAX(a, b) is a > b ? a : b: a NaN replaces amax, and the next value replaces the NaN */
        amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            const float a = fabsf(x[j]);
            amax = amax > a ? amax : a;
        }
    }
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    store_fp16(y, fp32_to_fp16(d));
    for (int j = 0; j < QK; ++j) {
        y[2 + j] = (uint8_t)round_i8(x[j] * id);
    }
}

/* make_qx_quants(16, 32, x, L, rmse_type = 1, qw = NULL) (ggml-quants.c).
 *
 * The 19 trial scales (the initial -nmax/max, then is = -9..-1, 1..9) are fitted side by side: for
 * each element, every trial's running sums take one more term, so each trial's sums are still
 * accumulated in element order (identical to C's loop), and the loop over trials vectorises. The
 * winner is then chosen in C's order, and L recomputed from its iscale (as C does). Used for the
 * super-blocks with a NaN or inf; the others take make_qx_quants_finite, below. */
#define NTRIAL 19
#define NTRIAL_PAD 20

static float make_qx_quants16(const float *x, int8_t *L) {
    const int nmax = 32;
    float max = 0;
    float amax = 0;
    for (int i = 0; i < 16; ++i) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, 16);
        return 0.f;
    }
    float iscale[NTRIAL_PAD], sumlx[NTRIAL_PAD], suml2[NTRIAL_PAD];
    iscale[0] = -nmax / max;
    for (int t = 1, is = -9; is <= 9; ++is) {
        if (is != 0) {
            iscale[t++] = -(nmax + 0.1f * is) / max;
        }
    }
    iscale[NTRIAL] = iscale[0]; /* padding: computed, never read */
    for (int t = 0; t < NTRIAL_PAD; ++t) {
        sumlx[t] = suml2[t] = 0;
    }
    for (int i = 0; i < 16; ++i) {
        const float xi = x[i];
        const float w = xi * xi;
        const float wx = w * xi;
        for (int t = 0; t < NTRIAL_PAD; ++t) {
            int l = nearest_int(iscale[t] * xi);
            l = l < nmax - 1 ? l : nmax - 1;
            l = l > -nmax ? l : -nmax;
            sumlx[t] += wx * l;
            suml2[t] += w * l * l;
        }
    }
    float scale = suml2[0] ? sumlx[0] / suml2[0] : 0.0f;
    float best = scale * sumlx[0];
    int win = 0;
    for (int t = 1; t < NTRIAL; ++t) {
        if (suml2[t] > 0 && sumlx[t] * sumlx[t] > best * suml2[t]) {
            scale = sumlx[t] / suml2[t];
            best = scale * sumlx[t];
            win = t;
        }
    }
    for (int i = 0; i < 16; ++i) {
        int l = nearest_int(iscale[win] * x[i]);
        l = l < nmax - 1 ? l : nmax - 1;
        l = l > -nmax ? l : -nmax;
        L[i] = (int8_t)(l + nmax);
    }
    return scale;
}

/* ---------------------------------------------------------------------------------------------------
 * Q6_K on finite super-blocks (no NaN, no inf: nearly every block), the same bytes as above with fewer
 * instructions. make_qx_quants_finite replaces make_qx_quants16 for the 16 sub-blocks at once (and serves the
 * weighted fits of Q6_K, Q4_0 and Q5_0 too):
 *
 * - qx_max: C's first value of largest |x|.
 * - qx_fit: the 19 trial iscales (one vector division per 4 or 8 trials), and each trial's sumlx and
 *   suml2, the trial loop innermost as in make_qx_quants16 (each trial's sums take their terms in C's
 *   element order, with C's operations: bit-identical). l = MAX(-nmax, MIN(nmax - 1, nearest_int(v)))
 *   is computed in float: |v| = |iscale * x| <= ~33 (|x| <= |max|, |max| >= GROUP_MAX_EPS), so
 *   nearest_int(v) is v rounded to the nearest integer, ties to even, and (v + 1.5 * 2^23) - 1.5 * 2^23
 *   is that integer, exactly, as a float; clamping it with minps/maxps (exact) gives (float)l, the value
 *   C's `w*x[i]*l` converts l to. This skips the int32 clamp, which SSE2 lacks (pminsd is SSE4.1:
 *   some ten instructions a vector), and the int -> float conversion. With a NaN or inf in the block,
 *   v can be NaN (nearest_int then returns payload bits): make_qx_quants16 runs instead.
 * - qx16_choose: the winner in C's order with C's tests.
 * - L from the winner's iscale (nearest_clamp16), as C recomputes it.
 * --------------------------------------------------------------------------------------------------- */

#define ROUND_MAGIC 12582912.f /* 1.5 * 2^23: nearest_int's constant */

/* C's `a < b ? a : b` and `a > b ? a : b` per lane: SSE's minps/maxps are exactly these (the second
 * operand when unordered); written out elsewhere. */
#if defined(__SSE2__)
static inline v4f min4(v4f a, v4f b) { return (v4f)_mm_min_ps((__m128)a, (__m128)b); }
static inline v4f max4(v4f a, v4f b) { return (v4f)_mm_max_ps((__m128)a, (__m128)b); }
/* the lane signs of a comparison result (lanes 0 or -1) as 4 bits, lane k -> bit k */
static inline int movemask4(v4i m) { return _mm_movemask_ps((__m128)m); }
#else
static inline v4f min4(v4f a, v4f b) { return select4(a < b, a, b); }
static inline v4f max4(v4f a, v4f b) { return select4(a > b, a, b); }
static inline int movemask4(v4i m) { return (m[0] & 1) | (m[1] & 2) | (m[2] & 4) | (m[3] & 8); }
#endif

/* No NaN or inf among x[0..n): no value with an all-ones exponent (one pass, vectorised). */
static inline int all_finite(const float *x, int n) {
    uint32_t bad = 0;
    for (int i = 0; i < n; ++i) {
        bad |= (f2u(x[i]) & 0x7F800000u) == 0x7F800000u;
    }
    return !bad;
}

/* L[k] = MAX(-nmax, MIN(nmax - 1, nearest_int(v[k]))) + nmax for 16 values, exactly as C for any v
 * (NaN and inf too: nearest_int's bit arithmetic is kept). nearest_int lies in [-2^22, 2^22), so
 * saturating it to int16 (packssdw) leaves the clamp unchanged, and SSE2 has the 16-bit min/max. */
static inline void nearest_clamp16(const v4f v[4], int nmax, int8_t *L) {
    const v4f magic = {ROUND_MAGIC, ROUND_MAGIC, ROUND_MAGIC, ROUND_MAGIC};
    const v4i mant = {0x007FFFFF, 0x007FFFFF, 0x007FFFFF, 0x007FFFFF};
    const v4i half = {0x00400000, 0x00400000, 0x00400000, 0x00400000};
    v4i q[4];
    for (int k = 0; k < 4; ++k) {
        q[k] = ((v4i)(v[k] + magic) & mant) - half;
    }
#if defined(__SSE2__)
    const __m128i lo = _mm_set1_epi16((short)-nmax), hi = _mm_set1_epi16((short)(nmax - 1));
    const __m128i off = _mm_set1_epi16((short)nmax);
    __m128i h[2];
    for (int k = 0; k < 2; ++k) {
        h[k] = _mm_packs_epi32((__m128i)q[2 * k], (__m128i)q[2 * k + 1]);
        h[k] = _mm_add_epi16(_mm_max_epi16(_mm_min_epi16(h[k], hi), lo), off);
    }
    _mm_storeu_si128((__m128i *)L, _mm_packs_epi16(h[0], h[1]));
#else
    for (int k = 0; k < 16; ++k) {
        int l = q[k / 4][k % 4];
        l = l < nmax - 1 ? l : nmax - 1;
        l = l > -nmax ? l : -nmax;
        L[k] = (int8_t)(l + nmax);
    }
#endif
}

/* The numerators of C's trial iscales, nmax + 0.1f*is, for nmax = 32 (Q6_K), 16 (Q5_0) and 8 (Q4_0) (float
 * arithmetic, which the compiler folds exactly as it would run): lane 0 is C's first fit (-nmax / max =
 * -(nmax + 0) / max), lanes 1..18 are is = -9..-1, 1..9, lanes 19..23 pad the vectors (copies of lane 0, never
 * chosen). */
#define TRIAL_NUM(n, is) ((n) + 0.1f * (is))
#define TRIAL_NUMS(n)                                                                                              \
    {(n),                TRIAL_NUM(n, -9), TRIAL_NUM(n, -8), TRIAL_NUM(n, -7), TRIAL_NUM(n, -6), TRIAL_NUM(n, -5), \
     TRIAL_NUM(n, -4),   TRIAL_NUM(n, -3), TRIAL_NUM(n, -2), TRIAL_NUM(n, -1), TRIAL_NUM(n, 1),  TRIAL_NUM(n, 2),  \
     TRIAL_NUM(n, 3),    TRIAL_NUM(n, 4),  TRIAL_NUM(n, 5),  TRIAL_NUM(n, 6),  TRIAL_NUM(n, 7),  TRIAL_NUM(n, 8),  \
     TRIAL_NUM(n, 9),    (n),              (n),              (n),              (n),              (n)}
#define NLANE 24 /* 6 vectors of 4, 3 of 8 */
static const float trial_nums[3][NLANE] __attribute__((aligned(32))) = {TRIAL_NUMS(32), TRIAL_NUMS(16), TRIAL_NUMS(8)};

static inline const float *trial_num_of(int nmax) { return trial_nums[nmax == 32 ? 0 : nmax == 16 ? 1 : 2]; }

/* One group's trial fits (see above) over its n values: isc[] = -(nmax + 0.1f*is) / max, and each trial's sumlx
 * and suml2, 4 trials a vector, with C's weights: qw[i] when given, else x[i]*x[i] (rmse_type 1 without them).
 * Lanes 0..19 are set. */
static inline void qx_fit(const float *restrict x, const float *restrict qw, int n, int nmax, float max,
                          v4f *restrict isc, v4f *restrict slx, v4f *restrict sl2) {
    const float *num = trial_num_of(nmax);
    const v4f maxv = {max, max, max, max};
    for (int t = 0; t < 5; ++t) {
        v4f nv;
        memcpy(&nv, num + 4 * t, sizeof nv);
        isc[t] = -nv / maxv;
        slx[t] = sl2[t] = (v4f){0};
    }
    const v4f magic = {ROUND_MAGIC, ROUND_MAGIC, ROUND_MAGIC, ROUND_MAGIC};
    const v4f hi = {nmax - 1, nmax - 1, nmax - 1, nmax - 1}, lo = {-nmax, -nmax, -nmax, -nmax};
    /* values outer, trials inner: C's loops swapped, each trial's sums still in element order */
    for (int i = 0; i < n; ++i) {
        const float xi = x[i];
        const float w = qw ? qw[i] : xi * xi;
        const float wx = w * xi;
        const v4f xiv = {xi, xi, xi, xi}, wv = {w, w, w, w}, wxv = {wx, wx, wx, wx};
        for (int t = 0; t < 5; ++t) {
            v4f l = (isc[t] * xiv + magic) - magic;
            l = max4(min4(l, hi), lo);
            slx[t] += wxv * l; /* C: sumlx += w*x[i]*l, i.e. (w*x[i])*l */
            sl2[t] += wv * l * l;
        }
    }
}

#if DISPATCH_AVX2
typedef float v8f __attribute__((vector_size(32)));

static int have_avx2(void) { return simd_level() >= SIMD_AVX2; }

/* qx_fit with 8 trials a vector (lanes 0..23 set), for CPUs with AVX2: the same operations on the same values, so
 * the same sums; three vectors do the work of five. */
__attribute__((target("avx2"))) static void qx_fit_avx2(const float *restrict x, const float *restrict qw, int n,
                                                        int nmax, float max, v4f *restrict isc, v4f *restrict slx,
                                                        v4f *restrict sl2) {
    const float *num = trial_num_of(nmax);
    const v8f maxv = (v8f)_mm256_set1_ps(max);
    /* named vectors rather than arrays, which GCC kept on the stack */
    const v8f is0 = -(v8f)_mm256_load_ps(num) / maxv, is1 = -(v8f)_mm256_load_ps(num + 8) / maxv,
              is2 = -(v8f)_mm256_load_ps(num + 16) / maxv;
    v8f sx0 = {0}, sx1 = {0}, sx2 = {0}, s20 = {0}, s21 = {0}, s22 = {0};
    const __m256 hi = _mm256_set1_ps((float)(nmax - 1)), lo = _mm256_set1_ps((float)-nmax);
    const v8f magic = (v8f)_mm256_set1_ps(ROUND_MAGIC);
    /* the weights and w*x first, 8 at a time, so that the loop broadcasts x, w, w*x from memory (a load, where a
     * broadcast from a register takes the port of an FP adder) */
    float w[32], wx[32];
    for (int h = 0; h < n / 8; ++h) {
        const v8f xh = (v8f)_mm256_loadu_ps(x + 8 * h), wh = qw ? (v8f)_mm256_loadu_ps(qw + 8 * h) : xh * xh;
        const v8f wxh = wh * xh;
        _mm256_storeu_ps(w + 8 * h, (__m256)wh);
        _mm256_storeu_ps(wx + 8 * h, (__m256)wxh);
    }
    for (int i = 0; i < n; ++i) {
        const v8f xiv = (v8f)_mm256_broadcast_ss(x + i), wv = (v8f)_mm256_broadcast_ss(w + i);
        const v8f wxv = (v8f)_mm256_broadcast_ss(wx + i);
        const v8f l0 = (v8f)_mm256_max_ps(_mm256_min_ps((__m256)((is0 * xiv + magic) - magic), hi), lo);
        const v8f l1 = (v8f)_mm256_max_ps(_mm256_min_ps((__m256)((is1 * xiv + magic) - magic), hi), lo);
        const v8f l2 = (v8f)_mm256_max_ps(_mm256_min_ps((__m256)((is2 * xiv + magic) - magic), hi), lo);
        sx0 += wxv * l0;
        sx1 += wxv * l1;
        sx2 += wxv * l2;
        s20 += wv * l0 * l0;
        s21 += wv * l1 * l1;
        s22 += wv * l2 * l2;
    }
    _mm256_storeu_ps((float *)isc, (__m256)is0);
    _mm256_storeu_ps((float *)isc + 8, (__m256)is1);
    _mm256_storeu_ps((float *)isc + 16, (__m256)is2);
    _mm256_storeu_ps((float *)slx, (__m256)sx0);
    _mm256_storeu_ps((float *)slx + 8, (__m256)sx1);
    _mm256_storeu_ps((float *)slx + 16, (__m256)sx2);
    _mm256_storeu_ps((float *)sl2, (__m256)s20);
    _mm256_storeu_ps((float *)sl2 + 8, (__m256)s21);
    _mm256_storeu_ps((float *)sl2 + 16, (__m256)s22);
}
#else
static int have_avx2(void) { return 0; }
#endif

/* C's choice among the trials of make_qx_quants_finite, from their sums (lanes 0..18): returns the
 * winning trial and sets *scale to its scale. C takes trial 0's scale = suml2 ? sumlx/suml2 : 0 and
 * best = scale*sumlx, then for t = 1..18 in order: if (suml2 > 0 && sumlx*sumlx > best*suml2), t wins:
 * scale = sumlx/suml2, best = scale*sumlx. Here every trial's scale and best are computed side by side
 * (the values C computes when it wins; a loser's, maybe 0/0, is never used). Wins are few and random,
 * so a branch per trial mispredicts; instead, from the last winner p (0 at first), the next winner is
 * the first t > p that passes C's test against p's best: each step tests all trials at once and jumps
 * there, until none passes. */
static inline int qx16_choose(const v4f *restrict slx, const v4f *restrict sl2, float *restrict scale) {
    float scl[20], bst[20];
    v4f sq[5];
    int can_win = 0;
    for (int t = 0; t < 5; ++t) {
        const v4f s = slx[t] / sl2[t], b = s * slx[t];
        memcpy(scl + 4 * t, &s, sizeof s);
        memcpy(bst + 4 * t, &b, sizeof b);
        sq[t] = slx[t] * slx[t];
        can_win |= movemask4(sl2[t] > (v4f){0}) << (4 * t);
    }
    can_win &= ((1 << NTRIAL) - 1) & ~1; /* trials 1..18 with suml2 > 0 */
    const float sumlx0 = slx[0][0], suml20 = sl2[0][0];
    const float scale0 = suml20 ? scl[0] : 0.0f;
    float best = suml20 ? bst[0] : scale0 * sumlx0;
    int win = 0;
    for (;;) {
        const v4f bv = {best, best, best, best};
        int pass = 0;
        for (int t = 0; t < 5; ++t) {
            pass |= movemask4(sq[t] > bv * sl2[t]) << (4 * t);
        }
        pass &= can_win & ~((2 << win) - 1); /* trials win + 1 .. 18 */
        if (!pass) {
            break;
        }
        win = __builtin_ctz((unsigned)pass);
        best = bst[win];
    }
    *scale = win ? scl[win] : scale0;
    return win;
}

/* C's `if (ax > amax) { amax = ax; max = x[i]; }` over n (16 or 32) finite values: the first x with |x| == max |x|
 * (the maximum of finite values is exact in any order, so it is taken over 4 lanes, the first index from a mask);
 * 0 when max |x| < GROUP_MAX_EPS (C's all-zero case; otherwise |max| >= GROUP_MAX_EPS). */
static inline float qx_max(const float *restrict x, int n) {
    const v4i abs_mask = {0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF};
    v4f av[8];
    memcpy(av, x, (size_t)n * 4);
    v4f m4 = {0};
    for (int k = 0; k < n / 4; ++k) {
        av[k] = (v4f)((v4i)av[k] & abs_mask);
        m4 = max4(m4, av[k]);
    }
    const float m01 = m4[0] > m4[1] ? m4[0] : m4[1], m23 = m4[2] > m4[3] ? m4[2] : m4[3];
    const float amax = m01 > m23 ? m01 : m23;
    if (amax < GROUP_MAX_EPS) {
        return 0.f;
    }
    const v4f amaxv = {amax, amax, amax, amax};
    uint32_t at = 0;
    for (int k = 0; k < n / 4; ++k) {
        at |= (uint32_t)movemask4(av[k] == amaxv) << (4 * k);
    }
    return x[__builtin_ctz(at)];
}

/* make_qx_quants(n, nmax, x, L, rmse_type = 1, qw) over `groups` groups of n (16 or 32) finite values (no NaN, no
 * inf): the same L (level + nmax) and scales as C, with fewer instructions (qx_fit, qx16_choose say how). All fits
 * run first, then all choices: each group's work is a long dependency chain, and independent chains back to back
 * overlap in the CPU, where fit, choice, fit, ... would wait on each choice. qw: C's weights (NULL: x*x). */
static inline void make_qx_quants_finite(const float *restrict x, const float *restrict qw, int n, int nmax,
                                         int groups, int8_t *restrict L, float *restrict scales, int avx2) {
    (void)avx2; /* unused without DISPATCH_AVX2 */
    v4f isc[QK_K / 16][NLANE / 4], slx[QK_K / 16][NLANE / 4], sl2[QK_K / 16][NLANE / 4];
    float max[QK_K / 16];
    for (int ib = 0; ib < groups; ++ib) {
        max[ib] = qx_max(x + n * ib, n);
        if (max[ib] == 0) {
            continue;
        }
        const float *w = qw ? qw + n * ib : NULL;
#if DISPATCH_AVX2
        if (avx2) {
            qx_fit_avx2(x + n * ib, w, n, nmax, max[ib], isc[ib], slx[ib], sl2[ib]);
            continue;
        }
#endif
        qx_fit(x + n * ib, w, n, nmax, max[ib], isc[ib], slx[ib], sl2[ib]);
    }
    for (int ib = 0; ib < groups; ++ib) {
        if (max[ib] == 0) {
            memset(L + n * ib, 0, (size_t)n);
            scales[ib] = 0.f;
            continue;
        }
        const int win = qx16_choose(slx[ib], sl2[ib], scales + ib);
        const float iw = isc[ib][win / 4][win % 4];
        const v4f iwv = {iw, iw, iw, iw};
        for (int h = 0; h < n; h += 16) {
            v4f v[4];
            memcpy(v, x + n * ib + h, sizeof v);
            for (int k = 0; k < 4; ++k) {
                v[k] = iwv * v[k];
            }
            nearest_clamp16(v, nmax, L + n * ib + h);
        }
    }
}

#if DISPATCH_AVX512
/* make_qx_quants_finite(x, qw, 16, 32, 16, L, scales) with AVX-512 the other way round: the 16 sub-blocks of a
 * super-block in the 16 lanes of a register (lane j: sub-block j) and the 19 trials one after another, four at a
 * time in independent accumulators. Each lane performs qx_fit's operations on its own sub-block (the same level in
 * float, the same sums in element order), then qx16_choose's choice in C's order, then L from the winner's iscale
 * (|v| <= about 33 on finite values: the float rounding is nearest_int's). A sub-block whose largest |x| is below
 * GROUP_MAX_EPS divides by 1 and is set to C's zeros at the end. */
__attribute__((target(AVX512_TARGET))) static void q6_fits_avx512(const float *x, const float *qw, int8_t *L,
                                                                 float *scales) {
    const float *num = trial_num_of(32);
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(16));
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 xt[16], w[16], wx[16], am = _mm512_setzero_ps();
    for (int i = 0; i < 16; ++i) {
        xt[i] = _mm512_i32gather_ps(at, x + i, 4);
        w[i] = qw ? _mm512_i32gather_ps(at, qw + i, 4) : _mm512_mul_ps(xt[i], xt[i]);
        wx[i] = _mm512_mul_ps(w[i], xt[i]);
        am = _mm512_max_ps(am, _mm512_andnot_ps(sign, xt[i]));
    }
    __m512 mx = _mm512_setzero_ps();
    for (int i = 15; i >= 0; --i) { /* C's first value of largest |x| */
        mx = _mm512_mask_mov_ps(mx, _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, xt[i]), am, _CMP_EQ_OQ), xt[i]);
    }
    const __mmask16 zero = _mm512_cmp_ps_mask(am, _mm512_set1_ps(GROUP_MAX_EPS), _CMP_LT_OQ);
    const __m512 maxv = _mm512_mask_mov_ps(mx, zero, _mm512_set1_ps(1.0f));
    const __m512 magic = _mm512_set1_ps(ROUND_MAGIC), hi = _mm512_set1_ps(31.0f), lo = _mm512_set1_ps(-32.0f);
    __m512 isc[NTRIAL], slx[NTRIAL], sl2[NTRIAL];
    for (int t0 = 0; t0 < NTRIAL; t0 += 4) {
        const int nt = NTRIAL - t0 < 4 ? NTRIAL - t0 : 4;
        __m512 sx[4], s2[4], is[4];
        for (int k = 0; k < 4; ++k) {
            is[k] = _mm512_div_ps(_mm512_xor_ps(_mm512_set1_ps(num[t0 + (k < nt ? k : 0)]), sign), maxv);
            sx[k] = s2[k] = _mm512_setzero_ps();
        }
        for (int i = 0; i < 16; ++i) {
            for (int k = 0; k < 4; ++k) {
                const __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(is[k], xt[i]), magic), magic);
                const __m512 l = _mm512_max_ps(_mm512_min_ps(r, hi), lo);
                sx[k] = _mm512_add_ps(sx[k], _mm512_mul_ps(wx[i], l));
                s2[k] = _mm512_add_ps(s2[k], _mm512_mul_ps(_mm512_mul_ps(w[i], l), l));
            }
        }
        for (int k = 0; k < nt; ++k) {
            isc[t0 + k] = is[k];
            slx[t0 + k] = sx[k];
            sl2[t0 + k] = s2[k];
        }
    }
    /* C's choice: scale = suml2 ? sumlx/suml2 : 0, best = scale*sumlx, then each later trial that passes */
    const __m512 z = _mm512_setzero_ps();
    __m512 scale = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sl2[0], z, _CMP_NEQ_UQ), slx[0], sl2[0]);
    __m512 best = _mm512_mul_ps(scale, slx[0]), win = isc[0];
    for (int t = 1; t < NTRIAL; ++t) {
        const __mmask16 pass = _mm512_cmp_ps_mask(sl2[t], z, _CMP_GT_OQ) &
                               _mm512_cmp_ps_mask(_mm512_mul_ps(slx[t], slx[t]), _mm512_mul_ps(best, sl2[t]),
                                                  _CMP_GT_OQ);
        scale = _mm512_mask_div_ps(scale, pass, slx[t], sl2[t]);
        best = _mm512_mask_mul_ps(best, pass, scale, slx[t]);
        win = _mm512_mask_mov_ps(win, pass, isc[t]);
    }
    _mm512_storeu_ps(scales, _mm512_mask_mov_ps(scale, zero, z));
    int8_t rows[16][16];
    for (int i = 0; i < 16; ++i) {
        const __m512 r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(win, xt[i]), magic), magic);
        __m512i l = _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_max_ps(_mm512_min_ps(r, hi), lo)),
                                     _mm512_set1_epi32(32));
        l = _mm512_mask_mov_epi32(l, zero, _mm512_setzero_si512());
        _mm_storeu_si128((__m128i *)rows[i], _mm512_cvtepi32_epi8(l));
    }
    for (int j = 0; j < 16; ++j) {
        for (int i = 0; i < 16; ++i) {
            L[16 * j + i] = rows[i][j];
        }
    }
}
#endif

/* The 16 sub-blocks' fits of a finite Q6_K super-block, by the active instruction set (level: simd_level()). */
static void q6_fits(const float *x, const float *qw, int8_t *L, float *scales, int level) {
#if DISPATCH_AVX512
    if (level >= SIMD_AVX512) {
        q6_fits_avx512(x, qw, L, scales);
        return;
    }
#endif
    make_qx_quants_finite(x, qw, 16, 32, QK_K / 16, L, scales, level >= SIMD_AVX2);
}

/* quantize_row_q6_K_ref (ggml-quants.c), one 256-value super-block -> 210 bytes
 * (ql[128], qh[64], int8 scales[16], fp16 d). */
static void q6_k_block(const float *x, uint8_t *y, int level) {
    int8_t L[QK_K];
    float scales[QK_K / 16];
    float max_scale = 0;
    float max_abs_scale = 0;
    if (all_finite(x, QK_K)) {
        q6_fits(x, NULL, L, scales, level);
    } else {
        for (int ib = 0; ib < QK_K / 16; ++ib) {
            scales[ib] = make_qx_quants16(x + 16 * ib, L + 16 * ib);
        }
    }
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const float scale = scales[ib];
        const float abs_scale = fabsf(scale);
        if (abs_scale > max_abs_scale) {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }
    if (max_abs_scale < GROUP_MAX_EPS) {
        memset(y, 0, 210);
        return;
    }
    uint8_t *ql = y, *qh = y + 128;
    int8_t *sc = (int8_t *)(y + 192);
    const float iscale = -128.f / max_scale;
    const uint16_t dh = fp32_to_fp16(1 / iscale);
    store_fp16(y + 208, dh);
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const int q = nearest_int(iscale * scales[ib]);
        sc[ib] = (int8_t)(uint8_t)((uint32_t)(q < 127 ? q : 127) & 0xFFu);
    }
    const float df = fp16_to_fp32(dh);
    for (int j = 0; j < QK_K / 16; ++j) {
        const float d = df * sc[j];
        if (!d) {
            continue;
        }
        const v4f dv = {d, d, d, d};
        v4f v[4];
        memcpy(v, x + 16 * j, sizeof v);
        for (int k = 0; k < 4; ++k) {
            v[k] = v[k] / dv;
        }
        nearest_clamp16(v, 32, L + 16 * j);
    }
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l + 0] & 0xF;
            const uint8_t q2 = L[j + l + 32] & 0xF;
            const uint8_t q3 = L[j + l + 64] & 0xF;
            const uint8_t q4 = L[j + l + 96] & 0xF;
            ql[l + 0] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                              ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

/* One block of n source values widened to float32, as llama-quantize's to_float does before quantizing
 * (ggml_fp16_to_fp32_row / ggml_bf16_to_fp32_row; both widenings are exact). The 16-bit words are copied
 * out first (the source may be unaligned), so the widening loops vectorise. */
static inline void load_block(const uint8_t *src, int src_type, int n, float *restrict x) {
    if (src_type == T_F32) {
        memcpy(x, src, (size_t)n * 4);
        return;
    }
    uint16_t h[QK_K];
    memcpy(h, src, (size_t)n * 2);
    if (src_type == T_F16) {
        for (int j = 0; j < n; ++j) {
            x[j] = fp16_to_fp32(h[j]);
        }
    } else { /* BF16: ggml_compute_bf16_to_fp32, the top half of a float32 */
        for (int j = 0; j < n; ++j) {
            x[j] = u2f((uint32_t)h[j] << 16);
        }
    }
}

/* One Q4_0 or Q8_0 block with the scalar code: the widening of load_block, then q4_0_block / q8_0_block. */
static void q_block_scalar(const uint8_t *src, int src_type, int dst_type, uint8_t *y) {
    float x[QK];
    load_block(src, src_type, QK, x);
    if (dst_type == T_Q4_0) {
        q4_0_block(x, y);
    } else {
        q8_0_block(x, y);
    }
}

/* ---------------------------------------------------------------------------------------------------
 * Q4_0 and Q8_0 with AVX2, chosen at run time like Q6_K's fits (the same bytes as q4_0_block and
 * q8_0_block, which remain the path without AVX2). Blocks go in batches of QBATCH:
 *
 * - per block, the largest |x| as bits: for BF16 on the 16-bit words themselves (|x| is the word without
 *   its sign bit, and for values that are not NaN the order of those bits is the order of |x|), for
 *   F32 (and F16, widened first by f16_widen_avx2) on the float32 bits the same way. The maximum of
 *   integers is exact in any order. A NaN or inf has larger bits than every finite value, so the
 *   maximum also says whether the block is finite. Q4_0's `max` is then the first value whose |x| has
 *   those bits (compare-equal mask, lowest set bit): C's first value of largest |x|; when every |x| is
 *   0, +0.0, C's initial value (never a -0.0 of the block).
 * - for the batch at once: d, id and the fp16 d with the float operations of C (vdivps is C's float
 *   division; fp32_to_fp16_avx2 is fp32_to_fp16 lane by lane), and the test that sends a block to the
 *   scalar code: a NaN or inf in it, or |id * max| beyond the bound that makes every conversion below a
 *   plain one (Q4_0: |x * id| <= |max * id| <= 8.5, as rounding is monotonic, so x * id + 8.5f is in
 *   [0, 17] and C's (int8_t) is cvttps2dq; Q8_0: |x * id| < 127.5, so roundf gives [-127, 127]). For
 *   finite blocks |max * id| is 8 or 127 within a few ulps unless d underflows (then id = 0, also fine)
 *   or 1/d overflows (id = inf: scalar path), so the scalar path takes only the non-finite blocks and
 *   those of tiny scales. (The bound alone would already catch a NaN or inf, through a NaN |max * id|;
 *   the explicit test does not rely on that.)
 * - per block, the values quantized 8 at a time with C's separate multiply and add (no FMA: the
 *   functions target AVX2 alone), converted, and packed with saturating packs that saturate nothing
 *   (the values are in range, above).
 *
 * BF16 words are widened in registers by interleaving them with zero words (vpunpck[lh]wd): each
 * 128-bit lane then holds elements 0-3 | 8-11 (low) and 4-7 | 12-15 (high) of 16, an order that the
 * packs undo (Q4_0's nibble pairs x[j], x[j + 16] sit in the same lane of the two halves).
 * --------------------------------------------------------------------------------------------------- */
#if DISPATCH_AVX2
#define QBATCH 8

typedef uint32_t v8u __attribute__((vector_size(32)));

/* fp32_to_fp16 on 8 lanes: the same float and integer operations (fabsf is clearing the sign bit). */
__attribute__((target("avx2"))) static inline __m128i fp32_to_fp16_avx2(__m256 f) {
    const v8u w = (v8u)f;
    v8f base = ((v8f)(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
    const v8u shl1_w = w + w;
    const v8u sign = w & 0x80000000u;
    /* bias < 0x71000000 ? 0x71000000 : bias, unsigned */
    const v8u bias = (v8u)_mm256_max_epu32((__m256i)(shl1_w & 0xFF000000u), _mm256_set1_epi32(0x71000000));
    base = (v8f)((bias >> 1) + 0x07800000u) + base;
    const v8u bits = (v8u)base;
    const v8u nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    const v8u nan = (v8u)(shl1_w > 0xFF000000u); /* unsigned compare: all-ones lanes */
    const v8u h = (sign >> 16) | (nan & 0x7E00u) | (~nan & nonsign);
    /* every lane <= 0xFFFF: the unsigned saturation of packusdw keeps it */
    return _mm_packus_epi32(_mm256_castsi256_si128((__m256i)h), _mm256_extracti128_si256((__m256i)h, 1));
}

/* ggml_compute_fp16_to_fp32 on 8 lanes (the same integer and float operations), for the 32 F16 words
 * at p -> x: load_block's F16 widening, vectorised. */
__attribute__((target("avx2"))) static inline void f16_widen_avx2(const uint8_t *p, float *x) {
    for (int k = 0; k < QK / 8; ++k) {
        const v8u w = (v8u)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * k))) << 16;
        const v8u sign = w & 0x80000000u;
        const v8u two_w = w + w;
        const v8f normalized = (v8f)((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
        const v8f denormalized = (v8f)((two_w >> 17) | (126u << 23)) - 0.5f;
        const v8u denorm = (v8u)(two_w < (1u << 27));
        _mm256_storeu_si256((__m256i *)(x + 8 * k),
                            (__m256i)(sign | (denorm & (v8u)denormalized) | (~denorm & (v8u)normalized)));
    }
}

/* The bits of the largest |x| over 32 BF16 words at p (above 0x7F7F: the block has a NaN or inf), and
 * the words without their sign bits. */
__attribute__((target("avx2"))) static inline uint32_t bf16_amax_avx2(const uint8_t *p, __m256i *a0, __m256i *a1) {
    const __m256i m = _mm256_set1_epi16(0x7FFF);
    *a0 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), m);
    *a1 = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 32)), m);
    const __m256i t = _mm256_max_epi16(*a0, *a1); /* 0..0x7FFF: signed is unsigned */
    const __m128i u = _mm_max_epi16(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    /* the maximum of 8 as a minimum of 0x7FFF - u (phminposuw) */
    const __m128i mn = _mm_minpos_epu16(_mm_xor_si128(u, _mm_set1_epi16(0x7FFF)));
    return 0x7FFFu ^ ((uint32_t)_mm_cvtsi128_si32(mn) & 0xFFFFu);
}

/* C's first value of largest |x| (Q4_0's max) over 32 BF16 words at p; *abits as bf16_amax_avx2. */
__attribute__((target("avx2"))) static inline float bf16_first_absmax_avx2(const uint8_t *p, uint32_t *abits) {
    __m256i a0, a1;
    const uint32_t am = bf16_amax_avx2(p, &a0, &a1);
    *abits = am;
    const __m256i amv = _mm256_set1_epi16((short)am);
    /* two mask bits a word: the lowest set bit is 2 * (first index) */
    const uint64_t eq = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(a0, amv)) |
                        (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi16(a1, amv)) << 32;
    uint16_t h;
    memcpy(&h, p + __builtin_ctzll(eq), 2);
    return am ? u2f((uint32_t)h << 16) : 0.0f;
}

/* The float32 bits of the largest |x| over 32 float32 values at p (above 0x7F7FFFFF: a NaN or inf), and
 * the values without their sign bits. */
__attribute__((target("avx2"))) static inline uint32_t f32_amax_avx2(const uint8_t *p, __m256i a[4]) {
    const __m256i m = _mm256_set1_epi32(0x7FFFFFFF);
    for (int k = 0; k < 4; ++k) {
        a[k] = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 32 * k)), m);
    }
    const __m256i t = _mm256_max_epi32(_mm256_max_epi32(a[0], a[1]), _mm256_max_epi32(a[2], a[3]));
    __m128i u = _mm_max_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_max_epi32(u, _mm_shuffle_epi32(u, 0x4E));
    u = _mm_max_epi32(u, _mm_shuffle_epi32(u, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(u);
}

/* C's first value of largest |x| over 32 float32 values at p; *abits as f32_amax_avx2. */
__attribute__((target("avx2"))) static inline float f32_first_absmax_avx2(const uint8_t *p, uint32_t *abits) {
    __m256i a[4];
    const uint32_t am = f32_amax_avx2(p, a);
    *abits = am;
    const __m256i amv = _mm256_set1_epi32((int)am);
    uint32_t eq = 0;
    for (int k = 0; k < 4; ++k) {
        eq |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a[k], amv))) << (8 * k);
    }
    float v;
    memcpy(&v, p + 4 * __builtin_ctz(eq), 4);
    return am ? v : 0.0f;
}

/* The 32 BF16 words at p widened, in the lane order described above: a0 = elements 0-3 | 8-11,
 * b0 = 4-7 | 12-15, a1 and b1 the same plus 16. */
__attribute__((target("avx2"))) static inline void bf16_widen_avx2(const uint8_t *p, __m256 *a0, __m256 *b0,
                                                                  __m256 *a1, __m256 *b1) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)p), v1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    *a0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v0));
    *b0 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v0));
    *a1 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v1));
    *b1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v1));
}

/* MIN(15, (int8_t)(x * id + 8.5f)) for x * id + 8.5f in [0, 17]: truncation, then the minimum */
__attribute__((target("avx2"))) static inline __m256i q4_0_q_avx2(__m256 v, __m256 id) {
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(v, id), _mm256_set1_ps(8.5f));
    return _mm256_min_epi32(_mm256_cvttps_epi32(t), _mm256_set1_epi32(15));
}

/* The 16 bytes xi0 | (xi1 << 4) of one block, from lo = x[0..16) and hi = x[16..32) in matching lanes,
 * whose 16-bit packs (a of lo/hi, then b) give j = 0..15 in order when perm is 0, or
 * j = 0-3, 8-11 | 4-7, 12-15 when perm is 1 (fixed by a qword permutation). */
__attribute__((target("avx2"))) static inline void q4_0_pack_avx2(__m256 a0, __m256 b0, __m256 a1, __m256 b1,
                                                                 __m256 id, int perm, uint8_t *y) {
    const __m256i A = _mm256_or_si256(q4_0_q_avx2(a0, id), _mm256_slli_epi32(q4_0_q_avx2(a1, id), 4));
    const __m256i B = _mm256_or_si256(q4_0_q_avx2(b0, id), _mm256_slli_epi32(q4_0_q_avx2(b1, id), 4));
    __m256i P = _mm256_packs_epi32(A, B); /* 0..255: no saturation */
    if (perm) {
        P = _mm256_permute4x64_epi64(P, 0xD8);
    }
    _mm_storeu_si128((__m128i *)y, _mm_packus_epi16(_mm256_castsi256_si128(P), _mm256_extracti128_si256(P, 1)));
}

/* (int8_t) roundf(x * id) for |x * id| < 127.5: round_i8's two truncations */
__attribute__((target("avx2"))) static inline __m256i q8_0_q_avx2(__m256 v, __m256 id) {
    const __m256 s = _mm256_mul_ps(v, id);
    const __m256i t = _mm256_cvttps_epi32(s);
    const __m256 frac = _mm256_sub_ps(s, _mm256_cvtepi32_ps(t));
    return _mm256_add_epi32(t, _mm256_cvttps_epi32(_mm256_add_ps(frac, frac)));
}

/* For a batch's block maxima m (Q4_0: C's signed max; Q8_0: the largest |x|): d = m / -8 or m / 127,
 * id = d ? 1.0f / d : 0.0f, and the fp16 d, with C's float operations. Returns the blocks of `fin` whose
 * |id * m| is within the bound that keeps every conversion plain (Q4_0: <= 8.5; Q8_0: < 127.5; see above);
 * the others take the scalar code. */
__attribute__((target("avx2"))) static inline int batch_scales_avx2(const float m[QBATCH], int dst_type, int fin,
                                                                   uint16_t h[QBATCH], float id[QBATCH]) {
    const __m256 sgn = _mm256_set1_ps(-0.0f);
    const __m256 M = _mm256_loadu_ps(m);
    const __m256 D = _mm256_div_ps(M, _mm256_set1_ps(dst_type == T_Q4_0 ? -8.0f : (float)((1 << 7) - 1)));
    const __m256 ID = _mm256_and_ps(_mm256_cmp_ps(D, _mm256_setzero_ps(), _CMP_NEQ_UQ),
                                    _mm256_div_ps(_mm256_set1_ps(1.0f), D));
    const __m256 r = _mm256_mul_ps(_mm256_andnot_ps(sgn, ID), _mm256_andnot_ps(sgn, M));
    const __m256 ok = dst_type == T_Q4_0 ? _mm256_cmp_ps(r, _mm256_set1_ps(8.5f), _CMP_LE_OQ)
                                         : _mm256_cmp_ps(r, _mm256_set1_ps(127.5f), _CMP_LT_OQ);
    _mm_storeu_si128((__m128i *)h, fp32_to_fp16_avx2(D));
    _mm256_storeu_ps(id, ID);
    return _mm256_movemask_ps(ok) & fin;
}

/* The 16 bytes of one Q4_0 block after its scale (p: the source block; xf: its F16 values widened, or NULL). */
__attribute__((target("avx2"))) static inline void q4_0_quants_avx2(const uint8_t *p, int src_type, const float *xf,
                                                                   __m256 idv, uint8_t *y) {
    if (src_type == T_BF16) {
        __m256 a0, b0, a1, b1;
        bf16_widen_avx2(p, &a0, &b0, &a1, &b1);
        q4_0_pack_avx2(a0, b0, a1, b1, idv, 0, y);
        return;
    }
    __m256 v[4];
    for (int k = 0; k < 4; ++k) {
        v[k] = xf ? _mm256_loadu_ps(xf + 8 * k) : _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * k)));
    }
    q4_0_pack_avx2(v[0], v[1], v[2], v[3], idv, 1, y);
}

/* The 32 bytes of one Q8_0 block after its scale (arguments as q4_0_quants_avx2). */
__attribute__((target("avx2"))) static inline void q8_0_quants_avx2(const uint8_t *p, int src_type, const float *xf,
                                                                   __m256 idv, uint8_t *y) {
    __m256i R;
    if (src_type == T_BF16) {
        __m256 a0, b0, a1, b1;
        bf16_widen_avx2(p, &a0, &b0, &a1, &b1);
        /* 16-bit: elements 0..15, then 16..31, in order; bytes: 0-7, 16-23 | 8-15, 24-31 */
        R = _mm256_packs_epi16(_mm256_packs_epi32(q8_0_q_avx2(a0, idv), q8_0_q_avx2(b0, idv)),
                               _mm256_packs_epi32(q8_0_q_avx2(a1, idv), q8_0_q_avx2(b1, idv)));
        R = _mm256_permute4x64_epi64(R, 0xD8);
    } else {
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            const __m256 v = xf ? _mm256_loadu_ps(xf + 8 * k)
                                : _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(p + 32 * k)));
            q[k] = q8_0_q_avx2(v, idv);
        }
        /* dwords of 4 bytes: 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31 */
        R = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        R = _mm256_permutevar8x32_epi32(R, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    }
    _mm256_storeu_si256((__m256i *)y, R);
}

/* quantize_row_q4_0_ref or quantize_row_q8_0_ref (dst_type) over nb blocks of src_type values. */
__attribute__((target("avx2"))) static void q4_0_q8_0_rows_avx2(const uint8_t *src, int src_type, uint8_t *dst,
                                                               int dst_type, Py_ssize_t nb) {
    const Py_ssize_t bsize = (src_type == T_F32 ? 4 : 2) * QK; /* source bytes a block */
    const Py_ssize_t out = dst_type == T_Q4_0 ? 18 : 34;
    const int q4 = dst_type == T_Q4_0;
    float xh[QBATCH][QK]; /* F16 widened */
    Py_ssize_t i = 0;
    for (; i + QBATCH <= nb; i += QBATCH) {
        const uint8_t *s = src + i * bsize;
        uint8_t *y = dst + i * out;
        float m[QBATCH]; /* Q4_0: C's signed max; Q8_0: the largest |x| (MAX(amax, fabsf(v)) from +0.0) */
        int fin = 0;
        for (int b = 0; b < QBATCH; ++b) {
            const uint8_t *p = s + b * bsize;
            uint32_t ab;
            if (src_type == T_BF16) {
                if (q4) {
                    m[b] = bf16_first_absmax_avx2(p, &ab);
                } else {
                    __m256i a0, a1;
                    ab = bf16_amax_avx2(p, &a0, &a1);
                    m[b] = u2f(ab << 16);
                }
                fin |= (ab <= 0x7F7Fu) << b;
                continue;
            }
            if (src_type == T_F16) {
                f16_widen_avx2(p, xh[b]);
                p = (const uint8_t *)xh[b];
            }
            if (q4) {
                m[b] = f32_first_absmax_avx2(p, &ab);
            } else {
                __m256i a[4];
                ab = f32_amax_avx2(p, a);
                m[b] = u2f(ab);
            }
            fin |= (ab <= 0x7F7FFFFFu) << b;
        }
        uint16_t h[QBATCH];
        float id[QBATCH];
        const int fast = batch_scales_avx2(m, dst_type, fin, h, id);
        for (int b = 0; b < QBATCH; ++b) {
            const uint8_t *p = s + b * bsize;
            uint8_t *yb = y + out * b;
            if (!((fast >> b) & 1)) {
                q_block_scalar(p, src_type, dst_type, yb);
                continue;
            }
            store_fp16(yb, h[b]);
            const float *xf = src_type == T_F16 ? xh[b] : NULL;
            (q4 ? q4_0_quants_avx2 : q8_0_quants_avx2)(p, src_type, xf, _mm256_set1_ps(id[b]), yb + 2);
        }
    }
    for (; i < nb; ++i) {
        q_block_scalar(src + i * bsize, src_type, dst_type, dst + i * out);
    }
}
#endif

/* ---------------------------------------------------------------------------------------------------
 * Q5_0 and Q5_1: quantize_row_q5_0_ref and quantize_row_q5_1_ref (ggml-quants.c), one 32-value block at a
 * time, with the float operations of the C reference in its order (legacy.py's notes on Q5_0/Q5_1 say
 * which edge each step has). The conversions are x86's cvttss2si (trunc_i8): (int8_t) and (uint8_t) of a
 * float both compile to it and keep the low byte.
 * --------------------------------------------------------------------------------------------------- */

/* The 5-bit values q[0..32) of a Q5_0/Q5_1 block as ggml lays them out: qs[j] = (q[j] & 15) | (q[j + 16] & 15)
 * << 4, and bit 4 of q[j] as bit j of qh, a little-endian 32-bit word (written byte by byte, as on x86). */
static inline void pack_q5(const uint8_t *restrict q, uint8_t *restrict qh, uint8_t *restrict qs) {
    uint32_t h = 0;
    for (int j = 0; j < QK / 2; ++j) {
        qs[j] = (uint8_t)((q[j] & 0x0Fu) | ((q[j + QK / 2] & 0x0Fu) << 4));
    }
    for (int j = 0; j < QK; ++j) {
        h |= (uint32_t)((q[j] & 0x10u) >> 4) << j;
    }
    for (int k = 0; k < 4; ++k) {
        qh[k] = (uint8_t)(h >> (8 * k));
    }
}

/* quantize_row_q5_0_ref, one block -> 22 bytes (fp16 d, qh[4], qs[16]): Q4_0's max (first_absmax), d = max / -16,
 * q = MIN(31, (int8_t)(x*id + 16.5f)) stored as a uint8 (a negative int8 keeps its bit pattern). */
static void q5_0_block(const float *restrict x, uint8_t *restrict y) {
    int finite;
    const float max = first_absmax(x, &finite);
    const float d = max / -16;
    const float id = d ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    store_fp16(y, fp32_to_fp16(d));
    for (int j = 0; j < QK; ++j) {
        const int8_t i = trunc_i8(x[j] * id + 16.5f);
        q[j] = (uint8_t)(i < 31 ? i : 31);
    }
    pack_q5(q, y + 2, y + 6);
}

/* C's strict scans of a 32-value block from FLT_MAX / -FLT_MAX (quantize_row_q4_1_ref, q5_1): a NaN is skipped, and
 * of equal zeros the first one's sign stays. */
static inline void minmax_scan(const float *restrict x, float *restrict min, float *restrict max) {
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int j = 0; j < QK; ++j) {
        const float v = x[j];
        if (v < lo) {
            lo = v;
        }
        if (v > hi) {
            hi = v;
        }
    }
    *min = lo;
    *max = hi;
}

/* quantize_row_q5_1_ref, one block -> 24 bytes (fp16 d, fp16 m, qh[4], qs[16]): min/max by C's strict scans
 * from FLT_MAX/-FLT_MAX (sequential: of equal zeros the first one's sign stays), d = (max - min) / 31,
 * q = (uint8_t)((x - min)*id + 0.5f), unclamped. */
static void q5_1_block_scalar(const float *restrict x, uint8_t *restrict y) {
    float min, max;
    minmax_scan(x, &min, &max);
    const float d = (max - min) / ((1 << 5) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    uint8_t q[QK];
    store_fp16(y, fp32_to_fp16(d));
    store_fp16(y + 2, fp32_to_fp16(min));
    for (int j = 0; j < QK; ++j) {
        q[j] = (uint8_t)trunc_i8((x[j] - min) * id + 0.5f);
    }
    pack_q5(q, y + 4, y + 8);
}

#if defined(__SSE2__)
/* quantize_row_q5_1_ref, one block, in SSE2 (the x86-64 baseline): the same bytes as q5_1_block_scalar.
 * - min and max over 4 lanes: C's strict scans from FLT_MAX / -FLT_MAX skip a NaN, and so does minps(v, min) (the
 *   second operand when unordered); the minimum of the other values is exact in any order, except which of equal
 *   zeros of either sign comes first: a block whose min or max is a zero takes the scalar scan.
 * - q = (uint8_t)((x - min)*id + 0.5f) is cvttps2dq's low byte, as trunc_i8 (NaN, inf and |f| >= 2^31 give
 *   0x80000000, whose low byte is 0), then masked to a byte before the packs (which would saturate). */
static void q5_1_block(const float *restrict x, uint8_t *restrict y) {
    __m128 v[QK / 4];
    __m128 mn = _mm_set1_ps(FLT_MAX), mx = _mm_set1_ps(-FLT_MAX);
    for (int k = 0; k < QK / 4; ++k) {
        v[k] = _mm_loadu_ps(x + 4 * k);
        mn = _mm_min_ps(v[k], mn);
        mx = _mm_max_ps(v[k], mx);
    }
    float a[4], b[4];
    _mm_storeu_ps(a, mn);
    _mm_storeu_ps(b, mx);
    float min = a[0], max = b[0];
    for (int k = 1; k < 4; ++k) {
        min = a[k] < min ? a[k] : min;
        max = b[k] > max ? b[k] : max;
    }
    if (min == 0.0f || max == 0.0f) {
        q5_1_block_scalar(x, y);
        return;
    }
    const float d = (max - min) / ((1 << 5) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    store_fp16(y, fp32_to_fp16(d));
    store_fp16(y + 2, fp32_to_fp16(min));
    const __m128 minv = _mm_set1_ps(min), idv = _mm_set1_ps(id), half = _mm_set1_ps(0.5f);
    const __m128i byte = _mm_set1_epi32(0xFF);
    __m128i q[QK / 4];
    for (int k = 0; k < QK / 4; ++k) {
        q[k] = _mm_and_si128(_mm_cvttps_epi32(_mm_add_ps(_mm_mul_ps(_mm_sub_ps(v[k], minv), idv), half)), byte);
    }
    const __m128i lo = _mm_packus_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3])); /* q[0..16) */
    const __m128i hi = _mm_packus_epi16(_mm_packs_epi32(q[4], q[5]), _mm_packs_epi32(q[6], q[7])); /* q[16..32) */
    const __m128i nib = _mm_set1_epi8(0x0F);
    /* the 4-bit values shifted within 16-bit lanes: nothing crosses into the next byte */
    const __m128i qs = _mm_or_si128(_mm_and_si128(lo, nib), _mm_slli_epi16(_mm_and_si128(hi, nib), 4));
    /* bit 4 of each byte to its bit 7 (a 16-bit shift by 3: the high byte's bit 7 is its own bit 4) */
    const uint32_t h = (uint32_t)_mm_movemask_epi8(_mm_slli_epi16(lo, 3)) |
                       (uint32_t)_mm_movemask_epi8(_mm_slli_epi16(hi, 3)) << 16;
    for (int k = 0; k < 4; ++k) {
        y[4 + k] = (uint8_t)(h >> (8 * k));
    }
    _mm_storeu_si128((__m128i *)(y + 8), qs);
}
#else
static void q5_1_block(const float *restrict x, uint8_t *restrict y) { q5_1_block_scalar(x, y); }
#endif

/* ---------------------------------------------------------------------------------------------------
 * Q4_K and Q5_K: quantize_row_q4_K_ref and quantize_row_q5_K_ref (ggml-quants.c), one 256-value super-block
 * of 8 sub-blocks of 32 at a time, make_qkx2_quants fitting each sub-block (kquants.py's notes on Q4_K/Q5_K
 * list every step). Its trials cannot run side by side: a winning trial moves `min`, which every later trial
 * uses. So the 8 sub-blocks run side by side instead, one per vector lane (the super-block transposed, lane j
 * holding sub-block j): each lane performs C's operations on its own sub-block in C's order (every sum in
 * index order), and C's branches become per-lane selects, so each lane computes what C computes. GCC/clang
 * generic vectors of 8 floats: two SSE registers in the portable build, one AVX register in the AVX2 build of
 * the same code (qk_block_avx2, chosen at run time: the same operations, so the same bytes).
 * --------------------------------------------------------------------------------------------------- */

/* the helpers below take and return 32-byte vectors, but are always inlined: no call ABI is involved */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define KSUB 8 /* sub-blocks per super-block: the vector lanes */
#define KLEN 32 /* values per sub-block */
#define KLANES_MAX 38 /* the first fit plus the 37 trials of the weighted fits (Q4_K without weights: 21) */
#define KALWAYS static inline __attribute__((always_inline))

/* make_qkx2_quants' parameters: nmax and the iscale numerators in C's order (the first fit's nmax, then
 * rmin + rdelta*is + nmax for is = 0..nstep, computed by kq_params_init with C's float operations). */
typedef struct {
    int nmax, nlanes;
    float lanes[KLANES_MAX];
} kq_params;

static void kq_params_init(kq_params *p, int nmax, float rmin, float rdelta, int nstep) {
    p->nmax = nmax;
    p->nlanes = nstep + 2;
    p->lanes[0] = (float)nmax;
    for (int is = 0; is <= nstep; ++is) {
        p->lanes[is + 1] = rmin + rdelta * is + nmax;
    }
}

/* ggml's build computes the requantization's x + dm as vector additions whose first operand (the NaN x86 keeps
 * when both are NaN) is x for elements 0..27 of a sub-block and dm for 28..31 (measured: the register allocation
 * of its vectorised loop). Both are NaN only for a NaN input in a sub-block whose dm is inf*0 (fp16 dmin
 * overflowed, 6-bit min 0), and the payload then reaches nearest_int. The operand order of our additions is our
 * compiler's choice, so where both are NaN the result is set to that operand, quieted as the addition does. */
#define KQ_X_FIRST 28

typedef int32_t v8i __attribute__((vector_size(32)));
static inline v4f sqrt4(v4f a) {
#if defined(__SSE2__)
    return (v4f)_mm_sqrt_ps((__m128)a);
#else
    return (v4f){sqrtf(a[0]), sqrtf(a[1]), sqrtf(a[2]), sqrtf(a[3])};
#endif
}
static inline int kany8(v8i m) { return movemask4((v4i){m[0], m[1], m[2], m[3]}) | movemask4((v4i){m[4], m[5], m[6], m[7]}); }

/* The template's instantiations: one chain of 8 lanes (one super-block) in the portable build; with AVX2, two
 * chains of 8 (two super-blocks); with AVX-512, two chains of 16 (four). */
#define KQ_N 8
#define KQ_G 1
#define KQ_ANY(m) kany8(m)
#define KQ_HW 4
#define KQ_NATIVE v4f
#define KQ_NMIN(a, b) min4(a, b)
#define KQ_NMAX(a, b) max4(a, b)
#define KQ_NSQRT(a) sqrt4(a)
#define KQ_FN(f) kq8_##f
#define KQ_TARGET
#include "_kquants.h"

#if DISPATCH_AVX2
#define KQ_N 8
#define KQ_G KQ_AVX2_CHAINS
#define KQ_ANY(m) _mm256_movemask_ps((__m256)(m))
#define KQ_HW 8
#define KQ_NATIVE __m256
#define KQ_NMIN(a, b) _mm256_min_ps(a, b)
#define KQ_NMAX(a, b) _mm256_max_ps(a, b)
#define KQ_NSQRT(a) _mm256_sqrt_ps(a)
#define KQ_FN(f) kq_avx2_##f
#define KQ_TARGET __attribute__((target("avx2")))
#include "_kquants.h"
#endif

#if DISPATCH_AVX512
#define KQ_N 16
#define KQ_G KQ_AVX512_CHAINS
#define KQ_ANY(m) _mm512_movepi32_mask((__m512i)(m))
#define KQ_HW 16
#define KQ_NATIVE __m512
#define KQ_NMIN(a, b) _mm512_min_ps(a, b)
#define KQ_NMAX(a, b) _mm512_max_ps(a, b)
#define KQ_NSQRT(a) _mm512_sqrt_ps(a)
#define KQ_FN(f) kq_avx512_##f
#define KQ_TARGET __attribute__((target(AVX512_TARGET)))
#include "_kquants.h"
#endif

/* ggml_quantize_chunk without an imatrix (what llama-quantize runs): nb blocks of src -> dst. */
/* MXFP4: quantize_row_mxfp4_ref, best_index_mxfp4 (ggml-quants.c) and ggml_e8m0_to_fp32_half (ggml-impl.h), in
 * their float operations; log2f is the C library's, as ggml's is. */
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int best_index_mxfp4(float x, float e) {
    int best = 0;
    float best_err = fabsf(kvalues_mxfp4[0] * e - x);
    for (int i = 1; i < 16; i++) {
        const float err = fabsf(kvalues_mxfp4[i] * e - x);
        if (err < best_err) {
            best = i;
            best_err = err;
        }
    }
    return best;
}

/* quantize_row_mxfp4_ref, one block, value by value: the portable build's (faster there than 8-lane vectors
 * emulated by SSE registers) */
static void mxfp4_block(const float *restrict x, uint8_t *restrict y) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float v = fabsf(x[j]);
        if (amax < v) {
            amax = v;
        }
    }
    uint8_t e = 0;
    if (amax > 0.0f) {
        /* ggml's (uint8_t) of this float: cvttss2si (INT32_MIN out of range), then the low byte */
        const float v = floorf(log2f(amax)) - 2 + 127;
        e = (uint8_t)(v >= -2147483648.0f && v < 2147483648.0f ? (int32_t)v : INT32_MIN);
    }
    const float d = u2f(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
    y[0] = e;
    for (int j = 0; j < QK / 2; ++j) {
        y[1 + j] = (uint8_t)(best_index_mxfp4(x[j], d) | (best_index_mxfp4(x[QK / 2 + j], d) << 4));
    }
}

/* The K-quant template's instantiation for the active instruction set: its group functions and how many
 * super-blocks (8 sub-blocks of 32) a group holds. */
typedef struct {
    void (*qk)(const float *, uint8_t *, const kq_params *, int);
    int (*qkx3)(const float *, const float *, const float *, const kq_params *, uint8_t *, float *, float *, float *);
    int per;
} kq_impl;

static kq_impl kq_of_level(void) {
    const int level = simd_level();
#if DISPATCH_AVX512
    if (level >= SIMD_AVX512) {
        return (kq_impl){kq_avx512_qk_group, kq_avx512_qkx3_group, KQ_AVX512_CHAINS * 2};
    }
#endif
#if DISPATCH_AVX2
    if (level >= SIMD_AVX2) {
        return (kq_impl){kq_avx2_qk_group, kq_avx2_qkx3_group, KQ_AVX2_CHAINS};
    }
#endif
    (void)level;
    return (kq_impl){kq8_qk_group, kq8_qkx3_group, 1};
}

/* Q4_K / Q5_K over nb super-blocks: whole groups of the active instruction set's width, then the rest one
 * super-block at a time in the group's first lanes (the other lanes zeros, their output dropped). */
static void kq_rows(const uint8_t *src, int src_type, Py_ssize_t item, uint8_t *dst, Py_ssize_t out, Py_ssize_t nb,
                    const kq_params *p, int q5) {
    const kq_impl k = kq_of_level();
    const int n = k.per;
    float x[KQ_GROUP_MAX * QK_K];
    uint8_t y[KQ_GROUP_MAX * 176];
    Py_ssize_t i = 0;
    for (; i + n <= nb; i += n) {
        for (int b = 0; b < n; ++b) {
            load_block(src + (i + b) * item * QK_K, src_type, QK_K, x + QK_K * b);
        }
        k.qk(x, dst + i * out, p, q5);
    }
    if (i < nb) {
        memset(x, 0, sizeof x);
        for (Py_ssize_t b = 0; i + b < nb; ++b) {
            load_block(src + (i + b) * item * QK_K, src_type, QK_K, x + QK_K * b);
        }
        k.qk(x, y, p, q5);
        memcpy(dst + i * out, y, (size_t)((nb - i) * out));
    }
}

/* quantize_row_mxfp4_ref, one block, in vectors of 8 lanes (one AVX register: mxfp4_block_avx2): the same bytes as
 * mxfp4_block. amax: C's `if (amax < v) amax = v` per lane
 * (a NaN never wins) merged the same way; the exponent as C. best_index_mxfp4 for 8 values at once, on |x|: for
 * x >= 0 no negative candidate (nor index 8, a second 0) can have a strictly smaller error than index 0's, so C's
 * first best is among indices 0..7; for x < 0 likewise among 0 and 9..15, in the same order of magnitudes, and each
 * error fabsf(-m*e - x) equals fabsf(m*e - |x|) (rounding is symmetric), so the index found for |x| moves to 8 + it.
 * Each candidate's error is C's float operations, kept where strictly smaller (C's first best). A NaN x stays 0. */
typedef float g8f __attribute__((vector_size(32)));
typedef int32_t g8i __attribute__((vector_size(32)));

KALWAYS g8f g8sel(g8i m, g8f a, g8f b) { return (g8f)(((g8i)a & m) | ((g8i)b & ~m)); }

KALWAYS void mxfp4_block_v(const float *restrict x, uint8_t *restrict y) {
    g8f v[QK / 8], a[QK / 8];
    memcpy(v, x, sizeof v);
    g8f am = {0};
    for (int k = 0; k < QK / 8; ++k) {
        a[k] = (g8f)((g8i)v[k] & 0x7FFFFFFF);
        am = g8sel(am < a[k], a[k], am);
    }
    float amax = 0.0f;
    for (int k = 0; k < 8; ++k) {
        if (amax < am[k]) {
            amax = am[k];
        }
    }
    uint8_t e = 0;
    if (amax > 0.0f) {
        const float f = floorf(log2f(amax)) - 2 + 127;
        e = (uint8_t)(f >= -2147483648.0f && f < 2147483648.0f ? (int32_t)f : INT32_MIN);
    }
    const float d = u2f(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
    y[0] = e;
    g8f idx[QK / 8];
    for (int k = 0; k < QK / 8; ++k) {
        g8f best = (g8f)((g8i)((float)kvalues_mxfp4[0] * d - a[k]) & 0x7FFFFFFF);
        g8f at = {0};
        for (int i = 1; i < 8; ++i) {
            const float kd = (float)kvalues_mxfp4[i] * d;
            const g8f err = (g8f)((g8i)(kd - a[k]) & 0x7FFFFFFF);
            const g8i take = err < best;
            best = g8sel(take, err, best);
            at = g8sel(take, (g8f){i, i, i, i, i, i, i, i}, at);
        }
        const g8i neg = (v[k] < 0.0f) & (at > 0.0f);
        idx[k] = at + g8sel(neg, (g8f){8, 8, 8, 8, 8, 8, 8, 8}, (g8f){0});
    }
    int32_t packed[QK / 2];
    for (int k = 0; k < 2; ++k) { /* x[j] in the low nibble, x[16 + j] in the high */
        const g8i p = __builtin_convertvector(idx[k], g8i) | __builtin_convertvector(idx[k + 2], g8i) << 4;
        memcpy(packed + 8 * k, &p, sizeof p);
    }
    for (int j = 0; j < QK / 2; ++j) {
        y[1 + j] = (uint8_t)packed[j];
    }
}


#if DISPATCH_AVX2
__attribute__((target("avx2"))) static void mxfp4_block_avx2(const float *restrict x, uint8_t *restrict y) {
    mxfp4_block_v(x, y);
}
#endif

static void quantize_blocks(const uint8_t *src, int src_type, uint8_t *dst, int dst_type, Py_ssize_t nb) {
    const Py_ssize_t item = src_type == T_F32 ? 4 : 2;
    const int level = simd_level(), avx2 = level >= SIMD_AVX2;
    (void)avx2; /* unused without DISPATCH_AVX2 */
    if (dst_type == T_Q6_K) {
        float x[QK_K];
        for (Py_ssize_t i = 0; i < nb; ++i) {
            load_block(src + i * item * QK_K, src_type, QK_K, x);
            q6_k_block(x, dst + i * 210, level);
        }
        return;
    }
    if (dst_type == T_Q4_K || dst_type == T_Q5_K) {
        const int q5 = dst_type == T_Q5_K;
        const Py_ssize_t out = q5 ? 176 : 144;
        kq_params p;
        if (q5) {
            kq_params_init(&p, 31, -0.5f, 0.1f, 15);
        } else {
            kq_params_init(&p, 15, -1.f, 0.1f, 20);
        }
        kq_rows(src, src_type, item, dst, out, nb, &p, q5);
        return;
    }
    if (dst_type == T_MXFP4) {
        float x[QK];
        for (Py_ssize_t i = 0; i < nb; ++i) {
            load_block(src + i * item * QK, src_type, QK, x);
#if DISPATCH_AVX2
            if (avx2) {
                mxfp4_block_avx2(x, dst + i * 17);
                continue;
            }
#endif
            mxfp4_block(x, dst + i * 17);
        }
        return;
    }
    if (dst_type == T_Q5_0 || dst_type == T_Q5_1) {
        const Py_ssize_t out = dst_type == T_Q5_0 ? 22 : 24;
        float x[QK];
        for (Py_ssize_t i = 0; i < nb; ++i) {
            load_block(src + i * item * QK, src_type, QK, x);
            (dst_type == T_Q5_0 ? q5_0_block : q5_1_block)(x, dst + i * out);
        }
        return;
    }
#if DISPATCH_AVX2
    if (avx2) {
        q4_0_q8_0_rows_avx2(src, src_type, dst, dst_type, nb);
        return;
    }
#endif
    const Py_ssize_t out = dst_type == T_Q4_0 ? 18 : 34;
    for (Py_ssize_t i = 0; i < nb; ++i) {
        q_block_scalar(src + i * item * QK, src_type, dst_type, dst + i * out);
    }
}

/* ggml_compute_fp32_to_bf16 (ggml-impl.h; ggml_fp32_to_bf16_row_ref, what ggml_quantize_chunk runs for BF16):
 * round to nearest even on the bits, a NaN keeps its top half and is made quiet. */
static inline uint16_t fp32_to_bf16(float s) {
    const uint32_t u = f2u(s);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return (uint16_t)((u >> 16) | 64u);
    }
    return (uint16_t)((u + (0x7FFFu + ((u >> 16) & 1u))) >> 16);
}

#if DISPATCH_AVX2
/* fp32 -> fp16 of n values, 8 lanes at a time (fp32_to_fp16_avx2: the same operations as fp32_to_fp16). */
__attribute__((target("avx2"))) static void fp16_row_avx2(const float *x, uint16_t *dst, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        _mm_storeu_si128((__m128i *)(dst + j), fp32_to_fp16_avx2(_mm256_loadu_ps(x + j)));
    }
    for (; j < n; ++j) {
        dst[j] = fp32_to_fp16(x[j]);
    }
}
#endif

/* ggml_quantize_chunk's F16 and BF16 cases (ggml_fp32_to_fp16_row, ggml_fp32_to_bf16_row_ref) over n values. Why
 * here and not numpy's astype: numpy keeps a NaN's payload where ggml writes sign | 0x7E00, and converts values
 * below fp16's normal range (much of a BF16 weight file) about 20x slower than others. */
static void float_rows(const uint8_t *src, int src_type, uint16_t *dst, int dst_type, Py_ssize_t n) {
    const Py_ssize_t item = src_type == T_F32 ? 4 : 2;
    const int avx2 = have_avx2();
    float x[QK_K];
    for (Py_ssize_t i = 0; i < n; i += QK_K) {
        const int m = n - i < QK_K ? (int)(n - i) : QK_K;
        load_block(src + i * item, src_type, m, x);
#if DISPATCH_AVX2
        if (avx2 && dst_type == T_F16) {
            fp16_row_avx2(x, dst + i, m);
            continue;
        }
#endif
        (void)avx2;
        if (dst_type == T_F16) {
            for (int j = 0; j < m; ++j) {
                dst[i + j] = fp32_to_fp16(x[j]);
            }
        } else {
            for (int j = 0; j < m; ++j) {
                dst[i + j] = fp32_to_bf16(x[j]);
            }
        }
    }
}

/* What quantize() makes: a block of `block` values -> `out_bytes` bytes (F16/BF16: one value, two bytes). */
static int dst_layout(int dst_type, int *block, Py_ssize_t *out_bytes) {
    switch (dst_type) {
    case T_Q4_0: *block = QK; *out_bytes = 18; return 1;
    case T_Q8_0: *block = QK; *out_bytes = 34; return 1;
    case T_Q6_K: *block = QK_K; *out_bytes = 210; return 1;
    case T_Q5_0: *block = QK; *out_bytes = 22; return 1;
    case T_Q5_1: *block = QK; *out_bytes = 24; return 1;
    case T_Q4_K: *block = QK_K; *out_bytes = 144; return 1;
    case T_Q5_K: *block = QK_K; *out_bytes = 176; return 1;
    case T_MXFP4: *block = QK; *out_bytes = 17; return 1;
    case T_F16:
    case T_BF16: *block = 1; *out_bytes = 2; return 1;
    default: return 0;
    }
}

static PyObject *quantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, dst;
    int src_type, dst_type;
    if (!PyArg_ParseTuple(args, "y*iw*i", &src, &src_type, &dst, &dst_type)) {
        return NULL;
    }
    const Py_ssize_t item = src_type == T_F32 ? 4 : 2;
    int block = 1;
    Py_ssize_t out_bytes = 0;
    const char *err = NULL;
    if (src_type != T_F32 && src_type != T_F16 && src_type != T_BF16) {
        err = "source type must be F32, F16 or BF16";
    } else if (!dst_layout(dst_type, &block, &out_bytes)) {
        err = "destination type must be Q4_0, Q8_0, Q6_K, Q5_0, Q5_1, Q4_K, Q5_K, F16 or BF16";
    } else if (src.len % (item * block)) {
        err = "source size is not a whole number of blocks";
    } else if (dst.len != src.len / (item * block) * out_bytes) {
        err = "destination size does not match the source";
    } else if (block == 1 && ((uintptr_t)dst.buf & 1)) {
        err = "destination of F16/BF16 values must be 2-byte aligned";
    }
    if (err == NULL) {
        const Py_ssize_t nb = src.len / (item * block);
        Py_BEGIN_ALLOW_THREADS
        if (block == 1) {
            float_rows(src.buf, src_type, dst.buf, dst_type, nb);
        } else {
            quantize_blocks(src.buf, src_type, dst.buf, dst_type, nb);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (err != NULL) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* How many values (F32/F16/BF16) or block scales (fp16 d, and dmin / m) are NaN or infinite: what
 * ggml_validate_row_data finds in llama-quantize's output before it refuses the tensor. */
static Py_ssize_t nonfinite(const uint8_t *p, int type, Py_ssize_t len) {
    Py_ssize_t bad = 0;
    if (type == T_F32) {
        for (Py_ssize_t i = 0; i + 4 <= len; i += 4) {
            uint32_t u;
            memcpy(&u, p + i, 4);
            bad += (u & 0x7F800000u) == 0x7F800000u;
        }
        return bad;
    }
    if (type == T_F16 || type == T_BF16) {
        const uint16_t mask = type == T_F16 ? 0x7C00u : 0x7F80u;
        const Py_ssize_t n = len / 2;
        for (Py_ssize_t i = 0; i < n; i += 4096) { /* 16-bit counts per stretch: the loop vectorises */
            const Py_ssize_t m = n - i < 4096 ? n - i : 4096;
            uint16_t c = 0;
            for (Py_ssize_t j = 0; j < m; ++j) {
                uint16_t h;
                memcpy(&h, p + 2 * (i + j), 2);
                c = (uint16_t)(c + ((h & mask) == mask));
            }
            bad += c;
        }
        return bad;
    }
    int block = 1;
    Py_ssize_t size = 1;
    dst_layout(type, &block, &size);
    if (type == T_MXFP4) { /* validate_e_e8m0: the exponent byte 0xFF is NaN */
        for (Py_ssize_t i = 0; i + size <= len; i += size) {
            bad += p[i] == 0xFF;
        }
        return bad;
    }
    /* d at 0 (Q6_K: at 208), and dmin / m at 2 for the types that have one */
    const Py_ssize_t at = type == T_Q6_K ? 208 : 0;
    const int two = type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K;
    for (Py_ssize_t i = 0; i + size <= len; i += size) {
        uint16_t h;
        memcpy(&h, p + i + at, 2);
        bad += (h & 0x7C00u) == 0x7C00u;
        if (two) {
            memcpy(&h, p + i + 2, 2);
            bad += (h & 0x7C00u) == 0x7C00u;
        }
    }
    return bad;
}

static PyObject *count_nonfinite(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    int type;
    if (!PyArg_ParseTuple(args, "y*i", &data, &type)) {
        return NULL;
    }
    if (type != T_F32 && type != T_F16 && type != T_BF16 && type != T_Q4_0 && type != T_Q8_0 && type != T_Q6_K &&
        type != T_Q5_0 && type != T_Q5_1 && type != T_Q4_K && type != T_Q5_K && type != T_MXFP4) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError,
                        "type must be F32, F16, BF16, Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K or MXFP4");
        return NULL;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = nonfinite(data.buf, type, data.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return PyLong_FromSsize_t(bad);
}

/* ------------------------------------------------------------------------------------------------------------------
 * Importance-weighted quantizers: what ggml_quantize_chunk runs when llama-quantize has an importance matrix for a
 * tensor (quantize_q4_0 / q5_0 / q5_1 / q4_K / q5_K / q6_K with quant_weights, their quantize_row_*_impl), and
 * IQ4_NL / IQ4_XS with or without one (quantize_iq4_nl / quantize_iq4_xs: the chunk functions llama-quantize calls,
 * which try 7 scales either way). Scalar, row by row: the weighted paths fit each block against weights derived
 * from the whole row (or super-block), in the order ggml sums them.
 * ---------------------------------------------------------------------------------------------------------------- */

enum { T_Q4_1 = 3, T_IQ4_NL = 20, T_IQ4_XS = 23 };

static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float fmax_c(float a, float b) { return a > b ? a : b; }  /* C's MAX(a, b) on floats, NaN as there */

/* The signed fit of make_qx_quants with weights (rmse_type 1): levels L in [0, 2*nmax), the scale returned. */
static float fit_signed_w(int n, int nmax, const float *x, int8_t *L, const float *w) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        const float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
        L[i] = (int8_t)(l + nmax);
        sumlx += w[i] * x[i] * (float)l;
        suml2 += w[i] * (float)l * (float)l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            sumlx += w[i] * x[i] * (float)l;
            suml2 += w[i] * (float)l * (float)l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = nearest_int(iscale * x[i]);
                l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
                L[i] = (int8_t)(nmax + l);
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* The scale-and-minimum fit of make_qkx3_quants (squared error, weights given): levels in [0, nmax], the scale
 * returned and -min in *neg_min. */
static float fit_min_w(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min, uint8_t *aux,
                       float rmin, float rdelta, int nstep) {
    float min = x[0], max = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max <= min) {
        memset(L, 0, (size_t)n);
        *neg_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min);
    float scale = 1 / iscale;
    float best = 0;
    for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        const float diff = scale * L[i] + min - x[i];
        best += w[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            const float v = iscale * (x[i] - min);
            const int l = v > 0 ? nearest_int(v < nmax ? v : (float)nmax) : 0;
            aux[i] = (uint8_t)l;
            sum_l += w[i] * (float)l;
            sum_l2 += w[i] * (float)l * (float)l;
            sum_xl += w[i] * (float)l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float err = 0;
            for (int i = 0; i < n; ++i) {
                const float diff = this_scale * aux[i] + this_min - x[i];
                err += w[i] * (diff * diff);
            }
            if (err < best) {
                memcpy(L, aux, (size_t)n);
                best = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *neg_min = -min;
    return scale;
}

/* make_qp_quants: the positive levels (<= nmax) of a super-block's scales or minimums, weighted by each sub-block's
 * weight sum; the scale returned. */
static float fit_positive_w(int n, int nmax, const float *x, uint8_t *L, const float *w) {
    float max = 0;
    for (int i = 0; i < n; ++i) max = fmax_c(max, x[i]);
    if (max < GROUP_MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = nmax / max;
    for (int i = 0; i < n; ++i) L[i] = (uint8_t)nearest_int(iscale * x[i]);
    const float scale = 1 / iscale;
    float best = 0;
    for (int i = 0; i < n; ++i) {
        const float diff = x[i] - scale * L[i];
        best += w[i] * diff * diff;
    }
    for (int is = -4; is <= 4; ++is) {
        if (is == 0) continue;
        const float iscale_is = (0.1f * is + nmax) / max;
        const float scale_is = 1 / iscale_is;
        float err = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale_is * x[i]);
            l = l < nmax ? l : nmax;
            const float diff = x[i] - scale_is * (float)l;
            err += w[i] * diff * diff;
        }
        if (err < best) {
            best = err;
            iscale = iscale_is;
        }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = l < nmax ? l : nmax;
        L[i] = (uint8_t)l;
        sumlx += w[i] * x[i] * (float)l;
        suml2 += w[i] * (float)l * (float)l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int changed = 0;
        for (int i = 0; i < n; ++i) {
            float slx = sumlx - w[i] * x[i] * L[i];
            float sl2 = suml2 - w[i] * L[i] * L[i];
            if (slx > 0 && sl2 > 0) {
                int new_l = nearest_int(x[i] * sl2 / slx);
                new_l = new_l < nmax ? new_l : nmax;
                if (new_l != L[i]) {
                    slx += w[i] * x[i] * (float)new_l;
                    sl2 += w[i] * (float)new_l * (float)new_l;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++changed;
                    }
                }
            }
        }
        if (!changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Q4_0 / Q5_0 / Q5_1 with weights (quantize_row_q4_0_impl, q5_0, q5_1): each block's weights are the row's importance
 * times sqrt(sigma2 + x^2), sigma2 the row's mean square. */
/* make_qx_quants(32, nmax, x, L, 1, w) of one Q4_0/Q5_0 block: the vector fit when its values are finite. */
static inline float fit_signed(const float *x, const float *w, int nmax, int8_t *L, int avx2) {
    if (!all_finite(x, QK)) {
        return fit_signed_w(QK, nmax, x, L, w);
    }
    float scale;
    make_qx_quants_finite(x, w, QK, nmax, 1, L, &scale, avx2);
    return scale;
}

/* quantize_row_q4_0_impl / quantize_row_q5_0_impl: one row of n values with weights, block by block. */
static void q_small_row_w(const float *x, int n, const float *qw, uint8_t *y, int dst_type) {
    const int avx2 = have_avx2();
    float sum_x2 = 0;
    for (int j = 0; j < n; ++j) sum_x2 += x[j] * x[j];
    const float sigma2 = sum_x2 / n;
    float weight[QK];
    for (int ib = 0; ib < n / QK; ++ib) {
        const float *xb = x + QK * ib;
        const float *q = qw + QK * ib;
        for (int j = 0; j < QK; ++j) weight[j] = q[j] * sqrtf(sigma2 + xb[j] * xb[j]);
        if (dst_type == T_Q4_0) {
            int8_t L[QK];
            uint8_t *b = y + 18 * ib;
            store_fp16(b, fp32_to_fp16(fit_signed(xb, weight, 8, L, avx2)));
            for (int j = 0; j < 16; ++j) b[2 + j] = (uint8_t)(L[j] | (L[j + 16] << 4));
            continue;
        }
        /* Q5_0 */
        uint8_t L[QK], *b = y + 22 * ib;
        int8_t S[QK];
        store_fp16(b, fp32_to_fp16(fit_signed(xb, weight, 16, S, avx2)));
        for (int j = 0; j < QK; ++j) L[j] = (uint8_t)S[j];
        b += 2;
        uint32_t qh = 0;
        for (int j = 0; j < 16; ++j) {
            const uint8_t lo = L[j], hi = L[j + 16];
            b[4 + j] = (uint8_t)((lo & 0x0F) | ((hi & 0x0F) << 4));
            qh |= ((lo & 0x10u) >> 4) << j;
            qh |= ((hi & 0x10u) >> 4) << (j + 16);
        }
        memcpy(b, &qh, 4);
    }
}

/* The rest of quantize_row_q4_K_impl / q5_K after the sub-blocks' fits (L, scales, mins, their weights' sums sw):
 * the super-block's scales, the levels again from them, the bytes. */
static void qk_finish_w(const float *x, uint8_t *L, const float *scales, const float *mins, const float *sw,
                        uint8_t *y, int q5) {
    const int nmax = q5 ? 31 : 15;
    uint8_t Ls[8], Lm[8];
    const float d_block = fit_positive_w(8, 63, scales, Ls, sw);
    const float m_block = fit_positive_w(8, 63, mins, Lm, sw);
    uint8_t *sc = y + 4;
    memset(sc, 0, 12);
    for (int j = 0; j < 8; ++j) {
        uint8_t ls = Ls[j], lm = Lm[j];
        if (q5) {
            ls = ls < 63 ? ls : 63;
            lm = lm < 63 ? lm : 63;
        }
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j - 0] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t dh = fp32_to_fp16(d_block), mh = fp32_to_fp16(m_block);
    store_fp16(y, dh);
    store_fp16(y + 2, mh);
    for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        if (j < 4) {
            s = sc[j] & 63; m = sc[j + 4] & 63;
        } else {
            s = (uint8_t)((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4));
            m = (uint8_t)((sc[j + 4] >> 4) | ((sc[j - 0] >> 6) << 4));
        }
        const float d = fp16_to_fp32(dh) * s;
        if (!d) continue;
        const float dm = fp16_to_fp32(mh) * m;
        for (int i = 0; i < 32; ++i) {
            const int l = nearest_int((x[32 * j + i] + dm) / d);
            L[32 * j + i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        }
    }
    if (!q5) {
        uint8_t *q = y + 16;
        for (int j = 0; j < QK_K; j += 64) {
            for (int l = 0; l < 32; ++l) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
            q += 32;
        }
        return;
    }
    uint8_t *qh = y + 16, *ql = y + 48;
    memset(qh, 0, 32);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK_K; n += 64) {
        for (int j = 0; j < 32; ++j) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
            if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
        m1 <<= 2; m2 <<= 2;
        ql += 32;
    }
}


/* Q4_K / Q5_K with weights (quantize_row_q4_K_impl, q5_K): one super-block of 256, the fits one after another. */
static void qk_block_w(const float *x, const float *qw, uint8_t *y, int q5) {
    const int nmax = q5 ? 31 : 15;
    uint8_t L[QK_K], aux[32];
    float weights[32], sw[8], mins[8], scales[8];
    float sum_x2 = 0;
    for (int l = 0; l < QK_K; ++l) sum_x2 += x[l] * x[l];
    const float sigma2 = 2 * sum_x2 / QK_K;
    for (int j = 0; j < 8; ++j) {
        const float *q = qw + 32 * j;
        for (int l = 0; l < 32; ++l) weights[l] = q[l] * sqrtf(sigma2 + x[32 * j + l] * x[32 * j + l]);
        float sumw = 0;
        for (int l = 0; l < 32; ++l) sumw += weights[l];
        sw[j] = sumw;
        scales[j] = fit_min_w(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], aux, -0.9f, 0.05f, 36);
    }
    qk_finish_w(x, L, scales, mins, sw, y, q5);
}

/* Q6_K with weights (quantize_row_q6_K_impl): each 16-value group fitted against the importance itself. */
static void q6_k_block_w(const float *x, const float *qw, uint8_t *y) {
    int8_t L[QK_K];
    float scales[16];
    float max_scale = 0, max_abs_scale = 0;
    if (all_finite(x, QK_K)) {
        q6_fits(x, qw, L, scales, simd_level());
    } else {
        for (int ib = 0; ib < 16; ++ib) {
            scales[ib] = fit_signed_w(16, 32, x + 16 * ib, L + 16 * ib, qw + 16 * ib);
        }
    }
    for (int ib = 0; ib < 16; ++ib) {
        const float scale = scales[ib];
        const float abs_scale = fabsf(scale);
        if (abs_scale > max_abs_scale) { max_abs_scale = abs_scale; max_scale = scale; }
    }
    uint8_t *ql = y, *qh = y + 128;
    int8_t *sc = (int8_t *)(y + 192);
    if (max_abs_scale < GROUP_MAX_EPS) {
        memset(y, 0, 210);
        store_fp16(y + 208, fp32_to_fp16(0.f));
        return;
    }
    const float iscale = -128.f / max_scale;
    const uint16_t dh = fp32_to_fp16(1 / iscale);
    store_fp16(y + 208, dh);
    for (int ib = 0; ib < 16; ++ib) {
        const int v = nearest_int(iscale * scales[ib]);
        sc[ib] = (int8_t)(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; ++j) {
        const float d = fp16_to_fp32(dh) * sc[j];
        if (!d) continue;
        for (int i = 0; i < 16; ++i) {
            int l = nearest_int(x[16 * j + i] / d);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            L[16 * j + i] = (int8_t)(l + 32);
        }
    }
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l] & 0xF, q2 = L[j + l + 32] & 0xF, q3 = L[j + l + 64] & 0xF,
                          q4 = L[j + l + 96] & 0xF;
            ql[l] = (uint8_t)(q1 | (q3 << 4));
            ql[l + 32] = (uint8_t)(q2 | (q4 << 4));
            qh[l] = (uint8_t)((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                              ((L[j + l + 96] >> 4) << 6));
        }
        ql += 64;
        qh += 32;
    }
}

/* best_index_int8: the nearest of the 16 IQ4 values (below the first: 0, above the last: 15, ties to the lower). */
static inline int iq4_index(float x) {
    if (x <= iq4_values[0]) return 0;
    if (x >= iq4_values[15]) return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (x < iq4_values[mid]) hi = mid; else lo = mid;
    }
    return x - iq4_values[hi - 1] < iq4_values[hi] - x ? hi - 1 : hi;
}

/* quantize_row_iq4_nl_impl with 7 trial scales (what quantize_iq4_nl / quantize_iq4_xs run): one block of 32 (NL,
 * `super` 32) or a super-block of 256 in 8 blocks with 6-bit block scales (XS). Weights: the importance times
 * sqrt(sigma2 + x^2), else x^2. */
/* iq4_index for many values at once, and IQ4's 16 fits of a 32-block side by side (the first fit and itry = -7..7,
 * one per lane; each lane's sums still take their terms in C's element order): the binary search of iq4_index run
 * in every lane, each step taken only where the lane's interval is still wider than 1 (as C's loop), without its
 * two edge tests, which the search reproduces (v <= -127 ends at 0, v >= 113 at 15, NaN at 15, as C). */
#if DISPATCH_AVX512
static const float iq4_f[16] __attribute__((aligned(64))) = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                             1,    13,   25,  38,  53,  69,  89,  113};

__attribute__((target(AVX512_TARGET))) static inline __m512i iq4_index_avx512(__m512 v, __m512 tab) {
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_set1_epi32(15);
    const __m512i one = _mm512_set1_epi32(1);
    for (int step = 0; step < 4; ++step) {
        const __mmask16 open = _mm512_cmpgt_epi32_mask(_mm512_sub_epi32(hi, lo), one);
        const __m512i mid = _mm512_srli_epi32(_mm512_add_epi32(lo, hi), 1);
        const __mmask16 below = _mm512_cmp_ps_mask(v, _mm512_permutexvar_ps(mid, tab), _CMP_LT_OQ);
        hi = _mm512_mask_mov_epi32(hi, open & below, mid);
        lo = _mm512_mask_mov_epi32(lo, open & ~below, mid);
    }
    const __m512i hm1 = _mm512_sub_epi32(hi, one);
    const __mmask16 first = _mm512_cmp_ps_mask(_mm512_sub_ps(v, _mm512_permutexvar_ps(hm1, tab)),
                                               _mm512_sub_ps(_mm512_permutexvar_ps(hi, tab), v), _CMP_LT_OQ);
    return _mm512_mask_mov_epi32(hi, first, hm1);
}

/* The 16 fits' sums (sumqx, sumq2) of the 32 values xb with weights w, lane t at iscale ids[t]. */
__attribute__((target(AVX512_TARGET))) static void iq4_fits_avx512(const float *xb, const float *w, const float *ids,
                                                                 float *sumqx, float *sumq2) {
    const __m512 tab = _mm512_load_ps(iq4_f), id = _mm512_loadu_ps(ids);
    __m512 sx = _mm512_setzero_ps(), s2 = _mm512_setzero_ps();
    for (int j = 0; j < 32; ++j) {
        const __m512 xj = _mm512_set1_ps(xb[j]), wj = _mm512_set1_ps(w[j]);
        const __m512 q = _mm512_permutexvar_ps(iq4_index_avx512(_mm512_mul_ps(id, xj), tab), tab);
        const __m512 wq = _mm512_mul_ps(wj, q);
        sx = _mm512_add_ps(sx, _mm512_mul_ps(wq, xj));
        s2 = _mm512_add_ps(s2, _mm512_mul_ps(wq, q));
    }
    _mm512_storeu_ps(sumqx, sx);
    _mm512_storeu_ps(sumq2, s2);
}

/* L[j] = iq4_index(id * x[j]) for j < n (a multiple of 16) */
__attribute__((target(AVX512_TARGET))) static void iq4_levels_avx512(const float *x, float id, int n, uint8_t *L) {
    const __m512 tab = _mm512_load_ps(iq4_f), idv = _mm512_set1_ps(id);
    for (int j = 0; j < n; j += 16) {
        _mm_storeu_si128((__m128i *)(L + j),
                         _mm512_cvtepi32_epi8(iq4_index_avx512(_mm512_mul_ps(idv, _mm512_loadu_ps(x + j)), tab)));
    }
}
#endif

static void iq4_levels(const float *x, float id, int n, uint8_t *L, int level) {
#if DISPATCH_AVX512
    if (level >= SIMD_AVX512) {
        iq4_levels_avx512(x, id, n, L);
        return;
    }
#endif
    (void)level;
    for (int j = 0; j < n; ++j) L[j] = (uint8_t)iq4_index(id * x[j]);
}

static void iq4_block(const float *x, const float *qw, uint8_t *y, int super) {
    const int ntry = 7, nb = super / 32;
    uint8_t L[QK_K];
    float weight[32], scales[8];
    float sigma2 = 0;
    for (int j = 0; j < super; ++j) sigma2 += x[j] * x[j];
    sigma2 *= 2.f / super;
    uint8_t *q4 = super == 32 ? y + 2 : y + 8;
    memset(q4, 0, (size_t)super / 2);
    store_fp16(y, fp32_to_fp16(0.f));
    float max_scale = 0, amax_scale = 0;
    const int level = simd_level();
    for (int ib = 0; ib < nb; ++ib) {
        const float *xb = x + 32 * ib;
        uint8_t *Lb = L + 32 * ib;
        if (qw) {
            for (int j = 0; j < 32; ++j) weight[j] = qw[32 * ib + j] * sqrtf(sigma2 + xb[j] * xb[j]);
        } else {
            for (int j = 0; j < 32; ++j) weight[j] = xb[j] * xb[j];
        }
        float amax = 0, max = 0;
        for (int j = 0; j < 32; ++j) {
            const float ax = fabsf(xb[j]);
            if (ax > amax) { amax = ax; max = xb[j]; }
        }
        if (amax < GROUP_MAX_EPS) {
            scales[ib] = 0;
            continue;
        }
        float d = -max / iq4_values[0];
        float id = 1 / d;
#if DISPATCH_AVX512
        if (level >= SIMD_AVX512) { /* the first fit and the 15 trials side by side, then C's choice in order */
            float ids[16], sx[16], s2[16];
            ids[0] = id;
            for (int itry = -ntry; itry <= ntry; ++itry) ids[itry + ntry + 1] = (itry + iq4_values[0]) / max;
            iq4_fits_avx512(xb, weight, ids, sx, s2);
            d = s2[0] > 0 ? sx[0] / s2[0] : 0.f;
            float best = d * sx[0];
            for (int t = 1; t < 16; ++t) {
                if (s2[t] > 0 && sx[t] * sx[t] > best * s2[t]) {
                    d = sx[t] / s2[t];
                    best = d * sx[t];
                }
            }
            scales[ib] = d;
            const float abs_d = fabsf(d);
            if (abs_d > amax_scale) { amax_scale = abs_d; max_scale = d; }
            continue;
        }
#endif
        float sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; ++j) {
            const int l = iq4_index(id * xb[j]);
            Lb[j] = (uint8_t)l;
            const float q = iq4_values[l];
            sumqx += weight[j] * q * xb[j];
            sumq2 += weight[j] * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        float best = d * sumqx;
        for (int itry = -ntry; itry <= ntry; ++itry) {
            id = (itry + iq4_values[0]) / max;
            sumqx = sumq2 = 0;
            for (int j = 0; j < 32; ++j) {
                const float q = iq4_values[iq4_index(id * xb[j])];
                sumqx += weight[j] * q * xb[j];
                sumq2 += weight[j] * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        const float abs_d = fabsf(d);
        if (abs_d > amax_scale) { amax_scale = abs_d; max_scale = d; }
    }
    if (nb > 1) {
        uint16_t scales_h = 0;
        uint8_t *scales_l = y + 4;
        const float d = -max_scale / 32;
        store_fp16(y, fp32_to_fp16(d));
        const float id = d ? 1 / d : 0.f;
        for (int ib = 0; ib < nb; ++ib) {
            int l = nearest_int(id * scales[ib]);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            const float dl = d * l;
            const float idl = dl ? 1 / dl : 0.f;
            iq4_levels(x + 32 * ib, idl, 32, L + 32 * ib, level);
            l += 32;
            const uint8_t l_l = (uint8_t)(l & 0xf), l_h = (uint8_t)(l >> 4);
            if (ib % 2 == 0) scales_l[ib / 2] = l_l;
            else scales_l[ib / 2] |= (uint8_t)(l_l << 4);
            scales_h |= (uint16_t)(l_h << 2 * (ib % 8));
        }
        memcpy(y + 2, &scales_h, 2);
    } else {
        store_fp16(y, fp32_to_fp16(scales[0]));
        const float id = scales[0] ? 1 / scales[0] : 0;
        iq4_levels(x, id, super, L, level);
    }
    for (int i = 0; i < super / 32; ++i) {
        for (int j = 0; j < 16; ++j) q4[16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
    }
}

/* One row of n values of dst_type with the row's importance qw (NULL: IQ4_NL/IQ4_XS without one). */
/* One row of n values to Q4_K / Q5_K with weights: the active instruction set's groups of super-blocks fitted side
 * by side (qkx3_group; the last ones in a group padded with zeros), each super-block finished alone; a group the
 * vector fits turn down (a NaN or inf, a trial that is not plain) takes qk_block_w. */
/* quantize_row_q4_K_impl's sigma2 = 2 * sum x^2 / 256 of each of n super-blocks, for each of its 8 sub-blocks */
static void kq_sigma2(const float *x, int n, float *sig) {
    for (int b = 0; b < n; ++b) {
        float sum_x2 = 0;
        for (int l = 0; l < QK_K; ++l) sum_x2 += x[QK_K * b + l] * x[QK_K * b + l];
        for (int j = 0; j < KSUB; ++j) sig[KSUB * b + j] = 2 * sum_x2 / QK_K;
    }
}

/* quantize_row_q4_1_impl / quantize_row_q5_1_impl (nmax 15 / 31) of one row of n values with weights: the 32-blocks'
 * fits side by side (qkx3_group, the row's sigma2 in every lane; the last group padded with zeros), each block
 * written alone; a group the vector fits turn down takes q_small_row_w's scalar fit. */
static void q_min_rows_w(const float *x, int n, const float *qw, uint8_t *y, int dst_type) {
    const int nmax = dst_type == T_Q4_1 ? 15 : 31, out = dst_type == T_Q4_1 ? 20 : 24;
    const kq_impl k = kq_of_level();
    const int lanes = k.per * KSUB;
    kq_params p;
    kq_params_init(&p, nmax, -0.9f, 0.05f, 36);
    float sum_x2 = 0;
    for (int j = 0; j < n; ++j) sum_x2 += x[j] * x[j];
    float sig[KQ_GROUP_MAX * KSUB];
    for (int j = 0; j < lanes; ++j) sig[j] = sum_x2 / n;
    uint8_t L[KQ_GROUP_MAX * QK_K];
    float scales[KQ_GROUP_MAX * KSUB], mins[KQ_GROUP_MAX * KSUB], sw[KQ_GROUP_MAX * KSUB];
    float xs[KQ_GROUP_MAX * QK_K], qs[KQ_GROUP_MAX * QK_K];
    for (int b0 = 0; b0 < n / QK; b0 += lanes) {
        const int nb = n / QK - b0 < lanes ? n / QK - b0 : lanes;
        const float *xg = x + QK * b0, *qg = qw + QK * b0;
        if (nb < lanes) { /* the row's last blocks, padded with zeros */
            memset(xs, 0, sizeof xs);
            memset(qs, 0, sizeof qs);
            memcpy(xs, xg, sizeof(float) * QK * (size_t)nb);
            memcpy(qs, qg, sizeof(float) * QK * (size_t)nb);
            xg = xs;
            qg = qs;
        }
        if (!k.qkx3(xg, qg, sig, &p, L, scales, mins, sw)) {
            /* the scalar fit, block by block, with the row's sigma2 (q_small_row_w recomputes it: the same value) */
            float w[QK];
            for (int b = 0; b < nb; ++b) {
                const float *xb = x + QK * (b0 + b), *q = qw + QK * (b0 + b);
                for (int j = 0; j < QK; ++j) w[j] = q[j] * sqrtf(sig[0] + xb[j] * xb[j]);
                uint8_t aux[QK];
                scales[b] = fit_min_w(QK, nmax, xb, w, L + QK * b, &mins[b], aux, -0.9f, 0.05f, 36);
            }
        }
        for (int b = 0; b < nb; ++b) {
            const uint8_t *Lb = L + QK * b;
            uint8_t *yb = y + out * (b0 + b);
            store_fp16(yb, fp32_to_fp16(scales[b]));
            store_fp16(yb + 2, fp32_to_fp16(-mins[b]));
            if (dst_type == T_Q4_1) {
                for (int j = 0; j < 16; ++j) yb[4 + j] = (uint8_t)(Lb[j] | (Lb[j + 16] << 4));
                continue;
            }
            uint32_t qh = 0;
            for (int j = 0; j < 16; ++j) {
                const uint8_t lo = Lb[j], hi = Lb[j + 16];
                yb[8 + j] = (uint8_t)((lo & 0x0F) | ((hi & 0x0F) << 4));
                qh |= ((lo & 0x10u) >> 4) << j;
                qh |= ((hi & 0x10u) >> 4) << (j + 16);
            }
            memcpy(yb + 4, &qh, 4);
        }
    }
}

static void qk_rows_w(const float *x, int n, const float *qw, uint8_t *y, int q5) {
    const kq_impl k = kq_of_level();
    const int per = k.per;
    float sig[KQ_GROUP_MAX * KSUB];
    kq_params p;
    kq_params_init(&p, q5 ? 31 : 15, -0.9f, 0.05f, 36);
    const int out = q5 ? 176 : 144, nsb = n / QK_K;
    uint8_t L[KQ_GROUP_MAX * QK_K];
    float scales[KQ_GROUP_MAX * KSUB], mins[KQ_GROUP_MAX * KSUB], sw[KQ_GROUP_MAX * KSUB];
    int i = 0;
    for (; i + per <= nsb; i += per) {
        kq_sigma2(x + QK_K * i, per, sig);
        if (k.qkx3(x + QK_K * i, qw + QK_K * i, sig, &p, L, scales, mins, sw)) {
            for (int b = 0; b < per; ++b) {
                qk_finish_w(x + QK_K * (i + b), L + QK_K * b, scales + KSUB * b, mins + KSUB * b, sw + KSUB * b,
                            y + out * (i + b), q5);
            }
            continue;
        }
        for (int b = 0; b < per; ++b) {
            qk_block_w(x + QK_K * (i + b), qw + QK_K * (i + b), y + out * (i + b), q5);
        }
    }
    if (i < nsb) { /* the last super-blocks in a group padded with zeros (all-zero sub-blocks are plain) */
        float xs[KQ_GROUP_MAX * QK_K], qs[KQ_GROUP_MAX * QK_K];
        memset(xs, 0, sizeof xs);
        memset(qs, 0, sizeof qs);
        memcpy(xs, x + QK_K * i, sizeof(float) * QK_K * (size_t)(nsb - i));
        memcpy(qs, qw + QK_K * i, sizeof(float) * QK_K * (size_t)(nsb - i));
        kq_sigma2(xs, per, sig);
        const int fitted = k.qkx3(xs, qs, sig, &p, L, scales, mins, sw);
        for (int b = 0; i + b < nsb; ++b) {
            if (fitted) {
                qk_finish_w(x + QK_K * (i + b), L + QK_K * b, scales + KSUB * b, mins + KSUB * b, sw + KSUB * b,
                            y + out * (i + b), q5);
            } else {
                qk_block_w(x + QK_K * (i + b), qw + QK_K * (i + b), y + out * (i + b), q5);
            }
        }
    }
}

/* quantize_row_q4_1_ref (ggml-quants.c), one block -> 20 bytes (fp16 d, fp16 m, qs[16]): what quantize_q4_1 runs
 * without an importance. min and max by C's strict scans from FLT_MAX, d = (max - min) / 15,
 * q = MIN(15, (int8_t)((x - min)*id + 0.5f)) stored as a uint8 (a negative int8 keeps its bit pattern). */
static void q4_1_block(const float *restrict x, uint8_t *restrict y) {
    float min, max;
    minmax_scan(x, &min, &max);
    const float d = (max - min) / ((1 << 4) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    store_fp16(y, fp32_to_fp16(d));
    store_fp16(y + 2, fp32_to_fp16(min));
    for (int j = 0; j < QK / 2; ++j) {
        const int8_t i0 = trunc_i8((x[j] - min) * id + 0.5f);
        const int8_t i1 = trunc_i8((x[QK / 2 + j] - min) * id + 0.5f);
        const uint8_t xi0 = (uint8_t)(i0 < 15 ? i0 : 15);
        const uint8_t xi1 = (uint8_t)(i1 < 15 ? i1 : 15);
        y[4 + j] = (uint8_t)(xi0 | (xi1 << 4));
    }
}

static void weighted_row(const float *x, int n, const float *qw, uint8_t *y, int dst_type) {
    switch (dst_type) {
    case T_Q4_1:
        if (qw == NULL) {
            for (int i = 0; i < n / QK; ++i) q4_1_block(x + QK * i, y + 20 * i);
        } else {
            q_min_rows_w(x, n, qw, y, dst_type);
        }
        return;
    case T_Q4_0:
    case T_Q5_0:
        q_small_row_w(x, n, qw, y, dst_type);
        return;
    case T_Q5_1:
        q_min_rows_w(x, n, qw, y, dst_type);
        return;
    case T_Q4_K:
    case T_Q5_K:
        qk_rows_w(x, n, qw, y, dst_type == T_Q5_K);
        return;
    case T_Q6_K:
        for (int i = 0; i < n / QK_K; ++i) q6_k_block_w(x + QK_K * i, qw + QK_K * i, y + 210 * i);
        return;
    case T_IQ4_NL:
        for (int i = 0; i < n / QK; ++i) iq4_block(x + QK * i, qw ? qw + QK * i : NULL, y + 18 * i, QK);
        return;
    case T_IQ4_XS:
        for (int i = 0; i < n / QK_K; ++i) iq4_block(x + QK_K * i, qw ? qw + QK_K * i : NULL, y + 136 * i, QK_K);
        return;
    }
}

/* What quantize_weighted() makes: the weighted block types (their layout as dst_layout's) and the two IQ4 types. */
static int weighted_layout(int dst_type, int *block, Py_ssize_t *out_bytes) {
    switch (dst_type) {
    case T_Q4_0: case T_Q5_0: case T_Q5_1: case T_Q4_K: case T_Q5_K: case T_Q6_K:
        return dst_layout(dst_type, block, out_bytes);
    case T_Q4_1: *block = QK; *out_bytes = 20; return 1;
    case T_IQ4_NL: *block = QK; *out_bytes = 18; return 1;
    case T_IQ4_XS: *block = QK_K; *out_bytes = 136; return 1;
    default: return 0;
    }
}

static PyObject *quantize_weighted(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src, dst, imp;
    int src_type, dst_type;
    Py_ssize_t n_per_row;
    if (!PyArg_ParseTuple(args, "y*iw*iny*", &src, &src_type, &dst, &dst_type, &n_per_row, &imp)) {
        return NULL;
    }
    const Py_ssize_t item = src_type == T_F32 ? 4 : 2;
    int block = 1;
    Py_ssize_t out_bytes = 0;
    const char *err = NULL;
    if (src_type != T_F32 && src_type != T_F16 && src_type != T_BF16) {
        err = "source type must be F32, F16 or BF16";
    } else if (!weighted_layout(dst_type, &block, &out_bytes)) {
        err = "destination type must be Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS";
    } else if (n_per_row <= 0 || n_per_row % block || n_per_row > (1 << 24) || src.len % (item * n_per_row)) {
        err = "rows must be whole blocks, and the source whole rows";
    } else if (dst.len != src.len / (item * block) * out_bytes) {
        err = "destination size does not match the source";
    } else if (imp.len != 0 && imp.len != n_per_row * 4) {
        err = "the importance must be one float32 per column of a row";
    } else if (imp.len == 0 && dst_type != T_IQ4_NL && dst_type != T_IQ4_XS && dst_type != T_Q4_1) {
        err = "this type is weighted only with an importance";
    }
    if (err == NULL) {
        float *x = PyMem_RawMalloc((size_t)n_per_row * sizeof(float));
        if (x == NULL) {
            err = "out of memory";
        } else {
            const Py_ssize_t rows = src.len / (item * n_per_row);
            const Py_ssize_t row_out = n_per_row / block * out_bytes;
            const float *qw = imp.len ? (const float *)imp.buf : NULL;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t r = 0; r < rows; ++r) {
                const uint8_t *row = (const uint8_t *)src.buf + r * item * n_per_row;
                for (Py_ssize_t j = 0; j < n_per_row; j += QK_K) {  /* load_block widens at most QK_K at a time */
                    load_block(row + j * item, src_type, (int)(n_per_row - j < QK_K ? n_per_row - j : QK_K), x + j);
                }
                weighted_row(x, (int)n_per_row, qw, (uint8_t *)dst.buf + r * row_out, dst_type);
            }
            Py_END_ALLOW_THREADS
            PyMem_RawFree(x);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&imp);
    if (err != NULL) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *simd_levels(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    const int top = simd_available();
    PyObject *names = PyTuple_New(top + 1);
    if (names == NULL) {
        return NULL;
    }
    for (int k = 0; k <= top; ++k) {
        PyObject *name = PyUnicode_FromString(simd_names[k]);
        if (name == NULL) {
            Py_DECREF(names);
            return NULL;
        }
        PyTuple_SET_ITEM(names, k, name);
    }
    return names;
}

static PyObject *simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(simd_names[simd_level()]);
}

static PyObject *set_simd(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) {
        return NULL;
    }
    const int top = simd_available();
    for (int k = 0; k <= top; ++k) {
        if (strcmp(name, simd_names[k]) == 0) {
            simd_active = k;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "instruction set %s is not available here (this CPU and build have %s and below)",
                 name, simd_names[top]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"count_nonfinite", count_nonfinite, METH_VARARGS,
     "count_nonfinite(data, type): NaN or infinite values (F32/F16/BF16) or block scales (the block types)."},
    {"quantize_weighted", quantize_weighted, METH_VARARGS,
     "quantize_weighted(src, src_type, dst, dst_type, n_per_row, importance): rows of n_per_row values -> blocks, "
     "with the rows' importance (float32 per column; empty: Q4_1/IQ4_NL/IQ4_XS without one)."},
    {"quantize", quantize, METH_VARARGS,
     "quantize(src, src_type, dst, dst_type): src (F32/F16/BF16 bytes) -> dst (Q4_0/Q8_0/Q6_K/Q5_0/Q5_1/Q4_K/Q5_K/MXFP4 "
     "blocks, F16/BF16)."},
    {"simd_levels", simd_levels, METH_NOARGS, "simd_levels(): the instruction sets this CPU and build can run."},
    {"simd", simd, METH_NOARGS, "simd(): the instruction set the kernels use now."},
    {"set_simd", set_simd, METH_VARARGS, "set_simd(name): use that instruction set (one of simd_levels())."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
