/*
 * The CPU GEMM driver: argument checks, activation preparation, work split, output conversion.
 *
 * y[m, n] = sum_k x[m, perm[k]] * w[n, k] (+ bias[n]), K in packed order. Per activation block b of
 * `ab` columns (inside one quantization group g), with w = s*(q - z) (zero modes none / int) or
 * w = s*q + m (zero mode float, m the minimum), q whole codes (8-bit: both nibble planes):
 *   exact, int zeros: acc = sum (q - z)*x (fp32),       y += s*acc
 *   exact, minima:    acc = sum fma(s, q, m)*x (fp32),  y += acc
 *   fast:  x ~ xs*a (a int8 per block), A = sum q*a (int32, exact),
 *          int zeros: y += xs*s*(A - z*sum(a))  (an exact integer below 2^24, so exact in fp32)
 *          minima:    y += xs*(s*A + m*sum(a))  (the rounding error of s*A added back by an FMA)
 * The factored form s*sum(q*x) - s*z*sum(x) is not used by exact: with a large scale its two terms
 * cancel and each carries a rounding error of order eps*s*z*sum|x|, which can exceed the result (a
 * group of weights that is exactly zero gave 24 % relative error at s = 65536). q - z is an exact small
 * integer, so exact has the error of an fp32 dot product of the true weights, like fp32
 * dequantize-then-matmul; the subtraction is one vector op per weight vector, shared by the rows of a
 * register tile. The fast path's result is the dot product of the dequantized weights with the
 * int8-rounded activations, to fp32 rounding of the per-block terms.
 */
#include "w4p_cpu_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- scalar conversions (round to nearest even, like numpy) ------------------------------------- */
float w4p_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            man &= 0x3FF;
            u = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t w4p_float_to_half(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000;
    uint32_t a = u & 0x7FFFFFFF;
    if (a >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (a > 0x7F800000 ? 0x200 : 0));
    if (a >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* rounds to >= 65520: inf */
    if (a < 0x38800000) {                                  /* result subnormal or zero */
        if (a < 0x33000000) return (uint16_t)sign;         /* < half of the smallest subnormal */
        /* value = m * 2^(e-150); in units of the smallest subnormal 2^-24 that is m >> (126 - e) */
        uint32_t e = a >> 23, m = (a & 0x7FFFFF) | 0x800000;
        int shift = 126 - (int)e;
        uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t r = a + 0xFFF + ((a >> 13) & 1) - (112u << 23);
    return (uint16_t)(sign | (r >> 13));
}

uint16_t w4p_float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline size_t dtype_size(int dtype) { return dtype == W4P_DT_F32 ? 4 : 2; }

void w4p_block_params(const struct w4p_cpu_layer *L, int tile, int blk, float *s, float *zm) {
    const uint8_t *p = w4p_tile_params(L, tile, w4p_block_group(L, blk));
    if (L->pkind == W4P_PK_F16U8) {
        for (int i = 0; i < W4P_TILE; i++) {
            s[i] = w4p_half_to_float(((const uint16_t *)p)[i]);
            zm[i] = (float)p[128 + i];
        }
    } else if (L->pkind == W4P_PK_F16F16) {
        for (int i = 0; i < W4P_TILE; i++) {
            s[i] = w4p_half_to_float(((const uint16_t *)p)[i]);
            zm[i] = w4p_half_to_float(((const uint16_t *)p)[W4P_TILE + i]);
        }
    } else {
        memcpy(s, p, 4 * W4P_TILE);
        memcpy(zm, p + 4 * W4P_TILE, 4 * W4P_TILE);
    }
}

void w4p_store_row(const w4p_job *J, int64_t m, int tile, const float *v) {
    int n0 = tile * W4P_TILE;
    int cnt = J->L->n - n0;
    if (cnt > W4P_TILE) cnt = W4P_TILE;
    const float *b = J->bias ? J->bias + n0 : NULL;
    switch (J->y_dtype) {
    case W4P_DT_F16: {
        uint16_t *y = (uint16_t *)J->y + m * J->ldy + n0;
        for (int i = 0; i < cnt; i++) y[i] = w4p_float_to_half(b ? v[i] + b[i] : v[i]);
        break;
    }
    case W4P_DT_BF16: {
        uint16_t *y = (uint16_t *)J->y + m * J->ldy + n0;
        for (int i = 0; i < cnt; i++) y[i] = w4p_float_to_bf16(b ? v[i] + b[i] : v[i]);
        break;
    }
    default: {
        float *y = (float *)J->y + m * J->ldy + n0;
        for (int i = 0; i < cnt; i++) y[i] = b ? v[i] + b[i] : v[i];
    }
    }
}

/* ---- activation preparation ------------------------------------------------------------------- */
void w4p_cvt_generic(const void *src, int dtype, float *dst, int n) {
    if (dtype == W4P_DT_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    for (int i = 0; i < n; i++) dst[i] = w4p_load_float(src, dtype, i);
}

/* fp-contract off: the product x*inv is rounded to fp32 before rounding to an integer on every
 * target (an FMA-contracted version rounds differently on aarch64 and breaks cross-ISA agreement). */
__attribute__((optimize("fp-contract=off")))
void w4p_quant_generic(const float *x, int n, int8_t *q, float *scale, int32_t *sum) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
    for (int i = 0; i < n; i++) {
        float v = x[i] * inv;
        v = (v + 12582912.0f) - 12582912.0f; /* round to nearest even, |v| <= 127 */
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        q[i] = (int8_t)v;
        s += q[i];
    }
    *scale = amax / 127.0f;
    *sum = s;
}

typedef struct {
    const struct w4p_cpu_layer *L;
    const void *x;
    int x_dtype;
    int64_t ldx;
    int precision;
    w4p_cvt_fn cvt;
    w4p_quant_fn quant;
    float *xf;
    int8_t *xq;
    float *xs;
    int32_t *xsum;
    uint16_t *xb; /* AMX: bf16 pieces, rows of w4p_amx_row(pieces, kp) values, or NULL */
    int pieces;
    float *xsumf; /* AMX with float minima: per-block activation sums [m][nblk], or NULL */
} prep_ctx;

static void prep_row(void *vctx, int64_t m) {
    const prep_ctx *P = vctx;
    const struct w4p_cpu_layer *L = P->L;
    const int kp = L->kp, k = L->k, ab = L->ab;
    float *xf = P->xf + m * kp;
    const char *row = (const char *)P->x + (size_t)m * P->ldx * dtype_size(P->x_dtype);
    if (L->perm) {
        /* convert in source order into the tail of this row's scratch, then gather */
        float *tmp = malloc(sizeof(float) * (size_t)k);
        if (tmp) {
            P->cvt(row, P->x_dtype, tmp, k);
            for (int i = 0; i < k; i++) xf[i] = tmp[L->perm[i]];
            free(tmp);
        } else {
            for (int i = 0; i < k; i++) xf[i] = w4p_load_float(row, P->x_dtype, L->perm[i]);
        }
    } else {
        P->cvt(row, P->x_dtype, xf, k);
    }
    for (int i = k; i < kp; i++) xf[i] = 0.0f;
#if defined(__x86_64__)
    if (P->xb) w4p_bf16_pieces_avx512(xf, kp, P->pieces, P->xb + (size_t)m * w4p_amx_row(P->pieces, kp), (size_t)kp);
    if (P->xsumf) w4p_block_sums_avx512(xf, L->nblk, ab, P->xsumf + m * L->nblk);
#endif
    if (P->precision == W4P_PREC_FAST)
        for (int b = 0; b < L->nblk; b++)
            P->quant(xf + (size_t)b * ab, ab, P->xq + m * kp + (size_t)b * ab, &P->xs[m * L->nblk + b],
                     &P->xsum[m * L->nblk + b]);
}

/* ---- work split ------------------------------------------------------------------------------- */

typedef struct {
    const w4p_job *job;
    w4p_tile_fn fn;
    int64_t mchunks;
} run_ctx;

static void run_item(void *vctx, int64_t i) {
    const run_ctx *R = vctx;
    int tile = (int)(i / R->mchunks);
    int64_t m0 = (i % R->mchunks) * W4P_MCHUNK;
    int64_t m1 = m0 + W4P_MCHUNK;
    if (m1 > R->job->m) m1 = R->job->m;
    R->fn(R->job, tile, m0, m1);
}

static w4p_tile_fn pick_kernel(int isa) {
    switch (isa) {
    case W4P_ISA_SCALAR: return w4p_tile_scalar;
#if defined(__x86_64__) || defined(__i386__)
    case W4P_ISA_AVX2: return w4p_tile_avx2;
    case W4P_ISA_AVX512: return w4p_tile_avx512;
    case W4P_ISA_AVX512VNNI: return w4p_tile_avx512vnni;
#endif
#if defined(__x86_64__)
    case W4P_ISA_AMX: return w4p_tile_amx;
#endif
#if defined(__aarch64__)
    case W4P_ISA_NEON: return w4p_tile_neon;
#endif
    default: return NULL;
    }
}

static int valid_dtype(int dt) { return dt == W4P_DT_F16 || dt == W4P_DT_BF16 || dt == W4P_DT_F32; }

static int gemm_rows(const w4p_cpu_layer *L, const void *x, int x_dtype, int64_t m, int64_t ldx,
                     void *y, int y_dtype, int64_t ldy, const float *bias32, int precision, int isa,
                     w4p_tile_fn fn, int threads);

#define W4P_ROWS_PER_PASS 256 /* activation scratch stays bounded (and cache-sized) for any M */

int w4p_cpu_gemm(const w4p_cpu_layer *L, const void *x, int x_dtype, int64_t m, int64_t ldx,
                 void *y, int y_dtype, int64_t ldy, const void *bias, int bias_dtype,
                 int precision, int isa, int threads) {
    if (!L) { w4p_set_error("null layer"); return W4P_EINVAL; }
    if (!x || !y) { w4p_set_error("null activation or output pointer"); return W4P_EINVAL; }
    if (m < 1) { w4p_set_error("M must be >= 1, got %lld", (long long)m); return W4P_EINVAL; }
    if (ldx < L->k) { w4p_set_error("activation row stride %lld < K=%d", (long long)ldx, L->k); return W4P_EINVAL; }
    if (ldy < L->n) { w4p_set_error("output row stride %lld < N=%d", (long long)ldy, L->n); return W4P_EINVAL; }
    if (!valid_dtype(x_dtype) || !valid_dtype(y_dtype) || (bias && !valid_dtype(bias_dtype))) {
        w4p_set_error("unknown dtype code (activation %d, output %d, bias %d)", x_dtype, y_dtype, bias_dtype);
        return W4P_EINVAL;
    }
    if (precision != W4P_PREC_EXACT && precision != W4P_PREC_FAST) {
        w4p_set_error("unknown precision %d", precision);
        return W4P_EINVAL;
    }
    if (threads < 1) { w4p_set_error("threads must be >= 1, got %d", threads); return W4P_EINVAL; }
    int avail = w4p_cpu_isa_available();
    if (isa == 0) {
        /* W4PACK_ISA is read on every call; a forced path that is unknown or unavailable is an error,
           never a silent fallback (tests rely on the path they force actually running) */
        const char *force = getenv("W4PACK_ISA");
        isa = w4p_cpu_isa_selected();
        if (force && *force && strcmp(force, "auto") && strcmp(force, w4p_cpu_isa_name(isa)) &&
            !(!strcmp(force, "avx512") && (isa == W4P_ISA_AVX512 || isa == W4P_ISA_AVX512VNNI))) {
            w4p_set_error("W4PACK_ISA=%s is not a path this CPU can run (available bit set %d; names: scalar, "
                          "avx2, avx512, avx512vnni, avx512novnni, amx, neon)", force, avail);
            return W4P_EUNSUPPORTED;
        }
    }
    w4p_tile_fn fn = pick_kernel(isa);
    if (!fn || !(avail & isa)) {
        w4p_set_error("instruction-set path %s (%d) is not available on this CPU", w4p_cpu_isa_name(isa), isa);
        return W4P_EUNSUPPORTED;
    }

    /* waking a worker costs tens of microseconds on a busy machine: small problems run on fewer threads
       (at least ~2M multiply-adds per thread) */
    {
        int64_t work = m * (int64_t)L->n * (int64_t)L->k;
        int64_t most = 1 + work / ((int64_t)1 << 21);
        if (threads > most) threads = (int)most;
    }
    float *bias32 = NULL;
    if (bias) {
        bias32 = calloc((size_t)L->nt * W4P_TILE, sizeof(float));
        if (!bias32) { w4p_set_error("out of memory"); return W4P_ENOMEM; }
        for (int i = 0; i < L->n; i++) bias32[i] = w4p_load_float(bias, bias_dtype, i);
    }
    int rc = W4P_OK;
    for (int64_t m0 = 0; m0 < m && rc == W4P_OK; m0 += W4P_ROWS_PER_PASS) {
        int64_t mm = m - m0 < W4P_ROWS_PER_PASS ? m - m0 : W4P_ROWS_PER_PASS;
        rc = gemm_rows(L, (const char *)x + (size_t)m0 * ldx * dtype_size(x_dtype), x_dtype, mm, ldx,
                       (char *)y + (size_t)m0 * ldy * dtype_size(y_dtype), y_dtype, ldy, bias32, precision, isa, fn,
                       threads);
    }
    free(bias32);
    return rc;
}

static int gemm_rows(const w4p_cpu_layer *L, const void *x, int x_dtype, int64_t m, int64_t ldx,
                     void *y, int y_dtype, int64_t ldy, const float *bias32, int precision, int isa,
                     w4p_tile_fn fn, int threads) {
    const size_t kp = (size_t)L->kp, nblk = (size_t)L->nblk;
    prep_ctx P = {L, x, x_dtype, ldx, precision, w4p_cvt_generic, w4p_quant_generic, NULL, NULL, NULL, NULL, NULL, 0, NULL};
#if defined(__x86_64__) || defined(__i386__)
    if (isa == W4P_ISA_AVX512 || isa == W4P_ISA_AVX512VNNI || isa == W4P_ISA_AMX) {
        P.cvt = w4p_cvt_avx512;
        P.quant = w4p_quant_avx512;
    } else if (isa == W4P_ISA_AVX2) {
        P.cvt = w4p_cvt_avx2;
        P.quant = w4p_quant_avx2;
    }
#endif
    int rc = W4P_OK;
    if (posix_memalign((void **)&P.xf, 64, (size_t)m * kp * sizeof(float))) P.xf = NULL;
    /* the AMX kernels load whole 16-row tiles of activations: on that path the buffers they read have rows up to
       the next multiple of 16, zero past m */
    const int64_t mpad = isa == W4P_ISA_AMX ? (m + 15) / 16 * 16 : m;
    if (precision == W4P_PREC_FAST) {
        if (posix_memalign((void **)&P.xq, 64, (size_t)mpad * kp)) P.xq = NULL;
        P.xs = malloc((size_t)m * nblk * sizeof(float));
        P.xsum = malloc((size_t)m * nblk * sizeof(int32_t));
    }
    size_t row = 0; /* AMX exact: bf16 values per activation row of pieces */
#if defined(__x86_64__)
    /* AMX exact, when the first work item has enough rows (items are W4P_MCHUNK rows; only the last is shorter).
       Pieces that hold the activations exactly: fp32 3, fp16 2, bf16 1 (bits of significand / 8). */
    const int pieces = x_dtype == W4P_DT_BF16 ? 1 : x_dtype == W4P_DT_F16 ? 2 : 3;
    if (isa == W4P_ISA_AMX && precision == W4P_PREC_EXACT && w4p_amx_layer_ok(L) &&
        m >= w4p_amx_min_rows(precision, pieces)) {
        P.pieces = pieces;
        row = w4p_amx_row(pieces, (int)kp);
        if (posix_memalign((void **)&P.xb, 64, (size_t)mpad * row * sizeof(uint16_t))) P.xb = NULL;
        if (L->zero_mode == W4P_ZERO_FLOAT) P.xsumf = malloc((size_t)m * nblk * sizeof(float));
    }
#endif
    if (!P.xf || (precision == W4P_PREC_FAST && (!P.xq || !P.xs || !P.xsum)) ||
        (P.pieces && (!P.xb || (L->zero_mode == W4P_ZERO_FLOAT && !P.xsumf)))) {
        w4p_set_error("out of memory for M=%lld activations", (long long)m);
        rc = W4P_ENOMEM;
        goto done;
    }
    if (P.xq) memset(P.xq + (size_t)m * kp, 0, (size_t)(mpad - m) * kp);
    if (P.xb) memset(P.xb + (size_t)m * row, 0, (size_t)(mpad - m) * row * sizeof(uint16_t));

    w4p_parallel_for(m, m >= 8 ? threads : 1, prep_row, &P);

    w4p_job job = {L, m, precision, P.xq, P.xs, P.xsum, P.xf, y, y_dtype, ldy, bias32, P.xb, P.pieces, P.xsumf};
    run_ctx R = {&job, fn, (m + W4P_MCHUNK - 1) / W4P_MCHUNK};
    w4p_parallel_for((int64_t)L->nt * R.mchunks, threads, run_item, &R);
done:
    free(P.xf);
    free(P.xq);
    free(P.xs);
    free(P.xsum);
    free(P.xb);
    free(P.xsumf);
    return rc;
}

#if defined(__x86_64__) || defined(__i386__)
uint64_t w4p_read_stream_avx512(const void *buf, size_t bytes);
#endif

uint64_t w4p_cpu_read_stream(const void *buf, size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
    if (w4p_cpu_isa_available() & W4P_ISA_AVX512) return w4p_read_stream_avx512(buf, bytes);
#endif
    const uint64_t *p = buf;
    uint64_t h0 = 0, h1 = 0, h2 = 0, h3 = 0;
    size_t n = bytes / 8, i = 0;
    for (; i + 4 <= n; i += 4) { h0 ^= p[i]; h1 ^= p[i + 1]; h2 ^= p[i + 2]; h3 ^= p[i + 3]; }
    for (; i < n; i++) h0 ^= p[i];
    return h0 ^ h1 ^ h2 ^ h3;
}
