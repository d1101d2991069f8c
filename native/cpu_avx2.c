/*
 * AVX2 + FMA + F16C kernels (x86 without AVX-512).
 *
 * 16 ymm registers: a 64-column tile is processed as two 32-column halves (four ymm each), with up to
 * two activation rows sharing each loaded weight vector.
 *   fast:  low/high nibbles as unsigned bytes, vpmaddubsw with four broadcast int8 activations, then
 *          vpmaddwd with ones (pairs of int16 -> int32). |q*a| <= 15*127 keeps int16 pairs far from
 *          saturation.
 *   exact: nibble -> int32 (shift, AND) -> fp32, minus the zero point (or s*q + m for float minima, one
 *          FMA), formed once per weight vector and shared by the rows; then one FMA per row. 8-bit
 *          layers read both nibble planes in the same pass (q = lo + 16*hi, exact). With eight or more
 *          rows per work item, a slice of weights is dequantized once into L1 and shared by every row.
 */
#if defined(__x86_64__) || defined(__i386__)
#include "w4p_cpu_internal.h"

#include <immintrin.h>
#include <string.h>

#define T2 __attribute__((target("avx2,fma,f16c")))
#define INL inline __attribute__((always_inline))
#define RMAX2 2

/* scale s and zm: the zero point z as a float (zero modes none / int) or the minimum (mode float) */
static INL T2 void load_params_half(const struct w4p_cpu_layer *L, int tile, int blk, int half, __m256 s[4], __m256 zm[4]) {
    const uint8_t *p = w4p_tile_params(L, tile, w4p_block_group(L, blk));
    for (int q = 0; q < 4; q++) {
        const int col = 32 * half + 8 * q;
        if (L->pkind == W4P_PK_F16U8) {
            s[q] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * col)));
            __m128i z8 = _mm_loadl_epi64((const __m128i *)(p + 128 + col));
            zm[q] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(z8));
        } else if (L->pkind == W4P_PK_F16F16) {
            s[q] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * col)));
            zm[q] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 128 + 2 * col)));
        } else {
            s[q] = _mm256_loadu_ps((const float *)p + col);
            zm[q] = _mm256_loadu_ps((const float *)p + 64 + col);
        }
    }
}

static INL T2 void fast_rows(const w4p_job *J, int tile, int64_t m0, const int R, float ybuf[][W4P_TILE]) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const int two = L->planes == 2, minima = L->zero_mode == W4P_ZERO_FLOAT;
    float part[RMAX2][32] = {{0}}; /* 8-bit layers: plane 0's integer sums, until plane 1 completes the codes */
    for (int half = 0; half < 2; half++) {
        for (int b = 0; b < nblk; b++) {
            __m256 s[4], zm[4];
            load_params_half(L, tile, b, half, s, zm);
            for (int p = 0; p < L->planes; p++) {
                const uint32_t *w = w4p_tile_words(L, tile, p) + (size_t)b * cpb * W4P_TILE + 32 * half;
                const int8_t *a[RMAX2];
                for (int r = 0; r < R; r++) a[r] = J->xq + (m0 + r) * kp + (size_t)b * ab;
                __m256i acc[RMAX2][4];
                for (int r = 0; r < R; r++)
                    for (int q = 0; q < 4; q++) acc[r][q] = _mm256_setzero_si256();
                for (int c = 0; c < cpb; c++) {
                    __m256i alo[RMAX2], ahi[RMAX2];
                    for (int r = 0; r < R; r++) {
                        int32_t lo, hi;
                        memcpy(&lo, a[r] + 8 * c, 4);
                        memcpy(&hi, a[r] + 8 * c + 4, 4);
                        alo[r] = _mm256_set1_epi32(lo);
                        ahi[r] = _mm256_set1_epi32(hi);
                    }
                    const uint32_t *wc = w + (size_t)c * W4P_TILE;
                    for (int q = 0; q < 4; q++) {
                        __m256i wv = _mm256_loadu_si256((const __m256i *)(wc + 8 * q));
                        __m256i lo = _mm256_and_si256(wv, m4);
                        __m256i hi = _mm256_and_si256(_mm256_srli_epi32(wv, 4), m4);
                        for (int r = 0; r < R; r++) {
                            __m256i t16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo[r]), _mm256_maddubs_epi16(hi, ahi[r]));
                            acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(t16, ones));
                        }
                    }
                }
                /* integer sums are exact in fp32 (< 2^24); int zeros: sum q*a - z*sum a is an exact integer
                   (one FNMA), only s*(...) rounds; minima: s*acc + m*sum a with the rounding error of s*acc
                   added back (FMA), so the terms cannot cancel into noise */
                for (int r = 0; r < R; r++) {
                    const __m256 xs = _mm256_set1_ps(J->xs[(m0 + r) * nblk + b]);
                    const __m256 as = _mm256_set1_ps((float)J->xsum[(m0 + r) * nblk + b]);
                    for (int q = 0; q < 4; q++) {
                        __m256 d = _mm256_cvtepi32_ps(acc[r][q]);
                        if (two && p == 0) {
                            _mm256_storeu_ps(&part[r][8 * q], d);
                            continue;
                        }
                        if (two) d = _mm256_fmadd_ps(d, _mm256_set1_ps(16.0f), _mm256_loadu_ps(&part[r][8 * q]));
                        __m256 t;
                        if (minima) {
                            const __m256 pr = _mm256_mul_ps(s[q], d);
                            t = _mm256_add_ps(_mm256_fmadd_ps(zm[q], as, pr), _mm256_fmsub_ps(s[q], d, pr));
                        } else {
                            t = _mm256_mul_ps(s[q], _mm256_fnmadd_ps(zm[q], as, d));
                        }
                        float *yp = &ybuf[r][32 * half + 8 * q];
                        _mm256_storeu_ps(yp, _mm256_fmadd_ps(t, xs, _mm256_loadu_ps(yp)));
                    }
                }
            }
        }
    }
}

/* Int zeros: acc = sum (q - z)*x, y += s*acc (q - z is an exact small integer, so a weight that is
 * exactly zero contributes exactly zero however large s is). Minima: acc = sum (s*q + m)*x, each weight
 * formed by one FMA, y += acc. */
static INL T2 void exact_rows(const w4p_job *J, int tile, int64_t m0, const int R, float ybuf[][W4P_TILE],
                              const int minima, const int two) {
    const struct w4p_cpu_layer *L = J->L;
    const int kp = L->kp, ab = L->ab, cpb = ab / 8, nblk = L->nblk;
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    for (int half = 0; half < 2; half++) {
        for (int b = 0; b < nblk; b++) {
            __m256 s[4], zm[4];
            load_params_half(L, tile, b, half, s, zm);
            const uint32_t *w = w4p_tile_words(L, tile, 0) + (size_t)b * cpb * W4P_TILE + 32 * half;
            const uint32_t *w1 = two ? w4p_tile_words(L, tile, 1) + (size_t)b * cpb * W4P_TILE + 32 * half : w;
            const float *x[RMAX2];
            for (int r = 0; r < R; r++) x[r] = J->xf + (m0 + r) * kp + (size_t)b * ab;
            __m256 acc[RMAX2][4];
            for (int r = 0; r < R; r++)
                for (int q = 0; q < 4; q++) acc[r][q] = _mm256_setzero_ps();
            for (int c = 0; c < cpb; c++) {
                const uint32_t *wc = w + (size_t)c * W4P_TILE;
                const uint32_t *wc1 = w1 + (size_t)c * W4P_TILE;
                __m256i wv[4];
                for (int q = 0; q < 4; q++) wv[q] = _mm256_loadu_si256((const __m256i *)(wc + 8 * q));
#pragma GCC unroll 8
                for (int t = 0; t < 8; t++) {
                    const int koff = (t & 1) ? (t >> 1) + 4 : (t >> 1);
                    __m256 xb[RMAX2];
                    for (int r = 0; r < R; r++) xb[r] = _mm256_set1_ps(x[r][8 * c + koff]);
                    for (int q = 0; q < 4; q++) {
                        __m256i qi = _mm256_and_si256(t ? _mm256_srli_epi32(wv[q], 4 * t) : wv[q], m4);
                        if (two) { /* high nibble plane, from L1 */
                            __m256i hv = _mm256_loadu_si256((const __m256i *)(wc1 + 8 * q));
                            __m256i hi = _mm256_and_si256(t ? _mm256_srli_epi32(hv, 4 * t) : hv, m4);
                            qi = _mm256_add_epi32(qi, _mm256_slli_epi32(hi, 4));
                        }
                        const __m256 qf = _mm256_cvtepi32_ps(qi);
                        const __m256 wq = minima ? _mm256_fmadd_ps(s[q], qf, zm[q]) : _mm256_sub_ps(qf, zm[q]);
                        for (int r = 0; r < R; r++) acc[r][q] = _mm256_fmadd_ps(wq, xb[r], acc[r][q]);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int q = 0; q < 4; q++) {
                    float *yp = &ybuf[r][32 * half + 8 * q];
                    const __m256 yv = _mm256_loadu_ps(yp);
                    _mm256_storeu_ps(yp, minima ? _mm256_add_ps(yv, acc[r][q]) : _mm256_fmadd_ps(s[q], acc[r][q], yv));
                }
        }
    }
}

/* exact_rows with the row count, zero kind and plane count as compile-time constants */
static INL T2 void exact_any(const w4p_job *J, int tile, int64_t m0, const int R, float ybuf[][W4P_TILE]) {
    const int minima = J->L->zero_mode == W4P_ZERO_FLOAT, two = J->L->planes == 2;
    if (!minima && !two) exact_rows(J, tile, m0, R, ybuf, 0, 0);
    else if (!two) exact_rows(J, tile, m0, R, ybuf, 1, 0);
    else if (!minima) exact_rows(J, tile, m0, R, ybuf, 0, 1);
    else exact_rows(J, tile, m0, R, ybuf, 1, 1);
}

/* Exact with many rows: each 64-value slice of K of a block is dequantized once (q - z, or s*q + m)
 * into an L1-resident fp32 buffer (16 KiB) that every row pair of the work item reads, instead of
 * redoing the shift, mask, conversion and zero point per row pair. */
#define W4P_DQ_MIN_ROWS 8
#define W4P_DQ_K 64

static INL T2 void exact_dequantized(const w4p_job *J, int tile, int64_t m0, int64_t m1, const int minima,
                                     const int two) {
    const struct w4p_cpu_layer *L = J->L;
    const int ab = L->ab, cpb = ab / 8, kp = L->kp;
    const int sl = ab < W4P_DQ_K ? ab : W4P_DQ_K;
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    float w[W4P_DQ_K][W4P_TILE] __attribute__((aligned(32)));
    float y[W4P_MCHUNK][W4P_TILE] __attribute__((aligned(32)));
    memset(y, 0, sizeof(float) * W4P_TILE * (size_t)(m1 - m0));
    for (int b = 0; b < L->nblk; b++) {
        __m256 s[2][4], zm[2][4];
        load_params_half(L, tile, b, 0, s[0], zm[0]);
        load_params_half(L, tile, b, 1, s[1], zm[1]);
        for (int k0 = 0; k0 < ab; k0 += sl) {
            const uint32_t *w0 = w4p_tile_words(L, tile, 0) + ((size_t)b * cpb + k0 / 8) * W4P_TILE;
            const uint32_t *w1 = two ? w4p_tile_words(L, tile, 1) + ((size_t)b * cpb + k0 / 8) * W4P_TILE : w0;
            for (int c = 0; c < sl / 8; c++)
                for (int v = 0; v < 8; v++) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w0 + (size_t)c * W4P_TILE + 8 * v));
                    const __m256i hv = two ? _mm256_loadu_si256((const __m256i *)(w1 + (size_t)c * W4P_TILE + 8 * v)) : wv;
                    const int h = v >> 2, q = v & 3;
#pragma GCC unroll 8
                    for (int t = 0; t < 8; t++) {
                        const int koff = (t & 1) ? (t >> 1) + 4 : (t >> 1);
                        __m256i qi = _mm256_and_si256(t ? _mm256_srli_epi32(wv, 4 * t) : wv, m4);
                        if (two) qi = _mm256_add_epi32(qi, _mm256_slli_epi32(_mm256_and_si256(t ? _mm256_srli_epi32(hv, 4 * t) : hv, m4), 4));
                        const __m256 qf = _mm256_cvtepi32_ps(qi);
                        _mm256_store_ps(&w[8 * c + koff][8 * v],
                                        minima ? _mm256_fmadd_ps(s[h][q], qf, zm[h][q]) : _mm256_sub_ps(qf, zm[h][q]));
                    }
                }
            for (int64_t m = m0; m < m1; m += 2) {
                const int R = m1 - m >= 2 ? 2 : 1;
                const float *x0 = J->xf + m * kp + (size_t)b * ab + k0;
                const float *x1 = R == 2 ? x0 + kp : x0;
                for (int h = 0; h < 2; h++) {
                    __m256 a0[4], a1[4];
                    for (int q = 0; q < 4; q++) a0[q] = a1[q] = _mm256_setzero_ps();
                    for (int k = 0; k < sl; k++) {
                        const __m256 xb0 = _mm256_set1_ps(x0[k]), xb1 = _mm256_set1_ps(x1[k]);
                        for (int q = 0; q < 4; q++) {
                            const __m256 wq = _mm256_load_ps(&w[k][32 * h + 8 * q]);
                            a0[q] = _mm256_fmadd_ps(wq, xb0, a0[q]);
                            a1[q] = _mm256_fmadd_ps(wq, xb1, a1[q]); /* R == 1: computed, not stored */
                        }
                    }
                    for (int q = 0; q < 4; q++)
                        for (int r = 0; r < R; r++) {
                            float *yp = &y[m - m0 + r][32 * h + 8 * q];
                            const __m256 acc = r ? a1[q] : a0[q];
                            const __m256 yv = _mm256_load_ps(yp);
                            _mm256_store_ps(yp, minima ? _mm256_add_ps(yv, acc) : _mm256_fmadd_ps(s[h][q], acc, yv));
                        }
                }
            }
        }
    }
    for (int64_t m = m0; m < m1; m++) w4p_store_row(J, m, tile, y[m - m0]);
}

T2 void w4p_tile_avx2(const w4p_job *J, int tile, int64_t m0, int64_t m1) {
    float ybuf[RMAX2][W4P_TILE] __attribute__((aligned(32)));
    if (J->precision == W4P_PREC_EXACT && m1 - m0 >= W4P_DQ_MIN_ROWS) {
        const int minima = J->L->zero_mode == W4P_ZERO_FLOAT, two = J->L->planes == 2;
        if (!minima && !two) exact_dequantized(J, tile, m0, m1, 0, 0);
        else if (!two) exact_dequantized(J, tile, m0, m1, 1, 0);
        else if (!minima) exact_dequantized(J, tile, m0, m1, 0, 1);
        else exact_dequantized(J, tile, m0, m1, 1, 1);
        return;
    }
    for (int64_t m = m0; m < m1;) {
        const int R = (m1 - m) >= 2 ? 2 : 1;
        memset(ybuf, 0, sizeof ybuf);
        if (J->precision == W4P_PREC_FAST) {
            if (R == 2) fast_rows(J, tile, m, 2, ybuf); else fast_rows(J, tile, m, 1, ybuf);
        } else {
            if (R == 2) exact_any(J, tile, m, 2, ybuf); else exact_any(J, tile, m, 1, ybuf);
        }
        for (int r = 0; r < R; r++) w4p_store_row(J, m + r, tile, ybuf[r]);
        m += R;
    }
}

#endif

#if defined(__x86_64__) || defined(__i386__)
/* Activation preparation with F16C (same rounding as the generic C code). */
T2 void w4p_cvt_avx2(const void *src, int dtype, float *dst, int n) {
    int i = 0;
    if (dtype == W4P_DT_F16) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i))));
        for (; i < n; i++) dst[i] = w4p_half_to_float(((const uint16_t *)src)[i]);
    } else if (dtype == W4P_DT_BF16) {
        for (; i + 8 <= n; i += 8) {
            __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
        }
        for (; i < n; i++) {
            uint32_t u = (uint32_t)((const uint16_t *)src)[i] << 16;
            memcpy(dst + i, &u, 4);
        }
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

T2 void w4p_quant_avx2(const float *x, int n, int8_t *q, float *scale, int32_t *sum) {
    /* n is a multiple of 16 */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
    float mv[8];
    _mm256_storeu_ps(mv, amax);
    float m = 0.0f;
    for (int j = 0; j < 8; j++) m = mv[j] > m ? mv[j] : m;
    const float inv = m > 0.0f ? 127.0f / m : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv), lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    __m256i s = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(v, nlim), lim);
        __m256i vi = _mm256_cvtps_epi32(v);
        s = _mm256_add_epi32(s, vi);
        __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(vi), _mm256_extracti128_si256(vi, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w16, w16));
    }
    int32_t sv[8];
    _mm256_storeu_si256((__m256i *)sv, s);
    int32_t tot = 0;
    for (int j = 0; j < 8; j++) tot += sv[j];
    *scale = m / 127.0f;
    *sum = tot;
}
#endif
