/* Compiled Q4_0/Q8_0/Q6_K kernels, bit-exact with ggml b11434's reference quantizers.
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
 * The hot scans use GCC/clang vector extensions; another compiler fails the build, which only means the
 * numpy kernels are used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* GGML type ids (ggml.h) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q8_0 = 8, T_Q6_K = 14, T_BF16 = 30 };

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
 * winner is then chosen in C's order, and L recomputed from its iscale (as C does). */
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

/* quantize_row_q6_K_ref (ggml-quants.c), one 256-value super-block -> 210 bytes
 * (ql[128], qh[64], int8 scales[16], fp16 d). */
static void q6_k_block(const float *x, uint8_t *y) {
    int8_t L[QK_K];
    float scales[QK_K / 16];
    float max_scale = 0;
    float max_abs_scale = 0;
    for (int ib = 0; ib < QK_K / 16; ++ib) {
        const float scale = make_qx_quants16(x + 16 * ib, L + 16 * ib);
        scales[ib] = scale;
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
        for (int ii = 0; ii < 16; ++ii) {
            int l = nearest_int(x[16 * j + ii] / d);
            l = l < 31 ? l : 31;
            l = l > -32 ? l : -32;
            L[16 * j + ii] = (int8_t)(l + 32);
        }
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

/* ggml_quantize_chunk without an imatrix (what llama-quantize runs): nb blocks of src -> dst. */
static void quantize_blocks(const uint8_t *src, int src_type, uint8_t *dst, int dst_type, Py_ssize_t nb) {
    const Py_ssize_t item = src_type == T_F32 ? 4 : 2;
    float x[QK_K];
    for (Py_ssize_t i = 0; i < nb; ++i) {
        if (dst_type == T_Q4_0) {
            load_block(src + i * item * QK, src_type, QK, x);
            q4_0_block(x, dst + i * 18);
        } else if (dst_type == T_Q8_0) {
            load_block(src + i * item * QK, src_type, QK, x);
            q8_0_block(x, dst + i * 34);
        } else {
            load_block(src + i * item * QK_K, src_type, QK_K, x);
            q6_k_block(x, dst + i * 210);
        }
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
    const int block = dst_type == T_Q6_K ? QK_K : QK;
    const Py_ssize_t out_bytes = dst_type == T_Q4_0 ? 18 : dst_type == T_Q8_0 ? 34 : 210;
    const char *err = NULL;
    if (src_type != T_F32 && src_type != T_F16 && src_type != T_BF16) {
        err = "source type must be F32, F16 or BF16";
    } else if (dst_type != T_Q4_0 && dst_type != T_Q8_0 && dst_type != T_Q6_K) {
        err = "destination type must be Q4_0, Q8_0 or Q6_K";
    } else if (src.len % (item * block)) {
        err = "source size is not a whole number of blocks";
    } else if (dst.len != src.len / (item * block) * out_bytes) {
        err = "destination size does not match the source";
    }
    if (err == NULL) {
        const Py_ssize_t nb = src.len / (item * block);
        Py_BEGIN_ALLOW_THREADS
        quantize_blocks(src.buf, src_type, dst.buf, dst_type, nb);
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

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS,
     "quantize(src, src_type, dst, dst_type): src (F32/F16/BF16 bytes) -> dst (Q4_0/Q8_0/Q6_K blocks)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
